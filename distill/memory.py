"""`recycle distill --plan`: the per-rank memory of a distillation, from the configs alone, before anything loads.

The drafter is built on the meta device (recycle's own `EagleDrafter` over transformers' decoder-layer classes,
so the parameter count is the real one), the target likewise (`AutoModelForCausalLM.from_config` on meta), and
the bytes follow the code as it is written today:

- weights: every drafter parameter in fp32; grads and AdamW's two moments (fp32) for the trainable ones. With
  several ranks FSDP2 shards the trainable weights, their grads and moments (1/world each) and every rank holds
  the largest unit gathered whole (weights and gradients; bf16 under bf16 compute) while it runs; frozen weights
  stay whole on every rank;
- the teacher: the target's trunk in the same process (bf16 on a GPU under bf16 compute, else fp32), or its
  embedding and head only when the features come from a `recycle harvest` cache;
- activations, per rank (rows = batch × seq_len): the teacher's features kept for the step, each draft step's
  decoder-layer activations saved for backward (norms, projections, attention, the dense MLP or the routed and
  shared experts at top-k), under bf16 autocast a bf16 copy of every expert weight per draft step (the per-expert
  loop casts them in each call and keeps them for backward), and the loss's vocabulary-wide tensors: one chunk
  of `CHUNK_ROWS` rows at a time once rows exceed a chunk (recomputed in backward), else every step's logits.

The activation terms are an estimate of what autograd keeps (named terms, each an element count × bytes); the
weight, gradient and optimizer terms are exact (tested against a run's optimizer state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recycle.distill.freeze import BY_NAME, freeze
from recycle.distill.losses import CHUNK_ROWS
from recycle.errors import RecycleError
from recycle.preflight import load_json

GB = 1e9
GIB = 1 << 30


@dataclass
class MemoryPlan:
    """Per-rank bytes by part, and what they were computed for."""

    parts: dict[str, int]
    params: int
    trainable: int
    target_params: int
    options: dict = field(default_factory=dict)
    budget: int | None = None  # the device's bytes, when a GPU was named
    device: str | None = None

    @property
    def per_rank_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.per_rank_bytes <= self.budget

    def as_dict(self) -> dict:
        return {"per_rank_bytes": self.per_rank_bytes, "parts": dict(self.parts), "fits": self.fits,
                "device": self.device, "device_bytes": self.budget, "params": self.params,
                "trainable_params": self.trainable, "target_params": self.target_params,
                "sharded": self.options.get("world_size", 1) > 1, "options": self.options}


def _drafter_config(path: Path) -> tuple[dict, str, int]:
    """(block config dict, family name, depth) of the EAGLE drafter at `path`, or of the one `convert --to eagle`
    would write from the source checkpoint at `path`."""
    from recycle.families import FAMILIES, declared_depth, merged_config

    cfg = load_json(path / "config.json", "config.json")
    rc = cfg.get("recycle")
    if isinstance(rc, dict):
        if rc.get("format") != "eagle":
            raise RecycleError(f"{path}: --plan covers EAGLE drafters (and sources to convert --to eagle); this is "
                               f"a {rc.get('format')} drafter")
        body = {k: v for k, v in cfg.items() if k != "recycle"} | {"model_type": rc.get("model_type")}
        return body, rc["family"], int(rc["depth"])
    merged = merged_config(cfg)
    mt = merged.get("model_type")
    fam = next((f for f in FAMILIES if mt in f.model_types), None)
    if fam is None:
        raise RecycleError(f"{path}: model_type {mt!r} is no MTP family recycle converts")
    depth = declared_depth(fam, merged)
    if depth < 1:
        raise RecycleError(f"{path}: its config declares no MTP modules")
    return merged, fam.name, depth


def _meta_drafter(path: Path):
    from recycle.drafters.eagle import EagleDrafter, canonical_family
    from recycle.mtp import block_config

    body, family, depth = _drafter_config(path)
    fam = canonical_family(family)
    config = block_config(body, "sdpa", fam.block_model_type)
    with torch.device("meta"):
        return EagleDrafter(config, fam, depth), config


def _target_params(path: Path) -> tuple[int, int]:
    """(trunk parameters, embedding + head parameters) of the target, built on meta from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from recycle.decoding.target import quiet_transformers

    with quiet_transformers():
        cfg = AutoConfig.from_pretrained(path)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        io = text.vocab_size * text.hidden_size * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), io


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules distill shards as FSDP2 units of their own (before the drafter as a whole): transformers'
    decoder layers, one unit each."""
    return [m for m in model.modules() if m is not model and type(m).__name__.endswith("DecoderLayer")]


def _block_activations(c, rows: int) -> int:
    """Elements one draft step's decoder layer keeps for backward, per the config's shapes (named terms)."""
    h = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", heads) or heads
    if getattr(c, "kv_lora_rank", None):  # MLA
        qk = (c.qk_nope_head_dim + c.qk_rope_head_dim)
        attn = (c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim + heads * (2 * qk + 2 * c.v_head_dim)
    else:
        d = getattr(c, "head_dim", None) or h // heads
        attn = heads * d * 2 + kv_heads * d * 2
    experts = getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", None) or 0
    if experts:
        k = c.num_experts_per_tok
        inter = c.moe_intermediate_size
        shared = (getattr(c, "n_shared_experts", None) or 0) * inter
        mlp = k * (3 * inter + h) + 3 * shared + experts
    else:
        mlp = 3 * c.intermediate_size
    residual = 8 * h  # eh_proj input (2h), its output, two norms' inputs, the residual adds
    return rows * (residual + attn + mlp)


def plan(drafter: str | Path, target: str | Path, *, batch: int, seq_len: int, draft_steps: int | None,
         world: int = 1, precision: str = "fp32", cached_teacher: bool = False, groups: tuple[str, ...] = (),
         gpu: str | None = None, device_bytes: int | None = None, micro_batch: int | None = None,
         fsdp: bool = False) -> MemoryPlan:
    """The per-rank memory of `recycle distill` with these options (see the module's docstring). `gpu` names a
    device of `recycle.hardware`'s table to fit (its memory); `device_bytes` gives the memory directly. `fsdp`:
    sharded with one rank too (torchrun with one process), which gathers each unit as several ranks do."""
    from recycle.hardware import gpu as find_gpu

    if world < 1:
        raise RecycleError("--world-size must be at least 1")
    from recycle.distill.unroll import EagleUnroller

    model, config = _meta_drafter(Path(drafter).expanduser())
    EagleUnroller(model, draft_steps or EagleUnroller.default_steps)  # its own freeze: the embedding and head copies
    frozen = freeze(model, groups)
    params, trainable = frozen["params"], frozen["trainable_params"]
    trunk, io = _target_params(Path(target).expanduser())
    steps = draft_steps or 3
    act_bytes = 2 if precision == "bf16" else 4
    rows = min(micro_batch or batch, batch) * seq_len  # what one forward/backward holds
    vocab, hidden = config.vocab_size, config.hidden_size
    expert_params = sum(p.numel() for n, p in model.named_parameters() if BY_NAME["experts"].matches(n))
    if rows > CHUNK_ROWS:  # one chunk of drafter + teacher logits, softmaxes and the logits' grad at a time
        loss = 5 * CHUNK_ROWS * vocab * 4
    else:  # every step's drafter logits and log-softmax kept, the teacher's probabilities beside them
        loss = steps * 3 * rows * vocab * 4 + 2 * rows * vocab * 4
    unit = max((sum(p.numel() for p in m.parameters() if p.requires_grad) for m in fsdp_units(model)),
               default=trainable)
    shards = max(1, world)
    on_gpu = bool(gpu or device_bytes)
    teacher_bytes = 2 if on_gpu and precision == "bf16" else 4  # distill.teacher: bf16 weights on a bf16 GPU run
    gathered = 4 if precision == "bf16" else 8  # a unit's weights and grads while it runs: bf16 under bf16 compute
    parts = {
        "weights": (params - trainable) * 4 + math.ceil(trainable / shards) * 4,
        "grads": math.ceil(trainable / shards) * 4,
        "optimizer": math.ceil(trainable / shards) * 8,
        "fsdp_gathered_unit": unit * gathered if world > 1 or fsdp else 0,
        "teacher": io * 4 if cached_teacher else trunk * teacher_bytes,  # a cache's embedding and head: fp32
        "activations_features": rows * hidden * 4 * 2,
        "activations_blocks": steps * _block_activations(config, rows) * act_bytes,
        "activations_expert_copies": steps * expert_params * 2 if precision == "bf16" else 0,
        "activations_loss": loss,
    }
    budget, device = device_bytes, ("this device" if device_bytes else None)
    if gpu:
        g = find_gpu(gpu)
        budget, device = int(g.memory_gb * GB), g.key
    return MemoryPlan(parts, params, trainable, trunk, {
        "batch": batch, "seq_len": seq_len, "draft_steps": steps, "world_size": world, "precision": precision,
        "teacher": "harvested cache" if cached_teacher else "in process", "freeze": list(groups),
        "micro_batch": micro_batch, "fsdp": world > 1 or fsdp}, budget, device)


def advice(p: MemoryPlan) -> str:
    """What would fit, nearest first: the user's levers in the order they cost the least re-alignment."""
    o = p.options
    tips = []
    if "experts" not in o["freeze"] and p.parts["activations_expert_copies"] + p.parts["optimizer"] > 0:
        tips.append("--freeze experts")
    if o["teacher"] == "in process" and p.parts["teacher"] > 0.3 * p.per_rank_bytes:
        tips.append("a harvested teacher (recycle harvest, then --cache-hidden)")
    if o["world_size"] < 8 and p.parts["optimizer"] > 0.2 * p.per_rank_bytes:
        tips.append(f"more ranks (--world-size {max(2, o['world_size'] * 2)}: FSDP2 shards what trains)")
    rows = min(o["micro_batch"] or o["batch"], o["batch"])
    if rows > 1:
        tips.append(f"--micro-batch {max(1, rows // 2)} (the same step, accumulated)")
    return "; ".join(tips) or "a larger device"


def check(p: MemoryPlan) -> None:
    """Refuse a run whose plan exceeds the device, with the advice (one line)."""
    if p.fits is False:
        raise RecycleError(f"the plan needs {p.per_rank_bytes / GIB:.1f} GiB per rank, over the {p.device}'s "
                           f"{p.budget / GIB:.1f} GiB; try {advice(p)} (recycle distill ... --plan shows the parts)")


def for_options(opts, world: int = 1, gpu: str | None = None, device_bytes: int | None = None,
                fsdp: bool = False) -> MemoryPlan:
    """The plan of a DistillOptions run (the one mapping of distill's options onto the plan); the precision is
    the run's, else bf16 on a named GPU and fp32 otherwise (distill's own default on a CPU without bf16)."""
    precision = opts.precision or ("bf16" if gpu or device_bytes else "fp32")
    return plan(opts.drafter, opts.target, batch=opts.batch, seq_len=opts.seq_len, draft_steps=opts.draft_steps,
                world=world, precision=precision, cached_teacher=bool(opts.cache_hidden),
                groups=tuple(opts.freeze),
                gpu=gpu, device_bytes=device_bytes, micro_batch=opts.micro_batch, fsdp=fsdp)


__all__ = ["MemoryPlan", "plan", "advice", "check", "for_options"]
