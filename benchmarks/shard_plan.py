"""What `--max-shard-size` makes of DeepSeek-V3's outputs: the files `recycle convert --to eagle` (and stitch) would
write from the real tensor layout, without writing them.

Builds DeepSeek-V3's layout as sparse safetensors (`inspect_scale.build`: real names, shapes and dtypes, no bytes),
runs convert's own plan (reader → roles → the eagle converter → `split_plan`, the step convert runs before
writing) for each size asked, and prints the shards per layout with their planned bytes.

    python benchmarks/shard_plan.py --sizes 5GB,none
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from inspect_scale import build

from recycle.checkpoint import SHORT_DTYPES, Checkpoint
from recycle.converters import CONVERTERS
from recycle.converters.registry import ConvertRequest
from recycle.converters.roles import gather
from recycle.io.weights import whole_file
from recycle.io.writer import nbytes, split_plan
from recycle.options import ConvertOptions
from recycle.preflight import parse_size

from _common import parser, write_json


def plan_files(ckpt: Path, size: str, dtype: str = "bf16") -> dict[str, int]:
    """rel path → planned bytes of every safetensors file convert --to eagle would write at this size."""
    opts = ConvertOptions(source=str(ckpt), to="eagle", out=str(ckpt.parent / "unused"), dtype=dtype)
    w = gather(Checkpoint(ckpt))
    plan = CONVERTERS.get("eagle")(w, ConvertRequest(opts, "bfloat16", None, None))
    files, _ = split_plan(plan.tensors, SHORT_DTYPES[dtype], parse_size(size), plan.jsons)
    return {rel: sum(nbytes(lz.shape, lz.dtype or SHORT_DTYPES[dtype]) for lz in ts.values())
            for rel, ts in sorted(files.items())}


def main() -> None:
    ap = parser(__doc__, json=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/recycle_shard_plan"))
    ap.add_argument("--layers", type=int, default=4, help="trunk layers of the sparse layout (the MTP layer follows)")
    ap.add_argument("--sizes", default="5GB,none")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    built = build(args.dir / "ckpt", args.layers)
    out = {"layout": built, "sizes": {}}
    for size in args.sizes.split(","):
        t0 = time.perf_counter()
        files = plan_files(args.dir / "ckpt", size)
        took = time.perf_counter() - t0
        groups: dict[str, list[int]] = {}
        for rel, b in files.items():
            groups.setdefault(whole_file(rel), []).append(b)
        out["sizes"][size] = {"plan_s": round(took, 2), "files": files}
        print(f"--max-shard-size {size} (planned in {took:.1f} s):")
        for whole, sizes in groups.items():
            print(f"  {whole}: {len(sizes)} file(s), {sum(sizes) / 1e9:.2f} GB, largest {max(sizes) / 1e9:.2f} GB")
    if args.json:
        write_json(args.json, out, indent=2)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
