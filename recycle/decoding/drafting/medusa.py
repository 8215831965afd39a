"""Medusa drafting (`medusa`): heads over the target's last hidden state, one static tree per step."""

from __future__ import annotations

import torch
from torch import nn

from recycle.decoding.drafting.base import ENGINES, Drafter, EngineRequest
from recycle.decoding.tree import MaskCache, Shape, Tree, medusa_default, parse_shape, per_level_tree


class MedusaEngine(Drafter):
    """Medusa: head i reads the target's last committed hidden state h_{C-1} and proposes depth i+1
    (the token i+2 ahead of that state); no cache, the same head row serves every node of a level."""

    kind = "medusa"
    taps = ("last",)

    def __init__(self, model: nn.Module, shape: Shape, masks: MaskCache) -> None:
        self.model, self.shape, self.masks = model, shape, masks

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.h = feats["last"][-1:]

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.h = feats["last"][-1:]

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        depth = self.shape if isinstance(self.shape, int) else self.shape.depth
        m = self.model  # only the heads the tree reaches
        heads = [head(block(self.h)) for block, head in list(zip(m.blocks, m.lm_heads))[:depth]]
        return per_level_tree(root, self.shape, [lg[-1:] for lg in heads], temperature, gen,
                              self.draft_sample)


@ENGINES.register("medusa")
def medusa_engine(r: EngineRequest) -> Drafter:
    heads = r.model.num_heads
    return MedusaEngine(r.model, parse_shape(r.tree, medusa_default(heads), max_depth=heads), r.masks)
