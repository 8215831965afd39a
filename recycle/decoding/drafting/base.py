"""What every drafting engine shares: the `Drafter` interface (the autoregressive baseline), the request an engine
is made from, and `ENGINES`, the registry of engine factories keyed by format name (each engine's module registers
its own, `@ENGINES.register("eagle3")`), and `CHAINS`, native drafting for MTP runtimes of their own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from transformers import DynamicCache

from recycle.decoding.target import Target
from recycle.decoding.tree import DynamicTreeSpec, MaskCache, Shape, Tree, describe_shape
from recycle.registry import Registry

if TYPE_CHECKING:
    from recycle.formats.record import DrafterFormat

DEFAULT_DYNAMIC = DynamicTreeSpec()
HYBRID_CHAIN = 3  # the default for targets that verify chains only (vLLM's and llama.cpp's MTP drafting: chains)


class Drafter:
    """The autoregressive baseline, and the interface every engine implements."""

    kind = "ar"
    taps: tuple[str, ...] = ()
    shape: Shape = 0
    format: DrafterFormat | None = None  # the record it drafts for (set by load_engine; None: AR decoding)
    draft_sample: str | None = None  # greedy or probabilistic drafts at T > 0 (tree.Expander); None: the shape's default

    def bind(self, cache: DynamicCache) -> None:
        """The target's KV cache for this generation (only engines that attend it keep it)."""

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        pass

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        return Tree.root(root)

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        pass

    def describe(self) -> str:
        return "none" if self.kind == "ar" else f"{self.kind} {describe_shape(self.shape)}"


AutoRegressive = Drafter


@dataclass
class EngineRequest:
    """What a format's engine factory is given."""

    source: Path  # the drafter directory, or the checkpoint whose own modules draft
    target: Target
    masks: MaskCache
    tree: str | None  # --tree, unparsed
    model: nn.Module | None = None  # the drafter module (directory formats), on the target's device
    config: dict | None = None  # its config.json


class EngineFactory(Protocol):
    """A format's decoding engine, made for one request (`@ENGINES.register("FORMAT")`)."""

    def __call__(self, request: EngineRequest) -> Drafter: ...


ENGINES: Registry[EngineFactory] = Registry("decoding engine")
# drafting with a checkpoint's own modules where its family runs them with a runtime of its own (`Family.run.runtime`,
# `recycle.mtp.RUNTIMES`), keyed by the runtime's name: a class taking (the loaded MTP, the draft shape)
CHAINS: Registry[type] = Registry("native drafting engine")
