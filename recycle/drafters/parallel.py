"""Parallel prediction heads (Meta's multi-token prediction, Gloeckle et al. 2024) as a drafter.

The checkpoint's trunk is `layers[:-1]`; its next-token head is `layers[-1]`; `extra_heads.{k}` are
more blocks of the same kind, each reading the *same* trunk state h_i (the input of the last layer)
and predicting the token k+2 ahead of position i through the shared final norm and output head. No
embedding input, no chaining: all heads draft in one pass from the last committed trunk state, like
Medusa heads, but each head is a full transformer block that attends over the earlier trunk states,
so each keeps a KV cache of its own.

The blocks run as transformers' own decoder layers (the family row's `block_class`), their weights
mapped from Meta's names by the row's `HFLayout`; norm and head are the target's, borrowed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import match
from recycle.imports import import_object
from recycle.mtp import block_rotary


class ParallelHeads(nn.Module):
    """The extra heads of a parallel multi-token-prediction checkpoint, over the target's trunk state."""

    def __init__(self, config, heads: int, block_class: str, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        block_cls = import_object(block_class)
        self.blocks = nn.ModuleList(block_cls(config, layer_idx=0) for _ in range(heads))  # each its own cache
        self.rotary = block_rotary(block_class, config)
        self._shared = {"norm": norm, "head": head}  # the target's: not part of this module's state

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def head(self) -> nn.Module:
        """The shared LM head (the target's)."""
        return self._shared["head"]

    @classmethod
    def from_checkpoint(cls, path: str | Path, target_model: nn.Module) -> ParallelHeads:
        """The extra heads of `path`, run with the (already loaded) target's config, norm and head."""
        from recycle.layouts import block_state

        ckpt = Checkpoint(path)
        m = match(ckpt)
        fam = m.family
        if fam.kind != "parallel_heads" or fam.layout.hf_layout is None or fam.run.block_class is None:
            raise RecycleError(f"{ckpt.path}: family '{fam.name}' has no parallel heads to draft with")
        if not m.modules:
            raise RecycleError(f"{ckpt.path}: declares {m.declared} extra head(s) but stores none")
        decoder = target_model.get_decoder()
        model = cls(target_model.config, len(m.modules), fam.run.block_class, decoder.norm,
                    target_model.get_output_embeddings())
        for block, mod in zip(model.blocks, m.modules):
            state = block_state(fam.layout.hf_layout, target_model.config, ckpt, mod.block_prefixes[0])
            try:
                block.load_state_dict(state, strict=True)
            except RuntimeError as e:
                raise RecycleError(f"{ckpt.path}: head {mod.index} does not fit the trunk's block "
                                   f"({str(e).splitlines()[0]})") from None
        dtype = next(target_model.parameters()).dtype
        return model.to(device=next(target_model.parameters()).device, dtype=dtype).eval()

    def features(self, h: torch.Tensor, position_ids: torch.Tensor | None = None, attention_mask=None,
                 caches: list | None = None) -> list[torch.Tensor]:
        """h [B, T, H] trunk states → per head k, the normed block output [B, T, H] its LM head reads
        (predicting the token k+2 ahead). With `caches` (one per head) each head's cache grows by these T."""
        b, t, _ = h.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=h.device)[None].expand(b, t)
        if attention_mask is None and caches is None:
            from transformers.masking_utils import create_causal_mask

            attention_mask = create_causal_mask(config=self.blocks[0].self_attn.config, inputs_embeds=h,
                                                attention_mask=None, past_key_values=None, position_ids=position_ids)
        rope = self.rotary(h, position_ids)
        out = []
        for k, block in enumerate(self.blocks):
            y = block(h, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=rope,
                      past_key_values=caches[k] if caches is not None else None, use_cache=caches is not None)
            out.append(self._shared["norm"](y[0] if isinstance(y, tuple) else y))
        return out

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | None = None, attention_mask=None,
                caches: list | None = None) -> list[torch.Tensor]:
        """Per head k, logits [B, T, V] for the token k+2 ahead (`features` through the shared head)."""
        return [self.head(f) for f in self.features(h, position_ids, attention_mask, caches)]

    def new_caches(self) -> list[DynamicCache]:
        return [DynamicCache() for _ in self.blocks]
