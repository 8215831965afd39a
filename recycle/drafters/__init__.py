"""Drafter modules and their format records (EAGLE feature-chained, EAGLE-3, Medusa, Gemma 4's assistants,
native MTP, parallel heads), the registry over them (`registry.FORMATS`) and `load_drafter(dir)`.

The decoder and the distiller only see these modules; how a directory was initialised (which MTP
tensor became which weight) lives in its recycle.json, not here.
"""

from __future__ import annotations

from recycle.drafters.eagle import EagleDrafter
from recycle.drafters.eagle3 import Eagle3Drafter
from recycle.drafters.format import DrafterFormat
from recycle.drafters.medusa import MedusaDrafter
from recycle.drafters.registry import FORMATS, convertible, get, load_drafter, native_format, of_config, of_directory

__all__ = ["EagleDrafter", "Eagle3Drafter", "MedusaDrafter", "DrafterFormat", "FORMATS", "convertible", "get",
           "load_drafter", "native_format", "of_config", "of_directory"]
