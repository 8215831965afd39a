"""The one resolver of transformers' classes named as data: the family table names each family's decoder-layer
class ("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer"), which the MTP runtime
(`recycle.mtp`) and parallel heads (`recycle.drafters.parallel`) import on use, so the table itself imports nothing
heavy. recycle's own code is never named by string: a format's hooks are registered objects (`recycle.registry`).
"""

from __future__ import annotations

import importlib
from typing import Any

from recycle.errors import RecycleError


def import_object(ref: str) -> Any:
    """A dotted path whose last part is the attribute ("transformers.models.x.modeling_x.XDecoderLayer") → the
    class, from the installed transformers."""
    module, _, name = ref.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RecycleError(f"cannot import {ref} from the installed transformers ({e})") from None
