"""The one resolver of objects named as data: the family table names transformers' decoder-layer classes
("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer"), the drafter-format records
name the pieces that live in higher layers ("recycle.decoding.drafting:eagle_engine"). Imported on use, so
the tables themselves import nothing heavy and no arrow points back up."""

from __future__ import annotations

import importlib
from typing import Any

from recycle.errors import RecycleError


def import_object(ref: str) -> Any:
    """`"package.module:attr"`, or a dotted path whose last part is the attribute → the object."""
    module, _, name = ref.partition(":") if ":" in ref else ref.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        where = "the installed transformers" if module.startswith("transformers") else "recycle"
        raise RecycleError(f"cannot import {ref} from {where} ({e})") from None
