"""The EAGLE-3 drafter (one Llama layer over [embedding; fused aux features]) as engines run it.

Matches the original EAGLE-3 / vLLM `llama_eagle3.py` computation with `norm_before_residual`
false, so a directory recycle writes behaves the same here as in vLLM, SGLang or llama.cpp:

    g        = fc(cat[aux_1, aux_2, aux_3])            # [.., 3H] → [.., h]
    residual = g
    a        = attn(cat[input_layernorm(emb), hidden_norm(g)])   # q/k/v take 2h inputs
    y        = residual + a;  y = y + mlp(post_attention_layernorm(y))
    logits   = lm_head(norm(y))  over the draft vocabulary; target id = draft id + d2t[draft id]

Weights load from the official/SpecForge layout (`midlayer.*`, `fc`, `norm`, `lm_head`, and `d2t`,
`t2d` only for a reduced draft vocabulary: vLLM refuses them on a full one); the embedding is the
target's (pass it in) unless the directory stores `embed_tokens`.

The midlayer's attention is Llama's (the portable layout) or, for a config with `model_type`
`deepseek_v2`, DeepSeek's MLA (vLLM's `Eagle3DeepseekV2ForCausalLM`, whose MLA input projections
take the 2h features; V2 and V3 share that attention, and vLLM reads a `deepseek_v3` draft config as
its MTP model, so the file says V2): `LAYER_KINDS` says which transformers classes build each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DeepseekV3Config, LlamaConfig, PretrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.llama import modeling_llama as llama

from recycle.drafters.registry import BUILDERS


@dataclass(frozen=True)
class LayerKind:
    """The transformers classes a midlayer is built from, and which attention inputs read the 2h features."""

    config: type[PretrainedConfig]
    keys: tuple[str, ...]  # config.json keys the layer reads
    attention: type[nn.Module]
    mlp: type[nn.Module]
    norm: type[nn.Module]
    rotary: type[nn.Module]
    wide_inputs: tuple[str, ...]  # attention Linear modules whose input is cat[emb; hidden] (2h), where present


COMMON_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
               "max_position_embeddings", "hidden_act", "vocab_size", "rope_parameters", "rope_theta")
LAYER_KINDS = {
    "llama": LayerKind(LlamaConfig, (*COMMON_KEYS, "head_dim", "attention_bias", "mlp_bias"), llama.LlamaAttention,
                       llama.LlamaMLP, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding, ("q_proj", "k_proj", "v_proj")),
    "deepseek_v2": LayerKind(
        DeepseekV3Config,
        (*COMMON_KEYS, "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
         "rope_interleave", "attention_bias"),
        ds.DeepseekV3Attention, ds.DeepseekV3MLP, ds.DeepseekV3RMSNorm, ds.DeepseekV3RotaryEmbedding,
        ("q_a_proj", "q_proj", "kv_a_proj_with_mqa")),
}


def layer_kind(config_dict: Mapping) -> LayerKind:
    """A config.json's layer kind by its model_type (anything else is the Llama layer)."""
    return LAYER_KINDS.get(config_dict.get("model_type") or "llama", LAYER_KINDS["llama"])


class Eagle3Layer(nn.Module):
    """The `midlayer`: one decoder layer (dense MLP) whose attention reads 2h features."""

    def __init__(self, config: PretrainedConfig, kind: LayerKind) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = kind.norm(h, eps=config.rms_norm_eps)
        self.hidden_norm = kind.norm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = kind.norm(h, eps=config.rms_norm_eps)
        self.self_attn = kind.attention(config, layer_idx=0)
        for name in kind.wide_inputs:
            old = getattr(self.self_attn, name, None)
            if isinstance(old, nn.Linear):
                setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.mlp = kind.mlp(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope, mask) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        a, _ = self.self_attn(x, position_embeddings=rope, attention_mask=mask)
        y = residual + a
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Drafter(nn.Module):
    """fc + midlayer + norm + lm_head over a draft vocabulary mapped by d2t."""

    def __init__(self, config: PretrainedConfig, target_hidden_size: int | None = None, embed: bool = False,
                 kind: LayerKind = LAYER_KINDS["llama"]) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(3 * (target_hidden_size or h), h, bias=False)
        self.midlayer = Eagle3Layer(config, kind)
        self.norm = kind.norm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        # Stored only for a reduced vocabulary: vLLM creates the mapping parameter only then.
        reduced = self.draft_vocab_size != config.vocab_size
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=reduced)
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool), persistent=reduced)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if embed else None
        self.rotary = kind.rotary(config)

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """aux_hidden [B, T, 3H] (or an already fused [B, T, h] state from a previous step).

        Returns (draft-vocab logits [B, T, Vd], pre-norm output state [B, T, h]).
        """
        if inputs_embeds is None:
            if self.embed_tokens is None or input_ids is None:
                raise ValueError("pass inputs_embeds (the target's embedding) or store embed_tokens")
            inputs_embeds = self.embed_tokens(input_ids)
        g = self.fc(aux_hidden) if aux_hidden.shape[-1] == self.fc.in_features else aux_hidden
        b, t, _ = g.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=g.device).unsqueeze(0).expand(b, t)
        mask = create_causal_mask(config=self.config, inputs_embeds=g, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=position_ids)
        y = self.midlayer(inputs_embeds, g, self.rotary(g, position_ids), mask)
        return self.lm_head(self.norm(y)), y

    def target_ids(self) -> torch.Tensor:
        """Target token id of each draft id: draft + d2t[draft]."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocab logits into the full vocabulary (−inf elsewhere), as vLLM does."""
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.target_ids()] = logits
        return full


def eagle3_module(config_dict: Mapping, embed: bool = False, attn_implementation: str = "sdpa") -> Eagle3Drafter:
    """The untrained module a config.json describes (build it under `torch.device("meta")` to size it)."""
    kind = layer_kind(config_dict)
    cfg = {k: config_dict[k] for k in kind.keys if k in config_dict}
    cfg["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    cfg["norm_before_residual"] = bool(config_dict.get("norm_before_residual", False))
    config = kind.config(**cfg)
    config._attn_implementation = attn_implementation
    return Eagle3Drafter(config, config_dict.get("target_hidden_size"), embed=embed, kind=kind)


def build_eagle3(config_dict: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                 attn_implementation: str = "sdpa") -> Eagle3Drafter:
    model = eagle3_module(config_dict, "embed_tokens.weight" in state, attn_implementation)
    config = model.config
    state = dict(state)
    if model.draft_vocab_size == config.vocab_size:  # identity maps (older recycle files stored them anyway)
        d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
        if (d2t is not None and bool(d2t.any())) or (t2d is not None and not bool(t2d.all())):
            raise ValueError("full draft vocabulary with a non-identity d2t/t2d map")
    model.load_state_dict(state, strict=True)
    return model.to(dtype or torch.float32).eval()


@BUILDERS.register("eagle3")
def build(directory, config: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
          attn_implementation: str = "sdpa") -> Eagle3Drafter:
    return build_eagle3(config, state, dtype, attn_implementation)
