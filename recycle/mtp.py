"""The MTP runtime: a checkpoint's Multi-Token-Prediction modules as one torch module.

It computes what the serving engines compute (vLLM/SGLang `*_mtp.py`, see formats-source §0.2):

    depth k at position i:  e = Embed(t_{i+k})            (zeroed at position 0 where the family says so)
                            x = Proj(cat[Norm_e(e), Norm_h(h_i^{k-1})])   (order: family.concat_order)
                            h_i^k = Block(x, positions i)  (the block adds its own residuals)
                            logits_k = Head(FinalNorm(h_i^k))             predicts t_{i+k+1}
    h^0 is the trunk's output *after* its final norm; depth k+1 reads h^k before or after the final
    norm per family.chained_state.

Nothing here names a DeepSeek tensor: weights arrive by role through `families.match`, the block
is the family's transformers decoder-layer class, and transformers' own conversion mapping turns
checkpoint expert layouts (per-expert tensors) into the fused parameters its layers hold, and back.
"""

from __future__ import annotations

import copy
import importlib
import os
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion
from transformers.masking_utils import create_causal_mask

from recycle.checkpoint import STORAGE_KEYS, Checkpoint
from recycle.errors import RecycleError
from recycle.families import BY_NAME, Family, MTPMatch, match
from recycle.imports import import_object
from recycle.quant import SCALE_SUFFIX

LEAF_ROLES = ("embed_norm", "hidden_norm", "proj", "final_norm", "head", "embed")
REQUIRED_ROLES = ("embed_norm", "hidden_norm", "proj", "head", "embed")


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
    except (ValueError, TypeError, KeyError) as e:
        why = str(e).split(". Should contain")[0][:200]
        raise RecycleError(f"transformers cannot build a '{model_type}' config from config.json ({why})") from None
    out._attn_implementation = attn_implementation
    if hasattr(out, "_experts_implementation"):
        out._experts_implementation = "eager"  # the reference per-expert loop; no kernel dispatch outside a model
    return out


def _conversions(config: PretrainedConfig) -> list:
    return get_checkpoint_conversion_mapping(config.model_type) or []


def to_runtime_layout(state: Mapping[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """Checkpoint-layout block tensors → the layer's parameters (e.g. per-expert → fused experts).

    Uses transformers' registered conversion for the model type: reverting the reversed transforms
    applies them forwards, so checkpoint and runtime cannot drift from what from_pretrained does.
    """
    conv = _conversions(config)
    if not conv:
        return dict(state)
    forward = [c.reverse_transform() for c in conv][::-1]
    return revert_weight_conversion(types.SimpleNamespace(config=config, _weight_conversions=forward), dict(state))


def to_checkpoint_layout(state: Mapping[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_runtime_layout` (what save_pretrained writes)."""
    conv = _conversions(config)
    if not conv:
        return dict(state)
    return revert_weight_conversion(types.SimpleNamespace(config=config, _weight_conversions=conv), dict(state))


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


class MTPDepth(nn.Module):
    """One MTP module: the norms, the 2H→H projection, one decoder block, and optionally its own
    final norm / head / embedding (roles it does not hold are borrowed at forward time)."""

    def __init__(self, config: PretrainedConfig, family: Family, layer_idx: int, roles: Collection[str]) -> None:
        super().__init__()
        h, v = config.hidden_size, config.vocab_size
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.embed_norm = Norm(h, eps, family.norm)
        self.hidden_norm = Norm(h, eps, family.norm)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.block = import_object(family.block_class)(config, layer_idx)
        self.final_norm = Norm(h, eps, family.norm) if "final_norm" in roles else None
        self.head = nn.Linear(h, v, bias=False) if "head" in roles else None
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
        if family.block_class is None or family.kind != "mtp" or family.concat_order is None:
            raise RecycleError(f"family '{family.name}' has no sequential MTP runtime (kind {family.kind})")
        # a copy: the caller's config (a trunk's, when a fixture trains them together) keeps its own layer lists
        config = copy.copy(config)
        self.config, self.family = config, family
        base = int(getattr(config, "num_hidden_layers", 0) or 0)
        # MTP blocks sit after the trunk's layers: per-layer lists in the config must reach them.
        # Attention is always full (Qwen3-Next's MTP too); other kinds repeat the last trunk layer's
        # (DeepSeek-V3.2's `mlp_layer_types`: the MTP block is MoE like the trunk's late layers).
        for key, value in list(vars(config).items()):
            if key.endswith("layer_types") and isinstance(value, list) and value and len(value) < base + depth:
                fill = "full_attention" if key == "layer_types" else value[-1]
                setattr(config, key, value + [fill] * (base + depth - len(value)))
        self.layers = nn.ModuleList(MTPDepth(config, family, base + k, roles) for k in range(depth))
        # Borrowed trunk modules live outside the module tree: they belong to (and are trained,
        # moved and saved with) the trunk, not here.
        self._shared: dict[str, nn.Module] = dict(shared or {})
        unfilled = [r for r in ("embed", "head") if r not in roles and r not in self._shared]
        if unfilled:
            raise ValueError(f"MTP roles {unfilled} are neither held nor shared")
        self.rotary = block_rotary(family.block_class, config)

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
        cfg = self.config
        mask = create_causal_mask(
            config=cfg, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None, position_ids=position_ids
        )
        rope = self.rotary(hidden, position_ids) if self.rotary is not None else None
        at_start = (position_ids == 0).unsqueeze(-1)
        state, logits, states, normeds = hidden, [], [], []
        for k in range(n):
            layer = self.layer_for(k)
            embed, head, final_norm = (self.role(layer, r) for r in ("embed", "head", "final_norm"))
            e = embed(input_ids[:, k + 1 : k + 1 + t])
            if self.family.zero_embed_at_pos0:
                e = e.masked_fill(at_start, 0.0)
            e, s = layer.embed_norm(e), layer.hidden_norm(state)
            x = layer.proj(torch.cat([e, s] if self.family.concat_order == "eh" else [s, e], dim=-1))
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
            state = y if self.family.chained_state == "pre_norm" else normed
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
        ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
        m: MTPMatch = match(ckpt, family)
        if not m.modules:
            raise RecycleError(f"{ckpt.path}: stores no MTP module ({m.family.title} layout)")
        modules = m.modules[: depth or None]
        config = block_config(m.config, attn_implementation, m.family.block_model_type)
        roles = set(LEAF_ROLES)
        for mod in modules:
            missing = [r for r in REQUIRED_ROLES if mod.tensor(r) is None]
            if missing:
                raise RecycleError(f"{ckpt.path}: MTP module {mod.index} has no tensor for {', '.join(missing)}")
            if mod.tensor("final_norm") is None:
                roles.discard("final_norm")
        try:
            model = cls(config, m.family, len(modules), roles)
        except (IndexError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise RecycleError(
                f"{ckpt.path}: cannot build {m.family.block_class} from this config ({type(e).__name__}: {e})"
            ) from None
        for mod, layer in zip(modules, model.layers):
            state = {f"{r}.weight": ckpt.get(mod.tensor(r)) for r in LEAF_ROLES if r in roles}
            block = {rel: ckpt.get(full) for rel, full in mod.block_names().items() if not rel.endswith(SCALE_SUFFIX)}
            state.update({f"block.{k}": v for k, v in to_runtime_layout(block, config).items()})
            own = layer.state_dict()
            unknown, absent = sorted(set(state) - set(own)), sorted(set(own) - set(state))
            if unknown or absent:
                raise RecycleError(
                    f"{ckpt.path}: MTP module {mod.index} does not fit {m.family.block_class}"
                    + (f"; unexpected: {', '.join(unknown[:5])}" if unknown else "")
                    + (f"; missing: {', '.join(absent[:5])}" if absent else "")
                )
            for name, value in state.items():
                if tuple(value.shape) != tuple(own[name].shape):
                    raise RecycleError(
                        f"{ckpt.path}: MTP module {mod.index} tensor for {name} has shape {list(value.shape)},"
                        f" the block expects {list(own[name].shape)}"
                    )
            layer.load_state_dict(state, strict=True)
        return model.to(dtype).eval()

    def checkpoint_tensors(self, num_hidden_layers: int | None = None) -> dict[str, torch.Tensor]:
        """The modules' weights under the family's checkpoint names (what a release stores).

        Borrowed roles are written as copies where the family's releases store copies.
        """
        fam = self.family
        stored_norm = BY_NAME[fam.name].norm if fam.name in BY_NAME else fam.norm  # an EAGLE drafter runs `w`
        base = int(num_hidden_layers if num_hidden_layers is not None else self.config.num_hidden_layers)
        out: dict[str, torch.Tensor] = {}
        for k, layer in enumerate(self.layers):
            ctx = {"k": k, "layer": base + k, "first": k, "last": k}
            for role in LEAF_ROLES:
                module = getattr(layer, role)
                if module is None and role in fam.stores_copies:
                    module = self._shared.get(role)
                if module is None or role not in fam.roles:
                    continue
                w = module.weight.detach().clone()
                if isinstance(module, Norm) and module.style == "w" and stored_norm == "1+w":
                    w = w.float() - 1.0  # a plain `w` (an EAGLE drafter's) stored zero-centred, as the family stores it
                out[fam.roles[role][0].format(**ctx)] = w
            prefix = fam.block[0].format(s=k, **ctx)
            state = {n: t.detach().clone() for n, t in layer.block.state_dict().items()}
            for rel, t in to_checkpoint_layout(state, self.config).items():
                out[prefix + rel] = t.contiguous()
        return out
