"""DeepSeek-V4's MTP runtime (the `deepseek_v4` row's `runtime`): what vLLM's `DeepSeekV4MTP` computes, with
transformers' own V4 classes (`DeepseekV4DecoderLayer`, `DeepseekV4HyperHead`, `DeepseekV4RMSNorm`) as its parts.

    depth k at position i:  e = Embed(t_{i+k}), zeroed at position 0
                            x_c = h_proj(hnorm(S_{i,c})) + e_proj(enorm(e))     for each stream c of C (hc_mult)
                            S'  = Block(x)             a V4 layer: hyper-connections around attention and MoE
                            logits_k = Head(norm(hc_head(S')))                  predicts t_{i+k+1}
    S at depth 1 is the trunk's last layer output: its C hyper-connection streams [B, T, C, H], before the trunk's
    own hc_head and norm (not one final-normed state); depth k+1 reads S' (the streams, before this module's hc_head).

The common forward in recycle.mtp cannot run this (one state of width H, one eh_proj over a concat), hence this
subclass, registered in `RUNTIMES`; the row (recycle.families, `deepseek_v4`) says where each tensor lives.
Import this module before `MTP.from_checkpoint` meets a DeepSeek-V4 checkpoint (it registers the runtime).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import Family, MTPMatch
from recycle.imports import import_object
from recycle.mtp.base import (
    MTP,
    RUNTIMES,
    MTPOutput,
    family_config,
    mtp_layer_types,
    stored_modules,
    to_checkpoint_layout,
    to_runtime_layout,
)

# role → the parameter of `DeepseekV4Depth` it fills
LEAVES = {"embed_norm": "embed_norm.weight", "hidden_norm": "hidden_norm.weight", "e_proj": "e_proj.weight",
          "h_proj": "h_proj.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
          "hc_head_scale": "hc_head.hc_scale", "final_norm": "final_norm.weight", "head": "head.weight",
          "embed": "embed.weight"}
# transformers' deepseek_v4 conversion is not one-to-one backwards: `\.norm\.` → `.kv_norm.` (the compressors')
# also reverses the attention's own `kv_norm`. (wrong, right) substrings of the reverted names, as DeepSeek stores them.
NATIVE_FIXES = ((".attn.norm.", ".attn.kv_norm."),)
# safetensors dtypes of DeepSeek-V4's routed experts in its releases (e2m1 pairs packed in bytes, e8m0 scales)
FP4_STORAGE = frozenset({"I8", "U8", "F4"})


class DeepseekV4Depth(nn.Module):
    """One DeepSeek-V4 MTP module: enorm, hnorm, e_proj, h_proj, a V4 block, its own hc_head and norm, and the
    trunk's embedding and head (held here when loaded from a checkpoint, else borrowed)."""

    def __init__(self, config: PretrainedConfig, family: Family, layer_idx: int, own: bool) -> None:
        super().__init__()
        h, v, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        self.embed_norm = v4.DeepseekV4RMSNorm(h, eps)
        self.hidden_norm = v4.DeepseekV4RMSNorm(h, eps)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.block = import_object(family.run.block_class)(config, layer_idx)
        self.layer_type = config.layer_types[layer_idx]
        self.hc_head = v4.DeepseekV4HyperHead(config)
        self.final_norm = v4.DeepseekV4RMSNorm(h, eps)
        self.head = nn.Linear(h, v, bias=False) if own else None
        self.embed = nn.Embedding(v, h) if own else None
        self.proj = None  # no eh_proj over a concat: what callers of the common runtime test for


def mtp_types_from_ratios(config: PretrainedConfig, raw: Mapping, base: int) -> None:
    """The release's per-layer `compress_ratios` (trunk, then MTP layers) as `mtp_layer_types` for the MTP layers:
    transformers' config keeps only the trunk's part of the list."""
    ratios = raw.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) <= base:
        return
    by_rate = {0: "sliding_attention", **{rate: kind for kind, rate in config.compress_rates.items()}}
    unknown = [r for r in ratios[base:] if r not in by_rate]
    if unknown:
        raise RecycleError(f"config.json: compress ratio {unknown[0]} of an MTP layer is none of {sorted(by_rate)}")
    config.mtp_layer_types = [by_rate[r] for r in ratios[base:]]


def refuse_unreadable(ckpt: Checkpoint, m: MTPMatch, modules: list) -> None:
    """One line for FP4 codes in these modules that no storage codec reads: DeepSeek-V4's routed experts are read
    (`Checkpoint.get` through `recycle.quant.fp4`'s `mxfp4_native`: I8 pairs with an e8m0 `.scale` per 32 inputs),
    and so are its FP8 weights with e8m0 block scales (`dequantize_fp8`); FP4 codes left unfolded (no `.scale`
    beside them) would be read as integers, so the runtime must not run on them."""
    for mod in modules:
        for name in mod.names:
            info = ckpt.tensors[name]
            if info.dtype in FP4_STORAGE:
                raise RecycleError(f"{ckpt.path}: MTP module {mod.index} stores {name} as {info.dtype} with no e8m0 "
                                   "scale beside it (FP4 experts need `.scale` F8_E8M0 per 32 inputs), which recycle "
                                   "cannot dequantize; run it from a BF16 copy of the release")


@RUNTIMES.register("deepseek_v4")
class DeepseekV4MTP(MTP):
    """DeepSeek-V4's MTP modules: the chained state is the C hyper-connection streams (see the module docstring).

    `forward(streams, input_ids)` takes the trunk's last layer output [B, T, C, H]; `MTPOutput.states` holds each
    depth's streams [B, T, C, H] and `normed` what the head reads (after the module's hc_head and norm) [B, T, H].
    """

    leaves = LEAVES  # role → parameter of a module: what a converter writes each role as (`--to eagle`)
    reads = "streams"  # the target feature its modules chain (the decoder's tap; the teacher's streams)

    def __init__(self, config: PretrainedConfig, family: Family, depth: int, roles=(), shared=None) -> None:
        nn.Module.__init__(self)
        self.checkpoint_blocks = False
        config = copy.copy(config)
        self.config, self.family = config, family
        base = int(config.num_hidden_layers)
        mtp_layer_types(config, family, base, depth)
        own = {"head", "embed"} <= set(roles)
        self.layers = nn.ModuleList(DeepseekV4Depth(config, family, base + k, own) for k in range(depth))
        self._shared: dict[str, nn.Module] = dict(shared or {})
        unfilled = [r for r in ("embed", "head") if not own and r not in self._shared]
        if unfilled:
            raise ValueError(f"MTP roles {unfilled} are neither held nor shared")
        self.rotary = v4.DeepseekV4RotaryEmbedding(config)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        depth: int | None = None,
        heads: bool = True,
    ) -> MTPOutput:
        """hidden: the trunk's last decoder layer output, [B, T, C, H] (C = hc_mult streams, before its hc_head);
        input_ids: [B, T + n] (depth k reads t_{i+k}); the rest as `MTP.forward`."""
        c = self.config.hc_mult
        if hidden.dim() != 4 or hidden.shape[2] != c:
            raise RecycleError(f"DeepSeek-V4's MTP reads the trunk's {c} hyper-connection streams [B, T, {c}, H] (its "
                               f"last layer's output, before hc_head), not a state of shape {list(hidden.shape)}: "
                               "a final-normed state would draft silently wrong")
        b, t = hidden.shape[:2]
        n = input_ids.shape[1] - t
        for cap in (depth, self.max_steps):
            n = n if cap is None else min(n, cap)
        if n < 1:
            raise ValueError(f"input_ids must hold at least T+1 = {t + 1} tokens, got {input_ids.shape[1]}")
        if position_ids is None:
            position_ids = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, t)
        context = self.context(hidden, position_ids, attention_mask)
        state, logits, states, normeds = hidden, [], [], []
        for k in range(n):
            y, normed, logit = self.step(self.layer_for(k), state, input_ids[:, k + 1 : k + 1 + t], context, heads)
            if heads:
                logits.append(logit)
            states.append(y)
            normeds.append(normed)
            state = y
        return MTPOutput(logits, states, normeds)

    def context(self, streams: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> dict:
        """What every module reads at these positions: the mask, the rotary embeddings, where position 0 is.
        Positions may start past 0 (a drafter's tail of the sequence): the mask is built on positions relative to
        the first row (rows are consecutive), the rotary embeddings at the absolute ones."""
        flat = streams[:, :, 0]
        # every V4 attention type reads the sliding-window mask (DeepseekV4Model); an explicit one, never None
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=flat, attention_mask=attention_mask,
                                                 past_key_values=None, position_ids=position_ids - position_ids[:, :1],
                                                 allow_is_causal_skip=False)
        rope = {kind: self.rotary(flat, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
        return {"mask": mask, "rope": rope, "position_ids": position_ids, "at_start": (position_ids == 0).unsqueeze(-1)}

    def step(self, layer: DeepseekV4Depth, state: torch.Tensor, tokens: torch.Tensor, context: dict,
             heads: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One module over rows: state [B, T, C, H] (the trunk's streams, or the previous module's), tokens [B, T]
        (t_{i+k} at row i); returns its streams [B, T, C, H], what its head reads [B, T, H] and the logits (or None)."""
        e = self.role(layer, "embed")(tokens).masked_fill(context["at_start"], 0.0)
        x = layer.h_proj(layer.hidden_norm(state)) + layer.e_proj(layer.embed_norm(e)).unsqueeze(-2)
        kwargs = dict(input_ids=tokens, position_embeddings=context["rope"], position_ids=context["position_ids"],
                      attention_mask=context["mask"])
        if self.checkpoint_blocks and torch.is_grad_enabled():
            y = torch.utils.checkpoint.checkpoint(layer.block, x, use_reentrant=False, **kwargs)
        else:
            y = layer.block(x, **kwargs)
        normed = layer.final_norm(layer.hc_head(y))
        return y, normed, self.role(layer, "head")(normed) if heads else None

    def keep_fp32(self) -> DeepseekV4MTP:
        """Back to float32 what the V4 model keeps there at any dtype (hyper-connections, sinks, norms, biases), the
        modules' own norms and hc_head included."""
        keep = v4.DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict
        for name, module in self.named_modules():
            if (name and name.rsplit(".", 1)[-1] in keep) or isinstance(module, v4.DeepseekV4RMSNorm):
                module.float()
        for name, param in self.named_parameters():
            if name.rsplit(".", 1)[-1] in keep:  # parameters named in the list (sinks, position_bias)
                param.data = param.data.float()
        for name, buf in self.named_buffers():
            if name.rsplit(".", 1)[-1] in keep:
                buf.data = buf.data.float()
        return self

    # -- checkpoints ------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls,
        source: str | os.PathLike | Checkpoint,
        *,
        depth: int | None = None,
        dtype: torch.dtype = torch.float32,
        family: str | None = None,
        attn_implementation: str = "eager",
    ) -> DeepseekV4MTP:
        """Build from a DeepSeek-V4 checkpoint's `mtp.{k}.*` tensors, the embedding and head from the trunk's."""
        ckpt, m = stored_modules(source, family)
        modules = m.modules[: depth or None]
        refuse_unreadable(ckpt, m, modules)
        config = family_config(m.config, m.family, attn_implementation)
        base = int(config.num_hidden_layers)
        mtp_types_from_ratios(config, m.config, base)
        for mod in modules:
            missing = [r for r in LEAVES if mod.tensor(r) is None]
            if missing:
                raise RecycleError(f"{ckpt.path}: MTP module {mod.index} has no tensor for {', '.join(missing)}")
        try:
            model = cls(config, m.family, len(modules), roles=("head", "embed"))
        except (IndexError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise RecycleError(
                f"{ckpt.path}: cannot build {m.family.run.block_class} from this config ({type(e).__name__}: {e})"
            ) from None
        for k, (mod, layer) in enumerate(zip(modules, model.layers)):
            state = {param: ckpt.get(mod.tensor(role)) for role, param in LEAVES.items()}
            # the block under a trunk layer's name, so that transformers' own conversion renames it as on load
            at = f"layers.{base + k}."
            block = {at + rel: ckpt.get(full) for rel, full in mod.block_names().items()
                     if ckpt.tensors[full].dtype != "F8_E8M0"}
            for name, value in to_runtime_layout(block, model.config, m.family.run.block_renames).items():
                state["block." + name.removeprefix(at)] = value
            own = layer.state_dict()
            unknown, absent = sorted(set(state) - set(own)), sorted(set(own) - set(state))
            if unknown or absent:
                raise RecycleError(
                    f"{ckpt.path}: MTP module {mod.index} does not fit {m.family.run.block_class}"
                    + (f"; unexpected: {', '.join(unknown[:5])}" if unknown else "")
                    + (f"; missing: {', '.join(absent[:5])}" if absent else ""))
            for name, value in state.items():
                if tuple(value.shape) != tuple(own[name].shape):
                    raise RecycleError(f"{ckpt.path}: MTP module {mod.index} tensor for {name} has shape "
                                       f"{list(value.shape)}, the block expects {list(own[name].shape)}")
            layer.load_state_dict(state, strict=True)
        return model.to(dtype).keep_fp32().eval()

    def checkpoint_tensors(self, num_hidden_layers: int | None = None) -> dict[str, torch.Tensor]:
        """The modules' weights under DeepSeek's own names (`mtp.{k}.*`); the embedding and head stay the trunk's."""
        fam = self.family
        base = int(num_hidden_layers if num_hidden_layers is not None else self.config.num_hidden_layers)
        out: dict[str, torch.Tensor] = {}
        for k, layer in enumerate(self.layers):
            ctx = {"k": k, "layer": base + k, "first": k, "last": k}
            params = layer.state_dict()
            for role, param in LEAVES.items():
                if role in fam.layout.roles:
                    out[fam.layout.roles[role][0].format(**ctx)] = params[param].detach().clone()
            at = f"layers.{self.config.num_hidden_layers + k}."
            state = {at + n: t.detach().clone() for n, t in layer.block.state_dict().items()}
            prefix = fam.layout.block[0].format(s=k, **ctx)
            for name, t in to_checkpoint_layout(state, self.config, fam.run.block_renames).items():
                for wrong, right in NATIVE_FIXES:
                    name = name.replace(wrong, right)
                out[prefix + name.removeprefix(at)] = t.contiguous()
        return out


# The trunk after its last layer (transformers' DeepseekV4Model: `norm(hc_head(streams))` is its last state): each
# parameter of `TrunkTail` and the names it is stored under, DeepSeek's own and transformers'.
TRUNK_TAIL = {"hc_head.hc_fn": ("hc_head_fn", "model.hc_head.hc_fn"),
              "hc_head.hc_base": ("hc_head_base", "model.hc_head.hc_base"),
              "hc_head.hc_scale": ("hc_head_scale", "model.hc_head.hc_scale"),
              "norm.weight": ("norm.weight", "model.norm.weight")}


class TrunkTail(nn.Module):
    """DeepSeek-V4's last state from its C streams: the trunk's own hc_head and final norm (C·C·H + C + 1 + H
    parameters: 121,861, 0.49 MB in fp32, at V4-Pro's 4 × 7168). A stream cache stores the streams alone and its
    reader mixes the last state back with this (distill's teacher), a fifth less disk than storing both."""

    def __init__(self, hc_head: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.hc_head, self.norm = hc_head, norm

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [..., C, H] → the final-normed state [..., H], on the streams' device."""
        at = self.norm.weight.device
        return self.norm(self.hc_head(streams.to(at))).to(streams.device)

    @classmethod
    def of(cls, decoder: nn.Module) -> TrunkTail:
        """The tail of a loaded trunk (its own modules, shared, not copied)."""
        return cls(decoder.hc_head, decoder.norm)

    @classmethod
    def from_checkpoint(cls, source: str | os.PathLike | Checkpoint, config: PretrainedConfig,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> TrunkTail:
        """The tail alone from a target's checkpoint, through the lazy reader (what a trainer that never loads the
        trunk needs to read a stream cache)."""
        ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
        tail = cls(v4.DeepseekV4HyperHead(config), v4.DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        state = {}
        for param, names in TRUNK_TAIL.items():
            name = next((n for n in names if n in ckpt.tensors), None)
            if name is None:
                raise RecycleError(f"{ckpt.path}: no {' or '.join(names)}: the trunk's hc_head and norm, which mix "
                                   "its last state from the cached streams")
            state[param] = ckpt.get(name)
        own = tail.state_dict()
        for param, value in state.items():
            if tuple(value.shape) != tuple(own[param].shape):
                raise RecycleError(f"{ckpt.path}: the trunk's {param} has shape {list(value.shape)}, its config "
                                   f"gives {list(own[param].shape)}")
        tail.load_state_dict(state, strict=True)
        # hc_head's parameters stay fp32 (DeepSeek stores them so; its forward computes in fp32)
        tail.norm.to(device=device, dtype=dtype)
        return tail.to(device=device).eval().requires_grad_(False)
