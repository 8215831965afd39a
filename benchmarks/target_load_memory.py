"""Loading a quantized DeepSeek-V4 target: the host memory of the layer-at-a-time loader against the whole-state loader
it replaced.

Builds V4-Flash-width slices of the release layout (`inspect_scale.py --layout deepseek_v4_flash`: FP8 attention and
shared experts with e8m0 block scales, FP4 routed experts, BF16 compressors, float32 hyper-connections; every tensor
a hole), with fewer decoder layers and routed experts so that a slice loads on this machine, and loads each in a child
process at bf16, the dtype a GPU teacher runs in:

- `streamed`: `recycle.decoding.target.load_target` (its `recycle.decoding.placed.load_streamed`: a decoder layer at
  a time, each tensor cast as it is read, the MTP module never read);
- `to_gpus`: the same loader with every tensor sent to the meta device as it is placed: the host memory a load onto
  GPUs needs (there each tensor leaves the host once placed), without a GPU;
- `whole`: the loader it replaced (recycle at 843dbef, `_load_dequantized`: transformers' model built in float32,
  every stored tensor dequantized into one float32 state dict, loaded, then the model cast to bf16), written out
  here as it was.

Peak anonymous RSS of the child, sampled from /proc every 0.2 s, and the model's parameter bytes at bf16. What the
reader maps of the files is file-backed and counted apart: a BF16 tensor stored as the model holds it becomes its
parameter without a copy (safetensors' private mapping: written pages are copied, the file never changes), so on a
CPU the streamed model's BF16 parts count as file pages, and only once touched.

    python benchmarks/target_load_memory.py --layers 2 --experts 8 16 32
"""

from __future__ import annotations

import sys
from pathlib import Path

import inspect_scale

from _common import parser, sampled, stamp, write_json

GB = 1e9


def slice_of(layers: int, experts: int, root: Path) -> Path:
    """The V4-Flash-width release layout, `layers` decoder layers of `experts` routed experts (built once)."""
    out = root / f"l{layers}e{experts}"
    if not (out / "config.json").is_file():
        inspect_scale.V4_FLASH["E"] = experts
        inspect_scale.build(out, layers, "deepseek_v4_flash")
    return out


def whole(path: Path, dtype):
    """recycle 843dbef's `_load_dequantized`, as it was."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from recycle.checkpoint import Checkpoint
    from recycle.mtp import to_runtime_layout

    ckpt = Checkpoint(path)
    scales = {s.name for n, i in ckpt.tensors.items() if i.is_fp8 and (s := ckpt.scale_for(n)) is not None}
    config = AutoConfig.for_model(**{k: v for k, v in ckpt.config.items() if k != "quantization_config"})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    want = set(model.state_dict())
    state = to_runtime_layout({n: ckpt.raw(n) if i.dtype == "I64" else ckpt.get(n, torch.float32)
                               for n, i in ckpt.tensors.items() if not i.is_scale and n not in scales}, config)
    prefix = f"{model.base_model_prefix}."
    state = {k if k in want or prefix + k not in want else prefix + k: v for k, v in state.items()}
    model.load_state_dict({k: v for k, v in state.items() if k in want}, strict=False)
    return model.to(dtype)


def to_gpus(path: Path, dtype):
    """`load_streamed` with the meta device in the GPUs' place."""
    from recycle.checkpoint import Checkpoint
    from recycle.decoding.placed import load_streamed, skeleton_of

    ckpt = Checkpoint(path)
    model = skeleton_of(ckpt, dtype, "eager")
    load_streamed(ckpt, model, {"": "meta"}, dtype)
    return model


def child(path: Path, loader: str) -> None:
    import torch

    from recycle.decoding.target import load_target

    load = {"whole": whole, "to_gpus": to_gpus}.get(loader, lambda p, d: load_target(p, dtype=d))
    model = load(path, torch.bfloat16)
    print(sum(p.numel() * p.element_size() for p in model.parameters()))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(Path(sys.argv[2]), sys.argv[3])
    ap = parser(__doc__.splitlines()[0], json=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--loaders", nargs="+", default=["to_gpus", "streamed", "whole"],
                    choices=("to_gpus", "streamed", "whole"))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/recycle_v4flash_slices"))
    a = ap.parse_args()
    rows = []
    for experts in a.experts:
        path = slice_of(a.layers, experts, a.dir)
        for loader in a.loaders:
            try:
                wall, peak, out = sampled([sys.executable, __file__, "--child", str(path), loader], capture=True)
            except SystemExit as err:  # the whole-state loader past this machine's memory: killed (-9)
                rows.append({"layers": a.layers, "experts": experts, "loader": loader, "failed": str(err)})
                print(rows[-1], flush=True)
                continue
            model = int(out.strip().splitlines()[-1])
            rows.append({"layers": a.layers, "experts": experts, "loader": loader, "model_bf16_gb": round(model / GB, 2),
                         "peak_anon_gb": round(peak["RssAnon"] / GB, 2), "peak_file_gb": round(peak["RssFile"] / GB, 2),
                         "anon_over_model": round(peak["RssAnon"] / model, 2), "wall_s": round(wall, 1)})
            print(rows[-1], flush=True)
    if a.json:
        write_json(a.json, {**stamp(), "command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
