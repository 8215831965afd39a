"""Checks of paths and arguments that need nothing heavy: no torch, no transformers, no safetensors.

The CLI runs them before it imports the libraries that take seconds to load, so bad input fails in a
fraction of a second; the library runs the same functions, so the messages are one and the same.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from recycle.errors import RecycleError

SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def load_json(path: Path, what: str) -> dict:
    """A JSON object from a file, or a one-line RecycleError saying what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise RecycleError(f"{path}: no {what} found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecycleError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise RecycleError(f"{path}: {what} is not a JSON object")
    return data


def checkpoint_dir(path: str | os.PathLike) -> dict:
    """A checkpoint directory's config.json (it must exist, be a directory and hold a config)."""
    p = Path(path)
    if not p.exists():
        raise RecycleError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise RecycleError(f"{p}: not a directory (pass the checkpoint directory)")
    return load_json(p / "config.json", "config.json")


def model_dir(path: str | os.PathLike, what: str = "--target") -> None:
    """A directory transformers can be pointed at: it exists and holds a config.json."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise RecycleError(f"{what} {p}: not a model directory (no config.json)")


def drafter_dir(path: str | os.PathLike) -> None:
    p = Path(path)
    if not p.is_dir():
        raise RecycleError(f"{p}: no such drafter directory")


def drafter_record(path: str | os.PathLike) -> dict:
    """The recycle.json of a drafter directory that recycle wrote (push publishes only those)."""
    d = Path(path).expanduser()
    drafter_dir(d)
    record = d.resolve() / "recycle.json"
    if not record.is_file():
        raise RecycleError(f"{record}: missing; push publishes directories written by recycle "
                           "(convert/distill), whose recycle.json records how the drafter was made")
    return load_json(record, "recycle.json")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def output_dir(out: str | os.PathLike, overwrite: bool = False, protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Where an output may go: not a source or inside one, not around one, and not an existing
    directory unless `overwrite`. Returns the resolved path."""
    o = Path(out).expanduser().resolve()
    for p in protect:
        src = Path(p).expanduser().resolve()
        if _inside(o, src):
            raise RecycleError(f"{o}: the output must not be the source directory or inside it ({src})")
        if _inside(src, o):
            raise RecycleError(f"{o}: the output contains the source directory {src}; choose another -o")
    if o.exists() or o.is_symlink():
        if not o.is_dir():
            raise RecycleError(f"{o}: exists and is not a directory")
        if not overwrite:
            raise RecycleError(f"{o}: already exists (pass --overwrite to replace it)")
    return o


def parse_tokens(value: str | int, option: str = "--tokens") -> int:
    """'2M' → 2_000_000; accepts k/M/B (case-insensitive), decimals ('1.5M'), underscores, plain ints."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([kKmMbBgGtT]?)\s*", str(value).replace("_", "").replace(",", ""))
        if not m:
            raise RecycleError(f"{option} {value!r}: expected a count like 300k, 2M, 1.5B or 500000")
        n = int(round(float(m.group(1)) * SUFFIXES[m.group(2).lower()]))
    if n < 1:
        raise RecycleError(f"{option} {value!r}: the budget must be at least 1 token")
    return n


DEFAULT_SHARD_SIZE = "5GB"  # huggingface_hub's and transformers' default: what the Hub and every loader expect


def parse_size(value: str | int | None, option: str = "--max-shard-size") -> int | None:
    """'5GB' → 5_000_000_000 (huggingface_hub's units and parser: KB, MB, GB, TB, powers of 1000, as the Hub and
    transformers count a shard); None or 'none': no limit."""
    if value is None or isinstance(value, int):
        return value
    if str(value).strip().lower() in ("none", "0"):
        return None
    from huggingface_hub.serialization._base import parse_size_to_int  # the parser save_pretrained's sizes go through

    try:
        n = parse_size_to_int(str(value))
    except ValueError:
        raise RecycleError(f"{option} {value!r}: expected a size like 5GB, 500MB or 100KB (or none)") from None
    if n < 1:
        raise RecycleError(f"{option} {value!r}: a shard holds at least one byte")
    return n


def data_name(data: str | os.PathLike | None) -> None:
    """`--data`: a corpus name or a path that exists."""
    from recycle.corpus import corpus_root, is_corpus_name

    if data is None or str(data).startswith("hf:"):  # a cached dataset by name: found (or not) when read
        return
    if is_corpus_name(str(data)):
        corpus_root(str(data))
    elif not Path(data).expanduser().exists():
        raise RecycleError(f"--data {Path(data).expanduser()}: no such file or directory")
