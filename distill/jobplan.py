"""The whole job of a distillation (`recycle distill --plan`, `recycle harvest --plan`; issue 49): beside the memory
per rank (`distill.memory`), the host RAM per node at start-up, at a checkpoint and at the end, the storage (an
offline cache or an online window, the checkpoints, the best snapshot, the output), the FLOPs per token of the
drafter and of the teacher with wall-clock estimates at a stated MFU range, and where the teacher can run.

Every figure comes from the configs on the meta device (no weights read) and the formulas written beside it, which
the --json repeats under `derivation`. The MFU ranges and the teacher's share of a GPU are stated assumptions,
not measurements; the FLOPs are the matmuls' (2 per multiply-add), attention's scores counted as full heads over
the causal half of the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from recycle.checkpoint import Checkpoint
from recycle.decoding.placed import PLACED_SHARE, stored_trunk_bytes
from recycle.distill.experts import expert_modules, expert_params
from recycle.distill.memory import GB, GIB, MemoryPlan, config_drafter, for_options, target_counts
from recycle.distill.teacher import STREAMS_FROM_VLLM
from recycle.errors import RecycleError
from recycle.hardware import gpu as find_gpu
from recycle.mtp import chained_streams

# The MFU (achieved over peak dense bf16 FLOPs) the wall-clock lines are given at: a stated range, not a
# measurement. Distillation: small MoE modules, vocabulary-wide heads recomputed in chunks, expert rows exchanged.
# The teacher's prefill: a serving engine's batched prefill of long windows.
DISTILL_MFU = (0.20, 0.40)
PREFILL_MFU = (0.30, 0.50)
# A rank's process before it holds any tensor: torch, transformers and recycle's distill imported, measured on this
# CPU (torch 2.13): 341 MiB peak RSS, stated as 0.5 GB (a CUDA build's libraries add to it: not measured here).
PROCESS_RSS = 500_000_000
# The share of a GPU's memory the teacher's weights may take when it serves: vLLM asks for 0.9 of each device by
# default (vllm_env), and keeps at least a tenth of that for its KV cache, activations and CUDA graphs.
TEACHER_SHARE = 0.8
# A quantized release's bytes per weight of its packed matrices (scales included): block FP8 (one fp32 scale per
# 128 × 128 block), MXFP4 (one E8M0 byte per 32), NVFP4 (one FP8 byte per 16 and a per-tensor fp32).
WEIGHT_BYTES = {"fp8": 1 + 4 / (128 * 128), "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
IDS_BYTES = 8  # int64 input_ids per token in a cache file (distill.teacher.store_features)
EAGLE3_AUX = 3  # EAGLE-3's aux layers (low, middle, high): their states cached beside the last one
NODE_GPUS = 8  # GPUs per node, by default


def _attention_flops(cfg: dict, context: int) -> float:
    """Forward FLOPs per token of one attention layer's scores and weighted sum over `context` positions, as full
    heads (MLA's absorbed form differs little at these widths)."""
    heads = int(cfg.get("num_attention_heads") or 1)
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    qk = int(cfg.get("qk_head_dim") or (cfg.get("qk_nope_head_dim", 0) + cfg.get("qk_rope_head_dim", 0)) or dim)
    v = int(cfg.get("v_head_dim") or dim)
    return 2.0 * heads * (qk + v) * context


def _experts(cfg: dict) -> tuple[int, int]:
    """(experts chosen per token, routed experts), (1, 1) for a dense model."""
    k = next((int(cfg[key]) for key in ("num_experts_per_tok", "moe_top_k") if cfg.get(key)), 1)
    e = next((int(cfg[key]) for key in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.get(key)), 1)
    return k, e


def drafter_flops(drafter: str | Path, steps: int, seq_len: int, checkpointing: bool = False) -> dict[str, float]:
    """Training FLOPs per position of an EAGLE drafter over `steps` draft steps: each step's module forward (2 ×
    its active parameters: routed experts at top-k of their count, embedding and head apart) and backward (4 ×),
    attention over the causal half of the window (× 3), one more forward with --activation-checkpointing; the
    drafter's head per step: forward, the loss's recomputation and the input's gradient (3 × 2·V·H; the head is
    frozen: no weight gradient); the teacher's head: 2·V·H per position in the forward and again in the recomputed
    backward, once for all steps where the logits are shared (losses.TargetLogits), once per step where not."""
    model, config, body, _ = config_drafter(Path(drafter).expanduser())
    k, e = _experts(body)
    vocab, hidden = config.vocab_size, config.hidden_size
    block = 0.0
    for s in range(steps):
        layer = model.layer_for(s)
        routed = {id(p) for m in expert_modules(layer) for _, p in expert_params(m)}
        active = sum(p.numel() * (k / e if id(p) in routed else 1) for p in layer.parameters()
                     if p.dim() < 2 or p.shape[0] != vocab)
        attn = _attention_flops(body, seq_len / 2)
        block += 6 * active + 3 * attn + ((2 * active + attn) if checkpointing else 0)
    head = 2.0 * vocab * hidden
    drafter_heads = steps * 3 * head
    shared, unshared = 2 * head, steps * 2 * head
    return {"blocks": block, "drafter_heads": drafter_heads, "teacher_heads_shared": shared,
            "teacher_heads_per_step": unshared, "total_shared": block + drafter_heads + shared,
            "total_per_step": block + drafter_heads + unshared}


def teacher_flops(target: str | Path, seq_len: int) -> float:
    """Prefill FLOPs per token of the target: 2 × its active parameters (routed experts at top-k of their count)
    plus every layer's attention over the causal half of the window."""
    t = target_counts(str(Path(target).expanduser()))
    k, e = _experts(t.config)
    active = t.trunk - t.routed + t.routed * k / e
    return 2 * active + int(t.config.get("num_hidden_layers", 0)) * _attention_flops(t.config, seq_len / 2)


def teacher_weight_bytes(target: str | Path) -> tuple[int, str]:
    """(the target's weight bytes as it is stored, the scheme): a quantized release's packed matrices at its
    scheme's bytes (`WEIGHT_BYTES`), everything else (embedding, head, norms) at bf16."""
    t = target_counts(str(Path(target).expanduser()))
    q = t.config.get("quantization_config") or {}
    method = str(q.get("quant_method") or "").lower() if isinstance(q, dict) else ""
    scheme = next((name for name in WEIGHT_BYTES if name in method or name == str(q.get("fmt", "")).lower()), None)
    if scheme is None:
        return t.trunk * 2, "bf16"
    return math.ceil(t.matrices * WEIGHT_BYTES[scheme] + (t.trunk - t.matrices) * 2), scheme


def teacher_gpus(weight_bytes: int, memory_bytes: float) -> int:
    """GPUs a serving engine needs for these weights: the smallest power of two (tensor/expert parallel sizes) whose
    devices hold them at `TEACHER_SHARE` each."""
    n = 1
    while weight_bytes / n > TEACHER_SHARE * memory_bytes:
        n *= 2
    return n


def cache_bytes_per_token(hidden: int, aux_layers: int = 0, streams: int = 0) -> int:
    """A cache file's bytes per token: int64 ids, the last state in bf16, and each aux layer's in bf16; a
    DeepSeek-V4 target's C streams in bf16 in place of both (its reader mixes the last state from them)."""
    return IDS_BYTES + hidden * 2 * (streams or 1 + aux_layers)


def hours(flops: float, gpus: int, tflops: float, mfu: tuple[float, float]) -> tuple[float, float]:
    """(fastest, slowest) hours for `flops` on `gpus` devices of `tflops` peak at the `mfu` range."""
    return tuple(flops / (gpus * tflops * 1e12 * m) / 3600 for m in (mfu[1], mfu[0]))


def placement(target: str | Path, world: int, memory_bytes: float | None, free_per_gpu: float | None,
              node_gpus: int = NODE_GPUS) -> dict:
    """Where the teacher can run: beside the trainer (its weights over the trainer's ranks fit `TEACHER_SHARE` of
    what the trainer leaves free), on N more GPUs of one node (a server of its own, or a harvest ahead), or a server
    across nodes. None without a named GPU."""
    weights, scheme = teacher_weight_bytes(target)
    out = {"weight_bytes": weights, "scheme": scheme}
    if memory_bytes is None:
        return out | {"verdict": None}
    need = teacher_gpus(weights, memory_bytes)
    out["gpus_alone"] = need
    if free_per_gpu is not None and free_per_gpu > 0 and weights / world <= TEACHER_SHARE * free_per_gpu:
        return out | {"verdict": "beside", "text": f"fits beside the trainer: {weights / GB:.0f} GB of {scheme} "
                      f"weights over its {world} GPUs, {free_per_gpu / GB:.1f} GB free on each"}
    if need <= node_gpus:
        return out | {"verdict": "more_gpus", "text": f"needs {need} more GPUs: {weights / GB:.0f} GB of {scheme} "
                      f"weights do not fit beside the trainer; serve it on {need} GPUs (recycle teacher serve, then "
                      "distill --teacher URL) or harvest ahead (recycle harvest --shard i/N)"}
    nodes = math.ceil(need / node_gpus)
    return out | {"verdict": "server", "text": f"needs a server: {weights / GB:.0f} GB of {scheme} weights need "
                  f"{need} GPUs ({nodes} nodes of {node_gpus}); serve it across them (recycle teacher serve, then "
                  "distill --teacher URL) or harvest ahead on them (recycle harvest --shard i/N)"}


@dataclass
class JobPlan:
    """The whole job: the memory per rank, and per node, on disk, in FLOPs and hours, and the teacher's place."""

    memory: MemoryPlan
    host: dict  # phase -> bytes per node (and per rank)
    storage: dict
    flops: dict
    time: dict
    teacher: dict
    node_gpus: int
    host_ram: int
    derivation: dict = field(default_factory=dict)

    @property
    def host_peak(self) -> tuple[str, int]:
        phase = max(("startup", "checkpoint", "end"), key=lambda k: self.host[k]["per_node"])
        return phase, self.host[phase]["per_node"]

    def as_dict(self) -> dict:
        return self.memory.as_dict() | {
            "host": self.host, "host_ram_bytes": self.host_ram, "node_gpus": self.node_gpus,
            "storage": self.storage, "flops_per_token": self.flops, "time_hours": self.time,
            "teacher_placement": self.teacher,
            "derivation": self.memory.derivation | {f"job.{k}": v for k, v in self.derivation.items()}}


JOB_DERIVATION = {
    "host.startup": "per rank: the process (PROCESS_RSS) + its weights part (its shards at their training dtype) + "
                    "the bf16 bytes they are read from + the teacher's embedding and head in bf16 with a cache; "
                    "× ranks per node",
    "host.checkpoint": "per rank: the process + 2 × (its weights and AdamW moments): DCP's HuggingFaceStorageWriter "
                       "holds a CPU copy of every tensor of the rank's file, then safetensors' save() serialises the "
                       "whole file in memory (torch/distributed/checkpoint/filesystem.py:436-467); × ranks per node",
    "host.end": "per rank: the process + 2 × its share of the output (the drafter's parameters at the output's dtype "
                "over the ranks, each writing its part of the shards); × ranks per node",
    "storage.cache": "tokens × (8 B ids + H × 2 B last state + aux layers × H × 2 B; DeepSeek-V4: its C streams "
                     "× H × 2 B in place of the state and aux layers), one file per global batch "
                     "(batch per rank × ranks × seq-len tokens; harvest --plan: its --batch × seq-len)",
    "storage.window": "--online N (or --teacher-ahead) steps' files of one global batch each",
    "storage.checkpoint": "trainable × (4 + 8) B (fp32 weights, AdamW) + frozen × their bytes",
    "storage.best": "trainable × 4 B (the best snapshot's trained weights, fp32)",
    "storage.output": "the drafter's parameters × the output's dtype bytes",
    "time": "tokens × FLOPs per token / (GPUs × peak bf16 TFLOP/s × MFU), at the MFU range stated",
}


def _node_ram() -> int:
    """This machine's MemTotal, the --host-ram default."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_ram_bytes(gb: float | None) -> int:
    """--host-ram GB (per node), else this machine's MemTotal."""
    if gb is None:
        return _node_ram()
    if not gb > 0:
        raise RecycleError(f"--host-ram {gb}: the node's RAM in GB, a positive number")
    return int(gb * GB)


def _host(p: MemoryPlan, world: int, node_gpus: int, out_bytes: int) -> dict:
    """Host bytes per rank and per node at start-up, at a checkpoint and at the end (`JOB_DERIVATION`)."""
    c, ranks = p.counts, min(world, node_gpus)
    frozen = p.params - p.trainable - c["io_params"]
    # the rank's parameters (sharded from the start: its share of what trains and of the split experts, the other
    # frozen weights whole), read from bf16 files
    mine = math.ceil(p.trainable / world) + math.ceil(c["split_frozen"] / world) + frozen - c["split_frozen"]
    io_read = c["io"] * 2 if p.options["teacher"] != "in process" else 0
    rank = {"startup": PROCESS_RSS + p.parts["weights"] + mine * 2 + io_read,
            "checkpoint": PROCESS_RSS + 2 * (p.parts["weights"] + p.parts["optimizer"]),
            "end": PROCESS_RSS + 2 * math.ceil(p.params * out_bytes / world)}
    return {k: {"per_rank": v, "per_node": v * ranks} for k, v in rank.items()} | {"ranks_per_node": ranks}


def plan_job(opts, world: int, gpu: str | None, tokens: int | None, node_gpus: int = NODE_GPUS,
             host_ram: float | None = None) -> JobPlan:
    """The whole job of a DistillOptions run on `world` ranks of `gpu` (see the module's docstring)."""
    if node_gpus < 1:
        raise RecycleError("--gpus-per-node must be at least 1")
    node_ram = host_ram_bytes(host_ram)  # a bad --host-ram is refused before the plan runs
    mem = for_options(opts, world, gpu)
    g = find_gpu(gpu) if gpu else None
    c, o = mem.counts, mem.options
    body_dtype = 2  # the drafter's output in bf16 (convert's default --dtype)
    host = _host(mem, world, node_gpus, body_dtype)
    tokens_per_file = o["batch"] * world * o["seq_len"]  # a cache key holds one global batch (--batch is per rank)
    bpt = cache_bytes_per_token(c["hidden"])
    frozen = mem.params - mem.trainable - c["io_params"]
    storage = {"cache_bytes_per_token": bpt, "eagle3_bytes_per_token": cache_bytes_per_token(c["hidden"], EAGLE3_AUX),
               "file_bytes": tokens_per_file * bpt, "tokens_per_file": tokens_per_file,
               "checkpoint_bytes": mem.trainable * 12 + frozen * c["frozen_bytes"],
               "best_bytes": mem.trainable * 4, "output_bytes": mem.params * body_dtype}
    if mem.options.get("streams"):  # DeepSeek-V4: the cache holds the C streams its modules read, alone
        bpt = cache_bytes_per_token(c["hidden"], streams=mem.options["streams"])
        storage = {k: v for k, v in storage.items() if not k.startswith("eagle3_")}
        storage |= {"cache_bytes_per_token": bpt, "file_bytes": tokens_per_file * bpt, "streams": mem.options["streams"]}
    if tokens is not None:
        storage |= {"cache_bytes": tokens * bpt, "cache_files": math.ceil(tokens / tokens_per_file)}
        if "eagle3_bytes_per_token" in storage:
            storage["eagle3_cache_bytes"] = tokens * storage["eagle3_bytes_per_token"]
    if opts.online or opts.teacher:  # the disk holds only the window ahead of training
        storage["window_bytes"] = (opts.online or opts.teacher_ahead) * storage["file_bytes"]
    fl = drafter_flops(opts.drafter, o["draft_steps"], o["seq_len"], o["activation_checkpointing"])
    fl["teacher_prefill"] = teacher_flops(opts.target, o["seq_len"])
    fl["teacher_logits"] = "shared across steps (losses.TargetLogits)"
    in_process = o["teacher"] == "in process" and not opts.online
    fl["distill"] = fl["total_shared"] + (fl["teacher_prefill"] if in_process else 0)
    # what the trainer leaves free on each GPU, its teacher part counted as embedding and head only (an in-process
    # trunk is whole on every rank: the memory table says whether that fits)
    trunk_here = mem.parts["teacher"] - c["io"] * c["teacher_bytes"] if in_process else 0
    free = (mem.usable - mem.per_rank_bytes + trunk_here) if mem.usable is not None else None
    teacher = placement(opts.target, world, g.memory_gb * GB if g else None, free, node_gpus)
    if in_process and mem.fits:
        teacher |= {"verdict": "beside", "text": "fits beside the trainer: in process, whole on every rank "
                    "(the memory table counts it)"}
    elif mem.options.get("streams") and g is not None:  # DeepSeek-V4: only a transformers harvest carries them
        bf16 = target_counts(str(Path(opts.target).expanduser())).trunk * 2  # that engine's weights: dequantized,
        kept = stored_trunk_bytes(Checkpoint(Path(opts.target).expanduser()))  # or as stored (--keep-quantized)
        per, per_kept = (math.ceil(b / (PLACED_SHARE * g.memory_gb * GB)) for b in (bf16, kept))
        no_server = "a teacher server cannot: vLLM does not capture DeepSeek-V4's hyper-connection streams"
        how = "[--ahead N beside a distill --follow], then --cache-hidden"
        if per <= node_gpus:
            teacher |= {"gpus_alone": per, "weight_bytes": bf16, "scheme": "bf16, dequantized", "verdict": "harvest",
                        "text": f"harvest it ahead with the target in transformers over {per} GPUs of a node per "
                        f"shard ({bf16 / GB:.0f} GB at bf16; recycle harvest --engine transformers --gpus {per} {how}); "
                        + no_server}
        elif per_kept <= node_gpus:
            teacher |= {"gpus_alone": per_kept, "weight_bytes": kept, "scheme": "as stored", "verdict": "harvest_kept",
                        "text": f"harvest it ahead with the target in transformers kept as stored over {per_kept} GPUs "
                        f"of a node per shard ({kept / GB:.0f} GB; at bf16 it would need {per}: recycle harvest "
                        f"--engine transformers --keep-quantized --gpus {per_kept} {how}; transformers' FP8/FP4 "
                        f"kernels, not run here); " + no_server}
        else:
            teacher |= {"gpus_alone": per_kept, "weight_bytes": kept, "scheme": "as stored", "verdict": "none",
                        "text": f"no engine recycle drives can be its teacher off the trainer: --engine transformers "
                        f"needs {per_kept} GPUs even as stored ({kept / 1e12:.2f} TB), more than a node's {node_gpus}, "
                        "and vLLM does not capture DeepSeek-V4's hyper-connection streams"}
    time = {}
    if g is not None and tokens is not None:
        time["distill"] = hours(tokens * fl["distill"], world, g.bf16_tflops, DISTILL_MFU)
        if not in_process and not mem.options.get("streams"):  # the teacher's prefill on GPUs of its own (a harvest
            # ahead, or a server); a DeepSeek-V4 harvest runs in transformers, whose eager forward has no measured MFU
            gpus = teacher.get("gpus_alone") or world
            time["teacher"] = hours(tokens * fl["teacher_prefill"], gpus, g.bf16_tflops, PREFILL_MFU)
            time["teacher_gpus"] = gpus
        time |= {"distill_mfu": DISTILL_MFU, "prefill_mfu": PREFILL_MFU, "gpu": g.key, "tflops": g.bf16_tflops,
                 "gpus": world}
    return JobPlan(mem, host, storage, fl, time, teacher, node_gpus, node_ram, dict(JOB_DERIVATION))


def check_host(job: JobPlan) -> None:
    """Refuse a plan whose host RAM per node exceeds the node's (one line)."""
    phase, need = job.host_peak
    if job.host_ram and need > job.host_ram:
        raise RecycleError(f"the plan needs {need / GB:.0f} GB of host RAM per node ({phase}, "
                           f"{job.host['ranks_per_node']} ranks), over the node's {job.host_ram / GB:.0f} GB "
                           "(--host-ram); fewer ranks per node (--gpus-per-node) or more ranks (--world-size: smaller "
                           "shards) lower it")


def harvest_plan(target: str | Path, tokens: int, seq_len: int, batch: int, gpu: str | None, gpus: int,
                 aux_layers: int = 0, engine: str = "vllm", node_gpus: int = NODE_GPUS,
                 keep_quantized: bool = False) -> dict:
    """`recycle harvest --plan`: the cache's storage, the teacher's prefill FLOPs and hours on `gpus` devices of
    `gpu` (vLLM: every engine's GPUs), and the GPUs its weights need. `engine` "transformers": `gpus` is the shards,
    each one process holding the target dequantized to bf16 over the GPUs it needs of one node (whole decoder layers,
    `PLACED_SHARE` of each; the layers run one after another, so a shard computes at one GPU's rate; no hours: its
    eager forward has no measured MFU), and a
    DeepSeek-V4 target's C streams go in every file; vLLM refuses such a target (it captures no streams).
    `keep_quantized`: that engine holds the weights as stored (`placed.load_kept`), their bytes from the headers."""
    t = target_counts(str(Path(target).expanduser()))
    streams = chained_streams(t.config)
    if streams and engine == "vllm":
        raise RecycleError(STREAMS_FROM_VLLM.format(what="--engine vllm", instead="plan it with --engine transformers"))
    bpt = cache_bytes_per_token(int(t.config["hidden_size"]), aux_layers, streams)
    weights, scheme = teacher_weight_bytes(target) if engine == "vllm" else \
        (stored_trunk_bytes(Checkpoint(target)), "as stored") if keep_quantized else (t.trunk * 2, "bf16, dequantized")
    out = {"tokens": tokens, "cache_bytes_per_token": bpt, "cache_bytes": tokens * bpt, "engine": engine,
           "streams": streams, "file_bytes": batch * seq_len * bpt, "cache_files": math.ceil(tokens / (batch * seq_len)),
           "teacher_flops_per_token": teacher_flops(target, seq_len), "weight_bytes": weights, "scheme": scheme,
           "gpus": gpus, "derivation": {"storage.cache": JOB_DERIVATION["storage.cache"], "time": JOB_DERIVATION["time"]}}
    if gpu and engine == "transformers":  # a shard: the target over `per` GPUs of one node, one busy at a time; no
        g = find_gpu(gpu)  # hours: transformers' eager forward has no measured MFU
        per = math.ceil(weights / (PLACED_SHARE * g.memory_gb * GB))
        out |= {"gpu": g.key, "gpus_needed": per, "fits_one_node": per <= node_gpus, "node_gpus": node_gpus}
    elif gpu:
        g = find_gpu(gpu)
        need = teacher_gpus(weights, g.memory_gb * GB)
        out |= {"gpu": g.key, "gpus_needed": need, "prefill_mfu": PREFILL_MFU,
                "time_hours": hours(tokens * out["teacher_flops_per_token"], max(gpus, need), g.bf16_tflops,
                                    PREFILL_MFU)}
    return out


def _gb(b: float) -> str:
    return f"{b / 1e12:.2f} TB" if b >= 1e12 else f"{b / GB:.1f} GB" if b >= 0.1 * GB else f"{b / 1e6:.1f} MB"


def _g(flops: float) -> str:
    return f"{flops / 1e9:.3g} G"


def _h(span: tuple[float, float]) -> str:
    """An hours range, in minutes under an hour."""
    return (f"{span[0]:.1f}-{span[1]:.1f} h" if span[1] >= 1 else
            f"{span[0] * 60:.2g}-{span[1] * 60:.2g} min")


def lines(d: dict) -> list[str]:
    """The job's lines under the memory table (`recycle distill --plan` without --json)."""
    out = [f"margin: {d['margin']:.0%} of the device kept free"
           + (f" (usable {d['usable_bytes'] / GIB:.1f} of {d['device_bytes'] / GIB:.1f} GiB; the plan "
              f"{d['per_rank_bytes'] / GIB:.1f} GiB)" if d["usable_bytes"] else "")]
    h = d["host"]
    out.append(f"host RAM per node ({h['ranks_per_node']} ranks): start-up {_gb(h['startup']['per_node'])}, "
               f"checkpoint {_gb(h['checkpoint']['per_node'])}, end {_gb(h['end']['per_node'])}; the node has "
               f"{_gb(d['host_ram_bytes'])}")
    s = d["storage"]
    cache = (f"offline cache {_gb(s['cache_bytes'])} in {s['cache_files']} files of {_gb(s['file_bytes'])} "
             f"({s['cache_bytes_per_token']} B/token"
             + (f"; EAGLE-3: {_gb(s['eagle3_cache_bytes'])})" if "eagle3_cache_bytes" in s else ")")
             if "cache_bytes" in s else f"offline cache {s['cache_bytes_per_token']} B/token (--tokens for the total)")
    if s.get("streams"):
        cache += f", DeepSeek-V4's {s['streams']} hyper-connection streams included"
    window = f"; online window {_gb(s['window_bytes'])}" if "window_bytes" in s else ""
    out.append(f"storage: {cache}{window}; checkpoint {_gb(s['checkpoint_bytes'])}, best snapshot "
               f"{_gb(s['best_bytes'])}, output {_gb(s['output_bytes'])}")
    f = d["flops_per_token"]
    out.append(f"FLOPs per token: distill {_g(f['distill'])} (blocks {_g(f['blocks'])}, drafter heads "
               f"{_g(f['drafter_heads'])}, teacher logits {_g(f['teacher_heads_shared'])}, {f['teacher_logits']}; "
               f"{_g(f['total_per_step'])} unshared); teacher prefill {_g(f['teacher_prefill'])}")
    t = d["time_hours"]
    if "distill" in t:
        line = (f"time on {t['gpus']}×{t['gpu']} ({t['tflops']:.0f} TFLOP/s bf16): distill {_h(t['distill'])} at MFU "
                f"{t['distill_mfu'][1]:.0%}-{t['distill_mfu'][0]:.0%}")
        if "teacher" in t:
            line += (f"; teacher prefill {_h(t['teacher'])} on {t['teacher_gpus']} GPU(s) at MFU "
                     f"{t['prefill_mfu'][1]:.0%}-{t['prefill_mfu'][0]:.0%}")
        elif d["storage"].get("streams") and d["options"]["teacher"] != "in process":
            line += "; the harvest's hours not given (transformers' eager DeepSeek-V4 forward has no measured MFU)"
        out.append(line)
    p = d["teacher_placement"]
    out.append(f"teacher: {p['text']}" if p.get("verdict") else
               f"teacher: {_gb(p['weight_bytes'])} of {p['scheme']} weights (--gpu for its placement)")
    return out


def harvest_lines(d: dict) -> list[str]:
    """`recycle harvest --plan` without --json."""
    out = [f"harvest plan: {d['tokens']:,} tokens → {_gb(d['cache_bytes'])} in {d['cache_files']} files of "
           f"{_gb(d['file_bytes'])} ({d['cache_bytes_per_token']} B/token)",
           f"teacher prefill {_g(d['teacher_flops_per_token'])}FLOP/token; weights {_gb(d['weight_bytes'])} "
           f"({d['scheme']})"]
    if d.get("streams"):
        out.append(f"every file holds DeepSeek-V4's {d['streams']} hyper-connection streams, in place of the last "
                   "state (mixed back from them on reading)")
    if "gpu" in d and d.get("engine") == "transformers":
        out.append(f"{d['gpu']}: each shard holds the target ({_gb(d['weight_bytes'])} {d['scheme']}"
                   + ("; transformers' FP8/FP4 kernels, not run here" if d["scheme"] == "as stored" else "") + ") over "
                   + (f"--gpus {d['gpus_needed']} of one node, its layers running one after another; no hours given "
                      "(transformers' eager forward has no measured MFU on GPUs)" if d["fits_one_node"] else
                      f"{d['gpus_needed']} GPUs, more than a node's {d['node_gpus']}: --engine transformers cannot "
                      "hold it"))
    elif "gpu" in d:
        out.append(f"{d['gpu']}: its weights need {d['gpus_needed']} GPU(s); {_h(d['time_hours'])} on "
                   f"{max(d['gpus'], d['gpus_needed'])} at MFU {d['prefill_mfu'][1]:.0%}-{d['prefill_mfu'][0]:.0%}"
                   + (" (vLLM's range: transformers' eager forward is slower, not measured)"
                      if d.get("engine") == "transformers" else ""))
    return out


__all__ = ["JobPlan", "plan_job", "check_host", "harvest_plan", "lines", "harvest_lines", "placement",
           "teacher_weight_bytes", "drafter_flops", "teacher_flops", "DISTILL_MFU", "PREFILL_MFU"]
