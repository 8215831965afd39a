"""The MTP runtime: a checkpoint's Multi-Token-Prediction modules as one torch module.

It computes what the serving engines compute (vLLM/SGLang `*_mtp.py`, see formats-source §0.2):

    depth k at position i:  e = Embed(t_{i+k})            (zeroed at position 0 where the family says so)
                            x = Proj(cat[Norm_e(e), Norm_h(h_i^{k-1})])   (order: family.run.concat_order)
                            h_i^k = Block(x, positions i)  (the block adds its own residuals)
                            logits_k = Head(FinalNorm(h_i^k))             predicts t_{i+k+1}
    h^0 is the trunk's output *after* its final norm; depth k+1 reads h^k before or after the final
    norm per family.run.chained_state.

Nothing here names a DeepSeek tensor: weights arrive by role through `families.match`, the block
is the family's transformers decoder-layer class, and transformers' own conversion mapping turns
checkpoint expert layouts (per-expert tensors) into the fused parameters its layers hold, and back.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.utils.checkpoint
from huggingface_hub.errors import StrictDataclassClassValidationError
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from recycle.checkpoint import STORAGE_KEYS, Checkpoint
from recycle.errors import RecycleError
from recycle.families import BY_NAME, Family, MTPMatch, config_rows, declared_depth, first_value, match
from recycle.fused import fuse, scale_chunks, split
from recycle.imports import import_object
from recycle.quant import SCALE_SUFFIX
from recycle.registry import Registry
from recycle.release_config import transformers_keys

T = TypeVar("T")
LEAF_ROLES = ("embed_norm", "hidden_norm", "proj", "final_norm", "head", "embed")
REQUIRED_ROLES = ("embed_norm", "hidden_norm", "proj", "head", "embed")

# MTP subclasses for layouts the common forward below cannot run, by the name a family row gives in `runtime`
RUNTIMES = Registry("MTP runtime")


def chained_streams(config: Mapping) -> int:
    """How many hyper-connection streams a drafter of this target's family chains from it in place of one state (the
    row's runtime `reads` "streams": DeepSeek-V4's `hc_mult`), from its config alone (a trunk that dropped its MTP
    modules too); 0 where the modules chain one state."""
    archs = set(config.get("architectures") or ())
    for fam in config_rows(str(config.get("model_type", "")), archs):
        if fam.run.runtime and getattr(RUNTIMES.get(fam.run.runtime, fam.title), "reads", None) == "streams":
            return int(config.get("hc_mult") or 0)
    return 0
# the mask each attention layer type reads (any other type: the causal one)
MASKS = {"sliding_attention": create_sliding_window_causal_mask}


def mtp_layer_types(config: PretrainedConfig, family: Family, base: int, depth: int) -> None:
    """Extend the config's per-layer lists (`layer_types`, `mlp_layer_types`, ...) over the MTP layers base..base+depth-1.

    The config's own `mtp_<key>` list wins (Step-3.7, Mellum); then the row's `mtp_layer_types`; else attention is
    full and other kinds repeat the last trunk layer's (DeepSeek-V3.2's MTP block is MoE like the late layers).
    """
    for key, value in list(vars(config).items()):
        # per-layer lists: `*layer_types`, and any the row names (GLM-5.2's `indexer_types`: the MTP layer runs its own)
        listed = key.endswith("layer_types") or key in family.run.mtp_layer_types
        if not listed or key.startswith("mtp_") or not isinstance(value, list) or not value:
            continue
        own = getattr(config, f"mtp_{key}", None)
        if isinstance(own, list) and own:  # the release says what its MTP layers are
            value = (value + [value[-1]] * base)[:base]
            setattr(config, key, value + [own[min(k, len(own) - 1)] for k in range(depth)])
        elif len(value) < base + depth:
            fill = family.run.mtp_layer_types.get(key, "full_attention" if key == "layer_types" else value[-1])
            setattr(config, key, value + [fill] * (base + depth - len(value)))


def block_rotary(block_class: str, config: PretrainedConfig) -> nn.Module | None:
    """The rotary embedding that goes with a decoder-layer class (its module's `*RotaryEmbedding`), or
    None when the model has none: blocks run outside their model need the position embeddings it makes."""
    block_cls = import_object(block_class)
    module = importlib.import_module(block_cls.__module__)
    for suffix in ("RotaryEmbedding", "TextRotaryEmbedding"):  # multimodal models name their text model's "Text"
        rotary_cls = getattr(module, block_cls.__name__.replace("DecoderLayer", suffix), None)
        if rotary_cls is not None:
            return rotary_cls(config)
    return None


def block_config(config: Mapping, attn_implementation: str = "sdpa", model_type: str | None = None) -> PretrainedConfig:
    """The family's transformers config class, built from a checkpoint's (merged) config dict.

    `model_type` overrides the config's own (the family's `block_model_type`, for families whose
    model type transformers does not know, e.g. MiMo runs Qwen2 layers).
    """
    cfg = {k: v for k, v in config.items() if k not in STORAGE_KEYS}
    if model_type and model_type != cfg.get("model_type") and "head_dim" not in cfg:
        # another class's defaults may not derive head_dim from hidden_size / heads; make it explicit
        if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    model_type = model_type or cfg.pop("model_type", None)
    cfg.pop("model_type", None)
    if not model_type:
        raise RecycleError("config.json has no model_type; cannot pick the transformers config class")
    try:
        out = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError, KeyError, StrictDataclassClassValidationError) as e:  # the last: a config class's
        why = " ".join(str(e).split(". Should contain")[0].split())[:200]  # validator (layer_types vs layers)
        raise RecycleError(f"transformers cannot build a '{model_type}' config from config.json ({why})") from None
    out._attn_implementation = attn_implementation
    if hasattr(out, "_experts_implementation"):
        out._experts_implementation = "eager"  # the reference per-expert loop; no kernel dispatch outside a model
    return out


def family_config(config: Mapping, family: Family, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """`block_config` for a family's block: its model type, and the attention implementation its row forces.

    With the row's `config_counts_mtp` (per-layer lists that run over the MTP layers), the config class lays out the
    MTP layers' entries itself: built with them counted as layers and no MTP count, then given the trunk's count back.
    """
    config = {**{key: first_value(config, (src,)) for key, src in family.keys.block_config_keys.items()
                 if first_value(config, (src,)) is not None}, **config}  # the config's own keys win
    if family.model_types and config.get("model_type") not in family.model_types and not family.run.block_model_type:
        # read as this row (`--family`) under another name: the row's own config class builds its block
        config = {**config, "model_type": family.model_types[0]}
    config = transformers_keys(config, family.keys.release_config, family.title)  # a type transformers has no class for
    attn, trunk = family.run.attn_implementation or attn_implementation, int(config.get("num_hidden_layers") or 0)
    n = declared_depth(family, config)
    lists = [v for k, v in config.items() if k.endswith("layer_types") and isinstance(v, list)]
    if not family.keys.config_counts_mtp or not n or any(len(v) != trunk + n for v in lists):
        return block_config(config, attn, family.run.block_model_type)
    counts = {k: config[k] for k in family.keys.depth_keys if k in config}
    out = block_config({**config, "num_hidden_layers": trunk + n, **dict.fromkeys(counts, 0)}, attn,
                       family.run.block_model_type)
    out.num_hidden_layers = trunk
    for key, value in counts.items():
        setattr(out, key, value)
    return out


def _conversions(config: PretrainedConfig, key: str | None = None) -> list:
    """transformers' conversion mapping under `key` (a row's `block_conversions`), else the config's model type."""
    return get_checkpoint_conversion_mapping(key or config.model_type) or []


def renamed(state: Mapping[str, T], pairs: tuple[tuple[str, str], ...]) -> dict[str, T]:
    """`state` with each (old, new) substring pair replaced in its names, in order (a row's `block_renames`)."""
    out = {}
    for name, t in state.items():
        for old, new in pairs:
            name = name.replace(old, new)
        out[name] = t
    return out


def part_rows(own: Mapping[str, torch.Tensor], renames: tuple[tuple[str, str], ...] = ()) -> Callable[[str], int | None]:
    """`recycle.fused.split`'s `rows_of` for a decoder layer whose state dict is `own`: a part's rows by its
    checkpoint name, read through the row's `block_renames` (None: the layer has no such parameter)."""
    def rows_of(rel: str) -> int | None:
        key = next(iter(renamed({rel: 0}, renames)))
        return own[key].shape[0] if key in own else None
    return rows_of


def misfit(state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> str | None:
    """Why `state` does not load into a module whose state dict is `own` (names first, then shapes); None: it fits."""
    unknown, absent = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if unknown or absent:
        return "; ".join([f"unexpected: {', '.join(unknown[:5])}"] * bool(unknown)
                         + [f"missing: {', '.join(absent[:5])}"] * bool(absent))
    wrong = next((n for n in state if tuple(state[n].shape) != tuple(own[n].shape)), None)
    if wrong is not None:
        return f"the tensor for {wrong} has shape {list(state[wrong].shape)}, the block expects {list(own[wrong].shape)}"
    return None


def to_runtime_layout(state: Mapping[str, torch.Tensor], config: PretrainedConfig,
                      renames: tuple[tuple[str, str], ...] = (), conversions: str | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint-layout block tensors → the layer's parameters (e.g. per-expert → fused experts), after the row's
    `block_renames` (a release's names for what the decoder-layer class calls otherwise).

    Uses transformers' registered conversion for the model type: reverting the reversed transforms
    applies them forwards, so checkpoint and runtime cannot drift from what from_pretrained does.
    """
    state = renamed(state, renames)
    conv = _conversions(config, conversions)
    if not conv:
        return state
    forward = [c.reverse_transform() for c in conv][::-1]
    return revert_weight_conversion(types.SimpleNamespace(config=config, _weight_conversions=forward), state)


def to_checkpoint_layout(state: Mapping[str, torch.Tensor], config: PretrainedConfig,
                         renames: tuple[tuple[str, str], ...] = (), conversions: str | None = None
                         ) -> dict[str, torch.Tensor]:
    """The inverse of `to_runtime_layout` (what save_pretrained writes, under the release's names)."""
    conv = _conversions(config, conversions)
    if conv:
        state = revert_weight_conversion(types.SimpleNamespace(config=config, _weight_conversions=conv), dict(state))
    return renamed(state, tuple((new, old) for old, new in renames))


class Norm(nn.Module):
    """RMSNorm in either parametrisation: `w·x̂` ("w") or zero-centred `(1+w)·x̂` ("1+w").

    The "w" form mirrors transformers' Llama/DeepSeek RMSNorm bit for bit (float32 statistics,
    weight applied after casting back), so depth-1 logits can be compared exactly.
    """

    def __init__(self, size: int, eps: float, style: str = "w") -> None:
        super().__init__()
        if style not in ("w", "1+w"):
            raise ValueError(f"unknown norm style {style!r}")
        self.style, self.eps = style, eps
        self.weight = nn.Parameter(torch.zeros(size) if style == "1+w" else torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "1+w":
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


def _fold_trunk_semantics(state: dict[str, torch.Tensor], m: MTPMatch, ckpt: Checkpoint, config: PretrainedConfig) -> None:
    """Fold what the engines apply around a borrowed embedding or head into the module's own copies, so that every
    reader of `embed`/`head` (the forward, the drafting engines, distill, the converters) computes it: a trunk norm the
    embedding passes first (`embed_trunk_norm`), a divisor of the head's input (`logit_divisor_key`, muP) and the
    head's real rows (`logit_rows_key`, a padded unembedding)."""
    fam = m.family
    norm = next((m.outer_prefix + n for n in fam.run.embed_trunk_norm if m.outer_prefix + n in ckpt.tensors), None)
    if norm is not None and "embed.weight" in state:
        trunk_norm = Norm(config.hidden_size, float(getattr(config, "rms_norm_eps", 1e-6)), fam.run.norm)
        trunk_norm.weight.data = ckpt.get(norm, torch.float32)
        with torch.no_grad():
            state["embed.weight"] = trunk_norm(state["embed.weight"].float())
    if "head.weight" not in state:
        return
    divisor = first_value(m.config, (fam.run.logit_divisor_key,)) if fam.run.logit_divisor_key else None
    if divisor is not None:
        state["head.weight"] = state["head.weight"].float() / float(divisor)
    rows = first_value(m.config, (fam.run.logit_rows_key,)) if fam.run.logit_rows_key else None
    if isinstance(rows, int) and 0 < rows < state["head.weight"].shape[0]:
        state["head.weight"] = state["head.weight"][:rows]


def stored_modules(source: str | os.PathLike | Checkpoint, family: str | None = None) -> tuple[Checkpoint, MTPMatch]:
    """The checkpoint and its match, refusing one that stores no MTP module (what every runtime loads from)."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    m = match(ckpt, family)
    if not m.modules:
        raise RecycleError(f"{ckpt.path}: stores no MTP module ({m.family.title} layout)")
    return ckpt, m


class MTPDepth(nn.Module):
    """One MTP module: the norms, the 2H→H projection, one decoder block, and optionally its own
    final norm / head / embedding (roles it does not hold are borrowed at forward time)."""

    def __init__(self, config: PretrainedConfig, family: Family, layer_idx: int, roles: Collection[str]) -> None:
        super().__init__()
        h, v = config.hidden_size, config.vocab_size
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.embed_norm = Norm(h, eps, family.run.norm)
        self.hidden_norm = Norm(h, eps, family.run.norm)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.block = import_object(family.run.block_class)(config, layer_idx)
        types_ = getattr(config, "layer_types", None) or []
        self.layer_type = types_[layer_idx] if layer_idx < len(types_) else "full_attention"  # its mask and rotary
        self.final_norm = Norm(h, eps, family.run.norm) if "final_norm" in roles else None
        rows = getattr(config, family.run.logit_rows_key, None) if family.run.logit_rows_key else None
        rows = rows if isinstance(rows, int) and 0 < rows < v else v  # a padded unembedding: its real tokens only
        self.head = nn.Linear(h, rows, bias=False) if "head" in roles else None
        self.embed = nn.Embedding(v, h) if "embed" in roles else None


@dataclass
class MTPOutput:
    logits: list[torch.Tensor]  # per depth k (1-based k = index + 1): [B, T, V], predicting t_{i+k+1} (heads=True)
    states: list[torch.Tensor]  # per depth: the block output h^k before the final norm, [B, T, H]
    normed: list[torch.Tensor]  # per depth: what the head reads (the final-normed state), [B, T, H]


class MTP(nn.Module):
    """The MTP modules of one checkpoint, run as the engines run them.

    Build from a checkpoint with `MTP.from_checkpoint(path)`, or with random init for training
    (`MTP(config, family, depth, roles, shared=...)`, sharing the trunk's embedding and head).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        depth: int,
        roles: Collection[str] = LEAF_ROLES,
        shared: Mapping[str, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        # recompute each step's decoder layer in backward instead of keeping its activations (distill's
        # --activation-checkpointing: the layers keep their inputs only)
        self.checkpoint_blocks = False
        if family.run.block_class is None or family.kind != "mtp" or family.run.concat_order is None:
            raise RecycleError(f"family '{family.name}' has no sequential MTP runtime (kind {family.kind})")
        # a copy: the caller's config (a trunk's, when a fixture trains them together) keeps its own layer lists
        config = copy.copy(config)
        self.config, self.family = config, family
        base = int(getattr(config, "num_hidden_layers", 0) or 0)
        mtp_layer_types(config, family, base, depth)  # MTP blocks sit after the trunk's layers: the lists must reach them
        layers = config
        if family.keys.config_counts_mtp:  # the layers' per-layer config views (config.per_layer_config[i]) reach them too
            layers = copy.copy(config)
            layers.num_hidden_layers = base + depth
        self.layers = nn.ModuleList(MTPDepth(layers, family, base + k, roles) for k in range(depth))
        # Borrowed trunk modules live outside the module tree: they belong to (and are trained,
        # moved and saved with) the trunk, not here.
        self._shared: dict[str, nn.Module] = dict(shared or {})
        unfilled = [r for r in ("embed", "head") if r not in roles and r not in self._shared]
        if unfilled:
            raise ValueError(f"MTP roles {unfilled} are neither held nor shared")
        self.rotary = block_rotary(family.run.block_class, config)
        # rotary classes of models with several attention types take the layer's type (MiMo-V2, Step-3.7, Mellum)
        self._typed_rope = self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> tuple | None:
        """The position embeddings a block of `layer_type` reads at `position_ids` (None: the block makes its own)."""
        if self.rotary is None:
            return None
        return self.rotary(x, position_ids, layer_type) if self._typed_rope else self.rotary(x, position_ids)

    @property
    def depth(self) -> int:
        return len(self.layers)

    @property
    def max_steps(self) -> int | None:
        """How many steps one forward can run: the stored depth (an EAGLE drafter has no cap)."""
        return self.depth

    def layer_for(self, step: int) -> MTPDepth:
        """The module that runs step `step` (0-based)."""
        return self.layers[step]

    def role(self, layer: MTPDepth, role: str) -> nn.Module | None:
        """A module's `role` ("embed", "head", "final_norm"): its own copy, else the one it shares with the trunk."""
        own = getattr(layer, role)
        return own if own is not None else self._shared.get(role)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        depth: int | None = None,
        heads: bool = True,
    ) -> MTPOutput:
        """Run depths 1..n in parallel over positions (`heads=False`: no logits, the caller applies the heads to
        `normed` itself, a chunk of rows at a time; distillation at a 129k vocabulary needs that).

        hidden:    [B, T, H] the trunk's final-normed hidden states at positions 0..T-1.
        input_ids: [B, T + n] tokens t_0..t_{T+n-1}; depth k reads t_{i+k}, so n ≥ 1 extra tokens
                   give n depths (capped by `depth` and the module count).
        position_ids: [B, T] (default 0..T-1); every depth runs at the hidden state's positions.
        attention_mask: optional [B, T] padding mask (1 = real token).
        """
        b, t, _ = hidden.shape
        n = input_ids.shape[1] - t
        for cap in (depth, self.max_steps):
            n = n if cap is None else min(n, cap)
        if n < 1:
            raise ValueError(f"input_ids must hold at least T+1 = {t + 1} tokens, got {input_ids.shape[1]}")
        if position_ids is None:
            position_ids = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, t)
        context: dict[str, tuple] = {}  # per attention layer type: (mask, rotary embedding)

        def for_type(layer_type: str) -> tuple:
            if layer_type not in context:
                # blocks that index the mask (DeepSeek-V3.2's sparse-attention indexer) get one, never None
                mask = MASKS.get(layer_type, create_causal_mask)(
                    config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None,
                    position_ids=position_ids, allow_is_causal_skip=not self.family.run.mask_required)
                context[layer_type] = mask, self.rope(hidden, position_ids, layer_type)
            return context[layer_type]

        at_start = (position_ids == 0).unsqueeze(-1)
        state, logits, states, normeds = hidden, [], [], []
        for k in range(n):
            layer = self.layer_for(k)
            mask, rope = for_type(layer.layer_type)
            embed, head, final_norm = (self.role(layer, r) for r in ("embed", "head", "final_norm"))
            e = embed(input_ids[:, k + 1 : k + 1 + t])
            if self.family.run.zero_embed_at_pos0:
                e = e.masked_fill(at_start, 0.0)
            e, s = layer.embed_norm(e), layer.hidden_norm(state)
            x = layer.proj(torch.cat([e, s] if self.family.run.concat_order == "eh" else [s, e], dim=-1))
            if self.checkpoint_blocks and torch.is_grad_enabled():  # distill --activation-checkpointing
                y = torch.utils.checkpoint.checkpoint(layer.block, x, use_reentrant=False, attention_mask=mask,
                                                      position_ids=position_ids, position_embeddings=rope)
            else:
                y = layer.block(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
            y = y[0] if isinstance(y, tuple) else y
            normed = final_norm(y) if final_norm is not None else y
            if heads:
                logits.append(head(normed))
            states.append(y)
            normeds.append(normed)
            state = y if self.family.run.chained_state == "pre_norm" else normed
        return MTPOutput(logits, states, normeds)

    # -- checkpoints ------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls,
        source: str | os.PathLike | Checkpoint,
        *,
        depth: int | None = None,
        dtype: torch.dtype = torch.float32,
        family: str | None = None,
        attn_implementation: str = "sdpa",
    ) -> MTP:
        """Build from a checkpoint's stored MTP tensors (FP8 dequantized; borrowed roles from the trunk)."""
        ckpt, m = stored_modules(source, family)
        if m.family.run.runtime is not None and cls is MTP:  # a layout the forward above cannot run: its own runtime
            return RUNTIMES.get(m.family.run.runtime, m.family.title).from_checkpoint(
                ckpt, depth=depth, dtype=dtype, family=m.family.name, attn_implementation=attn_implementation)
        modules = m.modules[: depth or None]
        config = family_config(m.config, m.family, attn_implementation)
        roles = set(LEAF_ROLES)
        for mod in modules:
            missing = [r for r in REQUIRED_ROLES if mod.tensor(r) is None]
            if missing:
                raise RecycleError(f"{ckpt.path}: MTP module {mod.index} has no tensor for {', '.join(missing)}")
            if mod.tensor("final_norm") is None:
                roles.discard("final_norm")
        try:
            model = cls(config, m.family, len(modules), roles)
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise RecycleError(
                f"{ckpt.path}: cannot build {m.family.run.block_class} from this config ({type(e).__name__}: {e})"
            ) from None
        fused = m.family.layout.fused
        for mod, layer in zip(modules, model.layers):
            state = {f"{r}.weight": ckpt.get(mod.tensor(r)) for r in LEAF_ROLES if r in roles}
            block = {rel: ckpt.get(full, row_chunks=scale_chunks(rel, fused, m.config))
                     for rel, full in mod.block_names().items() if not rel.endswith(SCALE_SUFFIX)}
            if fused:  # q/k/v stored as one pre-sharded tensor: cut to the rows the layer's own parameters have
                try:
                    block = split(block, fused, m.config, part_rows(layer.block.state_dict(), m.family.run.block_renames))
                except RecycleError as e:
                    raise RecycleError(f"{ckpt.path}: {mod.prefix}{e}") from None
            state.update({f"block.{k}": v for k, v in to_runtime_layout(
                block, config, m.family.run.block_renames, m.family.run.block_conversions).items()})
            _fold_trunk_semantics(state, m, ckpt, config)
            why = misfit(state, layer.state_dict())
            if why is not None:
                raise RecycleError(f"{ckpt.path}: MTP module {mod.index} does not fit {m.family.run.block_class}: {why}")
            layer.load_state_dict(state, strict=True)
        return model.to(dtype).eval()

    def checkpoint_tensors(self, num_hidden_layers: int | None = None) -> dict[str, torch.Tensor]:
        """The modules' weights under the family's checkpoint names (what a release stores).

        Borrowed roles are written as copies where the family's releases store copies.
        """
        fam = self.family
        stored_norm = BY_NAME[fam.name].run.norm if fam.name in BY_NAME else fam.run.norm  # an EAGLE drafter runs `w`
        base = int(num_hidden_layers if num_hidden_layers is not None else self.config.num_hidden_layers)
        out: dict[str, torch.Tensor] = {}
        for k, layer in enumerate(self.layers):
            ctx = {"k": k, "layer": base + k, "first": k, "last": k}
            for role in LEAF_ROLES:
                module = getattr(layer, role)
                if module is None and role in fam.layout.stores_copies:
                    module = self._shared.get(role)
                if module is None or role not in fam.layout.roles:
                    continue
                w = module.weight.detach().clone()
                if isinstance(module, Norm) and module.style == "w" and stored_norm == "1+w":
                    w = w.float() - 1.0  # a plain `w` (an EAGLE drafter's) stored zero-centred, as the family stores it
                out[fam.layout.roles[role][0].format(**ctx)] = w
            prefix = fam.layout.block[0].format(s=k, **ctx)
            state = {n: t.detach().clone() for n, t in layer.block.state_dict().items()}
            state = to_checkpoint_layout(state, self.config, fam.run.block_renames, fam.run.block_conversions)
            for rel, t in fuse(state, fam.layout.fused, self.config).items():
                out[prefix + rel] = t.contiguous()
        return out
