"""Decoder layers composed from transformers' own parts, for MTP blocks that no transformers class runs as stored.

A family row names one of these as its `block_class` where the release's MTP layer is a plain version of a layer
transformers only has in a richer form. Each is built from the same model file's attention, MLP and norm modules
(so weights, conversions and the math inside them are transformers'), and only the wiring between them is here.
"""

from __future__ import annotations

import torch
from torch import nn


def padding_mask(attention_mask: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """The [B, T] keep-mask of real tokens, from the 4-D causal mask the MTP runtime builds (its diagonal: query i
    sees key i exactly when token i is not padding), a [B, T] mask, or none (every token real)."""
    if attention_mask is None:
        return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    if attention_mask.dim() == 4:
        diagonal = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)
        return diagonal if diagonal.dtype == torch.bool else diagonal == 0
    return attention_mask.bool()


class Glm5NextPlainDecoderLayer(nn.Module):
    """GLM-5.3-Flash's MTP layer: NoPE-MLA with the k-pool DSA indexer, then the MLP (MoE), each behind an RMSNorm
    with the ordinary residual. transformers' `Glm5NextTextDecoderLayer` always mixes `hc_mult` hyper-connection
    streams, which the trunk has and the MTP layer does not (it stores no `hc_*` tensors)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        from transformers.models.glm5_next import modeling_glm5_next as glm

        self.self_attn = glm.Glm5NextTextAttention(config, layer_idx)
        sparse = config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = glm.Glm5NextTextMoE(config) if sparse else glm.Glm5NextTextMLP(config)
        self.input_layernorm = glm.Glm5NextTextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = glm.Glm5NextTextRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """`attention_mask` as the runtime gives it (4-D causal); the attention reads the padding mask and builds
        its own causal top-k mask, as `Glm5NextTextModel` does. No position embeddings: the layer is NoPE."""
        keep = padding_mask(attention_mask, hidden_states)
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=keep)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
