"""Every hook a format record declares resolves, in the registry of the layer that owns it, to a real object of
the right kind; every registered object belongs to a format that declares it; a format without a hook gets the
registry's one-line error (as `test_every_family_row_has_a_fixture` holds the family table to its fixtures)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from recycle.errors import RecycleError
from recycle.families import FAMILIES
from recycle.formats import FORMATS, DrafterFormat
from recycle.formats.record import HOOKS
from recycle.quant.schemes import HOOKS as SCHEME_HOOKS
from recycle.quant.schemes import SCHEMES

# hook → (owning module, its registry, the hook's signature there: a Protocol, or the base class of a class hook)
OWNERS = {
    "build": ("recycle.drafters", "BUILDERS", "Builder"),
    "engine": ("recycle.decoding.drafting", "ENGINES", "EngineFactory"),
    "unroller": ("recycle.distill.unroll", "UNROLLERS", "Unroller"),
    "converter": ("recycle.converters", "CONVERTERS", "Converter"),
    "calibrate": ("recycle.distill.calibrate", "CALIBRATORS", "FormatCalibration"),
    "rewrite": ("recycle.converters", "REWRITERS", "Rewriter"),
}
CLASS_HOOKS = {"unroller"}  # registered as classes (subclasses of the base); the others as callables

DECLARED = [(name, hook) for name, fmt in FORMATS.items() for hook in sorted(fmt.hooks)]
MISSING = [(name, hook) for name, fmt in FORMATS.items() for hook in HOOKS if hook not in fmt.hooks]


def owner(hook: str):
    module, registry, signature = OWNERS[hook]
    mod = importlib.import_module(module)
    return getattr(mod, registry), getattr(mod, signature)


def test_every_hook_has_an_owner() -> None:
    assert set(OWNERS) == set(HOOKS)


@pytest.mark.parametrize(("name", "hook"), DECLARED, ids=[f"{n}-{h}" for n, h in DECLARED])
def test_every_declared_hook_resolves(name: str, hook: str) -> None:
    fmt = FORMATS[name]
    registry, signature = owner(hook)
    obj = registry.get(fmt.name, fmt.title)
    if hook in CLASS_HOOKS:
        assert inspect.isclass(obj) and issubclass(obj, signature) and obj is not signature, obj
        assert not inspect.isabstract(obj), f"{obj.__name__} leaves abstract methods undefined"
        return
    assert callable(obj), obj
    # it takes every positional argument its Protocol's __call__ is given
    params = list(inspect.signature(signature.__call__).parameters.values())[1:]  # without self
    args = [object()] * sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    inspect.signature(obj).bind(*args)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_registered_object_belongs_to_a_format_declaring_it(hook: str) -> None:
    registry, _ = owner(hook)
    for name in registry.names():
        assert name in FORMATS, f"{registry.what} registered for '{name}', which is no format"
        assert hook in FORMATS[name].hooks, f"{registry.what} registered for '{name}', whose record lacks '{hook}'"


@pytest.mark.parametrize(("name", "hook"), MISSING, ids=[f"{n}-{h}" for n, h in MISSING])
def test_a_format_without_a_hook_gets_one_line(name: str, hook: str) -> None:
    fmt = FORMATS[name]
    registry, _ = owner(hook)
    with pytest.raises(RecycleError) as e:
        registry.get(fmt.name, fmt.title)
    message = str(e.value)
    assert "\n" not in message
    assert message == f"{fmt.title}: recycle has no {registry.what} for it"


def test_a_record_names_only_known_hooks() -> None:
    with pytest.raises(ValueError, match="unknown hooks"):
        DrafterFormat(name="x", title="X", summary="x", hooks=frozenset({"build", "engnie"}))


# -- family rows: their code hooks (the MTP runtime a row names, and its decoder-layer class) ---------------------


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_family_row_resolves(family: str) -> None:
    from torch import nn

    from recycle.decoding.drafting import CHAINS, Drafter
    from recycle.families import BY_NAME
    from recycle.imports import import_object
    from recycle.mtp import MTP, RUNTIMES

    fam = BY_NAME[family]
    if fam.run.runtime is not None:
        runtime = RUNTIMES.get(fam.run.runtime, fam.title)
        assert inspect.isclass(runtime) and issubclass(runtime, MTP) and runtime is not MTP, runtime
        chain = CHAINS.get(fam.run.runtime, fam.title)  # its own modules draft with the runtime's own engine
        assert inspect.isclass(chain) and issubclass(chain, Drafter), chain
        from recycle.drafters import RUNTIME_BUILDERS

        assert callable(RUNTIME_BUILDERS.get(fam.run.runtime, fam.title))  # and its --to eagle drafter builds
        assert runtime.leaves and {"head", "embed"} <= set(runtime.leaves)  # the roles a converter writes
    if fam.run.block_class is not None:
        block = import_object(fam.run.block_class)
        assert inspect.isclass(block) and issubclass(block, nn.Module), fam.run.block_class


def test_every_release_config_reader_resolves_and_is_named_by_a_row() -> None:
    """A row's `keys.release_config` names a reader of recycle.release_config's registry, and every reader there is
    some row's; the reader turns the row's generator's config.json into keys transformers' config class builds."""
    from transformers import AutoConfig

    from recycle.release_config import READERS

    from fixtures.families import make

    named = {f.keys.release_config: f for f in FAMILIES if f.keys.release_config is not None}
    assert set(READERS.names()) == set(named)
    for name, fam in named.items():
        reader = READERS.get(name, fam.title)
        assert callable(reader)
        keys = reader(make(fam.name).config)
        assert AutoConfig.for_model(**{k: v for k, v in keys.items() if k != "quantization_config"})
    with pytest.raises(RecycleError, match="recycle has no release config reader for it"):
        READERS.get("nope")


def test_every_runtime_belongs_to_a_row_naming_it() -> None:
    from recycle.decoding.drafting import CHAINS
    from recycle.mtp import RUNTIMES

    named = {f.run.runtime for f in FAMILIES if f.run.runtime is not None}
    from recycle.drafters import RUNTIME_BUILDERS

    assert set(RUNTIMES.names()) == named == set(CHAINS.names()) == set(RUNTIME_BUILDERS.names())
    with pytest.raises(RecycleError, match="recycle has no MTP runtime for it"):
        RUNTIMES.get("nope")


# -- scheme records (recycle/quant/schemes.py): the engine ignore rule each names, the storage codecs it uses -------

SCHEME_OWNERS = {"ignore_rule": ("recycle.quant.schemes", "IGNORE_RULES", "IgnoreRule")}
SCHEME_DECLARED = [(s.name, hook) for s in SCHEMES for hook in sorted(s.hooks)]
SCHEME_CODECS = [(s.name, codec) for s in SCHEMES for codec in s.codecs]


def test_every_scheme_hook_has_an_owner() -> None:
    assert set(SCHEME_OWNERS) == set(SCHEME_HOOKS)


@pytest.mark.parametrize(("name", "hook"), SCHEME_DECLARED, ids=[f"{n}-{h}" for n, h in SCHEME_DECLARED])
def test_every_scheme_hook_resolves(name: str, hook: str) -> None:
    module, registry, signature = SCHEME_OWNERS[hook]
    mod = importlib.import_module(module)
    obj = getattr(mod, registry).get(name)
    assert callable(obj), obj
    params = list(inspect.signature(getattr(mod, signature).__call__).parameters.values())[1:]  # without self
    inspect.signature(obj).bind(*[object()] * len(params))


@pytest.mark.parametrize("hook", SCHEME_HOOKS)
def test_every_scheme_rule_belongs_to_a_record_declaring_it(hook: str) -> None:
    module, registry, _ = SCHEME_OWNERS[hook]
    by_name = {s.name: s for s in SCHEMES}
    for name in getattr(importlib.import_module(module), registry).names():
        assert name in by_name and hook in by_name[name].hooks, f"{registry} has '{name}', whose record lacks {hook}"


@pytest.mark.parametrize(("name", "codec"), SCHEME_CODECS, ids=[f"{n}-{c}" for n, c in SCHEME_CODECS])
def test_every_scheme_codec_is_registered(name: str, codec: str) -> None:
    import recycle.quant  # importing the package registers every codec
    from recycle.quant.codec import Codec

    obj = recycle.quant.CODECS.get(codec, name)
    assert isinstance(obj, Codec) and obj.name == codec, obj
