"""Quantized releases: the schemes recycle reads and writes back (one record each, `schemes.py`), the storage
codecs that read their packed weights (`codec.py`'s `CODECS`, one module per codec), and block FP8 (`fp8.py`:
what an engine builds as FP8, the ignore list, the codec).

Importing the package registers every codec; the reader (`recycle.checkpoint`) folds packed weights through them.
"""

from __future__ import annotations

from recycle.quant import ctensors as ctensors  # registers ct_pack, ct_nvfp4, ct_float, ct_naive
from recycle.quant import fp4 as fp4  # registers the FP4 codecs: mxfp4, mxfp4_native, nvfp4
from recycle.quant import intpack as intpack  # registers awq, gptq
from recycle.quant import schemes as schemes  # the scheme records and their ignore rules
from recycle.quant.codec import CODECS, Codec, Packed
from recycle.quant.fp8 import (
    IGNORE_KEYS,
    NATIVE_SCALE_SUFFIX,
    SCALE_SUFFIX,
    BlockFP8,
    dequantize_fp8,
    engine_fp8,
    expected_scale_shape,
    ignore_entries,
    module_of,
    quantize_fp8,
    requantize,
    scale_name,
    scale_names,
    scheme,
    with_ignored,
)

__all__ = ["CODECS", "IGNORE_KEYS", "NATIVE_SCALE_SUFFIX", "SCALE_SUFFIX", "BlockFP8", "Codec", "Packed",
           "dequantize_fp8", "engine_fp8", "expected_scale_shape", "ignore_entries", "module_of", "quantize_fp8",
           "requantize", "scale_name", "scale_names", "scheme", "with_ignored"]
