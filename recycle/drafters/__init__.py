"""Drafter modules (EAGLE feature-chained, EAGLE-3, Medusa; Gemma 4's assistants; parallel heads) and
`load_drafter(dir)`, which builds the one a directory holds through its format's record (`recycle.formats`).

The decoder and the distiller only see these modules; how a directory was initialised (which MTP
tensor became which weight) lives in its recycle.json, not here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from recycle.checkpoint import load_weights
from recycle.drafters.eagle import EagleDrafter
from recycle.drafters.eagle3 import Eagle3Drafter
from recycle.drafters.medusa import MedusaDrafter
from recycle.errors import RecycleError
from recycle.formats import of_directory
from recycle.preflight import load_json

WEIGHTS = "model.safetensors"

__all__ = ["EagleDrafter", "Eagle3Drafter", "MedusaDrafter", "load_drafter"]


def load_drafter(path: str | os.PathLike, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
    """The drafter module a drafter directory holds (written by `recycle convert` or the distiller, or a
    format recycle reads such as a Gemma 4 assistant), built by its format's record."""
    d = Path(path)
    if not d.is_dir():
        raise RecycleError(f"{d}: no such drafter directory")
    fmt = of_directory(d)
    cfg = load_json(d / "config.json", "drafter config.json")
    # whole or sharded; on the meta device (push's validation) the headers alone: shapes and dtypes, no bytes read
    state = load_weights(d, WEIGHTS, meta=torch.get_default_device().type == "meta")
    try:
        return fmt.resolve("build")(d, cfg, fmt.module_names(state), dtype, attn_implementation)
    except (RuntimeError, KeyError, ValueError) as e:
        raise RecycleError(f"{d}: weights do not fit the {fmt.name} drafter ({str(e).splitlines()[0]})") from None
