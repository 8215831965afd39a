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
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from recycle.converters.eagle import OVERLAY_INDEX
from recycle.converters.roles import raw
from recycle.converters.writer import OutputDir, Progress
from recycle.checkpoint import INDEX_FILE, Checkpoint
from recycle.errors import RecycleError
from recycle.families import MTPMatch, match

STITCHED_FILE = "recycle-mtp.safetensors"


def _read_index(overlay: Path) -> dict:
    import json

    try:
        return json.loads((overlay / OVERLAY_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecycleError(f"{overlay}: not an MTP overlay (no readable {OVERLAY_INDEX}: {e})") from None


def _raise_depth(config: dict, key: str | None, modules: int) -> dict:
    config = dict(config)
    if not key:
        return config
    for scope in (config, config.get("text_config")):
        if isinstance(scope, dict) and isinstance(scope.get(key), int) and scope[key] < modules:
            scope[key] = modules
    return config


def _target_copies(ov: Checkpoint, om: MTPMatch, tgt: Checkpoint) -> dict[str, str]:
    """Overlay names of the modules' embedding/head copies → the target's trunk tensor to store there."""
    out = {}
    for mod in om.modules:
        for role in ("embed", "head"):
            own = mod.tensor(role) if role in mod.roles else None
            trunk = next((n for n in om.family.trunk.get(role, ()) if n in tgt.tensors), None)
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


def stitch(overlay: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, *,
           overwrite: bool = False, progress: Progress | None = None) -> dict:
    """Write `out` = target with the overlay's MTP tensors in place of its own; returns a summary."""
    ov_dir, tgt_dir = Path(overlay), Path(target)
    meta = _read_index(ov_dir).get("metadata", {})
    ov, tgt = Checkpoint(ov_dir), Checkpoint(tgt_dir)
    fam = match(tgt).family.name
    if meta.get("family") not in (None, fam):
        raise RecycleError(f"{ov_dir}: overlay of a '{meta.get('family')}' checkpoint, target is '{fam}'")
    from recycle.fit import check_fit

    check_fit(ov.config, tgt.config, _tokenizer_dir(ov_dir), tgt_dir, f"{ov_dir}")
    copies = _target_copies(ov, match(ov, fam), tgt)
    names = set(ov.tensors)
    for n in names:
        info = tgt.tensors.get(n)
        if info is not None and info.shape != ov.tensors[n].shape:
            raise RecycleError(f"{ov_dir}: {n} has shape {list(ov.tensors[n].shape)}, the target's is {list(info.shape)}")
    writer = OutputDir(out, overwrite=overwrite, protect=(tgt_dir, ov_dir))
    weight_map: dict[str, str] = {}
    rewritten, linked = [], []
    with writer as d:
        rewrite: dict[str, dict] = {}
        for file in tgt.files:
            held = [n for n, i in tgt.tensors.items() if i.file == file]
            keep = [n for n in held if n not in names]
            weight_map.update(dict.fromkeys(keep, file))
            if len(keep) == len(held):
                d.copy_file(tgt.path / file, file, link=True)
                linked.append(file)
            elif keep:
                rewrite[file] = {n: raw(tgt, n) for n in sorted(keep)}
                rewritten.append(file)
        rewrite[STITCHED_FILE] = {n: raw(tgt, copies[n]) if n in copies else raw(ov, n) for n in sorted(names)}
        d.write_safetensors(rewrite, dtype=torch.bfloat16, progress=progress)  # raw tensors keep their dtype
        weight_map.update(dict.fromkeys(names, STITCHED_FILE))
        total = sum(tgt.tensors[n].nbytes for n in weight_map if n in tgt.tensors and n not in names)
        total += sum(tgt.tensors[copies[n]].nbytes if n in copies else ov.tensors[n].nbytes for n in names)
        d.write_json(INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        d.write_json("config.json", _raise_depth(tgt.config, meta.get("depth_key"), int(meta.get("modules") or 0)))
        for p in sorted(tgt.path.iterdir()):
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX_FILE, "config.json"):
                d.copy_file(p, p.name)
    return {"out": str(writer.out), "family": fam, "overlay_tensors": len(names), "linked": linked,
            "rewritten": rewritten, "file": STITCHED_FILE,
            "copies_from_target": dict(sorted(copies.items())), "target_had_mtp": bool(match(tgt).modules)}
