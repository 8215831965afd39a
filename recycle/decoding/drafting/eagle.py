"""The `--to eagle` drafter (`recycle.drafters.EagleDrafter`): the MTP modules' computation, feature-chained, run by
`MTPStack` for any number of steps (past its depth the last module runs again, as distill trains it); DeepSeek-V4's
(`recycle.drafters.HyperEagleDrafter`) by its runtime's chains (`hyper_mtp.StreamChain`), `chain:3` by default."""

from __future__ import annotations

from recycle.decoding.drafting.base import CHAINS, DEFAULT_DYNAMIC, ENGINES, HYBRID_CHAIN, Drafter, EngineRequest
from recycle.decoding.drafting.native_mtp import MTPStack
from recycle.decoding.tree import parse_shape


@ENGINES.register("eagle")
def eagle_engine(r: EngineRequest) -> Drafter:
    runtime = r.model.family.run.runtime
    if runtime is not None:  # DeepSeek-V4's modules (`HyperEagleDrafter`): its own chains (`CHAINS`), chains only
        shape = parse_shape(r.tree, HYBRID_CHAIN)
        return CHAINS.get(runtime, r.model.family.title)(r.model, shape, kind="eagle", reuse="last")
    return MTPStack(r.model, parse_shape(r.tree, DEFAULT_DYNAMIC), r.masks, kind="eagle", reuse="last")
