"""Drafter modules (EAGLE feature-chained, EAGLE-3, Medusa; Gemma 4's assistants; parallel heads) and
`load_drafter(dir)`, which builds the one a directory holds with its format's builder.

Every format whose record declares the "build" hook has a `Builder` in `BUILDERS` (`registry.py`) under its
name: each module here registers its own (`@BUILDERS.register("eagle3")`) when this file imports it. The decoder
and the distiller only see these modules; how a directory was initialised (which MTP tensor became which weight)
lives in its recycle.json, not here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# The members register their builders in BUILDERS as they are imported.
from recycle.drafters import eagle, eagle3, gemma4, hyper_eagle, medusa
from recycle.drafters.eagle import EagleDrafter
from recycle.drafters.eagle3 import Eagle3Drafter
from recycle.drafters.hyper_eagle import HyperEagleDrafter
from recycle.drafters.medusa import MedusaDrafter
from recycle.drafters.registry import BUILDERS, RUNTIME_BUILDERS, Builder
from recycle.errors import RecycleError
from recycle.formats import of_directory
from recycle.io.weights import load_weights
from recycle.preflight import load_json

WEIGHTS = "model.safetensors"


def load_drafter(path: str | os.PathLike, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
    """The drafter module a drafter directory holds (written by `recycle convert` or the distiller, or a
    format recycle reads such as a Gemma 4 assistant), built by its format's builder."""
    d = Path(path)
    if not d.is_dir():
        raise RecycleError(f"{d}: no such drafter directory")
    fmt = of_directory(d)
    build = BUILDERS.get(fmt.name, fmt.title)
    cfg = load_json(d / "config.json", "drafter config.json")
    # whole or sharded; on the meta device (push's validation) the headers alone: shapes and dtypes, no bytes read
    state = load_weights(d, WEIGHTS, meta=torch.get_default_device().type == "meta")
    try:
        return build(d, cfg, fmt.module_names(state), dtype, attn_implementation)
    except (RuntimeError, KeyError, ValueError) as e:
        raise RecycleError(f"{d}: weights do not fit the {fmt.name} drafter ({str(e).splitlines()[0]})") from None


__all__ = [
    "BUILDERS",
    "Builder",
    "Eagle3Drafter",
    "EagleDrafter",
    "HyperEagleDrafter",
    "RUNTIME_BUILDERS",
    "MedusaDrafter",
    "eagle",
    "eagle3",
    "gemma4",
    "hyper_eagle",
    "load_drafter",
    "medusa",
]
