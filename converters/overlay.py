"""Stitch an MTP overlay back into a copy of its target checkpoint.

vLLM (`method: "mtp"`) and llama.cpp (`--spec-type draft-mtp`, after its own GGUF conversion)
run MTP modules only from inside the target checkpoint, under the target's own tensor names. An
overlay (`OUT/mtp_overlay/` from `recycle convert --to eagle`, or a distilled drafter's) holds
exactly those tensors, byte for byte in the target's storage dtypes (FP8 with `_scale_inv`).

`stitch(overlay, target, out)` writes a new checkpoint directory:
  * target shards holding none of the overlay's names are hard-linked (copied across filesystems);
  * shards holding some are rewritten without them;
  * the overlay's tensors go to `recycle-mtp.safetensors`, except the modules' stored copies of the
    embedding and LM head (`embed_tokens`, `shared_head.head`): those are the target's own trunk
    tensors, because engines (vLLM, SGLang) draft with the copies, and an overlay made from a base
    checkpoint carries the base's, which a post-trained target no longer has;
  * `model.safetensors.index.json` maps every tensor to its file; config.json's MTP depth key is
    raised to the overlay's module count when it is lower; every other file is copied.
The target is never modified, and an overlay whose hidden size, vocabulary or tokenizer is not the
target's is refused. It may go into a target that stores no MTP tensors at all (a build that dropped
them). CLI: `recycle stitch OUT/mtp_overlay TARGET_DIR -o STITCHED_DIR`.

Into a quantized target the MTP weights are written as its engine will build them (`--mtp-dtype`): block FP8
keeps its own path (`plan_tensors`: re-quantized into the target's blocks, or BF16 in its ignore list); every
other scheme goes through its record in `recycle.quant.schemes` (`scheme_plan.plan_scheme`): the target's own MTP storage
where its config agrees (NVFP4, compressed-tensors, ... through the codec's `quantize`; FP8 blocks), else the
record's `writes` (BF16 named in the scheme's own ignore key), every BF16 module checked with the scheme's ignore
rule; the configs (config.json, ModelOpt's hf_quant_config.json) are rewritten with the new entries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from recycle.checkpoint import DTYPES, INDEX_FILE, QUANT_CONFIG_FILE, Checkpoint
from recycle.converters.eagle import OVERLAY_INDEX
from recycle.converters.roles import EXACT, raw
from recycle.converters.scheme_plan import Requant, as_float, plan_scheme, refuse_scheme, trunk_dtype
from recycle.errors import RecycleError
from recycle.families import MTPMatch, match
from recycle.fused import scale_chunks, scale_fits, tiled_scale_shape
from recycle.io.writer import Lazy, OutputDir, Progress, nbytes, split_plan
from recycle.preflight import DEFAULT_SHARD_SIZE
from recycle.quant import (
    engine_fp8,
    expected_scale_shape,
    ignore_entries,
    scale_name,
    scheme,
    with_ignored,
)
from recycle.quant.schemes import detect

STITCHED_FILE = "recycle-mtp.safetensors"
RECORD = "recycle-stitch.json"  # what stitch decided, per tensor (the stitched directory is a model, not a drafter)
MTP_DTYPES = ("auto", "bf16")


def _read_index(overlay: Path) -> dict:

    try:
        return json.loads((overlay / OVERLAY_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecycleError(f"{overlay}: not an MTP overlay (no readable {OVERLAY_INDEX}: {e})") from None


def _raise_depth(config: dict, key: str | None, modules: int, source: dict | None = None) -> dict:
    """The target's config with its MTP depth key raised to the overlay's module count, and its per-layer lists that
    stop at the trunk (a release that shipped no MTP: DeepSeek-V4-Flash-0731's `compress_ratios`) given the MTP
    layers' entries from the overlay's source config, where the source's list runs exactly `modules` past its trunk."""
    config = dict(config)
    if not key:
        return config
    for scope, theirs in ((config, source or {}), (config.get("text_config"), (source or {}).get("text_config"))):
        if not isinstance(scope, dict):
            continue
        if isinstance(scope.get(key), int) and scope[key] < modules:
            scope[key] = modules
        layers = scope.get("num_hidden_layers")
        if not isinstance(theirs, dict) or not isinstance(layers, int) or theirs.get("num_hidden_layers") != layers:
            continue
        for name, value in theirs.items():
            mine = scope.get(name)
            if (isinstance(value, list) and isinstance(mine, list) and len(value) == layers + modules
                    and len(mine) == layers and value[:layers] == mine):
                scope[name] = mine + value[layers:]
    return config


def _target_copies(ov: Checkpoint, om: MTPMatch, tgt: Checkpoint) -> dict[str, str]:
    """Overlay names of the modules' embedding/head copies → the target's trunk tensor to store there."""
    out = {}
    for mod in om.modules:
        for role in ("embed", "head"):
            own = mod.tensor(role) if role in mod.roles else None
            trunk = next((n for n in om.family.layout.trunk.get(role, ()) if n in tgt.tensors), None)
            if own is None or trunk is None:
                continue
            if tgt.tensors[trunk].shape != ov.tensors[own].shape:
                raise RecycleError(f"{ov.path}: {own} has shape {list(ov.tensors[own].shape)}, the target's "
                                   f"{trunk} {list(tgt.tensors[trunk].shape)}: the overlay does not fit this target")
            out[own] = trunk
    return out


def _tokenizer_dir(overlay: Path) -> Path:
    """Where the overlay's tokenizer is: in it, or in the drafter directory that holds it."""
    return overlay if (overlay / "tokenizer.json").is_file() else overlay.parent


def _fused_notes(record: dict, tm: MTPMatch, tgt: Checkpoint) -> list[str]:
    """What an engine does with the pre-sharded fused weights (`recycle.fused`) written in a float dtype: vLLM 0.32's
    MTP loader takes one that is not FP8 as `--tensor-parallel-size` chunks (`mimo_v2_mtp.py:340-345`, measured at
    size 1: docs/engines.md), so it reads it right only at the size the chunks were made for."""
    notes = []
    for n, r in sorted(record.items()):
        chunks = scale_chunks(n, tm.family.layout.fused, tgt.config)
        if chunks > 1 and not str(r.get("stored", "")).startswith("F8"):
            notes.append(f"{n}: written {r.get('stored')} in its {chunks} pre-sharded chunks, which vLLM 0.32 reads "
                         f"right only at --tensor-parallel-size {chunks} (a fused weight not in FP8 is taken as that "
                         "many chunks; FP8, --mtp-dtype auto into an FP8 target, at any size: docs/engines.md)")
    return notes


def _check_blocks(tgt: Checkpoint, block: tuple[int, int], mtp: set[str], where: str, fused: tuple = ()) -> None:
    """The target's own FP8 weights must be scaled in the block its config declares (a pre-sharded fused weight's
    chunks each in blocks of their own, `recycle.fused`): scales written in another block than the engine reads
    would dequantize wrongly."""
    for n, info in tgt.tensors.items():
        scale = tgt.scale_for(n) if info.is_fp8 and n not in mtp else None
        if scale is not None and not scale_fits(n, info.shape, scale.shape, fused, tgt.config, block):
            raise RecycleError(f"{where}: {scale.name} has shape {list(scale.shape)}, not the {list(block)} blocks "
                               f"weight_block_size declares for {list(info.shape)}: the target's scales do not match "
                               "its config; nothing written")


def plan_tensors(ov: Checkpoint, tgt: Checkpoint, names: list[str], copies: dict[str, str], mode: str,
                 where: str, fused: tuple = ()) -> tuple[dict[str, Lazy], dict, list[str]]:
    """Every MTP tensor of the stitched file, in the target's scheme; the per-tensor record; the modules to add to
    the ignore list (mode bf16 under an FP8 target). Stored bytes are copied where they already fit; a weight the
    engine runs in FP8 is re-quantized with the target's block (fresh scales; a pre-sharded fused weight, `fused`,
    chunk by chunk, its scales tiled, as the releases and the engines' readers have them); everything else is
    written in the dtype the target stores for the trunk's same kind of tensor."""
    fp8 = scheme(tgt.config, where)
    emb = next((i for n, i in tgt.tensors.items() if "embed" in n and not i.is_scale), None)
    floats = DTYPES[emb.dtype][1] if emb is not None and DTYPES[emb.dtype][1] is not None else torch.bfloat16
    out: dict[str, Lazy] = {}
    record: dict[str, dict] = {}
    ignored: list[str] = []
    for n in names:
        if n in copies:  # the modules' embedding/head copies: the target's own trunk tensors, as stored
            out[n] = raw(tgt, copies[n])
            record[n] = {"stored": tgt.tensors[copies[n]].dtype, "how": f"the target's {copies[n]}"}
            continue
        info, scale = ov.tensors[n], ov.scale_for(n)
        as_fp8 = fp8 is not None and mode == "auto" and engine_fp8(n, info.shape)
        chunks = scale_chunks(n, fused, tgt.config)
        tiled = tiled_scale_shape(n, info.shape, fused, tgt.config, fp8.block) if fp8 is not None else None
        if as_fp8 and info.is_fp8 and scale is not None and scale_fits(n, info.shape, scale.shape, fused,
                                                                      tgt.config, fp8.block):
            out[n], out[scale_name(n)] = raw(ov, n), raw(ov, scale.name)
            record[n] = {"stored": info.dtype, "how": "stored bytes (FP8 in the target's blocks)"}
        elif as_fp8:
            job = Requant(lambda n=n, chunks=chunks: ov.get(n, row_chunks=chunks), fp8.block, row_chunks=chunks)
            out[n] = Lazy(info.shape, lambda job=job: job.get()[0], (n,), EXACT, "re-quantized to the target's FP8 "
                          "blocks", dtype=torch.float8_e4m3fn)
            out[scale_name(n)] = Lazy(tiled or expected_scale_shape(info.shape, fp8.block), lambda job=job: job.get()[1],
                                      (n,), EXACT, "fresh weight_scale_inv", dtype=torch.float32)
            record[n] = {"stored": "F8_E4M3", "how": "re-quantized", "error": job}
        else:
            want = floats if fp8 is not None and engine_fp8(n, info.shape) else trunk_dtype(tgt, n, floats)
            if fp8 is not None and engine_fp8(n, info.shape):
                ignored.append(n)
            out[n], record[n] = as_float(ov, n, want, chunks)
    return out, record, ignore_entries(ignored)


def _errors(record: dict) -> dict:
    """The re-quantization errors, once the tensors were made (the writer made them)."""
    out = {}
    for n, r in record.items():
        job = r.pop("error", None)
        if job is not None and job.done is not None:
            r.update(job.done[2] if isinstance(job, Requant) else job.error)
        out[n] = r
    return out


def stitch(overlay: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, *,
           overwrite: bool = False, progress: Progress | None = None, mtp_dtype: str = "auto",
           max_shard_size: int | str | None = DEFAULT_SHARD_SIZE) -> dict:
    """Write `out` = target with the overlay's MTP tensors in place of its own, in the target's quantization scheme
    (`mtp_dtype` "auto": FP8 where the engine runs FP8; "bf16": BF16 with the modules in the ignore list); returns a
    summary, also written as recycle-stitch.json. The MTP tensors go to `recycle-mtp.safetensors`, in shards of at
    most `max_shard_size` (the target's own files keep theirs)."""
    if mtp_dtype not in MTP_DTYPES:
        raise RecycleError(f"--mtp-dtype {mtp_dtype!r}: choose {' or '.join(MTP_DTYPES)}")
    ov_dir, tgt_dir = Path(overlay), Path(target)
    meta = _read_index(ov_dir).get("metadata", {})
    ov, tgt = Checkpoint(ov_dir), Checkpoint(tgt_dir)
    rec = detect(tgt.config, tgt_dir)  # the scheme record (None: unquantized)
    # block FP8 keeps its own path; every other scheme goes through its record (refusals before anything is written)
    fp8 = scheme(tgt.config, str(tgt_dir)) if rec is not None and rec.name == "fp8_block" else None
    # the row convert used (its --family) is the overlay's; the target's tensors must be that row's
    tm = match(tgt, strict=meta.get("family") is None)
    fam = tm.family.name
    if meta.get("family") not in (None, fam):
        raise RecycleError(f"{ov_dir}: overlay of a '{meta.get('family')}' checkpoint, target is '{fam}'")
    if rec is not None and fp8 is None:
        refuse_scheme(rec, tgt, tm, mtp_dtype, str(tgt_dir))
    from recycle.fit import check_fit

    check_fit(ov.config, tgt.config, _tokenizer_dir(ov_dir), tgt_dir, f"{ov_dir}")
    om = match(ov, fam)
    copies = _target_copies(ov, om, tgt)
    names = sorted(n for n, i in ov.tensors.items() if not i.is_scale)
    for n in names:
        info = tgt.tensors.get(n)
        if info is not None and info.shape != ov.tensors[n].shape:
            raise RecycleError(f"{ov_dir}: {n} has shape {list(ov.tensors[n].shape)}, the target's is {list(info.shape)}")
    if fp8 is not None:
        _check_blocks(tgt, fp8.block, set(tm.mtp_names), str(tgt_dir), tm.family.layout.fused)
    cfg = None
    if rec is None or fp8 is not None:
        tensors, record, ignored = plan_tensors(ov, tgt, names, copies, mtp_dtype, str(tgt_dir), tm.family.layout.fused)
    else:
        tensors, record, cfg, ignored = plan_scheme(ov, tgt, om, tm, rec, names, copies, mtp_dtype, str(tgt_dir))
    drop = set(tm.mtp_names) | set(tensors)  # the target's old MTP tensors go, stale scales with them
    drop |= {part for n in drop if n in tgt.packed for part in tgt.packed[n].parts.values()}  # and packed parts
    writer = OutputDir(out, overwrite=overwrite, protect=(tgt_dir, ov_dir))
    weight_map: dict[str, str] = {}
    rewritten, linked = [], []
    with writer as d:
        rewrite: dict[str, dict] = {}
        for file in tgt.files:
            held = [n for n, i in tgt.stored.items() if i.file == file]
            keep = [n for n in held if n not in drop]
            weight_map.update(dict.fromkeys(keep, file))
            if len(keep) == len(held):
                d.copy_file(tgt.path / file, file, link=True)
                linked.append(file)
            elif keep:
                rewrite[file] = {n: raw(tgt, n) for n in sorted(keep)}
                rewritten.append(file)
        stitched, _ = split_plan({STITCHED_FILE: dict(sorted(tensors.items()))}, torch.bfloat16, max_shard_size)
        rewrite.update(stitched)
        d.write_safetensors(rewrite, dtype=torch.bfloat16, progress=progress)  # each Lazy says its own dtype
        sizes = {n: i.nbytes for n, i in tgt.stored.items()}
        total = sum(sizes[n] for n in weight_map)
        for file, part in stitched.items():
            weight_map.update(dict.fromkeys(part, file))
        total += sum(nbytes(t.shape, t.dtype or torch.bfloat16) for t in tensors.values())
        d.write_json(INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        config = _raise_depth(cfg.config if cfg is not None else tgt.config, meta.get("depth_key"),
                              int(meta.get("modules") or 0), ov.config)
        if ignored and cfg is None:
            config = with_ignored(config, ignored)
        d.write_json("config.json", config)
        rewrites = {INDEX_FILE, "config.json", RECORD}
        if cfg is not None and cfg.hf is not None:
            d.write_json(QUANT_CONFIG_FILE, cfg.hf)
            rewrites.add(QUANT_CONFIG_FILE)
        for p in sorted(tgt.path.iterdir()):
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in rewrites:
                d.copy_file(p, p.name)
        target = ("fp8 block " + "x".join(map(str, fp8.block)) if fp8 else rec.title if rec is not None else "none")
        summary = {"out": str(writer.out), "family": fam, "overlay_tensors": len(names), "linked": linked,
                   "rewritten": rewritten, "file": STITCHED_FILE,
                   "files": sorted(stitched), "copies_from_target": dict(sorted(copies.items())),
                   "target_had_mtp": bool(tm.modules),
                   "quantization": {"target": target, "scheme": rec.name if rec is not None else None,
                                    "mtp_dtype": mtp_dtype, "ignored_added": sorted(ignored),
                                    "ignore_keys": {k: sorted(v) for k, v in sorted(cfg.added.items())} if cfg is not None else {},
                                    "tensors": _errors(record)}}
        summary["notes"] = _fused_notes(record, tm, tgt)
        q = summary["quantization"]
        errs = [r["max_rel_error"] for r in q["tensors"].values() if "max_rel_error" in r]
        q["requantized"] = len(errs)
        q["max_rel_error"] = max(errs) if errs else None
        d.write_json(RECORD, summary)
    return summary
