"""Medusa heads: head i predicts the token i+2 ahead from the target's last hidden state.

Each head is `ResBlock × L` then an LM head, with `ResBlock(x) = x + SiLU(W x + b)` (FasterDecoding
Medusa). Parameter names follow vLLM's layout (`blocks.{i}.layers.{j}`, `lm_heads.{i}`), which is
the file recycle writes at the top of a Medusa directory.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from recycle.drafters.registry import BUILDERS


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaBlock(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=True) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = x + nn.functional.silu(lin(x))
        return x


class MedusaDrafter(nn.Module):
    """K heads over the target's final-normed hidden state."""

    def __init__(self, hidden: int, vocab: int, heads: int, layers: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MedusaBlock(hidden, layers) for _ in range(heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [B, T, H] → per head i logits [B, T, V] for the token at offset i+2."""
        return [head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)]

    @torch.no_grad()
    def draft(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Greedy chain (vLLM's Medusa proposer): argmax of each head at the last position → [B, K]."""
        return torch.stack([lg[:, -1].argmax(-1) for lg in self(hidden_last)], dim=1)


def build_medusa(config_dict: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> MedusaDrafter:
    model = MedusaDrafter(int(config_dict["hidden_size"]), int(config_dict["vocab_size"]),
                          int(config_dict["num_heads"]), int(config_dict.get("num_hidden_layers", 1)))
    model.load_state_dict(dict(state), strict=True)
    return model.to(dtype or torch.float32).eval()


@BUILDERS.register("medusa")
def build(directory, config: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
          attn_implementation: str = "sdpa") -> MedusaDrafter:
    return build_medusa(config, state, dtype)
