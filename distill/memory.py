"""`recycle distill --plan`: the per-rank memory of a distillation, from the configs alone, before anything loads.

The drafter is built on the meta device (recycle's own `EagleDrafter` over transformers' decoder-layer classes,
so the parameter count is the real one), the target likewise (`AutoModelForCausalLM.from_config` on meta), and
the bytes follow the code as it is written today:

- weights: the trainable drafter parameters in fp32, with their grads and AdamW's two moments (fp32); the frozen
  ones in bf16 when the run computes in bf16 and the drafter is stored in bf16 (`freeze.lower_frozen`: exact),
  else fp32; the embedding and head not at all (the drafter holds the teacher's own). With several ranks FSDP2
  shards the trainable weights, their grads and moments (1/world each) and every rank holds the largest unit
  gathered whole (weights and gradients; bf16 under bf16 compute) while it runs; frozen weights stay whole on
  every rank, except fused routed experts, which several ranks split by expert (`distill.experts`: trained or
  frozen, 1/world each, never gathered; each rank casts its share once per call under autocast and exchanges
  every rank's rows with the others while a MoE block runs);
- the teacher: the target's trunk in the same process, or its embedding and head only when the features come
  from a `recycle harvest` cache; bf16 on a GPU under bf16 compute, else fp32;
- activations, per rank (rows = batch × seq_len, or --micro-batch × seq_len): the teacher's features kept for the
  step; what the drafter's layers save for backward over the draft steps, *measured* on a proxy (`_proxy_bytes`:
  one module at the block's real widths with its experts cut to top-k and a small vocabulary, one forward over a
  few positions under the run's autocast, every saved storage counted once) and scaled to the rows; under bf16
  autocast, the per-expert loop's bf16 copy of every expert per draft step and autocast's one copy of each other
  weight (none when FSDP2 gathers bf16 weights); and the loss's vocabulary-wide tensors: one chunk of at most
  `LOSS_CHUNK_ROWS` rows at a time (recomputed in backward), the heads being the teacher's own tensors (no copy of them
  on a GPU under bf16: they are bf16 already);
- what the allocator and the runtime hold beyond the tensors (issue 49): FSDP2's fp32 reduce-scatter buffer and its
  root unit, the held-out rows' features, the busiest expert rank's extra rows, the CUDA context, NCCL's buffers and
  the allocator's fragmentation (with `expandable_segments`), each with its formula in `DERIVATION`; and `check`
  keeps `MARGIN` of the device free besides.

Weights, gradients, optimizer and teacher bytes are exact (tested against a run's state); the layers' activations
are measured on the proxy, not estimated from a formula (an element-count formula was 2× low on a GPU run), and
tested against a real distill step's saved tensors; the loss term is the chunk's arithmetic; the runtime terms
(context, NCCL, fragmentation, imbalance) are stated constants, not measured here (no GPU).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recycle.distill.experts import EXCHANGE, EXCHANGE_ENV, expert_modules, expert_params, shardable
from recycle.distill.freeze import freeze
from recycle.distill.losses import LOSS_CHUNK_ROWS
from recycle.distill.teacher import HARVEST_STREAMS, STREAMS_FROM_VLLM
from recycle.errors import RecycleError
from recycle.formats import of_config
from recycle.preflight import load_json

GB = 1e9
GIB = 1 << 30
# The share of the device `check` keeps free beyond every planned part: the plan was 0.89-1.03 of the allocator's
# peak on five H200 bf16 runs (BENCHMARKS.md, "The plan's activations against an H200"), so 3% over at worst, and 2%
# more for what no run has measured yet (the NCCL and imbalance terms at 8 ranks).
MARGIN = 0.05
# The CUDA context and the kernels' modules loaded, outside torch's allocator: issue 49's ≈ 0.6 GB for an H100 under
# CUDA 12 (not measured here: this machine has no GPU).
CUDA_CONTEXT = 600_000_000
# NCCL's buffers per communicator, an upper count from its defaults: NCCL_BUFFSIZE (4 MiB, the SIMPLE protocol's
# buffer) for each of its 3 protocols (SIMPLE, LL, LL128: LL's is smaller, LL128's about as large), for the send and
# the receive side, on each of NCCL_MAX_NCHANNELS (32) channels; distill's collectives (FSDP2's, the experts', DCP's
# object collectives) run on the default process group's one communicator.
NCCL_BUFFSIZE, NCCL_PROTOCOLS, NCCL_CHANNELS, NCCL_COMMUNICATORS = 4 << 20, 3, 32, 1
# The caching allocator's fragmentation with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (distill sets it,
# issue 49): segments grow in place, so what is lost is the rounding of blocks and the free tail of the last
# segments; a stated 5% of the allocator's bytes (issue 49 counted 3-9 GB, 5-13%, without expandable segments).
FRAGMENTATION = 0.05
# The busiest expert rank's rows over the mean (split experts, `distill.experts`): a stated 1.10. Uniform routing
# gives 1 + 3σ = 1.02 at 8 ranks and 16k positions × top-8 (σ = sqrt(n p (1-p)) of the rank's rows); real routers
# are less even, and the extra rows' bytes are bounded by the layers' activations and the exchange, which it scales.
EXPERT_IMBALANCE = 1.10


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
    derivation: dict[str, str] = field(default_factory=dict)  # part -> how it was counted (a formula)
    counts: dict = field(default_factory=dict)  # the parameter counts and widths the parts came from

    @property
    def per_rank_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def usable(self) -> int | None:
        """The device's bytes less the `MARGIN` kept free."""
        return None if self.budget is None else int(self.budget * (1 - MARGIN))

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.per_rank_bytes <= self.usable

    def as_dict(self) -> dict:
        return {"per_rank_bytes": self.per_rank_bytes, "parts": dict(self.parts), "fits": self.fits,
                "device": self.device, "device_bytes": self.budget, "margin": MARGIN, "usable_bytes": self.usable,
                "derivation": dict(self.derivation), "params": self.params,
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


def plans(path: str | Path) -> bool:
    """Whether the plan covers this drafter: an EAGLE drafter (DeepSeek-V4's `HyperEagleDrafter` included), or a
    source checkpoint to convert --to eagle. distill's check on a GPU runs for these; other formats (EAGLE-3,
    Medusa) start without it, as on a CPU."""
    cfg = load_json(Path(path) / "config.json", "config.json")
    rc = cfg.get("recycle")
    if isinstance(rc, dict):
        return rc.get("format") == "eagle"
    return of_config(cfg) is None


def config_drafter(path: Path):
    """(the drafter on the meta device, built from its config.json alone (a config without weights plans too), its
    block config, its config dict, its family's name)."""
    body, family, depth = _drafter_config(path)
    model = _shell(body, family, depth)
    return model, model.config, body, family


def streams_of(model: torch.nn.Module) -> int:
    """How many hyper-connection streams the drafter reads from the target in place of one state (DeepSeek-V4's
    hc_mult), or 0."""
    return int(model.config.hc_mult) if getattr(model, "reads", None) == "streams" else 0


def _shell(body: dict, family: str, depth: int) -> torch.nn.Module:
    """The EAGLE drafter of `depth` modules on the meta device, from its block config: `EagleDrafter`, or the drafter
    class a family's own runtime registers (`RUNTIME_BUILDERS`: DeepSeek-V4's `HyperEagleDrafter`)."""
    from recycle.drafters.eagle import EagleDrafter, canonical_family
    from recycle.drafters.registry import RUNTIME_BUILDERS
    from recycle.mtp import family_config

    fam = canonical_family(family)
    with torch.device("meta"):
        if fam.run.runtime is not None:
            rc = {"family": family, "depth": depth, "model_type": body.get("model_type")}
            return RUNTIME_BUILDERS.get(fam.run.runtime)(None, {**body, "recycle": rc}, None)
        return EagleDrafter(family_config(body, fam), fam, depth)


@dataclass(frozen=True)
class TargetCounts:
    """The target's parameters by kind, from its config on meta: what the teacher's memory, weight bytes and FLOPs
    per token follow."""

    trunk: int  # every parameter the causal LM holds (its MTP modules are not built)
    io: int  # embedding + LM head
    routed: int  # the routed experts' (names with `.experts.`, not `shared_experts`)
    matrices: int  # parameters of 2-D weights other than the embedding and head (what a quantized release packs)
    config: dict  # the text config, as a dict


@functools.lru_cache(maxsize=8)
def target_counts(path: str) -> TargetCounts:
    """`TargetCounts` of the target at `path`, built on meta from its config (no weights read)."""
    from recycle.decoding.placed import config_of, lm_class
    from recycle.encode import quiet_transformers
    from recycle.preflight import load_json

    with quiet_transformers():
        raw = load_json(Path(path) / "config.json", "config.json")
        cfg = config_of(path, raw)  # as the target loads: a release's own keys read by its row, never its code
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        io = text.vocab_size * text.hidden_size * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        with torch.device("meta"):
            model = lm_class(cfg).from_config(cfg)
    trunk = routed = matrices = 0
    for name, p in model.named_parameters():
        trunk += p.numel()
        if ".experts." in name and "shared_experts" not in name:
            routed += p.numel()
        if p.dim() >= 2 and p.shape[0] != text.vocab_size:
            matrices += p.numel()
    quant = raw.get("quantization_config")  # what the loader's config leaves out (it dequantizes): the stored bytes
    return TargetCounts(trunk, io, routed, matrices, text.to_dict() | ({"quantization_config": quant} if quant else {}))


def _target_params(path: Path) -> tuple[int, int]:
    """(trunk parameters, embedding + head parameters) of the target, built on meta from its config."""
    t = target_counts(str(path))
    return t.trunk, t.io


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules distill shards as FSDP2 units of their own (before the drafter as a whole): transformers'
    decoder layers, one unit each."""
    return [m for m in model.modules() if m is not model and type(m).__name__.endswith("DecoderLayer")]


# A MoE block's expert count and group routing, by the names transformers' configs give them: the proxy sets the
# count to top-k and the groups to one, so every token visits all of its experts, the per-token work of the whole block.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
GROUP_KEYS = ("n_group", "topk_group")
PROXY_VOCAB = 257  # no width of any family is 257: vocabulary-wide tensors are told apart (the loss has its own term)
PROXY_POSITIONS = 48  # positions of the proxy forward: bytes per position are its saved bytes over these
# Measured on an H200 (torch 2.11, benchmarks/activation_account.py): before the first step the allocator held 66 MiB
# beyond the exact parts at every batch size, cuBLAS's and cuBLASLt's workspaces (allocated through torch's caching
# allocator since torch 2.x), and the backward's peak exceeded the saved bytes by about three [rows, hidden] fp32
# gradients of the residual stream.
CUDA_WORKSPACE = 64 << 20
BACKWARD_STATES = 3


class SavedAccount:
    """The unique storages autograd saves for backward while active, by kind: `params` (a reference, no bytes of
    their own), `loss` (vocabulary-wide), `expert_copies` (low-precision copies of one expert's weights, which the
    per-expert loop makes in every call under autocast), `weight_copies` (autocast's copy of another weight, made
    once per autocast region) and `blocks` (everything else the layers keep: what grows with the rows), split into
    `blocks_inside` for what the decoder layers named by `watch_layers` save (what activation checkpointing drops).
    Copies are told from activations by where they came from (`_CastWatch`), not by their shape.

    Attention goes through `scaled_dot_product_attention`, whose saved tensors depend on the kernel: CPU's math
    path keeps the [B, heads, T, T] probabilities, CUDA's fused kernels keep q, k, v, the output and a float32
    log-sum-exp per row and head. Inside `fused_attention()` every call is counted as a fused kernel saves it, on
    any device, so a CPU measurement stands for a GPU run."""

    def __init__(self, model: torch.nn.Module, vocab: int) -> None:
        # parameters by their storage (a view, an expert's slice, a transpose, shares it): expert or other weight
        self.params = {p.untyped_storage().data_ptr(): "loss" if p.shape[0] == vocab else
                       "expert_copies" if ".experts." in n else "weight_copies" for n, p in model.named_parameters()}
        # storage of a weight's cast copy -> (expert_copies | weight_copies, the copy: held, so its address is not
        # reused by an activation while the account is open)
        self.copies: dict[int, tuple[str, torch.Tensor]] = {}
        self.vocab = vocab
        self.seen: dict[int, tuple[str, int]] = {}
        self.held: list[torch.Tensor] = []
        self.inside = 0  # > 0 while a decoder layer runs (`watch_layers`): its saves are `blocks_inside`

    def kind(self, t: torch.Tensor) -> str:
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return "params"
        if key in self.copies:
            return self.copies[key][0]
        if t.dim() and t.shape[-1] == self.vocab:
            return "loss"
        return "blocks_inside" if self.inside else "blocks"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            key = t.untyped_storage().data_ptr()
            if key not in self.seen:
                self.seen[key] = (self.kind(t), t.untyped_storage().nbytes())
                self.held.append(t)  # its address is not reused (and miscounted) while the account is open
        return t

    @contextlib.contextmanager
    def active(self):
        """Count what autograd saves (a step run inside does not train the attention: counting only)."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t), self.fused_attention(), \
                _CastWatch(self):
            yield self

    @contextlib.contextmanager
    def fused_attention(self):
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def counted(q, k, v, *args, **kwargs):
            with torch.no_grad():
                out = sdpa(q, k, v, *args, **kwargs)
            if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
                for x in (q, k, v, out):  # as passed: a view keeps its projection's storage, counted once
                    self.pack(x)
                self.seen[-1 - len(self.seen)] = ("blocks", math.prod(q.shape[:-1]) * 4)  # log-sum-exp, float32
                out.requires_grad_(True)  # a leaf: the layers after it keep their inputs as in training
            return out

        torch.nn.functional.scaled_dot_product_attention = counted
        try:
            yield
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa

    def watch_layers(self, layers) -> None:
        """Tell what `layers` (the decoder layers) save from what the rest keeps: what activation checkpointing
        recomputes instead."""
        def enter(*_):
            self.inside += 1

        def leave(*_):
            self.inside -= 1

        for layer in layers:
            layer.register_forward_pre_hook(enter)
            layer.register_forward_hook(leave)

    def totals(self) -> dict[str, int]:
        out = dict.fromkeys(("params", "loss", "expert_copies", "weight_copies", "blocks", "blocks_inside"), 0)
        for kind, n in self.seen.values():
            out[kind] += n
        return out


class _CastWatch(TorchDispatchMode):
    """Notes every copy made of a parameter (autocast's casts: `_to_copy` of a weight or of one expert's slice), so
    the account tells a weight's copy from an activation of the same shape."""

    def __init__(self, account: SavedAccount) -> None:
        super().__init__()
        self.account = account

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            kind = self.account.params.get(args[0].untyped_storage().data_ptr())
            if kind is not None:  # an LM head's or embedding's copy counts with the loss it serves
                self.account.copies[out.untyped_storage().data_ptr()] = (kind, out)
        return out


@functools.lru_cache(maxsize=16)
def _proxy_bytes(config_json: str, family: str, steps: int, precision: str) -> tuple[float, float, int, int]:
    """(bytes per position outside the decoder layers, inside them, one expert's copies per draft step, the other
    weights' autocast copies) that one distill forward of `steps` draft steps leaves saved for
    backward, measured on a proxy of the drafter on the CPU: one module of the block's real widths (attention,
    norms, projections, the shared and routed experts' widths), its experts cut to top-k and its vocabulary to
    PROXY_VOCAB, over PROXY_POSITIONS positions, under the run's autocast. The proxy costs its own weights in host
    memory (about 2.8 GB fp32 at DeepSeek-V3's widths) and seconds; nothing of the checkpoint is read."""
    from recycle.distill.teacher import autocast
    from recycle.distill.unroll import EagleUnroller
    body = json.loads(config_json)
    k = next((body[key] for key in ("num_experts_per_tok", "moe_top_k") if body.get(key)), None)
    for key in EXPERT_COUNT_KEYS:
        if body.get(key) and k:
            body[key] = k
    for key in GROUP_KEYS:
        if body.get(key):
            body[key] = 1
    body["vocab_size"] = PROXY_VOCAB
    model = _shell(body, family, 1)
    config = model.config
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():  # shapes, not values, decide what is saved; small values keep it finite
            p.fill_(0.01 if p.dim() > 1 else 1.0)
    unroller = EagleUnroller(model, steps)
    gen = torch.Generator().manual_seed(0)
    length = PROXY_POSITIONS + steps + 1
    ids = torch.randint(0, PROXY_VOCAB, (1, length), generator=gen)
    last = torch.randn(1, length, config.hidden_size, generator=gen)
    # a drafter that chains the target's hyper-connection streams (DeepSeek-V4) reads them as the teacher's aux
    hc = streams_of(model)
    streams = torch.randn(1, length, hc, config.hidden_size, generator=gen) if hc else None
    account = SavedAccount(model, PROXY_VOCAB)
    account.watch_layers(layer.block for layer in model.layers)
    with account.active(), autocast(torch.device("cpu"), precision):
        unroller.unroll(ids, last, streams, None)
    totals = account.totals()
    copies = totals["expert_copies"] / max(1, steps * (k or 1))
    positions = unroller.positions(length)
    return totals["blocks"] / positions, totals["blocks_inside"] / positions, int(copies), totals["weight_copies"]


def _activation_bytes(body: dict, family: str, steps: int, precision: str, rows: int, modules: int,
                      checkpointed: bool = False) -> dict[str, int]:
    """The layers' saved bytes for `rows` positions, every expert's copies over all steps (each expert is hit at
    the batch sizes distill runs), and the other weights' autocast copies (of each of the `modules` the steps run),
    from the proxy. `checkpointed` (--activation-checkpointing): each step's decoder layer keeps only its input (the
    projection's output) and one step's layer at a time is recomputed in backward, its expert copies with it."""
    outside, inside, per_expert, weights = _proxy_bytes(json.dumps(body, sort_keys=True), family, steps, precision)
    experts = next((body[key] for key in EXPERT_COUNT_KEYS if body.get(key)), 0)
    copies = per_expert * steps * experts
    if checkpointed:
        layer_input = steps * body["hidden_size"] * (2 if precision == "bf16" else 4)
        return {"blocks": math.ceil((outside + layer_input + inside / steps) * rows),
                "expert_copies": copies // steps, "weight_copies": weights * modules}
    return {"blocks": math.ceil((outside + inside) * rows), "expert_copies": copies,
            "weight_copies": weights * modules}



def exchange_visits(config: dict, ranks: int, exchange: str | None = None) -> int:
    """The most ranks one row visits in the experts' exchange (distill.experts: the routed experts split over the
    ranks in contiguous blocks). All-gather: every rank sees every row (W). All-to-all: a row goes only to the ranks
    holding its top-k experts (≤ k, ≤ W); with group-limited routing (DeepSeek-V3: n_group contiguous groups, the
    top `topk_group` chosen; transformers' modeling_deepseek_v3.py:138-152) to the ranks its chosen groups span:
    whole groups per rank when the ranks divide the groups, `W / n_group` ranks per group when the groups divide the
    ranks (DeepSeek-V3: 4 at 8 ranks, 8 at 16)."""
    if (exchange or os.environ.get(EXCHANGE_ENV, EXCHANGE)) == "all_gather":
        return ranks
    visits = min(ranks, int(config.get("num_experts_per_tok") or ranks))
    groups, top = int(config.get("n_group") or 1), int(config.get("topk_group") or 0)
    if groups > 1 and top:
        if groups % ranks == 0:
            visits = min(visits, top)
        elif ranks % groups == 0:
            visits = min(visits, top * (ranks // groups))
    return visits


LOSS_TENSORS = 6  # [chunk, V] fp32 tensors the chunked KL + CE holds at its peak (6.48 measured on this CPU)
# what each --loss term beyond KL (T = 1) and CE adds, in the same unit: benchmarks/loss_terms_memory.py measured
# tv +3.0, kl@0.7 +4.0, and all four of kl, tv, kl@0.7, tv@0.7 together +9.0 (tv@T counted here as kl@T: +4)
TERM_TENSORS = {"tv": 3, "kl@T": 4, "tv@T": 4}


def term_tensors(term) -> int:
    """[chunk, V] fp32 tensors a --loss term adds to the loss's peak (`TERM_TENSORS`; 0: KL at T = 1 and CE)."""
    if term.name == "ce" or term.key == "kl":
        return 0
    return TERM_TENSORS[term.name if term.temperature is None else f"{term.name}@T"]


def plan(drafter: str | Path, target: str | Path, *, batch: int, seq_len: int, draft_steps: int | None,
         world: int = 1, precision: str = "fp32", cached_teacher: bool = False, served: bool = False,
         groups: tuple[str, ...] = (),
         gpu: str | None = None, device_bytes: int | None = None, micro_batch: int | None = None,
         fsdp: bool = False, activation_checkpointing: bool = False, eval_rows: int = 16,
         loss_terms: tuple = ()) -> MemoryPlan:
    """The per-rank memory of `recycle distill` with these options (see the module's docstring). `gpu` names a
    device of `recycle.hardware`'s table to fit (its memory); `device_bytes` gives the memory directly. `fsdp`:
    sharded with one rank too (torchrun with one process), which gathers each unit as several ranks do. `loss_terms`:
    --loss's terms (`LossConfig.terms()`; none: KL and CE)."""
    from recycle.hardware import gpu as find_gpu

    if world < 1:
        raise RecycleError("--world-size must be at least 1")
    from recycle.distill.unroll import EagleUnroller

    model, config, body, family = config_drafter(Path(drafter).expanduser())
    hc = streams_of(model)  # DeepSeek-V4: the teacher's hyper-connection streams beside its final state, C wide
    if hc and served:
        raise RecycleError(STREAMS_FROM_VLLM.format(what="--teacher (a vLLM server)", instead=HARVEST_STREAMS))
    # its own freeze: the embedding and head, which are the teacher's own tensors in a run (adopt_target_io)
    unroller = EagleUnroller(model, draft_steps or EagleUnroller.default_steps)
    io_params = sum(p.numel() for n, p in model.named_parameters() if unroller.frozen(n))  # counted as the teacher's
    frozen = freeze(model, groups)
    params, trainable = frozen["params"], frozen["trainable_params"]
    # frozen weights stored in bf16 stay bf16 in a bf16 run (distill.freeze.lower_frozen: exact, so lossless)
    stored = str(body.get("torch_dtype") or body.get("dtype") or "")
    frozen_bytes = 2 if precision == "bf16" and stored in ("bfloat16", "bf16") else 4
    trunk, io = _target_params(Path(target).expanduser())
    steps = draft_steps or 3
    rows = min(micro_batch or batch, batch) * seq_len  # what one forward/backward holds
    vocab, hidden = config.vocab_size, config.hidden_size
    anchors = min(micro_batch or batch, batch) * max(1, seq_len - steps - 1)  # the positions the steps run over
    acts = _activation_bytes(body, family, steps, precision, anchors, min(model.depth, steps),
                             activation_checkpointing)
    bf16_units = (world > 1 or fsdp) and precision == "bf16"  # FSDP2 gathers bf16 weights: autocast copies nothing
    # the loss: every step's rows scored a chunk of at most LOSS_CHUNK_ROWS positions at a time, the teacher's logits
    # of a chunk computed once for all steps and each piece recomputed in backward (losses.distill_terms): six
    # [chunk, vocab] fp32 tensors at the backward's recomputation (drafter and teacher logits, softmaxes, the logits'
    # grad; measured on an H200: five in the forward), at any micro-batch. The heads are the teacher's own tensors
    # (unroll.EagleUnroller.adopt_target_io makes the drafter's modules hold them; teacher.py loads them bf16 on a GPU
    # under bf16): autocast copies them only where they are fp32 under bf16 autocast, the drafter's and the
    # teacher's call, for the chunk being recomputed (frozen: autocast caches no copy of them)
    on_gpu = bool(gpu or device_bytes)
    chunk = min(rows, LOSS_CHUNK_ROWS)
    loss = (LOSS_TENSORS + sum(term_tensors(t) for t in loss_terms)) * chunk * vocab * 4
    teacher_bytes = 2 if on_gpu and precision == "bf16" else 4  # distill.teacher: bf16 weights on a bf16 GPU run
    head_copies = 2 if precision == "bf16" and teacher_bytes == 4 else 0
    loss += head_copies * vocab * hidden * 2
    # several ranks: fused routed experts split by expert (distill.experts), outside FSDP2's units
    split = {id(p): p for m in expert_modules(model) for _, p in expert_params(m)} if shardable(model, world) else {}
    split_frozen = sum(p.numel() for p in split.values() if not p.requires_grad)
    in_units = {id(p) for m in fsdp_units(model) for p in m.parameters()}
    unit = max((sum(p.numel() for p in m.parameters() if p.requires_grad and id(p) not in split)
                for m in fsdp_units(model)), default=trainable)
    # FSDP2's root unit: what trains outside every decoder layer (the projection, norms), gathered whole from the
    # forward to the end of the backward
    root = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in in_units
               and id(p) not in split)
    sharded = world > 1 or fsdp
    shards = max(1, world)
    act_bytes = 2 if on_gpu and precision == "bf16" else 4  # the teacher's features, as it returns them
    gathered = 4 if precision == "bf16" else 8  # a unit's weights and grads while it runs: bf16 under bf16 compute
    parts = {
        "weights": (params - trainable - io_params - split_frozen + math.ceil(split_frozen / shards)) * frozen_bytes
        + math.ceil(trainable / shards) * 4,
        "grads": math.ceil(trainable / shards) * 4,
        "optimizer": math.ceil(trainable / shards) * 8,
        "fsdp_gathered_unit": unit * gathered if sharded else 0,
        "fsdp_reduce_scatter": unit * 4 if sharded else 0,
        "fsdp_root_unit": root * gathered if sharded else 0,
        "teacher": (io if cached_teacher else trunk) * teacher_bytes,  # with a cache: its embedding and head alone
        "activations_features": rows * hidden * 4 * 2 * (1 + hc),
        "heldout_features": eval_rows * seq_len * hidden * act_bytes * (1 + hc),
        "activations_blocks": acts["blocks"],
        # none when the experts are bf16 already: gathered so by FSDP2, or frozen and held in bf16; split over the
        # ranks, each casts its own experts once per call
        "activations_expert_copies": 0 if "experts" in groups and frozen_bytes == 2
        else acts["expert_copies"] // shards if split else 0 if bf16_units else acts["expert_copies"],
        # split experts: every rank's rows gathered in, the outputs' sum scattered back, while one block runs; the
        # rows are bf16 under FSDP2's bf16 gather (sharding.py's param_dtype: the norm before the experts returns its
        # weight's dtype, transformers' DeepseekV3RMSNorm), else fp32
        "activations_expert_exchange": 2 * exchange_visits(body, shards) * anchors * hidden * (2 if bf16_units else 4)
        if split else 0,
        "activations_weight_copies": 0 if bf16_units else acts["weight_copies"],
        "activations_loss": loss,
        # backward: the gradients of the residual stream (fp32, a few [rows, hidden] at once) beside what is saved
        "activations_backward": BACKWARD_STATES * rows * hidden * 4 * max(1, hc),
        "runtime": CUDA_WORKSPACE if on_gpu else 0,
    }
    parts["expert_imbalance"] = math.ceil((EXPERT_IMBALANCE - 1) * (parts["activations_blocks"]
                                          + parts["activations_expert_exchange"])) if split else 0
    allocated = sum(parts.values())  # what goes through torch's caching allocator
    parts["fragmentation"] = math.ceil(FRAGMENTATION * allocated) if on_gpu else 0
    parts["cuda_context"] = CUDA_CONTEXT if on_gpu else 0
    parts["nccl_buffers"] = (NCCL_COMMUNICATORS * NCCL_CHANNELS * 2 * NCCL_PROTOCOLS * NCCL_BUFFSIZE
                             if on_gpu and world > 1 else 0)
    budget, device = device_bytes, ("this device" if device_bytes else None)
    if gpu:
        g = find_gpu(gpu)
        budget, device = int(g.memory_gb * GB), g.key
    counts = {"io_params": io_params, "split_frozen": split_frozen,
              "split_trainable": sum(p.numel() for p in split.values() if p.requires_grad),
              "frozen_bytes": frozen_bytes, "unit": unit, "root": root, "vocab": vocab, "hidden": hidden,
              "rows": rows, "anchors": anchors, "loss_chunk_rows": chunk, "head_copies": head_copies,
              "teacher_bytes": teacher_bytes, "io": io}
    return MemoryPlan(parts, params, trainable, trunk, {
        "batch": batch, "seq_len": seq_len, "draft_steps": steps, "world_size": world, "precision": precision,
        "teacher": "harvested cache or server" if cached_teacher else "in process", "freeze": list(groups),
        "micro_batch": micro_batch, "fsdp": sharded, "activation_checkpointing": activation_checkpointing,
        "expert_parallel": bool(split), "eval_rows": eval_rows, "expandable_segments": on_gpu, "streams": hc},
        budget, device, dict(DERIVATION), counts)


# How each part is counted (the --json's `derivation`): P trainable params, W ranks, U the largest decoder-layer
# unit's trainable params, R the root's, g = 2 under bf16 compute (else 4), rows = micro-batch × seq-len,
# anchors = the positions the draft steps run over, V × H the vocabulary and hidden width.
DERIVATION = {
    "weights": "frozen params × their bytes (experts split by expert: /W) + P/W × 4 (fp32 master)",
    "grads": "P/W × 4",
    "optimizer": "P/W × 8 (AdamW's two fp32 moments)",
    "fsdp_gathered_unit": "U × 2g (the running unit's weights and grads, gathered: bf16 under bf16)",
    "fsdp_reduce_scatter": "U × 4 (FSDP2 reduce_dtype fp32: the unit's unsharded gradients cast for the "
                           "reduce-scatter: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:597-599)",
    "fsdp_root_unit": "R × 2g (the root unit's weights and grads, gathered from the forward to the backward's end)",
    "teacher": "trunk params (or embedding + head with a cache) × 2 on a GPU under bf16, else × 4",
    "activations_features": "rows × H × 4 × 2 (the teacher's features and their fp32 copy; × (1 + C) with "
                            "DeepSeek-V4's C hyper-connection streams)",
    "heldout_features": "eval_rows × seq-len × H × g (the held-out rows' features, kept on the device; × (1 + C) "
                        "with DeepSeek-V4's streams)",
    "activations_blocks": "measured on a proxy of the block (bytes per anchor) × anchors",
    "activations_expert_copies": "measured per expert per step on the proxy × steps × experts (/W when split)",
    "activations_expert_exchange": "2 × d × anchors × H × g: the rows sent to the d ranks holding their experts and "
                                   "the sums sent back (all-to-all; d = W under the all-gather exchange)",
    "activations_weight_copies": "measured on the proxy (autocast's copy of each other weight)",
    "activations_loss": "(6 + each --loss term's TERM_TENSORS: tv 3, kl@T 4, tv@T 4) × min(rows, LOSS_CHUNK_ROWS) × "
                        "V × 4 (+ 2 head copies × V × H × 2 where the heads are "
                        "fp32 under bf16 autocast; none on a GPU: the teacher's bf16 tensors)",
    "activations_backward": f"{BACKWARD_STATES} × rows × H × 4 (the residual stream's gradients; × C for "
                            "DeepSeek-V4's C streams)",
    "runtime": "64 MiB (cuBLAS and cuBLASLt workspaces, measured on an H200)",
    "expert_imbalance": f"({EXPERT_IMBALANCE} - 1) × (activations_blocks + activations_expert_exchange)",
    "fragmentation": f"{FRAGMENTATION} × the allocator's bytes (every part above; expandable_segments set)",
    "cuda_context": f"{CUDA_CONTEXT / GB:.1f} GB (context and modules, outside the allocator; stated, not measured)",
    "nccl_buffers": f"{NCCL_COMMUNICATORS} communicator × {NCCL_CHANNELS} channels × 2 (send, receive) × "
                    f"{NCCL_PROTOCOLS} protocols × NCCL_BUFFSIZE {NCCL_BUFFSIZE >> 20} MiB",
}


def advice(p: MemoryPlan) -> str:
    """What would fit, nearest first: the user's levers in the order they cost the least re-alignment."""
    o = p.options
    tips = []
    if "experts" not in o["freeze"] and p.parts["activations_expert_copies"] + p.parts["optimizer"] > 0:
        tips.append("--freeze experts")
    if o["teacher"] == "in process" and p.parts["teacher"] > 0.3 * p.per_rank_bytes:
        tips.append("a harvested teacher (recycle harvest, then --cache-hidden) or a served one (recycle teacher "
                    "serve, then --teacher URL)" if not o.get("streams") else "a harvested teacher (recycle harvest "
                    "--engine transformers, which keeps DeepSeek-V4's hyper-connection streams, then --cache-hidden)")
    if o["world_size"] < 8 and p.parts["optimizer"] > 0.2 * p.per_rank_bytes:
        tips.append(f"more ranks (--world-size {max(2, o['world_size'] * 2)}: FSDP2 shards what trains)")
    if not o["activation_checkpointing"] and p.parts["activations_blocks"] > 0.2 * p.per_rank_bytes:
        tips.append("--activation-checkpointing (each draft step's layer recomputed in backward)")
    rows = min(o["micro_batch"] or o["batch"], o["batch"])
    if rows > 1:
        tips.append(f"--micro-batch {max(1, rows // 2)} (the same step, accumulated)")
    return "; ".join(tips) or "a larger device"


def check(p: MemoryPlan) -> None:
    """Refuse a run whose plan exceeds the device less `MARGIN`, with the advice (one line)."""
    if p.fits is False:
        raise RecycleError(f"the plan needs {p.per_rank_bytes / GIB:.1f} GiB per rank, over the {p.device}'s "
                           f"{p.budget / GIB:.1f} GiB less a {MARGIN:.0%} margin ({p.usable / GIB:.1f} GiB); try "
                           f"{advice(p)} (recycle distill ... --plan shows the parts)")


def for_options(opts, world: int = 1, gpu: str | None = None, device_bytes: int | None = None,
                fsdp: bool = False) -> MemoryPlan:
    """The plan of a DistillOptions run (the one mapping of distill's options onto the plan: --cache-hidden and
    --teacher URL both leave only the target's embedding and head here); the precision is
    the run's, else bf16 on a named GPU and fp32 otherwise (distill's own default on a CPU without bf16)."""
    precision = opts.precision or ("bf16" if gpu or device_bytes else "fp32")

    def at(length: int) -> MemoryPlan:  # a window length's plan: its rows per step keep the step's tokens
        return plan(opts.drafter, opts.target, batch=max(1, opts.batch * opts.seq_len // length), seq_len=length,
                    draft_steps=opts.draft_steps, world=world, precision=precision,
                    cached_teacher=bool(opts.cache_hidden or opts.teacher), served=bool(opts.teacher),
                    groups=tuple(opts.freeze),
                    gpu=gpu, device_bytes=device_bytes, micro_batch=opts.micro_batch, fsdp=fsdp,
                    activation_checkpointing=opts.activation_checkpointing, eval_rows=opts.eval_rows,
                    loss_terms=opts.loss.terms() if opts.loss is not None else ())

    final = at(opts.seq_len)
    stages = opts.stages()
    if not stages:
        return final
    # --curriculum: each stage's plan (the held-out rows stay --seq-len long in every stage); the run needs the peak
    plans = [at(length) for length, _ in stages] + [final]
    for p in plans:
        p.parts["heldout_features"] = final.parts["heldout_features"]
    shares = [share for _, share in stages] + [1 - sum(share for _, share in stages)]
    peak = max(plans, key=lambda p: p.per_rank_bytes)
    peak.options = {**peak.options, "batch": opts.batch, "seq_len": opts.seq_len, "curriculum": [
        {"seq_len": p.options["seq_len"], "share": round(share, 6), "rows_per_rank": p.options["batch"],
         "per_rank_bytes": p.per_rank_bytes, "peak": p is peak} for p, share in zip(plans, shares)]}
    return peak


__all__ = ["MemoryPlan", "TargetCounts", "plan", "advice", "check", "for_options", "target_counts", "MARGIN"]
