"""A roofline for speculative decoding: what one forward reads and computes, and what that costs on a GPU.

Why: at batch 1 a decode step reads every weight once and does little math, so verifying K+1
tokens costs about what one token costs and speculation pays τ. As the batch grows the same
weights serve more tokens until the step turns compute-bound; then each verified token costs its
FLOPs and drafts that are rejected are paid for. Where that happens depends on the model (MoE
experts touched grow with the tokens in flight) and on the GPU's FLOPs per byte.

The model of one forward of n tokens per sequence, batch B, context c (tokens already cached):

    m        = B·n tokens
    experts  = E·(1 − (1 − k/E)^m)            distinct routed experts a MoE layer touches (uniform routing)
    bytes    = w·(dense + moe_layers·experts·expert) + B·c·L·kv           weights once, plus the KV cache
    flops    = 2·m·(dense + moe_layers·k·expert) + m·c·L·attn             matmuls, plus attention over c
    time     = max(bytes / (η_mem·BW), flops / (η_flops·F)) + L·t_layer

`dense` counts every weight a forward reads whatever the routing (attention, dense MLPs, shared
experts, routers, norms, the LM head; not the embedding table, of which a step reads m rows),
`w` bytes per weight (2 for bf16, 1 for FP8 checkpoints), `kv` bytes cached per token and layer
(MLA: the compressed latent plus the rope key, as vLLM and SGLang cache it), `attn` FLOPs per
(query, cached token, layer). η and `t_layer` (fixed per-layer launch cost) are what a real
engine loses to the peak; the defaults are stated where they are set and measured in BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from recycle.hardware import GPU

# Fractions of the datasheet peaks a decode step reaches: memory-bound GEMVs in a tuned engine get
# ~80% of HBM bandwidth, large bf16 GEMMs ~70% of tensor peak (BENCHMARKS.md, plan on the H100).
ETA_MEM = 0.8
ETA_FLOPS = 0.7


@dataclass(frozen=True)
class ForwardCost:
    """What one forward reads and computes, as counts a roofline turns into time."""

    layers: int
    moe_layers: int
    dense_params: int  # read by every forward (see the module docstring)
    expert_params: int  # one routed expert
    experts: int  # routed experts per MoE layer (0: dense model)
    topk: int
    kv_bytes: int  # per cached token per layer
    attn_flops: int  # per (query token, cached token, layer)
    weight_bytes: float = 2.0
    stored_params: int = 0  # every parameter, all experts and the embedding table included (memory needed)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with (excluding the embedding row it reads)."""
        return self.dense_params + self.moe_layers * self.topk * self.expert_params

    def experts_touched(self, tokens: float) -> float:
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.topk / self.experts) ** tokens)

    def bytes(self, batch: int, n: int, context: int) -> float:
        weights = self.dense_params + self.moe_layers * self.experts_touched(batch * n) * self.expert_params
        return self.weight_bytes * weights + batch * context * self.layers * self.kv_bytes

    def flops(self, batch: int, n: int, context: int) -> float:
        m = batch * n
        return 2.0 * m * self.active_params + m * context * self.layers * self.attn_flops

    def seconds(self, gpu: GPU, batch: int, n: int, context: int, *, eta_mem: float = ETA_MEM,
                eta_flops: float = ETA_FLOPS, layer_overhead_s: float = 0.0) -> float:
        mem = self.bytes(batch, n, context) / (eta_mem * gpu.bandwidth_gbs * 1e9)
        comp = self.flops(batch, n, context) / (eta_flops * gpu.bf16_tflops * 1e12)
        return max(mem, comp) + self.layers * layer_overhead_s

    def bound(self, gpu: GPU, batch: int, n: int, context: int, *, eta_mem: float = ETA_MEM,
              eta_flops: float = ETA_FLOPS) -> str:
        mem = self.bytes(batch, n, context) / (eta_mem * gpu.bandwidth_gbs * 1e9)
        comp = self.flops(batch, n, context) / (eta_flops * gpu.bf16_tflops * 1e12)
        return "memory" if mem >= comp else "compute"


def _get(cfg: dict, *names: str, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def target_cost(cfg: dict, weight_bytes: float | None = None) -> ForwardCost:
    """The forward cost of a transformers config (Llama/Qwen/GLM GQA or DeepSeek MLA; dense or MoE).

    Counts match the parameters transformers instantiates for the model (tests/test_plan.py checks
    both trained fixtures); MTP layers are not part of a target forward and are not counted.
    """
    cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
    h, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(_get(cfg, "num_key_value_heads", default=nh))
    if cfg.get("kv_lora_rank"):
        kvr, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, vd, qr = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"]), cfg.get("q_lora_rank")
        q = (h * qr + qr + qr * nh * (nope + rope)) if qr else h * nh * (nope + rope)
        attn = q + h * (kvr + rope) + kvr + kvr * nh * (nope + vd) + nh * vd * h
        kv_values = kvr + rope
        attn_flops = 2 * nh * (kvr + rope) + 2 * nh * kvr  # weight-absorbed MLA: scores and values over the latent
    else:
        hd = int(_get(cfg, "head_dim", default=h // nh))
        attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
        if cfg.get("attention_bias"):
            attn += nh * hd + 2 * nkv * hd
        if cfg.get("use_qk_norm") or cfg.get("model_type", "").startswith("qwen3"):
            attn += 2 * hd
        kv_values = 2 * nkv * hd
        attn_flops = 4 * nh * hd
    experts = int(_get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0) or 0)
    topk = int(_get(cfg, "num_experts_per_tok", default=0) or 0)
    dense_mlp = 3 * h * int(cfg.get("intermediate_size", 4 * h))
    if experts:
        mi = int(_get(cfg, "moe_intermediate_size", default=cfg.get("intermediate_size")))
        first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        moe_layers = L - first_dense
        shared = 3 * h * int(_get(cfg, "shared_expert_intermediate_size", default=0) or
                             int(cfg.get("n_shared_experts", 0) or 0) * mi)
        router = experts * h + (experts if cfg.get("n_group") is not None else 0)  # DeepSeek/GLM score bias
        per_layer_dense = attn + 2 * h
        dense = L * per_layer_dense + first_dense * dense_mlp + moe_layers * (shared + router)
        expert = 3 * h * mi
    else:
        moe_layers, expert = 0, 0
        dense = L * (attn + 2 * h + dense_mlp)
    dense += h + V * h  # final norm, LM head (tied or not, a step reads it)
    stored = dense + moe_layers * experts * expert + (0 if cfg.get("tie_word_embeddings") else V * h)
    if weight_bytes is None:
        q = cfg.get("quantization_config") or {}
        weight_bytes = 1.0 if "fp8" in str(q.get("quant_method", "")).lower() else 2.0
    return ForwardCost(L, moe_layers, dense, expert, experts, topk, kv_values * 2, attn_flops, weight_bytes, stored)


def module_cost(module, like: ForwardCost, kv_layers: int = 1) -> ForwardCost:
    """A drafter's forward cost from its own parameters: routed experts (a 3-D weight whose first dim
    is the target's expert count) are counted as `like`'s are, everything else is read once per pass;
    input embeddings are rows, not reads. Attention and KV as one layer of the target's kind."""
    import torch

    dense = expert_total = 0
    embeds = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen or id(p) in embeds:
            continue
        seen.add(id(p))
        if like.experts and p.dim() == 3 and p.shape[0] == like.experts:
            expert_total += p.numel()
        else:
            dense += p.numel()
    moe_layers = round(expert_total / (like.experts * like.expert_params)) if like.experts and like.expert_params else 0
    return ForwardCost(kv_layers, moe_layers, dense, like.expert_params if moe_layers else 0,
                       like.experts if moe_layers else 0, like.topk if moe_layers else 0, like.kv_bytes,
                       like.attn_flops, like.weight_bytes, dense + expert_total)


def speedup(tau: float, target: ForwardCost, drafter: ForwardCost, gpu: GPU, batch: int, *, verify_tokens: int,
            passes: int, pass_tokens: int, context: int, **kw) -> float:
    """τ · t(target, 1 token) / (passes · t(drafter, pass_tokens) + t(target, verify_tokens)) for every
    sequence of a batch, i.e. tokens per unit time against plain decoding at the same batch size."""
    ar = target.seconds(gpu, batch, 1, context, **kw)
    draft = passes * drafter.seconds(gpu, batch, pass_tokens, context, **kw) if passes else 0.0
    return tau * ar / (draft + target.seconds(gpu, batch, verify_tokens, context, **kw))


BATCH_GRID = tuple(sorted({int(round(2 ** (i / 4))) for i in range(0, 4 * 12 + 1)}))  # 1 … 4096, ~19% steps


def crossover(tau: float, target: ForwardCost, drafter: ForwardCost, gpu: GPU, **kw) -> int | None:
    """The batch size from which speculation no longer pays (< 1× at it and at every larger batch on a
    ~19%-step grid up to 4096); None if it still pays at 4096. For MoE targets the speedup can dip
    at small batches too (verification touches more experts than one token does); the per-batch
    figures show that, this is where it stops for good."""
    last_paying = None
    for b in BATCH_GRID:
        if speedup(tau, target, drafter, gpu, b, **kw) >= 1.0:
            last_paying = b
    if last_paying == BATCH_GRID[-1]:
        return None
    return BATCH_GRID[0] if last_paying is None else BATCH_GRID[BATCH_GRID.index(last_paying) + 1]


def gpus_needed(cost: ForwardCost, gpu: GPU) -> int:
    """How many of `gpu` hold the weights (90% of each one's memory)."""
    return max(1, math.ceil(cost.weight_bytes * cost.stored_params / (0.9 * gpu.memory_gb * 1e9)))


def node(gpu: GPU, count: int) -> GPU:
    """`count` GPUs serving one model with tensor parallelism, taken as one GPU with their summed
    bandwidth and FLOPs (ideal scaling: the all-reduces are not modelled)."""
    if count == 1:
        return gpu
    return replace(gpu, key=f"{count}x{gpu.key}", title=f"{count}× {gpu.title}", bandwidth_gbs=gpu.bandwidth_gbs * count,
                   bf16_tflops=gpu.bf16_tflops * count, memory_gb=gpu.memory_gb * count)


__all__ = ["ForwardCost", "target_cost", "module_cost", "speedup", "crossover", "BATCH_GRID", "gpus_needed", "node", "ETA_MEM", "ETA_FLOPS"]
