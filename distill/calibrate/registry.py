"""What the formats' calibrations share: their registry, `CALIBRATORS` (keyed by format name; each format's module
registers its step), and the calibration text."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from recycle.encode import chat_renderer, encode
from recycle.errors import RecycleError
from recycle.registry import Registry
from recycle.texts import data_source

if TYPE_CHECKING:
    from recycle.converters.roles import Plan, RoleWeights
    from recycle.options import ConvertOptions


class FormatCalibration(Protocol):
    """One format's calibration: replaces the plan's approximated tensors by fitted ones (in place, `approx`, each
    with its fit error) and returns recycle.json's "calibration" record. `progress(done, total, label)`."""

    def __call__(self, plan: Plan, w: RoleWeights, opts: ConvertOptions,
                 progress: Callable[[int, int, str], None] | None = None) -> dict: ...


CALIBRATORS: Registry[FormatCalibration] = Registry("calibration")


def windows(tokenizer, data: str | None, tokens: int, length: int) -> torch.Tensor:
    """Calibration windows: the training side of `--data` (default: the stdlib train split), packed. Conversations
    are rendered with the target's chat template; calibration fits every position of the rendered text (the fit
    matches features, which the template's tokens have as well)."""
    texts = data_source(data).train()
    renderer = chat_renderer(texts, tokenizer, "the target")
    ids: list[int] = []
    for chunk in range(0, len(texts), 32):
        for enc, _ in encode(texts[chunk:chunk + 32], tokenizer, renderer, lambda i, why: None):
            ids.extend(enc)
        if len(ids) >= tokens + length:
            break
    rows = max(1, min(len(ids) // length, -(-tokens // length)))
    if len(ids) < length:
        raise RecycleError(f"--calibrate: the calibration text holds only {len(ids)} tokens")
    return torch.tensor([ids[i * length:(i + 1) * length] for i in range(rows)], dtype=torch.long)
