"""`convert`: reader → role weights → the format's converter (`CONVERTERS`) → the atomic writer → recycle.json.

The CLI and the benchmarks call this; the converters themselves stay pure (weights in, plan out). `--calibrate`
(a format that fits what it could not copy: Medusa, EAGLE-3) is a short distillation, which lives above the
converters: the caller passes it in as a `Calibrator` (`recycle convert` and
`recycle.distill.calibrate.convert_calibrated` pass distill's), run between the converter and the writer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from recycle import __version__
from recycle.checkpoint import SHORT_DTYPES, ST_NAMES, TORCH_NAMES, Checkpoint
from recycle.converters.gguf import DTYPES as GGUF_DTYPES
from recycle.converters.reexport import source_view
from recycle.converters.registry import CONVERTERS, ConvertRequest
from recycle.converters.roles import APPROX, EXACT, FRESH, Plan, RoleWeights, backbone, gather
from recycle.errors import RecycleError
from recycle.fit import check_fit
from recycle.formats import DrafterFormat, get
from recycle.io.writer import OutputDir, Progress, split_plan
from recycle.options import ConvertOptions
from recycle.preflight import checkpoint_dir


def mapping_rows(plan: Plan, dtype: str) -> list[dict]:
    """recycle.json's mapping table: every written tensor with its shape, stored type and provenance (a GGUF
    file's tensors as its header stores them: float32 norms, q8_0 blocks)."""
    rows = []
    for file, tensors in plan.tensors.items():
        header = plan.gguf.get(file)
        for name, lazy in tensors.items():
            dt = header.storage(name, lazy.shape, GGUF_DTYPES[dtype]) if header is not None else \
                lazy.dtype or SHORT_DTYPES[dtype]
            rows.append({"file": file, "tensor": name, "shape": list(lazy.shape),
                         "dtype": dt.upper() if isinstance(dt, str) else ST_NAMES[dt],
                         "from": list(lazy.sources), "kind": lazy.kind, **({"note": lazy.note} if lazy.note else {})})
    return rows


def provenance(w: RoleWeights, fmt: DrafterFormat, dtype_name: str, options: dict, plan: Plan,
               rows: list[dict]) -> dict:
    m = w.match
    return {
        "recycle_version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {
            "path": str(w.ckpt.path.resolve()),
            "family": w.family.name,
            "family_title": w.family.title,
            "model_type": w.ckpt.config.get("model_type"),
            "architectures": w.ckpt.config.get("architectures"),
            "modules": len(w.modules),
            "declared": m.declared,
            "module_prefixes": [mod.prefix for mod in w.modules],
            "fp8": any(w.ckpt.tensors[n].is_fp8 for n in m.mtp_names),
            "packed": sorted({w.ckpt.tensors[n].dtype for n in m.mtp_names if n in w.ckpt.packed}),  # codec tags
        },
        "target": {"format": fmt.name, "dtype": dtype_name, "options": options,
                   "layouts": {k: v.what for k, v in fmt.layouts.items()  # the ones written
                               if any(f == k or (k.endswith("/") and f.startswith(k)) for f in plan.tensors)}},
        "summary": {"tensors": len(rows), **{k: sum(r["kind"] == k for r in rows) for k in (EXACT, APPROX, FRESH)}},
        "notes": plan.notes,
        "mapping": rows,
    }


class Calibrator(Protocol):
    """`--calibrate`'s step between the converter and the writer: replaces the plan's approximated tensors by ones
    fitted to the source on the target's own features (in place) and returns recycle.json's "calibration" record.
    `progress(done, total, label)`. Distill's is `recycle.distill.calibrate.calibrate`."""

    def __call__(self, fmt: DrafterFormat, plan: Plan, w: RoleWeights, opts: ConvertOptions,
                 progress: Callable[[int, int, str], None] | None = None) -> dict: ...


def convert(opts: ConvertOptions, progress: Progress | None = None, calibrator: Calibrator | None = None) -> dict:
    """Convert the MTP modules of `opts.source` into a drafter directory `opts.out` in the format `opts.to` names;
    returns a summary dict. The format's converter writes the plan; `calibrator` runs `opts.calibrate`."""
    started = time.perf_counter()
    opts.validate()
    if opts.calibrate is not None and calibrator is None:  # a caller's slip, before anything is read
        raise ValueError("convert: calibrate=TOKENS needs a calibrator (recycle.distill.calibrate.calibrate), "
                         "or convert through recycle.distill.calibrate.convert_calibrated")
    with source_view(opts.source) as source:  # an EAGLE drafter: its mtp_overlay/, re-exported
        return _convert(opts, Checkpoint(source, opts.family), progress, started, calibrator)


def _convert(opts: ConvertOptions, ckpt: Checkpoint, progress: Progress | None, started: float,
             calibrator: Calibrator | None) -> dict:
    fmt = get(opts.to)
    writer = OutputDir(opts.out, overwrite=opts.overwrite, protect=opts.inputs())  # refuses a bad OUT before reading
    if opts.target is not None and fmt.target_file is None:  # a file target (a trunk GGUF): its converter checks it
        check_fit(ckpt.config, checkpoint_dir(opts.target), ckpt.path, opts.target, f"--target {opts.target}")
    w = gather(ckpt)
    bb = backbone(opts.target) if w.family.exports.reads_target and opts.target is not None else None
    draft_ids = None
    if opts.draft_vocab is not None:
        from recycle.converters.vocab import draft_vocab as top_tokens

        # an assistant ships no tokenizer: its target's is the one it shares
        draft_ids = top_tokens(bb.path if bb is not None else ckpt.path, opts.draft_vocab, w.vocab_size,
                               opts.vocab_corpus)
    dtype_name = TORCH_NAMES.get(opts.dtype, opts.dtype)  # torch's name; a GGUF-only type (q8_0) as it is
    plan = CONVERTERS.get(fmt.name, fmt.title)(w, ConvertRequest(opts, dtype_name, draft_ids, bb))
    if not plan.tensors:
        raise RecycleError(f"--layouts {opts.layouts}: nothing to write ({'; '.join(plan.notes)})")
    calibration = calibrator(fmt, plan, w, opts, progress) if opts.calibrate is not None else None
    if opts.eagle3_names is not None:  # the names the chosen readers expect (the record's spellings)
        plan.tensors = {rel: fmt.disk_names(ts, fmt.spellings[opts.eagle3_names]) for rel, ts in plan.tensors.items()}
    # files over --max-shard-size become shards with an index (recycle.json's mapping names the shards)
    keep = frozenset(plan.gguf) | {rel for rel, lay in fmt.layouts.items() if lay.whole}
    plan.tensors, plan.jsons = split_plan(plan.tensors, SHORT_DTYPES.get(opts.dtype), opts.max_shard_size, plan.jsons,
                                          keep)
    rows = mapping_rows(plan, opts.dtype)
    options = {k: getattr(opts, k) for k in ("heads", "draft_vocab", "vocab_corpus", "layouts", "calibrate",
                                             "eagle3_attention", "eagle3_mlp", "module", "eagle3_names")}
    options["vocab_corpus"] = str(opts.vocab_corpus) if opts.vocab_corpus else None
    options["layouts"] = list(plan.layouts) if plan.layouts else None
    record = provenance(w, fmt, dtype_name, options, plan, rows)
    if calibration is not None:
        record["calibration"] = calibration
    with writer as d:
        safetensors = {rel: t for rel, t in plan.tensors.items() if rel not in plan.gguf}
        if safetensors:
            d.write_safetensors(safetensors, SHORT_DTYPES[opts.dtype], progress=_labelled(progress, "writing tensors"),
                                metadata={"recycle_format": fmt.name, "recycle_source_family": w.family.name})
        for rel, header in plan.gguf.items():  # GGUF side files (llama.cpp)
            d.write_gguf(rel, header, plan.tensors[rel], GGUF_DTYPES[opts.dtype],
                         progress=_labelled(progress, f"writing {rel}"))
        for rel, obj in plan.jsons.items():
            d.write_json(rel, obj)
        copied = [f for sub in plan.tokenizer_dirs for f in d.copy_tokenizer(ckpt.path, sub)]
        record["source"]["path"] = str(Path(opts.source).resolve())  # the directory given (a drafter: its overlay)
        record["sha256"] = d.sha256()  # every weight file as written: push refuses one replaced since
        d.write_json("recycle.json", record)
        files = dict(sorted(d.files.items()))
    return {
        "out": str(writer.out),
        "format": fmt.name,
        "dtype": dtype_name,
        "family": w.family.name,
        "modules": len(w.modules),
        "files": files,
        "bytes": sum(files.values()),
        "tokenizer_files": copied,
        "summary": record["summary"],
        "notes": plan.notes,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _labelled(progress: Progress | None, label: str) -> Progress | None:
    """A (done, total) callback that names its stage for a (done, total, label) reporter."""
    return None if progress is None else (lambda i, n: progress(i, n, label))


def convert_checkpoint(source: str | os.PathLike, to: str, out: str | os.PathLike, *, progress: Progress | None = None,
                       calibrator: Calibrator | None = None, **options) -> dict:
    """`convert` with the options as keywords (ConvertOptions' names): the scripts' and tests' shorthand."""
    return convert(ConvertOptions(source=str(source), to=to, out=str(out), **options), progress=progress,
                   calibrator=calibrator)
