"""Every drafter format recycle knows, in one list, and the functions that pick one (as `recycle.families`
holds every source layout). Adding a format: a module with its `FORMAT` record, and a line here."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from recycle.drafters import eagle, eagle3, gemma4, medusa, native, parallel
from recycle.drafters.format import DrafterFormat
from recycle.errors import RecycleError

# In detection order: a config.json is the first format whose `detect` accepts it.
FORMATS: dict[str, DrafterFormat] = {f.name: f for f in (
    eagle.FORMAT,
    eagle3.FORMAT,
    medusa.FORMAT,
    gemma4.FORMAT,
    native.FORMAT,
    parallel.FORMAT,
)}
WEIGHTS = "model.safetensors"
PROVENANCE = "recycle.json"


def convertible() -> tuple[str, ...]:
    """The formats `recycle convert --to` writes (and `recycle push` publishes)."""
    return tuple(name for name, f in FORMATS.items() if f.convertible)


def get(name: str, what: str = "format") -> DrafterFormat:
    if name not in FORMATS:
        raise RecycleError(f"unknown {what} '{name}' (choose from {', '.join(convertible())})")
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


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecycleError(f"{path}: missing; not a drafter directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecycleError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise RecycleError(f"{path}: not a JSON object")
    return data


def of_directory(path: str | os.PathLike) -> DrafterFormat:
    """The format of a drafter directory: recycle.json's, else what its config.json describes."""
    d = Path(path)
    if (d / PROVENANCE).is_file():
        name = (_json(d / PROVENANCE).get("target") or {}).get("format")
        if name in FORMATS and FORMATS[name].detect is not None:
            return FORMATS[name]
    fmt = of_config(_json(d / "config.json"))
    if fmt is None:
        raise RecycleError(f"{d}: cannot tell which drafter format this directory holds")
    return fmt


def load_drafter(path: str | os.PathLike, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
    """The drafter module a drafter directory holds (written by `recycle convert` or the distiller, or a
    format recycle reads such as a Gemma 4 assistant), built by its format's record."""
    from safetensors.torch import load_file

    d = Path(path)
    if not d.is_dir():
        raise RecycleError(f"{d}: no such drafter directory")
    fmt = of_directory(d)
    cfg = _json(d / "config.json")
    if not (d / WEIGHTS).is_file():
        raise RecycleError(f"{d / WEIGHTS}: missing")
    try:
        state = load_file(str(d / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise RecycleError(f"{d / WEIGHTS}: corrupt or unreadable safetensors ({' '.join(str(e).split())[:160]})") from None
    try:
        return fmt.resolve("build")(d, cfg, state, dtype, attn_implementation)
    except (RuntimeError, KeyError, ValueError) as e:
        raise RecycleError(f"{d}: weights do not fit the {fmt.name} drafter ({str(e).splitlines()[0]})") from None
