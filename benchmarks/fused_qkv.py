"""What MiMo-V2.5's fused, pre-sharded `qkv_proj` costs recycle at the release's real size: one FP8 tensor read by its
chunks (scales tiled per chunk), cut into transformers' q/k/v, and re-quantized chunk by chunk (what stitch writes).

MiMo-V2.5 (hidden 4096, 64 heads of 192/128, 4 chunks = num_key_value_heads): a sliding-window layer's (and each MTP
module's) `qkv_proj` is 64·192 + 8·192 + 8·128 = 14848 rows (four chunks of 3712 = 29 blocks: tiles and one grid
agree), a full-attention layer's 64·192 + 4·192 + 4·128 = 13568 rows (four chunks of 3392 = 26.5 blocks: 108 scale
rows, where one grid would have 106). Random FP8 codes, random positive scales; each step timed `--repeat` times
(the median), and the process's peak RSS above what it held before the step (`_common.Sampler`).

    python benchmarks/fused_qkv.py
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from _common import Sampler, parser

BLOCK = (128, 128)
LAYERS = {"sliding-window / MTP": (64, 8, 192, 128), "full attention": (64, 4, 192, 128)}


def sampled(sampler: Sampler, fn):
    """fn()'s result and this process's peak RSS above its RSS before the call, in bytes (`Sampler`, every 5 ms)."""
    sampler.mark("before")
    out = fn()
    sampler.mark("after")
    return out, (sampler.phases["after"]["peak_gib"] - sampler.phases["before"]["after_gib"]) * 2**30


PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def read(codes: torch.Tensor, scales: torch.Tensor, chunks: int, rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """The stored tensor as recycle reads it: dequantized chunk by chunk into bf16, cut into q/k/v."""
    from recycle.families import BY_NAME
    from recycle.fused import split
    from recycle.quant import dequantize_fp8

    w = dequantize_fp8(codes, scales, BLOCK, torch.bfloat16, row_chunks=chunks)
    return split({"self_attn.qkv_proj.weight": w}, BY_NAME["mimo_v2"].layout.fused, {"num_key_value_heads": chunks},
                 rows.get)


def write(state: dict[str, torch.Tensor], chunks: int):
    """q/k/v fused back into the chunks and re-quantized chunk by chunk (what stitch writes into an FP8 target)."""
    from recycle.families import BY_NAME
    from recycle.fused import fuse
    from recycle.quant import requantize

    w = fuse(state, BY_NAME["mimo_v2"].layout.fused, {"num_key_value_heads": chunks})["self_attn.qkv_proj.weight"]
    return requantize(w, BLOCK, row_chunks=chunks)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    hidden, chunks = 4096, 4
    sampler = Sampler(every=0.005)
    g = torch.Generator().manual_seed(0)
    for what, (heads, kv, hd, vd) in LAYERS.items():
        rows = dict(zip(PARTS, (heads * hd, kv * hd, kv * vd)))
        total = sum(rows.values())
        tiles = chunks * -(-(total // chunks) // BLOCK[0])
        codes = (torch.rand(total, hidden, generator=g) * 2 - 1).to(torch.float8_e4m3fn)
        scales = torch.rand(tiles, hidden // BLOCK[1], generator=g) + 0.5
        times, peaks = {"read + cut": [], "re-quantize by chunk": []}, {"read + cut": 0, "re-quantize by chunk": 0}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            state, peak = sampled(sampler, partial(read, codes, scales, chunks, rows))
            times["read + cut"].append(time.perf_counter() - t0)
            peaks["read + cut"] = max(peaks["read + cut"], peak)
            t0 = time.perf_counter()
            (_, s, _), peak = sampled(sampler, partial(write, state, chunks))
            times["re-quantize by chunk"].append(time.perf_counter() - t0)
            peaks["re-quantize by chunk"] = max(peaks["re-quantize by chunk"], peak)
        print(f"{what}: {total} x {hidden} = {total * hidden / 1e6:.1f} M values, FP8 {total * hidden / 1e6:.1f} MB, "
              f"bf16 {2 * total * hidden / 1e6:.1f} MB, {tiles} scale rows (one grid: {-(-total // BLOCK[0])}); "
              f"re-quantized scales {list(s.shape)}")
        for step, ts in times.items():
            print(f"  {step}: {statistics.median(ts):.3f} s (median of {len(ts)}), peak RSS +{peaks[step] / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
