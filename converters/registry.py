"""The converters' two registries, keyed by format name: `CONVERTERS`, one per format whose record declares the
"converter" hook (`converters/api.py` calls it), and `REWRITERS`, one per format that declares "rewrite"
(`converters/rewrite.py` calls it); with what a converter is given (`ConvertRequest`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from recycle.converters.roles import Backbone, Plan, RoleWeights
from recycle.options import ConvertOptions
from recycle.registry import Registry


@dataclass
class ConvertRequest:
    """What a format's converter is given beside the role weights."""

    options: ConvertOptions
    dtype_name: str  # the output's torch dtype name (config.json's torch_dtype)
    draft_ids: torch.Tensor | None = None  # EAGLE-3's reduced draft vocabulary (ascending target ids)
    backbone: Backbone | None = None  # the target of a drafter-kind source (a Gemma 4 assistant)


class Converter(Protocol):
    """`recycle convert --to NAME`: the source's role weights and the request (options, output dtype, EAGLE-3's
    draft vocabulary, a drafter source's target) → the plan the writer writes. Pure: weights in, plan out."""

    def __call__(self, w: RoleWeights, req: ConvertRequest) -> Plan: ...


class Rewriter(Protocol):
    """A trained drafter's other layouts (`src`: its directory; `main`: the trained weights under
    model.safetensors' names; `model`: the trained module) → (file → tensors to write, the layouts dropped
    because they cannot be rebuilt exactly, notes for recycle.json)."""

    def __call__(self, src: Path, main: dict[str, torch.Tensor], model: torch.nn.Module
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], list[str], list[str]]: ...


CONVERTERS: Registry[Converter] = Registry("converter")
REWRITERS: Registry[Rewriter] = Registry("layout rewriter")
