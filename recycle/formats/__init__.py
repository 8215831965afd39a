"""Drafter formats as data: every format recycle knows, one record each (`record.DrafterFormat`), in one list,
and the functions that pick one (as `recycle.families` holds every source layout). Adding a format: a module
here with its `FORMAT` record, a line in `FORMATS`, and each hook its record names registered in the layer that
runs it (`record.py` lists where). Nothing here imports torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from recycle.errors import RecycleError, did_you_mean
from recycle.formats import eagle, eagle3, gemma4_assistant, gguf, medusa, native_mtp, parallel_heads
from recycle.formats.record import DrafterFormat, Layout, Reads
from recycle.preflight import load_json

# In detection order: a config.json is the first format whose `detect` accepts it.
FORMATS: dict[str, DrafterFormat] = {f.name: f for f in (
    eagle.FORMAT,
    eagle3.FORMAT,
    medusa.FORMAT,
    gemma4_assistant.FORMAT,
    native_mtp.FORMAT,
    parallel_heads.FORMAT,
    gguf.FORMAT,
)}
PROVENANCE = "recycle.json"
BENCH_REPORT = "bench.json"  # `recycle bench --save` writes it into a drafter directory; the model card reads it


def convertible() -> tuple[str, ...]:
    """The formats `recycle convert --to` writes (and `recycle push` publishes)."""
    return tuple(name for name, f in FORMATS.items() if f.convertible)


def get(name: str, what: str = "format") -> DrafterFormat:
    if name not in FORMATS:
        raise RecycleError(f"unknown {what} '{name}' (choose from {', '.join(convertible())})"
                           f"{did_you_mean(name, convertible())}")
    return FORMATS[name]


def of_config(config: Mapping) -> DrafterFormat | None:
    """The format a drafter's config.json describes, or None."""
    return next((f for f in FORMATS.values() if f.detect is not None and f.detect(config)), None)


def native_format(kind: str, where: str | os.PathLike = "") -> DrafterFormat:
    """The format that drafts with a source family's own modules (its `kind` in the family table)."""
    found = next((f for f in FORMATS.values() if f.native_kind == kind), None)
    if found is None:
        raise RecycleError(f"{where}: a {kind.replace('_', ' ')} checkpoint has no modules of its own to draft with")
    return found


def of_directory(path: str | os.PathLike) -> DrafterFormat:
    """The format of a drafter directory: recycle.json's, else what its config.json describes."""
    d = Path(path)
    if (d / PROVENANCE).is_file():
        name = (load_json(d / PROVENANCE, "recycle.json").get("target") or {}).get("format")
        if name in FORMATS and FORMATS[name].detect is not None:
            return FORMATS[name]
    fmt = of_config(load_json(d / "config.json", "drafter config.json"))
    if fmt is None:
        raise RecycleError(f"{d}: cannot tell which drafter format this directory holds")
    return fmt


def aux_layers_of(drafter: str | os.PathLike, target: str | os.PathLike) -> tuple[int, ...]:
    """The target layers a drafter directory taps besides the last state (EAGLE-3's aux layers), or ()."""
    d, t = Path(drafter), Path(target)
    fmt = of_directory(d)
    if fmt.reads is None:
        return ()
    r = fmt.reads(load_json(d / "config.json", "drafter config.json"), load_json(t / "config.json", "target config.json"))
    return tuple(r.aux_layers or ())


__all__ = ["BENCH_REPORT", "PROVENANCE", "aux_layers_of", "DrafterFormat", "Layout", "Reads", "FORMATS", "convertible",
           "get", "of_config", "of_directory",
           "native_format"]
