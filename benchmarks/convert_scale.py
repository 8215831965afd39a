"""Scale benchmark for `recycle convert --to eagle`: a DeepSeek-V3-shaped checkpoint with real bytes.

Writes a checkpoint with DeepSeek-V3's full hidden size (7168) and vocabulary (129280), MLA
attention and FP8 (e4m3 + 128×128 `weight_scale_inv`) Linear weights, cut to 2 trunk layers and
16 routed experts, MTP module at layer 2 with its embed/head copies; values are random-ish (a
random block tiled; FP8 bytes with NaN codes removed) but every byte is on disk, since convert
reads them. Then each run below is a child process timed with os.wait4 (peak RSS of that child
alone), the output deleted and dirty pages synced before the next:
  warm (page cache holding the checkpoint, after one untimed read):
    1. safetensors alone reads every tensor convert reads (the MTP tensors and their scales) and
       copies their bytes out (get_tensor only maps the file: without the copy nothing is read);
    2. `recycle convert CKPT --to eagle -o OUT` (all three layouts);
    3. the same with `--layouts recycle` (recycle's own layout alone);
    4. I/O floors: the same tensors read with safetensors and their bytes written (cycled) until as
       many bytes as run 2 (and run 3) wrote are on disk, so the disk's write speed is visible;
  cold (the checkpoint's pages evicted before each run: os.sync, then POSIX_FADV_DONTNEED on
  every shard, which needs no root for clean pages): runs 1, 2 and 3 again.
Prints one table: wall time against the read in the same cache state and against the floor for
the same bytes written, peak RSS against the written directory's size. Deletes everything unless
--keep. `--hidden/--vocab/--experts` shrink the checkpoint for a smoke test (widths scale with
the hidden size).

Usage:  python benchmarks/convert_scale.py [--dir /tmp/dsv3_convert] [--experts 16] [--hidden 7168]
                                           [--vocab 129280] [--json] [--keep]
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from recycle.converters.roles import EXACT
from recycle.io.writer import Lazy, OutputDir

from _common import parser

H, V = 7168, 129280  # DeepSeek-V3's hidden size and vocabulary: the defaults
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


@dataclass(frozen=True)
class Dims:
    """DeepSeek-V3's widths; `scaled` shrinks them together so a smoke test keeps the same mix of tensors."""

    hidden: int = H
    vocab: int = V
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    vdim: int = 128
    heads: int = 128
    dense_i: int = 18432
    moe_i: int = 2048

    @classmethod
    def scaled(cls, hidden: int = H, vocab: int = V) -> Dims:
        """Every width × hidden/7168 (head dims kept), so bytes per layer scale as hidden²."""
        if (hidden, vocab) == (H, V):
            return cls()
        f = hidden / H

        def w(d: int) -> int:
            return max(16, round(d * f / 16) * 16)

        return cls(hidden, vocab, w(1536), w(512), heads=max(1, round(128 * f)), dense_i=w(18432), moe_i=w(2048))


def _norm(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bfloat16)


def tensors(d: Dims, experts: int) -> dict[str, dict[str, Lazy]]:
    """Shard file -> name -> Lazy, DeepSeek's names and dtypes; MTP layer in the last shard."""
    seed = iter(range(1, 1 << 30))
    h = d.hidden

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
        norm(out, p + "input_layernorm.weight", h)
        norm(out, p + "post_attention_layernorm.weight", h)
        a = p + "self_attn."
        fp8(out, a + "q_a_proj.weight", (d.q_lora, h))
        norm(out, a + "q_a_layernorm.weight", d.q_lora)
        fp8(out, a + "q_b_proj.weight", (d.heads * (d.nope + d.rope), d.q_lora))
        fp8(out, a + "kv_a_proj_with_mqa.weight", (d.kv_lora + d.rope, h))
        norm(out, a + "kv_a_layernorm.weight", d.kv_lora)
        fp8(out, a + "kv_b_proj.weight", (d.heads * (d.nope + d.vdim), d.kv_lora))
        fp8(out, a + "o_proj.weight", (h, d.heads * d.vdim))
        m = p + "mlp."
        if dense:
            for n, shape in (("gate_proj", (d.dense_i, h)), ("up_proj", (d.dense_i, h)), ("down_proj", (h, d.dense_i))):
                fp8(out, m + n + ".weight", shape)
            return
        out[m + "gate.weight"] = lazy((experts, h), torch.bfloat16)
        out[m + "gate.e_score_correction_bias"] = lazy((experts,), torch.float32)
        for e in [f"experts.{j}." for j in range(experts)] + ["shared_experts."]:
            for n, shape in (("gate_proj", (d.moe_i, h)), ("up_proj", (d.moe_i, h)), ("down_proj", (h, d.moe_i))):
                fp8(out, m + e + n + ".weight", shape)

    s1, s2, s3 = {}, {}, {}
    embed = lazy((d.vocab, h), torch.bfloat16)
    head = lazy((d.vocab, h), torch.bfloat16)
    s1["model.embed_tokens.weight"] = embed
    layer(s1, 0, dense=True)
    layer(s2, 1, dense=False)
    norm(s2, "model.norm.weight", h)
    s2["lm_head.weight"] = head
    p = "model.layers.2."
    s3[p + "embed_tokens.weight"] = embed  # the same bytes: DeepSeek stores physical copies
    s3[p + "shared_head.head.weight"] = head
    norm(s3, p + "enorm.weight", h)
    norm(s3, p + "hnorm.weight", h)
    norm(s3, p + "shared_head.norm.weight", h)
    s3[p + "eh_proj.weight"] = lazy((h, 2 * h), torch.bfloat16)
    layer(s3, 2, dense=False)
    return {"model-00001-of-000003.safetensors": s1, "model-00002-of-000003.safetensors": s2,
            "model-00003-of-000003.safetensors": s3}


def config(d: Dims, experts: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": d.hidden,
        "vocab_size": d.vocab, "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1,
        "intermediate_size": d.dense_i, "moe_intermediate_size": d.moe_i, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": min(8, experts), "n_group": 8, "topk_group": 4,
        "norm_topk_prob": True, "num_attention_heads": d.heads, "num_key_value_heads": d.heads,
        "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora, "qk_nope_head_dim": d.nope, "qk_rope_head_dim": d.rope,
        "v_head_dim": d.vdim, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [BLOCK, BLOCK]},
    }


def build(ckpt: Path, dims: Dims, experts: int) -> float:
    t0 = time.perf_counter()
    files = tensors(dims, experts)
    with OutputDir(ckpt, overwrite=True, records=("config.json",)) as d:  # an earlier run's synthetic checkpoint
        d.write_safetensors(files, torch.bfloat16)
        d.write_json("config.json", config(dims, experts))
        d.write_json("model.safetensors.index.json", {
            "metadata": {}, "weight_map": {n: f for f, ts in files.items() for n in sorted(ts)}})
    return time.perf_counter() - t0


READER = """
import sys, json, torch
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
            t = h.get_tensor(n).reshape(-1).view(torch.uint8).clone()  # get_tensor maps; the copy reads
            total += t.numel()
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


def evict(files: list[Path]) -> None:
    """Drop the files from the page cache: sync makes their pages clean, and clean pages go on
    POSIX_FADV_DONTNEED without root (pages some process has mapped stay, so no run is alive)."""
    os.sync()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mtp_names(ckpt: Path) -> tuple[list[str], int]:
    """The tensors convert reads (every MTP tensor and scale) and their bytes; no handle outlives the call."""
    from recycle.checkpoint import Checkpoint
    from recycle.converters.roles import gather

    w = gather(Checkpoint(ckpt))
    names = sorted(w.match.mtp_names)
    return names, sum(w.ckpt.tensors[n].nbytes for n in names)


@dataclass
class Run:
    """One timed child: what ran, in which page-cache state, its wall time, peak RSS, bytes written."""

    what: str
    cache: str
    wall: float
    rss: int = 0
    written: int = 0
    read: Run | None = None  # the read in the same cache state
    floor: Run | None = None  # the read-and-write floor for the same bytes


class Bench:
    """The timed children of one benchmark, over one checkpoint directory."""

    def __init__(self, root: Path, ckpt: Path, names_file: Path) -> None:
        self.root, self.ckpt, self.out, self.names = root, ckpt, root / "drafter", names_file
        self.shards = sorted(ckpt.glob("*.safetensors"))
        self.files: dict[str, dict] = {}  # layouts -> convert's files {path: bytes}

    def _settle(self, cache: str) -> None:
        shutil.rmtree(self.out, ignore_errors=True)
        if cache == "cold":
            evict(self.shards)
        else:
            os.sync()

    def read(self, cache: str, label: str) -> Run:
        self._settle(cache)
        wall, rss, _ = timed([sys.executable, "-c", READER, str(self.ckpt), str(self.names)])
        return Run(label, cache, wall, rss)

    def convert(self, cache: str, layouts: str | None, read: Run) -> Run:
        self._settle(cache)
        wall, rss, stdout = timed(self.command(layouts))
        written = dir_bytes(self.out)
        self.files[layouts or "all"] = json.loads(stdout)["files"]
        shutil.rmtree(self.out, ignore_errors=True)
        what = "`recycle convert --to eagle`" + (f" `--layouts {layouts}`" if layouts else " (3 layouts)")
        return Run(what, cache, wall, rss, written, read=read)

    def floor(self, written: int) -> Run:
        self._settle("warm")
        wall, rss, _ = timed([sys.executable, "-c", WRITER, str(self.ckpt), str(self.names),
                              str(self.root / "floor.bin"), str(written)])
        return Run(f"floor: read + write {gb(written)}", "warm", wall, rss, written)

    def command(self, layouts: str | None) -> list[str]:
        cmd = [sys.executable, "-m", "recycle.cli", "convert", str(self.ckpt), "--to", "eagle", "-o", str(self.out),
               "--json"]
        return cmd + (["--layouts", layouts] if layouts else [])


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def table(runs: list[Run]) -> str:
    rows = ["| run | page cache | wall | × read (same cache) | × floor (same bytes) | peak RSS | written "
            "| RSS / written |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        vs_read = f"{r.wall / r.read.wall:.2f}×" if r.read else ""
        vs_floor = f"{r.wall / r.floor.wall:.2f}×" if r.floor else ""
        per = f"{r.rss / r.written:.2f}×" if r.written and r.read else ""
        rows.append(f"| {r.what} | {r.cache} | {r.wall:.2f} s | {vs_read} | {vs_floor} | {gb(r.rss)} "
                    f"| {gb(r.written) if r.written else ''} | {per} |")
    return "\n".join(rows)


def measure(bench: Bench, read_label: str) -> list[Run]:
    """Warm runs, floors, then cold runs (see the module docstring)."""
    bench.read("warm", read_label)  # untimed: brings the checkpoint into the page cache
    warm_read = bench.read("warm", read_label)
    warm = [bench.convert("warm", layouts, warm_read) for layouts in (None, "recycle")]
    floors = {}
    for run in warm:
        run.floor = floors.get(run.written) or floors.setdefault(run.written, bench.floor(run.written))
    cold_read = bench.read("cold", read_label)
    cold = [bench.convert("cold", layouts, cold_read) for layouts in (None, "recycle")]
    return [warm_read, *warm, *floors.values(), cold_read, *cold]


def main() -> int:
    ap = parser(__doc__, first_line=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv3_convert"))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=H, help="hidden size; other widths scale with it (smoke tests)")
    ap.add_argument("--vocab", type=int, default=V)
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ckpt = args.dir / "ckpt"
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        built = build(ckpt, Dims.scaled(args.hidden, args.vocab), args.experts)
        names, read_bytes = mtp_names(ckpt)
        names_file = args.dir / "names.json"
        names_file.write_text(json.dumps(names))
        bench = Bench(args.dir, ckpt, names_file)
        runs = measure(bench, f"safetensors read, {len(names)} tensors ({gb(read_bytes)})")
        print(f"checkpoint {gb(dir_bytes(ckpt))} (built in {built:.1f} s); convert reads {len(names)} tensors, "
              f"{gb(read_bytes)}; command: python {' '.join(bench.command(None)[1:])}\n")
        print(table(runs))
        if args.json:
            print(json.dumps({"checkpoint_bytes": dir_bytes(ckpt), "tensors_read": len(names),
                              "bytes_read": read_bytes, "files": bench.files,
                              "runs": [{"what": r.what, "cache": r.cache, "wall_s": round(r.wall, 3), "peak_rss": r.rss,
                                        "written": r.written} for r in runs]}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
