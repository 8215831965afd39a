"""The `--to eagle` drafter (`recycle.drafters.EagleDrafter`): the MTP modules' computation, feature-chained, run by
`MTPStack` for any number of steps (past its depth the last module runs again, as distill trains it)."""

from __future__ import annotations

from recycle.decoding.drafting.base import DEFAULT_DYNAMIC, ENGINES, Drafter, EngineRequest
from recycle.decoding.drafting.native_mtp import MTPStack
from recycle.decoding.tree import parse_shape


@ENGINES.register("eagle")
def eagle_engine(r: EngineRequest) -> Drafter:
    return MTPStack(r.model, parse_shape(r.tree, DEFAULT_DYNAMIC), r.masks, kind="eagle", reuse="last")
