"""What one DeepSeek-V4-Pro MTP module costs as stored and as recycle's `--to eagle` drafter holds it, summed from the
released tensor list `inspect_scale.py --layout deepseek_v4_pro` lays out (names, dtypes, shapes; nothing written).

    python benchmarks/v4_module_size.py

Stored: every `mtp.*` tensor at its dtype's size (FP4 experts as I8 pairs with e8m0 scales, FP8 linears, BF16/F32).
Parameters: FP4 codes count two per byte, scales none. The drafter dequantizes: parameters × 2 bytes at bf16, plus the
trunk's embedding and head it carries.
"""

from __future__ import annotations

import math

import inspect_scale

from _common import parser

SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "F8_E8M0": 1}


def main() -> None:
    parser(__doc__.splitlines()[0]).parse_args()
    tensors, leaves, config = inspect_scale.v4_layout(61)
    every = tensors + leaves
    mtp = [t for t in every if t[0].startswith("mtp.")]
    stored = sum(math.prod(shape) * SIZE[dt] for _, dt, shape in mtp)
    params = sum(math.prod(shape) * (2 if dt == "I8" else 1) for _, dt, shape in mtp if dt != "F8_E8M0")
    io = sum(math.prod(shape) * 2 for name, _, shape in every if name in ("embed.weight", "head.weight"))
    print(f"DeepSeek-V4-Pro (hidden {config['hidden_size']}, vocabulary {config['vocab_size']}): one MTP module, "
          f"{len(mtp)} tensors, {params / 1e9:.2f} B parameters, stored {stored / 1e9:.2f} GB; "
          f"--to eagle drafter at bf16 {2 * params / 1e9:.2f} GB + embedding and head {io / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
