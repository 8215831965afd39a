"""Parallel-heads drafting (`parallel-heads`): Meta's extra prediction heads of a checkpoint, each a block over the
trunk state with its own KV cache."""

from __future__ import annotations

import torch
from torch import nn

from recycle.decoding.drafting.base import ENGINES, Drafter, EngineRequest
from recycle.decoding.tree import MaskCache, Shape, Tree, medusa_default, parse_shape, per_level_tree
from recycle.drafters.parallel import ParallelHeads


class ParallelEngine(Drafter):
    """Parallel heads (`recycle.drafters.parallel`): head k, a block over the trunk states with its own
    KV cache, proposes depth k+1 from the last committed trunk state; the heads' top-k choices make a
    Medusa-style static tree. The caches only ever hold committed positions."""

    kind = "parallel-heads"

    def __init__(self, heads: nn.Module, shape: Shape, masks: MaskCache, tap: str) -> None:
        self.heads, self.shape, self.masks = heads, shape, masks
        self.taps = (tap,)

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.pending = [feats[self.taps[0]]]
        self.caches = self.heads.new_caches()
        self.done = 0

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.pending.append(feats[self.taps[0]])

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        h = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        n = h.shape[0]
        pos = torch.arange(self.done, self.done + n, device=h.device)[None]
        depth = self.shape if isinstance(self.shape, int) else self.shape.depth
        # every head's block runs over the n new states (its cache must hold them all); only the last
        # state's row of the heads the tree reaches goes through the vocabulary projection
        feats = self.heads.features(h[None], pos, self.masks.causal(n, self.done), self.caches)
        self.done += n
        return per_level_tree(root, self.shape, [self.heads.head(f[0, -1:]) for f in feats[:depth]], temperature, gen,
                              self.draft_sample)


@ENGINES.register("parallel-heads")
def parallel_engine(r: EngineRequest) -> Drafter:
    heads = ParallelHeads.from_checkpoint(r.source, r.target.model)
    return ParallelEngine(heads, parse_shape(r.tree, medusa_default(heads.num_heads), max_depth=heads.num_heads),
                          r.masks, tap=f"layer:{r.target.num_layers - 1}")
