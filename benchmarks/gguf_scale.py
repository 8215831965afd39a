"""Scale benchmark for `recycle convert --to gguf` (issue 31): a DeepSeek-V3-width checkpoint (the full-width convert
benchmark's, `benchmarks/convert_scale.py`: hidden 7168, vocabulary 129280, MLA, FP8 block-scaled Linear weights,
16 routed experts) turned into an MTP side file, against writing the same tensors as safetensors with the one
writer (the same plan, the same bytes but for the few float32 norms), both warm, each a timed child process (peak
RSS of that child alone), alternating, `--repeats` times each (the best wall counts). Then the side file's bytes
at DeepSeek-V3's 256 experts, from the plan's shapes.

    python benchmarks/gguf_scale.py [--dir /tmp/dsv3_gguf] [--experts 16] [--json]
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from convert_scale import Dims, H, V, build, dir_bytes, gb, timed

from _common import parser

SAFETENSORS = """
import sys, time, torch
from recycle.checkpoint import Checkpoint
from recycle.converters.registry import ConvertRequest
from recycle.converters.gguf import convert
from recycle.converters.roles import gather
from recycle.io.writer import OutputDir
from recycle.options import ConvertOptions
ckpt, out = sys.argv[1], sys.argv[2]
opts = ConvertOptions(source=ckpt, to="gguf", out=out, overwrite=True)
plan = convert(gather(Checkpoint(ckpt)), ConvertRequest(opts, "torch.bfloat16"))
with OutputDir(out, overwrite=True) as d:
    d.write_safetensors({"mtp.safetensors": plan.tensors["mtp.gguf"]}, torch.bfloat16)
"""


def side_bytes_at(experts_now: int, experts_at: int, ckpt: Path) -> dict:
    """The side file's tensor bytes (bf16, f32 norms) with `experts_at` routed experts, from the plan's shapes."""
    from recycle.checkpoint import Checkpoint
    from recycle.converters.gguf import convert
    from recycle.converters.registry import ConvertRequest
    from recycle.converters.roles import gather
    from recycle.options import ConvertOptions

    plan = convert(gather(Checkpoint(ckpt)), ConvertRequest(ConvertOptions(source=str(ckpt), to="gguf", out="/x"),
                                                            "torch.bfloat16"))
    header = plan.gguf["mtp.gguf"]
    parts: dict[str, int] = {}
    for name, lazy in plan.tensors["mtp.gguf"].items():
        shape = list(lazy.shape)
        if "_exps." in name:
            shape[0] = shape[0] * experts_at // experts_now
        size = math.prod(shape) * (4 if header.keep_f32(name, lazy.shape) else 2)
        group = ("routed experts" if "_exps." in name else "token_embd / shared_head_head"
                 if name.startswith("token_embd") or "shared_head_head" in name else
                 "attention, eh_proj, shared expert, norms")
        parts[group] = parts.get(group, 0) + size
    return parts


def main() -> int:
    ap = parser(__doc__, first_line=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv3_gguf"))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=H)
    ap.add_argument("--vocab", type=int, default=V)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each writer, alternating")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ckpt = args.dir / "ckpt"
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        built = build(ckpt, Dims.scaled(args.hidden, args.vocab), args.experts)
        # a placeholder byte-level BPE vocabulary of the right size: the side file's vocabulary comes from it
        (ckpt / "tokenizer.json").write_text(json.dumps({
            "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(args.vocab)}, "merges": []},
            "added_tokens": [], "pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}))
        runs = (("`recycle convert --to gguf` (mtp.gguf)", [sys.executable, "-m", "recycle.cli", "convert", str(ckpt),
                                                           "--to", "gguf", "-o", str(args.dir / "gguf"), "--json"],
                 args.dir / "gguf"),
                ("the same plan as safetensors (one writer)", [sys.executable, "-c", SAFETENSORS, str(ckpt),
                                                                str(args.dir / "st")], args.dir / "st"))
        rows = [{"what": what, "wall_s": [], "peak_rss": 0, "written": 0} for what, _, _ in runs]
        for _ in range(args.repeats):  # alternating, warm page cache: the same conditions for both writers
            for row, (_, cmd, out) in zip(rows, runs):
                wall, rss, _ = timed(cmd)
                row["wall_s"].append(round(wall, 2))
                row["peak_rss"], row["written"] = max(row["peak_rss"], rss), dir_bytes(out)
                shutil.rmtree(out, ignore_errors=True)
        for row in rows:
            row["best_s"] = min(row["wall_s"])
        parts = side_bytes_at(args.experts, 256, ckpt)
        print(f"checkpoint {gb(dir_bytes(ckpt))} (built in {built:.1f} s), {args.experts} experts, hidden "
              f"{args.hidden}, vocabulary {args.vocab}\n")
        print("| run | best wall | every run | peak RSS | written |\n|---|---:|---|---:|---:|")
        for r in rows:
            print(f"| {r['what']} | {r['best_s']:.2f} s | {', '.join(f'{w:.1f}' for w in r['wall_s'])} s "
                  f"| {gb(r['peak_rss'])} | {gb(r['written'])} |")
        print(f"\ngguf / safetensors wall (best of {args.repeats}): {rows[0]['best_s'] / rows[1]['best_s']:.2f}×")
        print("\nside file at 256 experts (bf16, f32 norms): " + ", ".join(f"{k} {gb(v)}" for k, v in parts.items())
              + f"; total {gb(sum(parts.values()))}")
        if args.json:
            print(json.dumps({"runs": rows, "bytes_at_256_experts": parts}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
