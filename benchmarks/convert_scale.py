"""Scale benchmark for `recycle convert --to eagle`: a DeepSeek-V3-shaped checkpoint with real bytes.

Writes a checkpoint with DeepSeek-V3's full hidden size (7168) and vocabulary (129280), MLA
attention and FP8 (e4m3 + 128×128 `weight_scale_inv`) Linear weights, cut to 2 trunk layers and
16 routed experts, MTP module at layer 2 with its embed/head copies; values are random-ish (a
random block tiled; FP8 bytes with NaN codes removed) but every byte is on disk, since convert
reads them. Then, each in a child process timed with os.wait4 (peak RSS of that child alone):
  1. safetensors alone reads every tensor convert reads (the MTP tensors and their scales), once;
  2. `recycle convert CKPT --to eagle -o OUT`;
  3. the safetensors read again (page cache now equally warm for both);
  4. an I/O floor: the same tensors read with safetensors and their bytes written (cycled) until
     as many bytes as convert wrote are on disk, so the disk's write speed is visible.
Reports wall time (convert vs the warm read), peak RSS vs the written drafter directory's size,
and deletes everything unless --keep.

Usage:  python benchmarks/convert_scale.py [--dir /tmp/dsv3_convert] [--experts 16] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from converters.roles import EXACT, Lazy  # noqa: E402
from converters.writer import OutputDir  # noqa: E402

H, V = 7168, 129280
Q_LORA, KV_LORA, ROPE, NOPE, VDIM, HEADS = 1536, 512, 64, 128, 128, 128
DENSE_I, MOE_I = 18432, 2048
BLOCK = 128
TILE = 1 << 24  # elements in the random block that is tiled


def _tile(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.float8_e4m3fn:
        base = torch.randint(0, 256, (min(n, TILE),), dtype=torch.uint8, generator=g)
        base[(base & 0x7F) == 0x7F] = 0x3F  # 0x7F/0xFF are e4m3fn NaN
    else:
        base = (torch.randn(min(n, TILE), generator=g) * 0.02).to(dtype)
        if dtype == torch.float32:
            base = base.abs() + 1e-3  # scales: positive
    reps = -(-n // base.numel())
    flat = base.repeat(reps)[:n]
    return flat.view(torch.float8_e4m3fn).view(shape) if dtype == torch.float8_e4m3fn else flat.view(shape)


def _norm(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bfloat16)


def tensors(experts: int) -> dict[str, dict[str, Lazy]]:
    """Shard file -> name -> Lazy, DeepSeek's names and dtypes; MTP layer in the last shard."""
    seed = iter(range(1, 1 << 30))

    def lazy(shape, dtype, maker=None):
        s = next(seed)
        return Lazy(tuple(shape), maker or (lambda: _tile(shape, dtype, s)), (), EXACT, dtype=dtype)

    def fp8(out: dict, name: str, shape: tuple[int, int]) -> None:
        out[name] = lazy(shape, torch.float8_e4m3fn)
        out[name + "_scale_inv"] = lazy((math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)), torch.float32)

    def norm(out: dict, name: str, size: int) -> None:
        out[name] = Lazy((size,), lambda: _norm((size,)), (), EXACT, dtype=torch.bfloat16)

    def layer(out: dict, i: int, dense: bool) -> None:
        p = f"model.layers.{i}."
        norm(out, p + "input_layernorm.weight", H)
        norm(out, p + "post_attention_layernorm.weight", H)
        a = p + "self_attn."
        fp8(out, a + "q_a_proj.weight", (Q_LORA, H))
        norm(out, a + "q_a_layernorm.weight", Q_LORA)
        fp8(out, a + "q_b_proj.weight", (HEADS * (NOPE + ROPE), Q_LORA))
        fp8(out, a + "kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, H))
        norm(out, a + "kv_a_layernorm.weight", KV_LORA)
        fp8(out, a + "kv_b_proj.weight", (HEADS * (NOPE + VDIM), KV_LORA))
        fp8(out, a + "o_proj.weight", (H, HEADS * VDIM))
        m = p + "mlp."
        if dense:
            for n, shape in (("gate_proj", (DENSE_I, H)), ("up_proj", (DENSE_I, H)), ("down_proj", (H, DENSE_I))):
                fp8(out, m + n + ".weight", shape)
            return
        out[m + "gate.weight"] = lazy((experts, H), torch.bfloat16)
        out[m + "gate.e_score_correction_bias"] = lazy((experts,), torch.float32)
        for e in [f"experts.{j}." for j in range(experts)] + ["shared_experts."]:
            for n, shape in (("gate_proj", (MOE_I, H)), ("up_proj", (MOE_I, H)), ("down_proj", (H, MOE_I))):
                fp8(out, m + e + n + ".weight", shape)

    s1, s2, s3 = {}, {}, {}
    embed = lazy((V, H), torch.bfloat16)
    head = lazy((V, H), torch.bfloat16)
    s1["model.embed_tokens.weight"] = embed
    layer(s1, 0, dense=True)
    layer(s2, 1, dense=False)
    norm(s2, "model.norm.weight", H)
    s2["lm_head.weight"] = head
    p = "model.layers.2."
    s3[p + "embed_tokens.weight"] = embed  # the same bytes: DeepSeek stores physical copies
    s3[p + "shared_head.head.weight"] = head
    norm(s3, p + "enorm.weight", H)
    norm(s3, p + "hnorm.weight", H)
    norm(s3, p + "shared_head.norm.weight", H)
    s3[p + "eh_proj.weight"] = lazy((H, 2 * H), torch.bfloat16)
    layer(s3, 2, dense=False)
    return {"model-00001-of-000003.safetensors": s1, "model-00002-of-000003.safetensors": s2,
            "model-00003-of-000003.safetensors": s3}


def config(experts: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
        "vocab_size": V, "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1,
        "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": VDIM, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [BLOCK, BLOCK]},
    }


def build(ckpt: Path, experts: int) -> float:
    t0 = time.perf_counter()
    files = tensors(experts)
    with OutputDir(ckpt, overwrite=True) as d:
        d.write_safetensors(files, torch.bfloat16)
        d.write_json("config.json", config(experts))
        d.write_json("model.safetensors.index.json", {
            "metadata": {}, "weight_map": {n: f for f, ts in files.items() for n in sorted(ts)}})
    return time.perf_counter() - t0


READER = """
import sys, json
from safetensors import safe_open
ckpt, names = sys.argv[1], json.loads(open(sys.argv[2]).read())
index = json.load(open(ckpt + "/model.safetensors.index.json"))["weight_map"]
by_file = {}
for n in names:
    by_file.setdefault(index[n], []).append(n)
total = 0
for f, ns in by_file.items():
    with safe_open(ckpt + "/" + f, "pt") as h:
        for n in ns:
            t = h.get_tensor(n)
            total += t.numel() * t.element_size()
            del t
print(total)
"""


WRITER = """
import sys, json, os
from safetensors import safe_open
ckpt, names, out, want = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3], int(sys.argv[4])
index = json.load(open(ckpt + "/model.safetensors.index.json"))["weight_map"]
written = 0
with open(out, "wb") as f:
    while written < want:
        for n in names:
            with safe_open(ckpt + "/" + index[n], "pt") as h:
                t = h.get_tensor(n)
            data = t.reshape(-1).view(__import__("torch").uint8).numpy()[: want - written]
            f.write(data)
            written += len(data)
            if written >= want:
                break
os.remove(out)
print(written)
"""


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of this child alone, stdout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    stdout = proc.stdout.read()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr[-2000:]}")
    return wall, usage.ru_maxrss * 1024, stdout


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv3_convert"))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ckpt, out = args.dir / "ckpt", args.dir / "drafter"
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        built = build(ckpt, args.experts)
        from converters.roles import gather
        from recycle.checkpoint import Checkpoint

        w = gather(Checkpoint(ckpt))
        read = sorted({n for n in w.match.mtp_names})
        names_file = args.dir / "names.json"
        names_file.write_text(json.dumps(read))
        read_bytes = sum(w.ckpt.tensors[n].nbytes for n in read)
        reader = [sys.executable, "-c", READER, str(ckpt), str(names_file)]
        cold_wall, _, _ = timed(reader)
        cmd = [sys.executable, "-m", "recycle.cli", "convert", str(ckpt), "--to", "eagle", "-o", str(out), "--json"]
        conv_wall, conv_rss, conv_out = timed(cmd)
        warm_wall, read_rss, _ = timed(reader)
        written = dir_bytes(out)
        floor_wall, _, _ = timed([sys.executable, "-c", WRITER, str(ckpt), str(names_file),
                                  str(args.dir / "floor.bin"), str(written)])
        summary = json.loads(conv_out)
        result = {
            "checkpoint_bytes": dir_bytes(ckpt), "build_s": round(built, 1),
            "tensors_read": len(read), "bytes_read": read_bytes,
            "read_cold_s": round(cold_wall, 2), "read_warm_s": round(warm_wall, 2), "read_peak_rss": read_rss,
            "convert_s": round(conv_wall, 2), "convert_peak_rss": conv_rss,
            "written_bytes": written, "files": summary["files"],
            "read_and_write_floor_s": round(floor_wall, 2),
            "rss_over_written": round(conv_rss / written, 3), "wall_over_read": round(conv_wall / warm_wall, 2),
            "wall_over_read_and_write": round(conv_wall / floor_wall, 2),
            "command": " ".join(cmd[1:]).replace(sys.executable, "python"),
        }
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
