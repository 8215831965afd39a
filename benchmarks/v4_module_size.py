"""What one DeepSeek-V4-Pro MTP module costs as stored, as recycle's `--to eagle` drafter holds it, and as the GGUF
side file `--to gguf` writes for llama.cpp: summed from the released tensor list `inspect_scale.py --layout
deepseek_v4_pro` lays out (names, dtypes, shapes).

    python benchmarks/v4_module_size.py
    python benchmarks/v4_module_size.py --gguf --write /tmp/v4pro_gguf   # also write the bf16 side file, timed

Stored: every `mtp.*` tensor at its dtype's size (FP4 experts as I8 pairs with e8m0 scales, FP8 linears, BF16/F32).
Parameters: FP4 codes count two per byte, scales none. The drafter dequantizes: parameters × 2 bytes at bf16, plus the
trunk's embedding and head it carries.

`--gguf`: the side file's bytes per `--dtype`, from `convert --to gguf`'s own plan over the sparse V4-Pro checkpoint
(`inspect_scale.build`: every tensor a hole, a placeholder vocabulary of the real size): routed experts repacked as
MXFP4 whatever the dtype, the rest at the dtype (float32 where the writer keeps it). `--write DIR` runs the bf16
convert in a child process (wall; the child's peak RSS split into anonymous memory and the source's mapped pages,
sampled from /proc; bytes written); its reads are of holes, so the wall is the convert's own work and the writes,
not the disk's reads.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import inspect_scale

from _common import parser, sampled

SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "F8_E8M0": 1}
GB = 1e9


def side_file_bytes(ckpt: Path) -> dict[str, dict[str, int]]:
    """{dtype: {group: bytes}} of the side file `convert --to gguf` plans for `ckpt` (nothing is read or written)."""
    from recycle.checkpoint import Checkpoint
    from recycle.converters.gguf import DTYPES, convert
    from recycle.converters.registry import ConvertRequest
    from recycle.converters.roles import gather
    from recycle.io.writer import MXFP4, Q8_0, nbytes
    from recycle.options import ConvertOptions

    weights = gather(Checkpoint(ckpt))
    out: dict[str, dict[str, int]] = {}
    for name in ("bf16", "q8_0", "fp32"):
        plan = convert(weights, ConvertRequest(ConvertOptions(source=str(ckpt), to="gguf", out="/x", dtype=name),
                                               "torch.bfloat16"))
        header, dt = plan.gguf["mtp.gguf"], DTYPES[name]
        groups: dict[str, int] = {}
        for gname, lazy in plan.tensors["mtp.gguf"].items():
            st = MXFP4 if lazy.dtype == MXFP4 else header.storage(gname, lazy.shape, dt)
            n = math.prod(lazy.shape)
            size = n // 32 * {MXFP4: 17, Q8_0: 34}[st] if st in (MXFP4, Q8_0) else nbytes(lazy.shape, st)
            group = ("routed experts (MXFP4)" if "_exps." in gname else "token_embd, output"
                     if gname in ("token_embd.weight", "output.weight") else "the rest of the module")
            groups[group] = groups.get(group, 0) + size
        out[name] = groups
    return out


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--gguf", action="store_true", help="also the GGUF side file's bytes (builds a sparse checkpoint)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/v4pro_sparse"), help="where the sparse checkpoint goes")
    ap.add_argument("--write", type=Path, default=None, help="with --gguf: write the bf16 side file here, timed")
    a = ap.parse_args()
    tensors, leaves, config = inspect_scale.v4_layout(61)
    every = tensors + leaves
    mtp = [t for t in every if t[0].startswith("mtp.")]
    stored = sum(math.prod(shape) * SIZE[dt] for _, dt, shape in mtp)
    params = sum(math.prod(shape) * (2 if dt == "I8" else 1) for _, dt, shape in mtp if dt != "F8_E8M0")
    io = sum(math.prod(shape) * 2 for name, _, shape in every if name in ("embed.weight", "head.weight"))
    print(f"DeepSeek-V4-Pro (hidden {config['hidden_size']}, vocabulary {config['vocab_size']}): one MTP module, "
          f"{len(mtp)} tensors, {params / GB:.2f} B parameters, stored {stored / GB:.2f} GB; "
          f"--to eagle drafter at bf16 {2 * params / GB:.2f} GB + embedding and head {io / GB:.2f} GB")
    if not a.gguf:
        return
    ckpt = a.dir / "ckpt"
    try:
        inspect_scale.build(ckpt, 61, "deepseek_v4_pro")
        (ckpt / "tokenizer.json").write_text(json.dumps({  # the side file's vocabulary: placeholders, the real size
            "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(config["vocab_size"])}, "merges": []},
            "added_tokens": [], "pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}))
        sizes = side_file_bytes(ckpt)
        print("\n| --dtype | routed experts (MXFP4) | the rest of the module | token_embd, output | side file |")
        print("|---|---:|---:|---:|---:|")
        for name, g in sizes.items():
            print(f"| {name} | {g['routed experts (MXFP4)'] / GB:.2f} GB | {g['the rest of the module'] / GB:.2f} GB "
                  f"| {g['token_embd, output'] / GB:.2f} GB | {sum(g.values()) / GB:.2f} GB |")
        if a.write:
            from convert_scale import dir_bytes

            cmd = [sys.executable, "-m", "recycle.cli", "convert", str(ckpt), "--to", "gguf", "--dtype", "bf16",
                   "-o", str(a.write), "--overwrite", "--json"]
            wall, peak = sampled(cmd)
            print(f"\nwrote {dir_bytes(a.write) / GB:.2f} GB in {wall:.1f} s; peak RSS {peak['VmRSS'] / GB:.2f} GB, "
                  f"of which anonymous {peak['RssAnon'] / GB:.2f} GB and file-backed (the source's mapped pages, "
                  f"reclaimable) {peak['RssFile'] / GB:.2f} GB ({' '.join(cmd[2:])})")
            shutil.rmtree(a.write, ignore_errors=True)
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
