"""Drafter modules (EAGLE feature-chained, EAGLE-3, Medusa; Gemma 4's assistants) and `load_drafter(dir)`.

The decoder and the distiller only see these modules; how a directory was initialised (which MTP
tensor became which weight) lives in its recycle.json, not here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from recycle.drafters.eagle import EagleDrafter, build_eagle
from recycle.drafters.eagle3 import Eagle3Drafter, build_eagle3
from recycle.drafters.medusa import MedusaDrafter, build_medusa
from recycle.errors import RecycleError

FORMATS = ("eagle", "eagle3", "medusa")  # what `recycle convert` writes
ASSISTANT, ASSISTANT_FORMAT = "gemma4_assistant", "gemma4-assistant"  # Google's own drafter: distill and bench take it
WEIGHTS = "model.safetensors"

__all__ = ["EagleDrafter", "Eagle3Drafter", "MedusaDrafter", "FORMATS", "config_format", "drafter_format", "load_drafter"]


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecycleError(f"{path}: missing; not a drafter directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise RecycleError(f"{path}: unreadable ({e})") from None


def drafter_format(path: str | os.PathLike) -> str:
    """The drafter format of a directory, from recycle.json (else guessed from config.json)."""
    d = Path(path)
    if (d / "recycle.json").is_file():
        fmt = _json(d / "recycle.json").get("target", {}).get("format")
        if fmt in FORMATS or fmt == ASSISTANT_FORMAT:
            return fmt
    fmt = config_format(_json(d / "config.json"))
    if fmt is None:
        raise RecycleError(f"{d}: cannot tell which drafter format this directory holds")
    return fmt


def config_format(cfg: dict) -> str | None:
    """The drafter format a config.json describes, or None (push checks it against recycle.json)."""
    if cfg.get("model_type") == ASSISTANT:
        return ASSISTANT_FORMAT
    if isinstance(cfg.get("recycle"), dict):
        return "eagle"
    if cfg.get("model_type") == "medusa" or "medusa_num_heads" in cfg:
        return "medusa"
    if "draft_vocab_size" in cfg or cfg.get("speculators_model_type") == "eagle3":
        return "eagle3"
    return None


def load_drafter(path: str | os.PathLike, dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
    """The drafter module a directory written by `recycle convert` (or the distiller) holds, or a Gemma 4 assistant."""
    d = Path(path)
    if not d.is_dir():
        raise RecycleError(f"{d}: no such drafter directory")
    fmt = drafter_format(d)
    cfg = _json(d / "config.json")
    if not (d / WEIGHTS).is_file():
        raise RecycleError(f"{d / WEIGHTS}: missing")
    try:
        state = load_file(str(d / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise RecycleError(f"{d / WEIGHTS}: corrupt or unreadable safetensors ({' '.join(str(e).split())[:160]})") from None
    try:
        if fmt == "eagle":
            return build_eagle(cfg, state, dtype, attn_implementation)
        if fmt == "eagle3":
            return build_eagle3(cfg, state, dtype, attn_implementation)
        if fmt == ASSISTANT_FORMAT:
            from recycle.drafters.gemma4 import build_assistant

            return build_assistant(d, state, dtype)
        return build_medusa(cfg, state, dtype)
    except (RuntimeError, KeyError, ValueError) as e:
        raise RecycleError(f"{d}: weights do not fit the {fmt} drafter ({str(e).splitlines()[0]})") from None
