"""`recycle harvest`: the teacher's features computed by vLLM instead of the training process.

Distillation needs, per training window, the target's final-normed last state (eagle, medusa, native MTP)
and, for EAGLE-3, the aux layers' residual streams. Here vLLM computes them (its `extract_hidden_states`
method, so the target may be spread over as many GPUs as vLLM's own parallelism arguments say) and
recycle writes them in the one `--cache-hidden` format (`recycle.distill.teacher.store_features`), under the keys
the distiller will ask for: the windows are planned exactly as `distill` plans its steps (same data
stream, seed, batch, sequence length and token budget), plus distill's held-out rows under `eval` (their
greedy continuations written by vLLM first, as distill's own teacher writes them). `distill --cache-hidden
CACHE` then reads every step's features from the cache and never builds the target (only its embedding
and head); `manifest.json` says what the cache holds, and distill refuses a cache made for other options.
`harvest` streams the windows to one engine in chunks, can run as N shards (`--shard i/N`, any nodes, one shared
directory) and resumes after a kill (`CACHE/.harvest/`: the plan and each finished shard; the manifest comes last).

vLLM's layer ids: k < L is the residual stream entering layer k (transformers' `hidden_states[k]`); L is
the last layer's output *before* the final norm, so the target's final norm (read alone through the lazy
reader) is applied here. Measured against transformers on the fixture: ≤ 2.5e-5 (fp32).

`--engine transformers` runs the target in this process instead, as distill's own teacher does
(`recycle.distill.teacher.Teacher`: the same loader, hook and dtype, so the cache holds the bytes an in-process
`distill --cache-hidden` run stores); the held-out rows and `--self-distill` text are continued by transformers'
`generate`, as distill continues them. It is the engine for a DeepSeek-V4 target: its drafters chain the last layer's
hyper-connection streams, which vLLM 0.32 does not capture (its V4 model averages them), and the cache stores them
in place of the last state (`streams`, [n, T, C, H] bf16: C × H × 2 + 8 bytes a token; distill mixes the last state
from them with the trunk's own hc_head and norm). Shards and resume are as
with vLLM; data parallel is N shards, each process one target copy on its `--device`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from recycle.checkpoint import Checkpoint
from recycle.decoding.placed import check_gpus
from recycle.distill.data import (
    Generate,
    PackedStream,
    Regenerated,
    heldout_rows,
    in_process,
    regenerate,
    regenerate_turns,
)
from recycle.distill.schedule import EVAL_KEY, Schedule, eval_prompt_len
from recycle.distill.teacher import STREAMS_FROM_VLLM, Teacher, store_features
from recycle.encode import load_tokenizer, source_renderer
from recycle.errors import RecycleError
from recycle.families import match
from recycle.hardware import default_precision, resolve_device
from recycle.mtp import chained_streams
from recycle.options import HARVEST_STATE, DataOptions, HarvestOptions
from recycle.preflight import OutputLock, load_json
from recycle.texts import data_source

MANIFEST = "manifest.json"
REGENERATED = "regenerated.jsonl"  # --self-distill on conversations: what the target wrote, reusable as --data
FORMAT = "recycle-hidden-cache/1"
CHUNK_WINDOWS = 256  # windows per engine call of an offline harvest: bounded whatever the budget


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


def manifest_for(opts: HarvestOptions, keys: list[str], fp: dict | None = None, streams: int = 0) -> dict:
    return {"format": FORMAT, "target": str(Path(opts.target).resolve()), "fingerprint": fp or fingerprint(opts.target),
            "aux_layers": list(opts.aux_layers), "data": opts.data, "chat_template": opts.chat_template,
            "seq_len": opts.seq_len, "packing": opts.packing, "batch": opts.batch,
            "seed": opts.seed, "tokens": opts.tokens, "keys": keys, "dtype": "bfloat16",
            "eval_rows": opts.eval_rows, "eval_prompt_len": opts.eval_prompt_len, "engine": opts.engine,
            "streams": streams,  # DeepSeek-V4: the hyper-connection streams every file holds in place of the last state
            "self_distill": {"prompt_len": opts.prompt_len, "temperature": opts.sd_temperature,
                             "continuation": ENGINE_NAMES[opts.engine]} if opts.self_distill else None}


ENGINE_NAMES = {"vllm": "vLLM", "transformers": "transformers"}  # what the manifest says wrote the continuations


def vllm_generate(target: str, parallel: dict | None = None, gpu_memory_utilization: float | None = None) -> Generate:
    """`Generate` in vLLM: one engine run per call (all of a round's prompts at once), rows stopping at the stop ids;
    in this machine's build and dtype (`vllm_env.PLATFORMS`), with the harvest's parallel options and memory share."""
    from recycle.engines.vllm_env import job_engine, run_job

    def generate(prompts: list[list[int]], max_new: int, temperature: float, seed: int, stops: list[int]
                 ) -> list[list[int]]:
        if not prompts:
            return []
        res = run_job({"target": target, "prompt_ids": prompts, "max_new_tokens": max_new, "temperature": temperature,
                       "seed": seed, "stop_token_ids": stops, **job_engine(parallel, gpu_memory_utilization),
                       "runs": [{"name": "turns", "speculative_config": None}]})["turns"]
        if "error" in res:
            raise RecycleError(f"vLLM: {res['error']}")
        return res["tokens"]

    return generate


def check_manifest(cache: Path, opts: DataOptions, aux_layers: list[int], world: int, streams: int = 0,
                   follow: bool = False) -> dict:
    """Refuse (exit 2) a harvested cache made for other distill options: its keys would name other windows, or
    without the `streams` hyper-connection streams a DeepSeek-V4 drafter reads. Returns the manifest."""
    m = load_json(cache / MANIFEST, "cache manifest")
    if bool(m.get("follow")) != follow:
        raise RecycleError(f"--cache-hidden {cache}: " + (
            "a harvest read as it is written (--ahead): pass --follow" if m.get("follow") else
            "a finished harvest: --follow, which deletes what it reads, is for one run with --ahead"))
    if streams and m.get("streams") != streams:
        raise RecycleError(f"--cache-hidden {cache}: holds no hyper-connection streams, which a DeepSeek-V4 drafter "
                           f"trains on ({streams} a token); harvest with --engine transformers")
    if world > 1 and m.get("batch") != opts.batch * world:  # each rank reads its block of every step's rows
        raise RecycleError(f"--cache-hidden {cache}: harvested with --batch {m.get('batch')} (one process); under "
                           f"{world} ranks --batch is per rank: pass --batch {m.get('batch')}/{world}"
                           + ("" if isinstance(m.get("batch"), int) and m["batch"] % world == 0 else
                              f", which {world} ranks do not divide: choose a world size that does"))
    sd = m.get("self_distill")
    if opts.self_distill and sd is None:
        raise RecycleError(f"--cache-hidden {cache}: harvested on the data's own text; --self-distill trains on the "
                           "target's continuations: harvest with --self-distill")
    if sd is not None and not opts.self_distill:
        raise RecycleError(f"--cache-hidden {cache}: harvested with --self-distill (the target's continuations); "
                           "pass --self-distill to train on them")
    if sd is not None and (sd.get("prompt_len"), sd.get("temperature")) != (opts.prompt_len, opts.sd_temperature):
        raise RecycleError(f"--cache-hidden {cache}: harvested with --prompt-len {sd.get('prompt_len')} "
                           f"--sd-temperature {sd.get('temperature')} (distill: {opts.prompt_len}, "
                           f"{opts.sd_temperature})")
    want = {"aux_layers": list(aux_layers), "data": opts.data, "chat_template": opts.chat_template,
            "seq_len": opts.seq_len, "packing": opts.packing, "batch": opts.batch * world,
            "seed": opts.seed, "eval_rows": opts.eval_rows, "eval_prompt_len": opts.eval_prompt_len}
    got = {k: m.get(k, "stream" if k == "packing" else None) for k in want}  # a cache from before --packing: stream
    if got != want:
        diff = ", ".join(f"{k} {got[k]} (distill: {want[k]})" for k in want if got[k] != want[k])
        raise RecycleError(f"--cache-hidden {cache}: harvested for other options: {diff}")
    if m.get("tokens", 0) < opts.tokens:
        raise RecycleError(f"--cache-hidden {cache}: harvested {m.get('tokens')} tokens, distill asks for "
                           f"{opts.tokens}")
    if m.get("fingerprint") != fingerprint(opts.target):
        raise RecycleError(f"--cache-hidden {cache}: harvested from another target than {opts.target}")
    if not isinstance(m.get("eval"), dict) or not (cache / f"{EVAL_KEY}.safetensors").is_file():
        raise RecycleError(f"--cache-hidden {cache}: it holds no held-out rows (an older harvest); harvest again")
    return m


Window = tuple[str, torch.Tensor, torch.Tensor | None]  # (cache key, ids [n, T], assistant mask [n, T] or None)


def eval_rows(opts: HarvestOptions, tokenizer, generate: Generate | None = None
              ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """distill's held-out rows, how many tokens of each stay as the prompt (0: scored as they are, as conversations
    always are) and their assistant mask (conversations; None for text). With `generate` (`--self-distill` on
    conversations) the target writes the held-out conversations' assistant turns first, as distill does."""
    renderer = source_renderer(opts, tokenizer)
    rewrite = None
    if generate is not None and renderer is not None:
        rewrite = lambda idx, docs, key: regenerate_turns(
            generate, renderer, docs, opts.sd_temperature, opts.seed, opts.seq_len)
    ev, mask = heldout_rows(tokenizer, opts.seq_len, opts.eval_rows, opts.data, renderer, rewrite)
    return ev, 0 if mask is not None else eval_prompt_len(ev.shape[1], opts.eval_prompt_len), mask


def plan(opts: HarvestOptions, tokenizer, generate: Generate | None = None
         ) -> tuple[list[Window], Regenerated | None]:
    """Every micro-batch distill will run, in order (one rank), as (cache key, ids, assistant mask); conversations are
    rendered with the target's template, as distill renders them. With `generate` and `--self-distill` on
    conversations the target writes every assistant turn the windows read (`Regenerated`, also returned)."""
    renderer = source_renderer(opts, tokenizer)
    src = data_source(opts.data)
    stream = PackedStream(src.train, tokenizer, opts.seq_len, opts.seed, renderer, src.log, packing=opts.packing)
    regen = None
    if renderer is not None and opts.self_distill:
        if generate is None:
            raise RecycleError("--self-distill on conversations: the target must write the assistant turns "
                               "(harvest runs them in vLLM)")
        docs = stream.texts()
        sample = [renderer.render(d) for d in docs[:64] if not isinstance(d, str)]
        per_doc = sum(len(r.ids) for r in sample) / max(1, len(sample))
        regen = Regenerated(stream, generate, opts.sd_temperature, opts.seed, opts.seq_len,
                            block=int(1.1 * opts.tokens / max(1.0, per_doc)) + 32)
        stream.rewrite = regen.rewrite
    out: list[Window] = []
    for step in Schedule(opts.tokens, opts.batch, opts.seq_len).steps():
        rows, masks = stream.take_masked(len(step.lengths))
        out += [(mb.key, rows[list(mb.rows), :mb.length], masks[list(mb.rows), :mb.length] if masks is not None else None)
                for mb in step.micro_batches()]
    return out, regen


def final_norm(target: str | os.PathLike):
    """The target's final RMSNorm as a function, read alone (no trunk): the family's convention (w or 1+w)."""
    ck = Checkpoint(target)
    name = next((n for n in ("model.norm.weight", "model.language_model.norm.weight", "backbone.norm_f.weight")
                 if n in ck.tensors), None)
    if name is None:
        raise RecycleError(f"{target}: no final norm tensor (model.norm.weight) to apply to vLLM's last state")
    w = ck.get(name).float()
    try:
        m = match(ck, strict=False)
    except RecycleError:  # no row fits: a plain trunk, `w` norms
        m = None
    if m is not None and m.conflict:  # the norm's parametrisation would be a guess
        raise RecycleError(m.conflict)
    zero_centred = m is not None and m.family.run.norm == "1+w"
    w = w + 1 if zero_centred else w
    eps = float(ck.config.get("rms_norm_eps", 1e-6))

    def apply(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    return apply


def check_engine(opts: HarvestOptions) -> int:
    """The hyper-connection streams the cache must hold (a DeepSeek-V4 target's C, else 0); refused in one line for
    vLLM, which captures none, and `--gpus` past the GPUs this process sees (checked before an engine starts)."""
    check_gpus(opts.gpus, opts.keep_quantized)
    streams = chained_streams(load_json(Path(opts.target) / "config.json", "config.json"))  # the config alone
    if streams and opts.engine == "vllm":
        raise RecycleError(STREAMS_FROM_VLLM.format(what="--engine vllm", instead="harvest with --engine transformers"))
    return streams


class _Local:
    """`--engine transformers`: the target in this process, as distill's teacher runs it (its loader, its streams hook
    for a DeepSeek-V4 target, its device and dtype), loaded once for the whole harvest; `--gpus N` spreads it over N
    GPUs of the node (`recycle.decoding.placed`)."""

    def __init__(self, opts: HarvestOptions, streams: int) -> None:
        device = resolve_device(opts.device)
        self.teacher = Teacher(opts.target, device, list(opts.aux_layers), opts.precision or default_precision(device),
                               streams=bool(streams), gpus=opts.gpus, keep_quantized=opts.keep_quantized)
        self.model = self.teacher.model
        self.seconds = 0.0

    def generate(self, tokenizer) -> Generate:
        return in_process(self.model, tokenizer.pad_token_id)

    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        started = time.perf_counter()
        out = self.teacher.features(ids.to(self.teacher.device))
        self.seconds += time.perf_counter() - started
        return out


class _Job:
    """What both modes share: the checked target, distill's windows, the (engine-regenerated) held-out rows,
    the captured layers, and the conversion of the engine's features into one cache file per key."""

    def __init__(self, opts: HarvestOptions) -> None:
        self.opts = opts
        self.fp = fingerprint(opts.target)
        self.n_layers = n = self.fp["num_hidden_layers"]
        bad = [i for i in opts.aux_layers if not 0 <= i <= n]
        if bad:
            raise RecycleError(f"aux layer {bad[0]}: the target has {n} layers")
        self.streams = check_engine(opts)
        if self.streams and opts.aux_layers:
            raise RecycleError("--aux-layers: a DeepSeek-V4 drafter reads the target's streams, not aux layers")
        self.tokenizer = load_tokenizer(opts.target)
        self.target = str(Path(opts.target).resolve())
        self.chat = source_renderer(opts, self.tokenizer) is not None
        if self.chat and opts.self_distill and opts.shards()[1] > 1:  # each shard would write every conversation
            raise RecycleError("--shard with --self-distill on conversations: every shard would regenerate every "
                               "conversation; harvest them in one job (its engine takes the parallel options)")
        self.local = _Local(opts, self.streams) if opts.engine == "transformers" else None
        gen = None
        if self.chat and opts.self_distill:
            gen = self.local.generate(self.tokenizer) if self.local is not None else \
                vllm_generate(self.target, opts.parallel, opts.gpu_memory_utilization)
        self.batches, self.regenerated = plan(opts, self.tokenizer, gen)
        self.norm = final_norm(opts.target) if self.local is None else None  # transformers' states are normed
        self.layers = [*opts.aux_layers, n] if n not in opts.aux_layers else list(opts.aux_layers)
        self.eval, self.prompt, self.eval_mask = eval_rows(opts, self.tokenizer, gen)

    def regenerate_eval(self) -> None:
        """The held-out rows' continuations, written by the target (greedy, as distill does)."""
        from recycle.engines.vllm_env import run_job

        if not self.prompt:
            return
        ev, p = self.eval, self.prompt
        if self.local is not None:  # distill's own call (`setup._heldout`)
            self.eval = regenerate(self.local.model, ev, p, 0.0, self.opts.seed)
            return
        gen = run_job({"target": self.target, "prompt_ids": ev[:, :p].tolist(), "max_new_tokens": ev.shape[1] - p,
                       "runs": [{"name": "eval", "speculative_config": None}],
                       **self.engine()})["eval"]
        if "error" in gen:
            raise RecycleError(f"vLLM: {gen['error']}")
        self.eval = torch.cat([ev[:, :p], torch.tensor(gen["tokens"], dtype=ev.dtype)], dim=1)

    def engine(self) -> dict:
        """The engine arguments every vLLM job of this harvest carries (`vllm_env.engine_args`: parallel options,
        dtype, memory share), as a job holds them."""
        from recycle.engines.vllm_env import job_engine

        return job_engine(self.opts.parallel, self.opts.gpu_memory_utilization)

    def regenerate_windows(self, items: list[Window]) -> list[Window]:
        """--self-distill: every window of `items` keeps its first prompt_len tokens and the target in vLLM writes
        the rest (as distill's in-process teacher does with transformers; sampled windows are the same law, not
        the same draws). Row r of the whole plan samples with seed + r whichever shard or resumed run writes it."""
        from recycle.engines.vllm_env import run_job

        if not self.opts.self_distill or self.chat:  # conversations: their turns were regenerated by `plan`
            return items
        p = self.opts.prompt_len
        if not 1 <= p < self.opts.seq_len:
            raise RecycleError(f"--prompt-len must be in [1, {self.opts.seq_len - 1}], got {p}")
        # distill continues whole rows and then cuts the budget's last ones: a cut row is a prefix of that
        # (no shorter than the prompt: then it is the data's own text)
        first, n = {}, 0
        for key, ids, _ in self.batches:
            first[key], n = n, n + (ids.shape[0] if ids.shape[1] > p else 0)
        todo = [(first[key] + r, row) for key, ids, _ in items if key in first and ids.shape[1] > p
                for r, row in enumerate(ids)]
        if not todo:
            return items
        if self.local is not None:  # each window continued by transformers, sampled with seed + its first row's index
            return [(key, regenerate(self.local.model, ids, p, self.opts.sd_temperature, self.opts.seed + first[key]),
                     None) if key in first and ids.shape[1] > p else (key, ids, mask) for key, ids, mask in items]
        gen = run_job({"target": self.target, "prompt_ids": [row[:p].tolist() for _, row in todo],
                       "max_new_tokens_each": [len(row) - p for _, row in todo], "temperature": self.opts.sd_temperature,
                       "seed": self.opts.seed, "seed_each": [self.opts.seed + r for r, _ in todo],
                       "runs": [{"name": "windows", "speculative_config": None}],
                       **self.engine()})["windows"]
        if "error" in gen:
            raise RecycleError(f"vLLM: {gen['error']}")
        it = iter(gen["tokens"])
        # a regenerated window is the target's text to its end: whole packing's padding mask no longer applies
        return [(key, ids, mask) if key not in first or ids.shape[1] <= p else
                (key, torch.cat([ids[:, :p], torch.tensor([next(it) for _ in range(ids.shape[0])], dtype=ids.dtype)],
                                dim=1), None)
                for key, ids, mask in items]

    def manifest(self, extra: dict | None = None) -> dict:
        m = manifest_for(self.opts, [k for k, _, _ in self.batches], self.fp, self.streams)
        by = ENGINE_NAMES[self.opts.engine]
        m["eval"] = {"rows": int(self.eval.shape[0]), "seq_len": int(self.eval.shape[1]), "prompt_len": self.prompt,
                     "continuation": f"{by} greedy" if self.prompt else f"the target's own assistant turns ({by})"
                     if self.regenerated is not None else "none (the held-out text itself)"}
        if self.chat:
            m["chat"] = {"assistant_mask": "stored with every key",
                         "regenerated": f"{REGENERATED} ({len(self.regenerated.done)} conversations, every assistant "
                         f"turn written by the target in {by})" if self.regenerated is not None else None}
        return m | (extra or {})

    def save_regenerated(self, dest: Path) -> None:
        """The conversations vLLM regenerated, as JSONL rows in the order training reads them (reusable as --data)."""
        if self.regenerated is None:
            return
        order = {i: n for n, i in enumerate(self.regenerated.stream.order(0))}
        rows = [self.regenerated.done[i] for i in sorted(self.regenerated.done, key=order.__getitem__)]
        dest.write_text("".join(json.dumps(d.to_json()) + "\n" for d in rows if not isinstance(d, str)),
                        encoding="utf-8")

    def job(self, raw: Path, **how) -> dict:
        """vLLM's harvest job, in this machine's build and dtype (`vllm_env.PLATFORMS`: bf16 on GPUs) with
        --gpu-memory-utilization or the machine's default share."""
        from recycle.engines.vllm_env import job_engine

        return {"mode": "harvest", "target": self.target, "layers": self.layers, "out_dir": str(raw.resolve()),
                **job_engine(self.opts.parallel, self.opts.gpu_memory_utilization), **how}

    def store(self, dest: Path, ids: torch.Tensor, files: list[str], mask: torch.Tensor | None = None) -> None:
        """One key's cache file from vLLM's per-window files (which are then removed)."""
        hs = torch.stack([load_file(f)["hidden_states"] for f in files])  # [n, T, len(layers), H]
        n, layers = self.n_layers, self.layers
        last = self.norm(hs[:, :, layers.index(n)])
        aux = None
        if self.opts.aux_layers:  # transformers' hidden_states[L] is the normed state
            aux = torch.cat([self.norm(hs[:, :, layers.index(i)]) if i == n else hs[:, :, layers.index(i)]
                             for i in self.opts.aux_layers], dim=-1)
        store_features(dest, ids, last, aux, mask)
        for f in files:
            Path(f).unlink(missing_ok=True)

    def store_local(self, dest: Path, ids: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """One key's cache file from the target in this process: its features as distill's teacher stores them."""
        last, aux = self.local.features(ids)
        if self.streams:  # the streams alone: distill's teacher mixes the last state from them
            store_features(dest, ids, None, None, mask, streams=aux)
        else:
            store_features(dest, ids, last, aux, mask)


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def shard_of(items: list, index: int, count: int) -> list:
    """Shard `index` of `count`: every count-th key of distill's order (the held-out rows last), so the shards
    differ by at most one key and every key is in exactly one."""
    return items[index::count]


def chunks(items: list[Window], size: int) -> list[list[Window]]:
    """Consecutive whole keys, at most `size` windows a chunk (a key of more windows alone): one engine call each."""
    out: list[list[Window]] = []
    n = size
    for item in items:
        if n + item[1].shape[0] > size:
            out.append([])
            n = 0
        out[-1].append(item)
        n += item[1].shape[0]
    return out


def _stored_ids(path: Path, ids: torch.Tensor, prefix: int) -> bool:
    """Whether the finished cache file at `path` holds these windows (its first `prefix` tokens of each row)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        got = f.get_tensor("input_ids")
    return got.shape == ids.shape and torch.equal(got[:, :prefix], ids[:, :prefix])


def harvest(opts: HarvestOptions, progress=None) -> dict:
    """Run the target in vLLM (or in transformers, `--engine transformers`) over distill's windows (shard i/N of them
    with --shard) and write the cache directory (with `--ahead N`, for a `distill --follow` reading it as it goes).

    Streamed: one engine stays up and is fed CHUNK_WINDOWS windows at a time; each key's vLLM files become its cache
    file as they arrive, on `--convert-workers` threads. Resumable: every key's cache file is written whole (temp +
    rename) and kept; the same options again (any shard, any node) skip the keys already there, after checking they
    hold the planned windows. The manifest is written last, by the run that finishes the last shard: until then
    distill refuses the directory (no manifest.json)."""
    started = time.perf_counter()
    index, count = opts.shards()
    job = _Job(opts)  # every check and the plan before anything is written
    out = Path(opts.out).expanduser().resolve()
    state = out / HARVEST_STATE
    want = {"manifest": job.manifest(), "shards": count}
    if opts.overwrite and out.exists():  # a finished cache, or an unfinished harvest, started again
        lock = OutputLock(out).acquire()
        try:
            shutil.rmtree(out)
        finally:
            lock.release()
    lock = OutputLock(state / f"shard-{index}").acquire()  # CACHE/.harvest/.shard-i.recycle-lock: one run per shard
    try:
        plan_file = state / "plan.json"
        if plan_file.is_file():
            had = load_json(plan_file, "harvest plan")
            if had != want:
                old = had.get("manifest") or {}
                diff = ", ".join(k for k in sorted(set(old) | set(want["manifest"]))
                                 if old.get(k) != want["manifest"].get(k)) or f"in {had.get('shards')} shards"
                raise RecycleError(f"{out}: an unfinished harvest for other options ({diff}); run it with those, "
                                   "or --overwrite to start again")
        else:
            _atomic_json(plan_file, want)
        items = shard_of([*job.batches, (EVAL_KEY, job.eval, job.eval_mask)], index, count)
        todo = []
        for key, ids, mask in items:
            path = out / f"{key}.safetensors"
            for stale in out.glob(f".{key}.safetensors.tmp-*"):  # a killed run's partial write of this key
                stale.unlink(missing_ok=True)
            # what the plan fixes before vLLM writes: a held-out row's prompt, a self-distilled window's prompt
            fixed = (job.prompt or ids.shape[1]) if key == EVAL_KEY else \
                opts.prompt_len if opts.self_distill and not job.chat else ids.shape[1]
            if not path.is_file():
                todo.append((key, ids, mask))
            elif not _stored_ids(path, ids, fixed):
                raise RecycleError(f"{path}: holds other windows than this harvest plans (an earlier run's "
                                   "regenerated text?); --overwrite to start again")
        if any(key == EVAL_KEY for key, _, _ in todo):
            job.regenerate_eval()
            todo = [(k, job.eval, m) if k == EVAL_KEY else (k, ids, m) for k, ids, m in todo]
        todo = job.regenerate_windows(todo)
        if opts.ahead is not None:  # read as it is written: the held-out rows and the manifest first, then in order
            engine = _ahead(job, out, todo, progress)
        elif job.local is not None:
            for key, ids, mask in todo:  # one key at a time, each file whole before the next (resumable)
                job.store_local(out / f"{key}.safetensors", ids, mask)
                if progress is not None:
                    progress(key, total=len(todo))
            engine = {"seconds": job.local.seconds}
        else:
            engine = _extract(job, out, state / f"feed-{index}", todo, progress)
        seconds = float(engine.get("seconds", 0.0))
        tokens = sum(int(ids.numel()) for key, ids, _ in items if key != EVAL_KEY)
        fed = sum(int(ids.numel()) for _, ids, _ in todo)
        _atomic_json(state / f"shard-{index}.json", {"keys": [k for k, _, _ in items]})
        complete = all((state / f"shard-{j}.json").is_file() for j in range(count))
        if complete and opts.ahead is not None:  # the consumer deleted what it read: nothing to check or finalize
            shutil.rmtree(state, ignore_errors=True)
        elif complete:
            _finalize(job, out, state)
    finally:
        lock.release()
    files = [p for p in out.glob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    return {"out": str(out), "files": len(files), "bytes": size, "tokens": tokens, "shard": f"{index}/{count}",
            "keys": len(items), "keys_resumed": len(items) - len(todo), "complete": complete,
            "engine": opts.engine, "engine_seconds": round(seconds, 3),
            "engine_tokens_per_s": round(fed / seconds) if seconds else 0, "streams": job.streams,
            **({"vllm_seconds": round(seconds, 3), "vllm_tokens_per_s": round(fed / seconds) if seconds else 0,
                "vllm_connector": engine.get("connector")} if opts.engine == "vllm" else {}),
            "seconds": round(time.perf_counter() - started, 3),
            "options": asdict(opts) | {"aux_layers": list(opts.aux_layers)},
            "bytes_per_token": round(size / max(1, tokens))}


FOLLOW = ".follow.json"  # CACHE/.follow.json: the step a `distill --follow` waits for (a restarted harvest skips before)


def step_of(key: str) -> int:
    """The step a key's windows belong to (`s{step:08d}...`, `distill.schedule`)."""
    return int(key[1:9])


def follow_position(out: Path) -> int:
    """The step `distill --follow` waits for (0 before it starts)."""
    try:
        return int(json.loads((out / FOLLOW).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _keys_present(out: Path) -> list[Path]:
    return list(out.glob("s*.safetensors"))


def _ahead(job: _Job, out: Path, todo: list[Window], progress=None) -> dict:
    """`--ahead N`: the held-out rows, then the manifest (so `distill --follow` can start), then each key in order
    once fewer than N unread keys are on disk; keys before the step the consumer waits for are skipped (a harvest
    restarted under a running distill)."""
    for key, ids, mask in todo:
        if key == EVAL_KEY:
            job.store_local(out / f"{key}.safetensors", ids, mask)
    _atomic_json(out / MANIFEST, job.manifest({"follow": {"ahead": job.opts.ahead}}))
    for key, ids, mask in todo:
        if key == EVAL_KEY:
            continue
        while step_of(key) >= follow_position(out) and len(_keys_present(out)) >= job.opts.ahead:
            time.sleep(Follower.POLL_S)
        if step_of(key) < follow_position(out):
            continue
        job.store_local(out / f"{key}.safetensors", ids, mask)
        if progress is not None:
            progress(key, total=len(todo))
    return {"seconds": job.local.seconds}


def _finalize(job: _Job, out: Path, state: Path) -> None:
    """Every shard done: check every key's file is there, write the regenerated set and the manifest (last), and
    remove the harvest's state. Two shards finishing together both may: they write the same bytes."""
    missing = [k for k in [*(k for k, _, _ in job.batches), EVAL_KEY] if not (out / f"{k}.safetensors").is_file()]
    if missing:
        raise RecycleError(f"{out}: every shard says it is done but {len(missing)} keys are missing ({missing[0]} ...): "
                           "run the shards again (they redo only what is missing)")
    if job.regenerated is not None:
        tmp = out / f".{REGENERATED}.tmp-{os.getpid()}"
        job.save_regenerated(tmp)
        os.replace(tmp, out / REGENERATED)
    _atomic_json(out / MANIFEST, job.manifest())
    shutil.rmtree(state, ignore_errors=True)


def _extract(job: _Job, out: Path, feed: Path, todo: list[Window], progress=None) -> dict:
    """`todo`'s windows through one vLLM engine that stays up (`vllm_job.py`'s feed protocol), CHUNK_WINDOWS at a
    time, the next chunk posted while the engine runs one; each key converted on a thread pool as its files arrive.
    Returns the engine job's result (its busy seconds; how it found the connector). On any failure the engine is told to end and only the partial files go
    (the feed directory: chunks and vLLM's raw files); finished keys stay."""
    from recycle.engines.vllm_env import run_job

    if not todo:
        return {}
    shutil.rmtree(feed, ignore_errors=True)  # a killed run's chunks and raw files
    (feed / "raw").mkdir(parents=True)
    parts = chunks(todo, CHUNK_WINDOWS)
    result: dict = {}
    errors: list[BaseException] = []

    def engine() -> None:
        try:
            result.update(run_job(job.job(feed / "raw", feed_dir=str(feed.resolve()),
                                          max_window=max(int(ids.shape[1]) for _, ids, _ in todo)),
                                  env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}))
        except BaseException as e:  # raised in the caller's thread
            errors.append(e)

    workers = job.opts.convert_workers or min(8, os.cpu_count() or 1)
    thread = threading.Thread(target=engine, name="recycle-harvest-vllm", daemon=True)
    thread.start()
    pending: deque = deque()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="recycle-harvest-convert") as pool:
            try:
                _post(feed, 0, _windows(parts[0]))
                for n, part in enumerate(parts):
                    if n + 1 < len(parts):
                        _post(feed, n + 1, _windows(parts[n + 1]))
                    files = iter(_answer(feed, n, lambda n=n: errors[0] if errors else None if thread.is_alive()
                                         else RecycleError(f"vLLM's harvest job ended before chunk {n}")))
                    for key, ids, mask in part:
                        mine = [next(files) for _ in range(ids.shape[0])]
                        pending.append((key, pool.submit(job.store, out / f"{key}.safetensors", ids, mine, mask)))
                    while pending and (len(pending) > 2 * workers or pending[0][1].done()):
                        _finish(pending.popleft(), progress, len(todo))
                while pending:
                    _finish(pending.popleft(), progress, len(todo))
            except BaseException:  # the keys whose files came back are still converted and kept
                for item in pending:
                    with contextlib.suppress(Exception):
                        _finish(item, progress)
                raise
    finally:
        (feed / "end").touch()
        thread.join()
        shutil.rmtree(feed, ignore_errors=True)
    if errors:
        raise errors[0]
    return result


def _post(feed: Path, n: int, windows: list[list[int]]) -> None:
    """Chunk `n` of the feed protocol (`vllm_job.py`): its windows, written whole for the engine to take."""
    tmp = feed / f".{n:06d}.tmp"
    tmp.write_text(json.dumps({"windows": windows}))
    tmp.rename(feed / f"{n:06d}.json")


def _answer(feed: Path, n: int, failed: Callable[[], BaseException | None]) -> list[str]:
    """The engine's files for chunk `n`, once it has written them; `failed()`'s error, raised, if one comes first."""
    done = feed / f"{n:06d}.done.json"
    while not done.exists():
        err = failed()
        if err is not None:
            raise err
        time.sleep(OnlineHarvest.POLL_S)
    return json.loads(done.read_text())["files"]


def _windows(part: list[Window]) -> list[list[int]]:
    return [row.tolist() for _, ids, _ in part for row in ids]


def _finish(item: tuple, progress, total: int | None = None) -> None:
    key, fut = item
    fut.result()
    if progress is not None:
        progress(key, total=total)


class OnlineHarvest:
    """Online mode: vLLM computes each step's features while distill trains, at most `ahead` keys ahead.

    A thread feeds one key's windows at a time to a vLLM job that stays up (`vllm_job.py`'s feed
    protocol) whenever fewer than `ahead` unconsumed key files are in the cache directory, and turns
    vLLM's per-window files into the key's cache file; the consumer (`Teacher` with this producer)
    waits for each key and deletes it once read. Disk stays at about `ahead` keys plus the held-out
    rows, whatever the token budget. `begin(step)` starts feeding at a resumed run's step.
    """

    POLL_S = 0.01
    engine = "vllm"  # what computes the features (a DeepSeek-V4 drafter refuses it: no streams)

    def __init__(self, opts: HarvestOptions, ahead: int) -> None:
        if ahead < 1:
            raise RecycleError("--online: keep at least 1 step's windows ahead")
        if opts.self_distill:
            raise RecycleError("--online reads the data's own text; harvest --self-distill ahead instead")
        self.opts, self.ahead = opts, ahead
        self.job = _Job(opts)
        self.dir = Path(opts.out)
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("*.safetensors"):  # another run's keys: their windows are produced again
            old.unlink()
        (self.dir / MANIFEST).write_text(json.dumps(self.job.manifest({"online": {"ahead": ahead}}), indent=1) + "\n")
        self.feed = self.dir / ".feed"
        shutil.rmtree(self.feed, ignore_errors=True)
        (self.feed / "raw").mkdir(parents=True)
        self.error: BaseException | None = None
        self.max_present = 0
        self.max_bytes = 0
        self.done = False
        self._start_step: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="recycle-online-harvest", daemon=True)
        self._thread.start()

    def begin(self, step: int) -> None:
        self._start_step = step

    def close(self) -> None:
        self._closed = True
        (self.feed / "end").touch()
        self._thread.join(timeout=60)
        shutil.rmtree(self.feed, ignore_errors=True)

    def wait(self, key: str) -> None:
        """Block until `key`'s cache file exists; the producer's failure is raised here, once, as its own line."""
        path = self.dir / f"{key}.safetensors"
        while not path.exists():
            if self.error is not None:
                err, self.error = self.error, None
                raise err if isinstance(err, RecycleError) else RecycleError(f"online harvest: {err}")
            if self.done or not self._thread.is_alive():
                raise RecycleError(f"online harvest: the producer stopped before {key}")
            time.sleep(self.POLL_S)

    def _present(self) -> list[Path]:
        return [p for p in self.dir.glob("*.safetensors") if p.stem != EVAL_KEY]

    def _run(self) -> None:
        engine = threading.Thread(target=self._engine, name="recycle-online-vllm", daemon=True)
        try:
            self.job.regenerate_eval()
            engine.start()
            self._serve(0, EVAL_KEY, self.job.eval, self.job.eval_mask)
            while self._start_step is None and not self._closed:
                time.sleep(self.POLL_S)
            n = 1
            for key, ids, mask in self.job.batches:
                if self._closed:
                    break
                if int(key[1:9]) < (self._start_step or 0):
                    continue
                while len(self._present()) >= self.ahead and not self._closed:
                    time.sleep(self.POLL_S)
                self._serve(n, key, ids, mask)
                n += 1
        except BaseException as e:  # handed to the consumer, which raises it as one line
            self.error = e
        finally:
            self.done = True
            (self.feed / "end").touch()

    def _engine(self) -> None:
        from recycle.engines.vllm_env import run_job

        try:
            run_job(self.job.job(self.feed / "raw", feed_dir=str(self.feed.resolve()),
                                 max_window=max(self.opts.seq_len, int(self.job.eval.shape[1]))),
                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        except BaseException as e:
            self.error = e

    def _serve(self, n: int, key: str, ids: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        _post(self.feed, n, ids.tolist())
        files = _answer(self.feed, n, lambda: self.error or (RecycleError("online harvest: closed") if self._closed
                                                             else None))
        self.job.store(self.dir / f"{key}.safetensors", ids, files, mask)
        sizes = []
        for p in self._present():  # the consumer deletes what it read at any moment: a file gone since the listing
            with contextlib.suppress(FileNotFoundError):  # no longer counts
                sizes.append(p.stat().st_size)
        self.max_present = max(self.max_present, len(sizes))
        self.max_bytes = max(self.max_bytes, sum(sizes))


class Follower:
    """`distill --cache-hidden DIR --follow`: a `recycle harvest --engine transformers --ahead N` writing DIR elsewhere
    (other GPUs or nodes, a shared filesystem). Waits for the manifest and held-out rows, then for each key; says
    where it is (`.follow.json`, so a restarted harvest skips what was read); the trainer deletes each key once read
    (`Teacher.release`), so disk stays at N keys. On a resumed run the keys before its step are deleted unread."""

    POLL_S = 0.05
    NOTE_S = 30.0  # a wait longer than this says so, once

    def __init__(self, out: str | Path, main: bool = True) -> None:
        self.dir, self.main = Path(out), main
        self.ahead = 0
        self.max_present = self.max_bytes = 0
        self._at: int | None = None

    def ready(self) -> None:
        self._until(lambda: (self.dir / MANIFEST).is_file() and (self.dir / f"{EVAL_KEY}.safetensors").is_file(),
                    "the harvest's manifest and held-out rows")
        follow = load_json(self.dir / MANIFEST, "cache manifest").get("follow")
        if not isinstance(follow, dict):
            raise RecycleError(f"--follow {self.dir}: a finished harvest (made without --ahead), which --follow would "
                               "delete as it reads: drop --follow")
        self.ahead = int(follow.get("ahead") or 0)

    def begin(self, step: int) -> None:
        if self.main:
            for p in _keys_present(self.dir):
                if step_of(p.stem) < step:  # a resumed run's past: never read again
                    p.unlink(missing_ok=True)
        self._post(step)

    def close(self) -> None:
        """The harvest ends on its own; nothing to stop here."""

    def wait(self, key: str) -> None:
        if key != EVAL_KEY:
            self._post(step_of(key))
        path = self.dir / f"{key}.safetensors"
        self._until(path.is_file, f"{key} from the harvest")
        sizes = []
        for p in _keys_present(self.dir):
            with contextlib.suppress(FileNotFoundError):
                sizes.append(p.stat().st_size)
        self.max_present = max(self.max_present, len(sizes))
        self.max_bytes = max(self.max_bytes, sum(sizes))

    def _post(self, step: int) -> None:
        if self.main and step != self._at:
            self._at = step
            _atomic_json(self.dir / FOLLOW, {"step": step})

    def _until(self, ready: Callable[[], bool], what: str) -> None:
        from recycle.preflight import note

        started, said = time.monotonic(), False
        while not ready():
            if not said and time.monotonic() - started > self.NOTE_S:
                note(f"--follow: waiting for {what} (recycle harvest ... --ahead N writing {self.dir})")
                said = True
            time.sleep(self.POLL_S)


class OnlineFollower:
    """`--online` on a rank other than 0 under torchrun: rank 0's `OnlineHarvest` feeds vLLM and writes each step's
    key (the one-process key of the global batch); this rank waits for the file and reads its own rows of it (a
    span, as from any harvested cache). Rank 0 deletes a key once every rank has passed the step (`distill.train`)."""

    POLL_S = OnlineHarvest.POLL_S
    engine = "vllm"

    def __init__(self, out: str | Path, ahead: int) -> None:
        self.dir, self.ahead = Path(out), ahead
        self.max_present = self.max_bytes = 0

    def begin(self, step: int) -> None:
        """Rank 0's producer starts at the step; nothing to do here."""

    def close(self) -> None:
        """Rank 0's producer ends with its run; nothing to do here."""

    def wait(self, key: str) -> None:
        """Block until `key`'s file exists (rank 0 failing ends every rank: torchrun tears the group down)."""
        path = self.dir / f"{key}.safetensors"
        while not path.exists():
            time.sleep(self.POLL_S)
