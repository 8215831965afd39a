"""A drafter format as one declarative record: what recycle knows about EAGLE, EAGLE-3, Medusa, native MTP,
parallel heads, Gemma 4's assistants and llama.cpp's GGUF side files, each in one place.

The family table (`recycle/families.py`) describes where a checkpoint keeps its MTP modules; a
`DrafterFormat` describes what a drafter *is* once it exists: how a directory of it is recognised, what it
expects of its target (the fit check), which `recycle convert` options and layouts it has, and how engines
serve it. A record is data: it imports no code of a higher layer (nor torch), so the CLI lists the formats and
checks a directory's kind in a fraction of a second.

The code a format needs lives in the layer that runs it, filed under the format's name in that layer's
`recycle.registry.Registry`; the record's `hooks` says which of them the format has:

    "build"      recycle.drafters.BUILDERS               the drafter module from its directory
    "engine"     recycle.decoding.drafting.ENGINES       the decoder's drafting engine
    "unroller"   recycle.distill.unroll.UNROLLERS        distill's Unroller subclass
    "converter"  recycle.converters.CONVERTERS           `recycle convert --to NAME`'s weight mapping
    "calibrate"  recycle.distill.calibrate.CALIBRATORS   convert's `--calibrate`: fit what cannot be copied
    "rewrite"    recycle.converters.REWRITERS            trained weights back into the format's other layouts

Adding a format is a file here with its `FORMAT` record, a line in `FORMATS` (`__init__.py`), and one
registration per hook it declares; `tests/test_registries.py` checks the two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Reads:
    """What a drafter expects of its target, read from the drafter's config.json (no weights loaded).

    hidden: the width of the target state it reads; vocab: its vocabulary; aux_layers: the target layers
    whose residual streams it takes (EAGLE-3), None where it reads only the last state; target_types:
    the model types it can draft for (None: any with that width and vocabulary).
    """

    hidden: int | None
    vocab: int | None
    aux_layers: tuple[int, ...] | None = None
    target_types: tuple[str, ...] | None = None
    hidden_key: str = "hidden size"  # what the drafter calls the width it reads (messages name it)


@dataclass(frozen=True)
class Layout:
    """One file or folder a format writes: who reads it, and the card's serving lines for it (templates over
    {repo}, {local}, {target}, {target_dir}, {heads}, {verifier}; a line naming {verifier} only when the config
    names one).

    The serving lines name only engines known to load this layout (the interop suite runs vLLM; SGLang's
    loaders are checked by tests/test_engine_layouts.py); an engine that cannot load it gets no line, since a
    card is copied from, not read critically. `readers` says which engines, at which version, read it: the
    card's "Getting it" section, so a reader knows what to install."""

    what: str
    serving: tuple[str, ...] = ()
    readers: str = ""
    # (config.json) -> engines that refuse this directory although they read the layout (a variant only one
    # engine loads): the card drops the serving lines under a `# ENGINE` comment naming one of them.
    refused_by: Callable[[Mapping], tuple[str, ...]] | None = None
    # its readers open the file by name (one file, no index): `--max-shard-size` never splits it
    whole: bool = False


HOOKS = ("build", "engine", "unroller", "converter", "calibrate", "rewrite")


@dataclass(frozen=True)
class DrafterFormat:
    name: str  # recycle.json's `format`, `--to`'s value, the decoding engine's kind
    title: str  # a phrase for people (reports, cards)
    summary: str  # what the drafter is, one clause for the model card
    convertible: bool = False  # `recycle convert --to NAME` writes it; push publishes these
    native_kind: str | None = None  # a source family kind drafted with its own modules (no drafter directory)
    detect: Callable[[Mapping], bool] | None = None  # does a config.json describe a directory of this format
    reads: Callable[[Mapping, Mapping], Reads] | None = None  # (drafter config, target config) -> what it reads
    hooks: frozenset[str] = frozenset()  # which of HOOKS it has (each registered in its layer under `name`)
    default_steps: int | None = None  # distill's unrolled draft steps (None: the drafter's own number of heads)
    options: frozenset[str] = frozenset()  # `recycle convert` options that apply to this format
    layouts: Mapping[str, Layout] = field(default_factory=dict)  # what it writes, in order, and who reads it
    serving_note: str = ""  # a sentence under the card's serving commands
    # A sentence for the card on loading the directory as a plain transformers model, which none of the formats
    # is: where the format's config is the engines' (EAGLE-3, Medusa), its `architectures` cannot be changed.
    loading_note: str = ""
    tags: tuple[str, ...] = ()  # Hub tags beside "speculative-decoding" and the format's name
    single_pass: bool = False  # every depth drafts in one pass (heads over one state), not one call per step
    static_tree: bool = False  # drafts a fixed Medusa-style tree by default (no EAGLE-2 dynamic trees)
    source_layout: str | None = None  # a subfolder holding its modules in the source's own layout (convert reads it)
    native_chain: bool = False  # its chain is the MTP modules' own (compare it with native MTP at the same depth)
    # (drafter config, target config, where) -> None: the fit check beyond width, vocabulary and model types
    # (a one-line RecycleError naming `where`); from the configs alone
    fit_extra: Callable[[Mapping, Mapping, str], None] | None = None
    target_file: str | None = None  # `--target` is a file with this suffix the output pairs with (gguf: ".gguf")
    extra_dtypes: tuple[str, ...] = ()  # `--dtype` values beyond bf16/fp16/fp32 the output can store (gguf: q8_0)
    # (the module's name prefix, the same prefix as other tools spell it on disk): files with either are read,
    # and a trained drafter is written back in the spelling its directory used (EAGLE-3: midlayer. / layers.0.)
    aliases: tuple[tuple[str, str], ...] = ()
    spellings: Mapping[str, str | None] = field(default_factory=dict)  # convert's name choices -> on-disk prefix

    def __post_init__(self) -> None:
        unknown = sorted(self.hooks - frozenset(HOOKS))
        if unknown:  # a programming error in a record, not user input
            raise ValueError(f"format '{self.name}': unknown hooks {unknown} (known: {', '.join(HOOKS)})")

    def module_names(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A state read from disk under the module's own names (`aliases` undone)."""
        out = {}
        for name, value in state.items():
            for ours, theirs in self.aliases:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            out[name] = value
        return out

    def disk_names(self, state: Mapping[str, Any], spelling: str | None = None) -> dict[str, Any]:
        """A module state under the names a file uses: `spelling` one of the aliases' on-disk prefixes (None: the
        module's own names)."""
        swap = {ours: theirs for ours, theirs in self.aliases if theirs == spelling}
        out = {}
        for name, value in state.items():
            for ours, theirs in swap.items():
                if name.startswith(ours):
                    name = theirs + name[len(ours):]
                    break
            out[name] = value
        return out

    def spelling(self, names) -> str | None:
        """Which alias spelling a file's names use (None: the module's own)."""
        return next((theirs for _, theirs in self.aliases if any(n.startswith(theirs) for n in names)), None)
