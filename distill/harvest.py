"""`recycle harvest`: the teacher's features computed by vLLM instead of the training process.

Distillation needs, per training window, the target's final-normed last state (eagle, medusa, native MTP)
and, for EAGLE-3, the aux layers' residual streams. Here vLLM computes them (its `extract_hidden_states`
method, so the target may be spread over as many GPUs as vLLM's own parallelism arguments say) and
recycle writes them in the one `--cache-hidden` format (`distill.teacher.store_features`), under the keys
the distiller will ask for: the windows are planned exactly as `distill` plans its steps (same data
stream, seed, batch, sequence length and token budget). `distill --cache-hidden CACHE` then reads every
step's features from the cache; `manifest.json` says what the cache holds, and distill refuses a cache
made for other options.

vLLM's layer ids: k < L is the residual stream entering layer k (transformers' `hidden_states[k]`); L is
the last layer's output *before* the final norm, so the target's final norm (read alone through the lazy
reader) is applied here. Measured against transformers on the fixture: ≤ 2.5e-5 (fp32).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from distill.data import PackedStream, data_source
from distill.teacher import store_features
from distill.train import micro_batches, plan_batch
from recycle.checkpoint import Checkpoint, load_json
from recycle.errors import RecycleError
from recycle.families import match

MANIFEST = "manifest.json"
FORMAT = "recycle-hidden-cache/1"


@dataclass
class HarvestOptions:
    target: str
    out: str
    tokens: int
    data: str | None = None
    seq_len: int = 256
    batch: int = 8
    seed: int = 0
    aux_layers: tuple[int, ...] = ()  # EAGLE-3's eagle_aux_hidden_state_layer_ids (transformers' hidden_states ids)
    overwrite: bool = False
    parallel: dict | None = None  # vLLM's own names: tensor_parallel_size, pipeline_parallel_size, ...


def fingerprint(target: str | os.PathLike) -> dict:
    """What identifies a target without reading its weights: config, shard headers' sizes, tokenizer."""
    ck = Checkpoint(target)
    d = Path(target)
    h = hashlib.sha256(json.dumps(ck.config, sort_keys=True).encode())
    for name in sorted(ck.tensors):
        info = ck.tensors[name]
        h.update(f"{name}:{info.dtype}:{tuple(info.shape)};".encode())
    tok = d / "tokenizer.json"
    return {"weights_layout": h.hexdigest()[:16],
            "tokenizer": hashlib.sha256(tok.read_bytes()).hexdigest()[:16] if tok.is_file() else None,
            "num_hidden_layers": int(ck.config.get("num_hidden_layers", 0))}


def manifest_for(opts: HarvestOptions, keys: list[str], fp: dict | None = None) -> dict:
    return {"format": FORMAT, "target": str(Path(opts.target).resolve()), "fingerprint": fp or fingerprint(opts.target),
            "aux_layers": list(opts.aux_layers), "data": opts.data, "seq_len": opts.seq_len, "batch": opts.batch,
            "seed": opts.seed, "tokens": opts.tokens, "keys": keys, "dtype": "bfloat16"}


def check_manifest(cache: Path, *, target: str, aux_layers: list[int], data: str | None, seq_len: int, batch: int,
                   seed: int, tokens: int, world: int, self_distill: bool) -> None:
    """Refuse (exit 2) a harvested cache made for other distill options: its keys would name other windows."""
    m = load_json(cache / MANIFEST, "cache manifest")
    if world != 1:
        raise RecycleError(f"--cache-hidden {cache}: a harvested cache holds one process's windows; run distill "
                           "without torchrun (the target is not in the process anyway)")
    if self_distill:
        raise RecycleError(f"--cache-hidden {cache}: harvested on the data's own text; --self-distill trains on the "
                           "target's continuations, which this cache does not hold")
    want = {"aux_layers": list(aux_layers), "data": data, "seq_len": seq_len, "batch": batch, "seed": seed}
    got = {k: m.get(k) for k in want}
    if got != want:
        diff = ", ".join(f"{k} {got[k]} (distill: {want[k]})" for k in want if got[k] != want[k])
        raise RecycleError(f"--cache-hidden {cache}: harvested for other options: {diff}")
    if m.get("tokens", 0) < tokens:
        raise RecycleError(f"--cache-hidden {cache}: harvested {m.get('tokens')} tokens, distill asks for {tokens}")
    if m.get("fingerprint") != fingerprint(target):
        raise RecycleError(f"--cache-hidden {cache}: harvested from another target than {target}")


def plan(opts: HarvestOptions, tokenizer) -> list[tuple[str, torch.Tensor]]:
    """(cache key, ids [n, T]) for every micro-batch distill will run, in order (one rank)."""
    stream = PackedStream(data_source(opts.data).train, tokenizer, opts.seq_len, opts.seed)
    out, done, step = [], 0, 0
    while done < opts.tokens:
        lengths = plan_batch(opts.tokens - done, opts.batch, opts.seq_len)
        rows = stream.take(len(lengths))
        out += [(key, rows[idx, :n]) for idx, n, key in micro_batches(step, lengths, 0, 1, opts.seq_len)]
        done += sum(lengths)
        step += 1
    return out


def final_norm(target: str | os.PathLike):
    """The target's final RMSNorm as a function, read alone (no trunk): the family's convention (w or 1+w)."""
    ck = Checkpoint(target)
    name = next((n for n in ("model.norm.weight", "model.language_model.norm.weight", "backbone.norm_f.weight")
                 if n in ck.tensors), None)
    if name is None:
        raise RecycleError(f"{target}: no final norm tensor (model.norm.weight) to apply to vLLM's last state")
    w = ck.get(name).float()
    try:
        zero_centred = match(ck).family.norm == "1+w"
    except RecycleError:
        zero_centred = False
    w = w + 1 if zero_centred else w
    eps = float(ck.config.get("rms_norm_eps", 1e-6))

    def apply(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    return apply


def harvest(opts: HarvestOptions, progress=None) -> dict:
    """Run the target in vLLM over distill's windows and write the cache directory (atomically)."""
    from transformers import AutoTokenizer

    from recycle.engines.vllm_env import run_job

    started = time.perf_counter()
    out = Path(opts.out)
    if out.exists() and not opts.overwrite:
        raise RecycleError(f"{out}: exists (pass --overwrite to replace it)")
    fp = fingerprint(opts.target)
    n_layers = fp["num_hidden_layers"]
    bad = [i for i in opts.aux_layers if not 0 <= i <= n_layers]
    if bad:
        raise RecycleError(f"aux layer {bad[0]}: the target has {n_layers} layers")
    tokenizer = AutoTokenizer.from_pretrained(opts.target)
    batches = plan(opts, tokenizer)
    norm = final_norm(opts.target)
    work = out.parent / f".{out.name}.harvesting-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "raw").mkdir(parents=True)
    try:
        layers = [*opts.aux_layers, n_layers] if n_layers not in opts.aux_layers else list(opts.aux_layers)
        windows = [row.tolist() for _, ids in batches for row in ids]
        res = run_job({"mode": "harvest", "target": str(Path(opts.target).resolve()), "windows": windows,
                       "layers": layers, "out_dir": str((work / "raw").resolve()), "parallel": opts.parallel or {}},
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        files = iter(res["files"])
        last_i = layers.index(n_layers)
        for key, ids in batches:
            states = [load_file(next(files))["hidden_states"] for _ in range(ids.shape[0])]
            hs = torch.stack(states)  # [n, T, len(layers), H]
            last = norm(hs[:, :, last_i])
            aux = None
            if opts.aux_layers:  # transformers' hidden_states[L] is the normed state
                aux = torch.cat([norm(hs[:, :, layers.index(i)]) if i == n_layers else hs[:, :, layers.index(i)]
                                 for i in opts.aux_layers], dim=-1)
            store_features(work / f"{key}.safetensors", ids, last, aux)
            if progress is not None:
                progress(key)
        shutil.rmtree(work / "raw")
        tokens = sum(int(ids.numel()) for _, ids in batches)
        manifest = manifest_for(opts, [k for k, _ in batches], fp)
        manifest["engine"] = {"seconds": round(res["seconds"], 3), "tokens_per_s": round(tokens / res["seconds"])}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.iterdir())
    return {"out": str(out), "files": len(batches) + 1, "bytes": size, "tokens": tokens,
            "vllm_seconds": manifest["engine"]["seconds"], "vllm_tokens_per_s": manifest["engine"]["tokens_per_s"],
            "seconds": round(time.perf_counter() - started, 3), "options": asdict(opts) | {"aux_layers": list(opts.aux_layers)},
            "bytes_per_token": round(size / max(1, tokens))}
