"""What `recycle push` checks before anything leaves the machine: a bad drafter on the Hub is served by other
people's engines, so the layout must be the one recycle.json declares (the drafter class builds from it
strictly, every safetensors header equals the mapping table convert wrote), every weight must be finite, no
weight matrix made from the source's weights may be constant (all zeros: a broken conversion or training run,
whose card would still call it lossless), and every weight file must be the one recycle wrote (its sha256 equals
the one recycle.json recorded when the file was written)."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from recycle.bench_result import BenchResult
from recycle.checkpoint import Checkpoint
from recycle.drafters import load_drafter
from recycle.errors import RecycleError
from recycle.formats import BENCH_REPORT, convertible, get, of_config
from recycle.preflight import drafter_record, load_json

CARD = "README.md"
BENCH = BENCH_REPORT
PROVENANCE = "recycle.json"
Progress = Callable[[int, int], None]


@dataclass
class Drafter:
    """A validated drafter directory: what the card is written from and what would be uploaded."""

    path: Path
    format: str
    record: dict  # recycle.json
    config: dict  # config.json
    files: dict[str, int]  # relative path -> bytes, every file that goes up (the card excluded)
    tensors: int  # tensors checked for NaN/Inf
    bench: BenchResult | None  # bench.json (`recycle bench --save`), when present
    notes: list[str] = field(default_factory=list)


# -- validation -----------------------------------------------------------------------------------


def _hidden(rel: PurePosixPath) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _listing(d: Path) -> dict[str, int]:
    """Every non-hidden file under d (relative POSIX path -> bytes), sorted."""
    files = {}
    for p in sorted(d.rglob("*")):
        rel = PurePosixPath(p.relative_to(d).as_posix())
        if p.is_file() and not _hidden(rel):
            files[str(rel)] = p.stat().st_size
    return files


def _check_module(d: Path) -> None:
    """Build the format's drafter module strictly from config.json + model.safetensors on the meta device:
    the drafter classes own each format's key set and shapes, so a missing, extra or misshapen tensor
    fails here without allocating the module's memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "copying into a meta parameter is a no-op": intended
        with torch.device("meta"):
            load_drafter(d)


def _check_mapping(d: Path, record: dict, ckpts: dict[str, Checkpoint], st_files: list[str]) -> list[str]:
    """Every safetensors header must hold exactly the tensors (names, shapes, dtypes) recycle.json maps to it."""
    rows = record.get("mapping")
    if rows is None:
        return ["recycle.json has no mapping table: the layout was checked against the drafter class only"]
    planned: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    try:
        for row in rows:
            planned.setdefault(row["file"], {})[row["tensor"]] = (tuple(int(n) for n in row["shape"]), row["dtype"])
    except (KeyError, TypeError, ValueError):
        raise RecycleError(f"{d / PROVENANCE}: malformed mapping table (rows need file, tensor, shape, dtype)") from None
    notes = []
    for sub in sorted(_dropped_layouts(d, record, planned)):
        planned = {f: v for f, v in planned.items() if not f.startswith(sub)}
        notes.append(f"{sub} is not here: distillation dropped it (recycle.json still maps the converted layout)")
    for f in sorted(set(planned) - set(st_files)):
        raise RecycleError(f"{d / f}: missing, but recycle.json maps {len(planned[f])} tensors to it")
    for f in st_files:
        if f not in planned:
            raise RecycleError(f"{d / f}: not in recycle.json's mapping table; remove it or re-run recycle convert")
        sub, name = str(PurePosixPath(f).parent), PurePosixPath(f).name
        stored = {i.name: (i.shape, i.dtype) for i in ckpts[sub].stored.values() if i.file == name}
        want = planned[f]
        missing, extra = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
        if missing:
            raise RecycleError(f"{d / f}: lacks {len(missing)} tensor(s) recycle.json maps to it (first: {missing[0]})")
        if extra:
            raise RecycleError(f"{d / f}: holds {len(extra)} tensor(s) recycle.json does not map (first: {extra[0]})")
        for t, (shape, dtype) in want.items():
            if stored[t] != (shape, dtype):
                raise RecycleError(f"{d / f}: {t} is {stored[t][1]} {list(stored[t][0])}, "
                                   f"recycle.json says {dtype} {list(shape)}")
    return notes


def _fresh(record: dict) -> set[tuple[str, str]]:
    """(file, tensor) of the mapping's fresh tensors: initialised, not made from the source (Medusa's residual
    blocks start at zero, on purpose), so a constant one carries no warning."""
    rows = record.get("mapping") or []
    return {(r.get("file"), r.get("tensor")) for r in rows if isinstance(r, dict) and r.get("kind") == "fresh"}


def _check_values(path: Path, name: str, chunks, signal: bool) -> None:
    """Refuse a tensor holding NaN or Inf, or, where it should carry signal (`signal`: a matrix made from the source's
    weights), one value in every entry (all zeros: nothing a drafter could have learned or been converted to)."""
    lo = hi = None
    for chunk in chunks:
        if not bool(torch.isfinite(chunk).all()):
            raise RecycleError(f"{path}: tensor {name} holds NaN or Inf values; refusing to publish corrupt weights")
        if signal and chunk.numel():
            a, b = float(chunk.min()), float(chunk.max())
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    if signal and lo is not None and lo == hi:
        what = "all zeros" if lo == 0 else f"the one value {lo:g} in every entry"
        raise RecycleError(f"{path}: tensor {name} is {what}; refusing to publish degenerate weights (a broken "
                           "conversion or training run: re-run recycle convert or distill)")


def _check_digests(d: Path, record: dict, st_files: list[str]) -> list[str]:
    """Every weight file must be the one recycle wrote: its sha256 equal to recycle.json's `sha256` entry, which the
    writer computed when it wrote the file (an older record without one gets a note)."""
    digests = record.get("sha256")
    if digests is None:
        return [f"{PROVENANCE} records no sha256 of the weight files (written by an older recycle): a file replaced "
                "since cannot be told from the one recycle wrote"]
    if not isinstance(digests, dict):
        raise RecycleError(f"{d / PROVENANCE}: malformed sha256 table (file -> hex digest)")
    for f in st_files:
        want = digests.get(f)
        if want is None:
            raise RecycleError(f"{d / f}: recycle.json records no sha256 for it: not a file recycle wrote here; "
                               "remove it or re-run recycle convert")
        with open(d / f, "rb") as fh:
            got = hashlib.file_digest(fh, "sha256").hexdigest()
        if got != want:
            raise RecycleError(f"{d / f}: not the file recycle wrote (its sha256 differs from recycle.json's): it was "
                               "replaced or edited since; re-run recycle convert or distill")
    return []


def _dropped_layouts(d: Path, record: dict, planned: dict) -> set[str]:
    """Subfolder layouts a distilled drafter no longer has as a whole (distill drops nextn/ or mtp_overlay/
    when it cannot rebuild them exactly); a folder that is present but incomplete is still an error."""
    if not distillation_runs(record):
        return set()
    subs = {f.split("/")[0] + "/" for f in planned if "/" in f}
    subs |= {k for k in (record.get("target") or {}).get("layouts") or {} if k.endswith("/")}
    return {sub for sub in subs if not (d / sub).exists()}


def distillation_runs(record: dict) -> list[dict]:
    """recycle.json's `distillation` runs (distill appends one record per run; a lone dict is one run)."""
    runs = record.get("distillation")
    if isinstance(runs, dict):
        return [runs]
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def _read_bench(path: Path, fmt: str) -> BenchResult | None:
    """bench.json (`recycle bench --save`), which the card's benchmark table is made from: it must be bench's report,
    and of a drafter of this directory's format (a report copied in from another drafter would be published as
    this one's figures)."""
    if not path.is_file():
        return None
    try:
        data = BenchResult.from_json(load_json(path, "bench report"))
    except ValueError as e:
        raise RecycleError(f"{path}: not a `recycle bench --json` report ({e})") from None
    kind = data.drafter_kind
    if kind is not None and kind != fmt:
        raise RecycleError(f"{path}: measures a {kind} drafter, but this directory holds {fmt}; re-run "
                           f"`recycle bench {path.parent} --target TARGET_DIR --save`")
    return data


def validate_drafter(path: str | os.PathLike, progress: Progress | None = None) -> Drafter:
    """Refuse (RecycleError) a directory whose layout, config or weights do not match the format it declares."""
    record = drafter_record(path)
    d = Path(path).expanduser().resolve()
    fmt = (record.get("target") or {}).get("format")
    if fmt not in convertible():
        raise RecycleError(f"{d / PROVENANCE}: target.format is {fmt!r}, expected one of {', '.join(convertible())}")
    if get(fmt).detect is None:  # a file for another program (a GGUF side file), not a drafter directory
        files = ", ".join(sorted(get(fmt).layouts))
        raise RecycleError(f"{d}: a {get(fmt).title}; recycle push publishes drafter directories (with a config.json): "
                           f"upload {files} beside the trunk GGUFs it pairs with (`hf upload REPO {d / files}`)")
    config = load_json(d / "config.json", "config.json")
    described = of_config(config)
    if described is None or described.name != fmt:
        raise RecycleError(f"{d / 'config.json'}: describes {described.name if described else 'no known drafter format'}, "
                           f"but recycle.json declares {fmt}")
    _check_module(d)
    files = _listing(d)
    st_files = [f for f in files if f.endswith(".safetensors")]
    ckpts = {sub: Checkpoint(d / sub) for sub in sorted({str(PurePosixPath(f).parent) for f in st_files})}
    notes = _check_mapping(d, record, ckpts, st_files)
    dropped = _dropped_layouts(d, record, {})
    for rel in (record.get("target") or {}).get("layouts") or {}:
        if not (d / rel).exists() and rel not in dropped:
            raise RecycleError(f"{d / rel}: missing, but recycle.json lists it as a layout of this drafter")
    total = sum(len(c.tensors) for c in ckpts.values())
    done = 0
    fresh = _fresh(record)
    for sub, ckpt in ckpts.items():
        for name, info in ckpt.tensors.items():
            rel = str(PurePosixPath(sub) / info.file)
            signal = len(info.shape) >= 2 and info.numel > 1 and (rel, name) not in fresh
            _check_values(ckpt.path / info.file, name, ckpt.iter_chunks(name), signal)
            done += 1
            if progress:
                progress(done, total)
    notes += _check_digests(d, record, st_files)
    if CARD in files:
        notes.append(f"the directory's own {CARD} is replaced by the generated model card")
        del files[CARD]
    return Drafter(d, fmt, record, config, files, total, _read_bench(d / BENCH, fmt), notes)
