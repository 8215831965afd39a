"""The command line's flags, made from their one declaration: a flag that sets an option is declared on the
options field it sets (`recycle.options`: names, help, choices, default, hidden old name), and `options()` gives
a command those fields' Typer parameters; the few flags that set no option (--json, --quick ...) are declared
below, the same way. A flag means the same thing in every command, and a choice list shows as one (`[a|b]`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated

import typer

from recycle.options import CHECKPOINT, FAMILY, FIELD_DEFAULT, THREADS, Flag, flag

REQUIRED = ...  # a flag's default where the command requires it (Typer's spelling)
DEPRECATED: list[str] = []  # notes the CLI prints once the command has succeeded (a refusal stays one line)
_EMPTY, _KEYWORD = inspect.Parameter.empty, inspect.Parameter.KEYWORD_ONLY


def param(spec: Flag, default: object = _EMPTY, hidden: bool = False, names: tuple[str, ...] | None = None):
    """The Typer annotation of a flag whose default on the command line is `default` (none, or ...: required)."""
    kind = spec.type or (str if default is None or default is ... or default is _EMPTY else type(default))
    choices = tuple(spec.choices() if callable(spec.choices) else spec.choices)
    metavar = spec.metavar or (f"[{'|'.join(choices)}]" if choices else None)
    names = spec.names if names is None else names
    info = (typer.Option(*names, help=spec.help, metavar=metavar, hidden=hidden) if names
            else typer.Argument(help=spec.help, metavar=metavar, hidden=hidden))
    return Annotated[kind | None if default is None else kind, info]


def renamed(new_value, old_value, note: str):
    """A hidden old flag still works, with a one-line deprecation note."""
    if old_value is None:
        return new_value
    DEPRECATED.append(note)
    return old_value


def output_path(given: str | None, source: str, suffix: str) -> str:
    """-o, or ./SOURCE-suffix in the current directory (the same rule in every command that writes)."""
    return str(given) if given is not None else str(Path.cwd() / f"{Path(source).resolve().name}-{suffix}")


def _flags(cls: type) -> Iterator[tuple[str, tuple[Flag, object]]]:
    """The flagged fields of an options class and of the options nested in it: name → (flag, command-line default)."""
    for fl in fields(cls):
        if "options" in fl.metadata:
            yield from _flags(fl.metadata["options"])
        elif "flag" in fl.metadata:
            spec = fl.metadata["flag"]
            default = (spec.cli_default if spec.cli_default is not FIELD_DEFAULT
                       else _EMPTY if fl.default is MISSING else fl.default)
            yield fl.name, (spec, default)


def _build(cls: type, values: dict):
    """The options object from the command line's values (a nested options object from its own)."""
    kw = {fl.name: values[fl.name] for fl in fields(cls) if "flag" in fl.metadata and fl.name in values}
    for fl in fields(cls):
        if "options" in fl.metadata and any(name in values for name, _ in _flags(fl.metadata["options"])):
            kw[fl.name] = _build(fl.metadata["options"], values)
    return cls(**kw)


def options(cls: type, order: str, **defaults) -> Callable:
    """Give a command the flags of `cls` (and of the options nested in it) and its own parameters, in `order` (a
    flag's hidden old name follows it), and call it with the options object built from them and its own values.
    `defaults`: the command's own default for a flag (REQUIRED: none). Path values become strings; a flag's `parse`
    turns its value into the field's."""
    flags = dict(_flags(cls))

    def wrap(fn: Callable) -> Callable:
        _, *own = inspect.signature(fn, eval_str=True).parameters.values()  # the options object, then its own
        own = {p.name: p.replace(kind=_KEYWORD) for p in own}
        if set(own) - set(order.split()):
            raise TypeError(f"{fn.__name__}: {sorted(set(own) - set(order.split()))} missing from its flags' order")
        params = []
        for name in order.split():
            if name in own:
                params.append(own[name])
                continue
            spec, default = flags[name]
            default = defaults.get(name, default)
            params.append(inspect.Parameter(name, _KEYWORD, default=default, annotation=param(spec, default)))
            if spec.old is not None:  # hidden: a flag of its own, or the argument's old place
                old = param(spec, None, True, (spec.old.flag,) if spec.old.flag else ())
                params.append(inspect.Parameter(f"old_{name}", _KEYWORD, default=None, annotation=old))

        def run(**given):
            values = {}
            for name, (spec, _) in flags.items():
                if name in given:
                    value = given.pop(name)
                    if spec.old is not None:
                        value = renamed(value, given.pop(f"old_{name}"), spec.old.note)
                    values[name] = spec.parse(value) if spec.parse else str(value) if isinstance(value, Path) else value
            return fn(_build(cls, values), **given)

        run.__signature__ = inspect.Signature(params)
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(run, attr, getattr(fn, attr))
        return run

    return wrap


# -- flags that set no option -----------------------------------------------------------------------------------
Version = param(flag("--version", help="Print the version and exit."), False)
Json = param(flag("--json", help="Print one JSON object instead of the report."), False)
Threads = param(THREADS, None)  # bench, plan (distill: its option)
CkptArg = param(CHECKPOINT)  # inspect (convert: its option)
Stats = param(flag("--stats", help="Also read the MTP tensors: finite, all-zero, RMS, norms."), False)
ShowAll = param(flag("--all", help="With --stats: one row per tensor."), False)
Family = param(FAMILY, None)  # inspect (convert: its option)
Strict = param(flag("--strict", help="Exit 1 when a finding is an error (for CI); bad input stays exit 2."), False)
Quick = param(flag("--quick", help="The first 4 prompts, 64 new tokens: a look in about a minute."), False)
MemoryPlan = param(flag("--plan", help="Print the per-rank memory by part (weights, grads, optimizer, teacher, "
                        "activations) from the configs alone, and whether it fits --gpu; loads and trains nothing "
                        "(--tokens not needed)."), False)
WorldSize = param(flag("--world-size", help="With --plan: the ranks to plan for (default: WORLD_SIZE, else 1).",
                       type=int), None)
TrainGpu = param(flag("--gpu", help="With --plan: the GPU to fit (H100, H200, A100, L40S, ...)."), None)
HarvestDrafter = param(flag("--drafter", help="The drafter the cache is for: an EAGLE-3 directory's aux layers are "
                            "harvested too.", metavar="DRAFTER_DIR", type=Path), None)
TensorParallel = param(flag("--tensor-parallel-size", help="vLLM's own."), 1)
PipelineParallel = param(flag("--pipeline-parallel-size", help="vLLM's own."), 1)
ExpertParallel = param(flag("--enable-expert-parallel", help="vLLM's own: expert parallelism instead of tensor "
                            "parallelism for MoE layers."), False)
DataParallel = param(flag("--data-parallel-size", help="Refused: vLLM's offline engine takes none; run N shards "
                          "(--shard i/N)."), 1, hidden=True)
