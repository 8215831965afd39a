"""`convert --calibrate TOKENS`: fit what a converter could not copy to the source it came from, on the target's
own features, before anything is written.

Calibration is a short distillation (the target as teacher, distill's losses and unrolling), so it lives here,
above the converters: `recycle.converters.api.convert` runs whatever `Calibrator` its caller passes between the
converter and the writer. `recycle convert` passes `calibrate` below; from Python, `convert_calibrated` is
`convert_checkpoint` with it.

A format that calibrates (its record's `hooks` name "calibrate") files its step in `CALIBRATORS` (`registry.py`) under its name:
Medusa's ResBlocks fitted to the source's heads (`medusa.py`), the EAGLE-3 fold fitted to the MTP module it came
from (`eagle3.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from recycle.converters.api import convert_checkpoint
from recycle.distill.calibrate import eagle3, medusa  # each registers its format's step in CALIBRATORS
from recycle.distill.calibrate.registry import CALIBRATORS, FormatCalibration, windows

if TYPE_CHECKING:
    from recycle.converters.roles import Plan, RoleWeights
    from recycle.formats import DrafterFormat
    from recycle.options import ConvertOptions


def calibrate(fmt: DrafterFormat, plan: Plan, w: RoleWeights, opts: ConvertOptions,
              progress: Callable[[int, int, str], None] | None = None) -> dict:
    """The `Calibrator` convert takes (`recycle.converters.api`): the format's own calibration, from CALIBRATORS."""
    return CALIBRATORS.get(fmt.name, f"--calibrate with --to {fmt.name}")(plan, w, opts, progress)


def convert_calibrated(source: str | os.PathLike, to: str, out: str | os.PathLike, *,
                       progress: Callable[[int, int, str], None] | None = None, **options) -> dict:
    """`convert_checkpoint` (ConvertOptions' names as keywords) with `calibrate=TOKENS` honoured, as `recycle
    convert --calibrate` does."""
    return convert_checkpoint(source, to, out, progress=progress, calibrator=calibrate, **options)


__all__ = ["CALIBRATORS", "FormatCalibration", "calibrate", "convert_calibrated", "eagle3", "medusa", "windows"]
