"""Drafting engines: adapters that turn a drafter module into draft trees, keeping its own KV cache.

Every engine speaks the same three calls to the decode loop:
  start(ids, feats)      after the prompt's prefill: the prompt tokens and the target's features
  propose(root, T, gen)  a draft tree under `root` (the token the target emitted last)
  commit(tokens, feats)  the target accepted `tokens` (root first) with these features
and never keeps a cache entry computed from a token the target did not accept.

Engines, one module each, registered in `ENGINES` under their format's name (`recycle/formats/NAME.py`):
  Drafter          no drafts (the baseline, `AutoRegressive`; the tree is the root alone)
  native_mtp       `MTPStack`: the native MTP modules (`recycle.mtp.MTP`)
  hyper_mtp        `StreamChain`: DeepSeek-V4's native modules, over the trunk's hyper-connection streams
  eagle            `MTPStack` over the `--to eagle` drafter (`recycle.drafters.EagleDrafter`: the same
                   computation, any number of steps)
  eagle3           the EAGLE-3 layer run recursively, EAGLE-2 style
  medusa           Medusa heads over the target's last hidden state
  parallel_heads   Meta's parallel heads: blocks over the trunk state, each with its own KV cache
  gemma4_assistant Gemma 4's assistant: Q-only layers over the target's own KV cache (`bind`)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from recycle.checkpoint import Checkpoint
from recycle.decoding.drafting import (  # register
    eagle,
    eagle3,
    gemma4_assistant,
    hyper_mtp,
    medusa,
    native_mtp,
    parallel_heads,
)
from recycle.decoding.drafting.base import (
    CHAINS,
    DEFAULT_DYNAMIC,
    ENGINES,
    HYBRID_CHAIN,
    AutoRegressive,
    Drafter,
    EngineFactory,
    EngineRequest,
)
from recycle.decoding.target import Target
from recycle.decoding.tree import MaskCache
from recycle.drafters import load_drafter
from recycle.errors import RecycleError
from recycle.families import match
from recycle.fit import check_drafter
from recycle.formats import native_format, of_directory
from recycle.preflight import load_json

if TYPE_CHECKING:
    from recycle.formats.record import DrafterFormat

def load_engine(drafter_dir: str | None, target: Target, masks: MaskCache, tree: str | None = None,
                native: bool = False, target_dir: str | None = None) -> Drafter:
    """The drafting engine for a drafter directory (its module loaded after the one fit check), the target's own
    modules (`native`, or DRAFTER_DIR = the target dir: the family's native format), or none (`drafter_dir` None:
    AR decoding)."""
    if drafter_dir is None and not native:
        return Drafter()
    if native or _same_directory(drafter_dir, target_dir):
        fmt, req = _native_request(Path(target_dir if drafter_dir is None else drafter_dir), target, masks, tree)
    else:
        fmt, req = _drafter_request(Path(drafter_dir), target, masks, tree, target_dir)
    engine = _make_engine(fmt, req)
    engine.format = fmt
    return engine


def _same_directory(drafter_dir: str | None, target_dir: str | None) -> bool:
    return drafter_dir is not None and target_dir is not None and Path(drafter_dir).resolve() == Path(target_dir).resolve()


def _native_request(src: Path, target: Target, masks: MaskCache, tree: str | None
                    ) -> tuple[DrafterFormat, EngineRequest]:
    """Detection for a checkpoint drafting with its own modules: its family's native format."""
    fmt = native_format(match(Checkpoint(src)).family.kind, src)
    return fmt, EngineRequest(src, target, masks, tree)


def _drafter_request(d: Path, target: Target, masks: MaskCache, tree: str | None, target_dir: str | None
                     ) -> tuple[DrafterFormat, EngineRequest]:
    """A drafter directory: its format detected, the one fit check against the target, its module loaded."""
    if not d.is_dir():
        raise RecycleError(f"{d}: no such drafter directory")
    fmt = of_directory(d)
    cfg = load_json(d / "config.json", "drafter config.json")
    check_drafter(fmt, cfg, target.config.to_dict(), d, target_dir, str(d))
    model = load_drafter(d, dtype=target.dtype).to(target.device)
    return fmt, EngineRequest(d, target, masks, tree, model, cfg)


def _make_engine(fmt: DrafterFormat, req: EngineRequest) -> Drafter:
    """The format's engine; on a target that verifies chains only (recurrent layers, DeepSeek-V4's compressors), its
    default tree becomes a chain of HYBRID_CHAIN."""
    make = ENGINES.get(fmt.name, fmt.title)
    engine = make(req)
    if req.target.rolls_back and not isinstance(engine.shape, int):
        if req.tree is not None:
            raise RecycleError(f"--tree {req.tree}: this target has recurrent (linear-attention) layers or DeepSeek-V4's "
                               "compressors, which verify chains only: use --tree chain:N")
        req.tree = f"chain:{HYBRID_CHAIN}"
        engine = make(req)
    return engine



__all__ = ["AutoRegressive", "CHAINS", "DEFAULT_DYNAMIC", "Drafter", "ENGINES", "EngineFactory", "EngineRequest", "HYBRID_CHAIN",
           "load_engine", "eagle", "eagle3", "gemma4_assistant", "hyper_mtp", "medusa", "native_mtp", "parallel_heads"]
