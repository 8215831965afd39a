"""Which kind of directory a path is, checked once, before any model is built.

recycle reads four kinds of directory, and most mistakes are one given as another: a drafter passed as the
target (transformers would quietly build a random model from its config), a checkpoint passed as a drafter,
an MTP overlay passed as a target, a harvest cache passed as a model. Each kind is recognised by one function
here, from config.json, recycle.json and safetensors headers (never tensor data), and every command calls the
ones it needs through its options' `validate()`; a wrong kind gets one line naming what was given and what is
expected.

  target   a model with a trunk: an embedding and decoder layers that are not MTP modules
  drafter  a drafter directory recycle reads (recycle.formats detects its format)
  source   a checkpoint with MTP modules (or a drafter-kind family such as a Gemma 4 assistant) to convert, or an
           EAGLE drafter (its mtp_overlay/ is the modules in the source's layout: `converters/reexport.py`)
  cache    a `recycle harvest` cache (manifest.json)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from recycle.errors import RecycleError
from recycle.formats import DrafterFormat, of_config, of_directory
from recycle.preflight import CACHE_MANIFEST, load_json

LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def _what(path: Path) -> str:
    """What a directory is, for a message: a drafter of some format, a harvest cache, or a model directory."""
    if (path / CACHE_MANIFEST).is_file() and not (path / "config.json").is_file():
        return "a harvest cache"
    if (path / "config.json").is_file():
        fmt = of_config(load_json(path / "config.json", "config.json"))
        if fmt is not None:
            return f"a drafter ({fmt.name})"
    return "a model checkpoint"


def target(path: str | os.PathLike, flag: str = "--target") -> dict:
    """A target model directory: not a drafter, and its safetensors hold a trunk (not only MTP tensors).
    Returns its config.json."""
    from recycle.checkpoint import Checkpoint
    from recycle.families import match

    p = Path(path)
    if (p / CACHE_MANIFEST).is_file() and not (p / "config.json").is_file():
        raise RecycleError(f"{flag} {p}: this is a harvest cache, not a model: give it to distill --cache-hidden")
    cfg = load_json(p / "config.json", "config.json")
    fmt = of_config(cfg)
    if fmt is not None:
        raise RecycleError(f"{flag} {p}: this is a drafter ({fmt.name}), not a target: pass the model it drafts for as "
                           f"{flag}")
    ckpt = Checkpoint(p)
    try:
        mtp = set(match(ckpt, strict=False).mtp_names)
    except RecycleError:  # a family recycle has no MTP row for: all of it is trunk
        mtp = set()
    trunk = [n for n, info in ckpt.tensors.items() if n not in mtp and not info.is_scale]
    if not any(LAYER.search(n) for n in trunk) or not any("emb" in n for n in trunk):
        held = "only MTP tensors (an MTP overlay?)" if mtp else "no trunk (no embedding or decoder layers)"
        raise RecycleError(f"{flag} {p}: its weights hold {held}; a target is the whole model")
    return cfg


def drafter(path: str | os.PathLike) -> DrafterFormat:
    """A drafter directory recycle reads; a checkpoint given instead is named as one, with what to do."""
    p = Path(path)
    try:
        return of_directory(p)
    except RecycleError:
        if not (p / "config.json").is_file():
            raise
    if (p / CACHE_MANIFEST).is_file():
        raise RecycleError(f"{p}: this is a harvest cache, not a drafter")
    raise RecycleError(f"{p}: this is a model checkpoint, not a drafter: convert its MTP modules first "
                       f"(recycle convert {p} --to eagle), or pass it as both DRAFTER_DIR and --target to draft with "
                       "its own modules")


def source(path: str | os.PathLike) -> dict:
    """A checkpoint to convert: a model directory, not a drafter recycle wrote (those are converted already)."""
    p = Path(path)
    cfg = load_json(p / "config.json", "config.json")
    fmt = of_config(cfg)
    if fmt is not None and fmt.convertible and fmt.source_layout is None:
        raise RecycleError(f"{p}: this is a drafter ({fmt.name}) recycle wrote, not a checkpoint with MTP modules: "
                           "convert the checkpoint it came from")
    return cfg


def cache(path: str | os.PathLike) -> dict | None:
    """A `--cache-hidden` directory: a harvest cache (returns its manifest), or a place distill fills itself
    (None); never a model or drafter directory, whose files it would mix with cache files."""
    p = Path(path)
    if (p / "config.json").is_file():
        raise RecycleError(f"--cache-hidden {p}: this is {_what(p)}, not a feature cache: give a new or a cache "
                           "directory")
    return load_json(p / CACHE_MANIFEST, "cache manifest") if (p / CACHE_MANIFEST).is_file() else None
