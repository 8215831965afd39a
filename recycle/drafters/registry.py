"""The drafters' one registry: every format whose record declares the "build" hook has a `Builder` here under its
name, registered by its module (`@BUILDERS.register("eagle3")`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from recycle.registry import Registry


class Builder(Protocol):
    """A format's module builder: its directory, config.json, the stored tensors under the module's own names
    (`DrafterFormat.module_names`) → the drafter module, in `dtype` (None: float32), in eval mode. Tensors that do
    not fit raise RuntimeError, KeyError or ValueError (`load_drafter` makes them one line)."""

    def __call__(self, directory: Path, config: Mapping, state: Mapping[str, torch.Tensor],
                 dtype: torch.dtype | None = None, attn_implementation: str = "sdpa") -> nn.Module: ...


BUILDERS: Registry[Builder] = Registry("module builder")
# the `--to eagle` drafter of a family whose MTP runs on a runtime of its own (`Family.run.runtime`: DeepSeek-V4),
# keyed by the runtime's name: a Builder taking the drafter's config.json and stored tensors
RUNTIME_BUILDERS: Registry[Builder] = Registry("EAGLE drafter builder")
