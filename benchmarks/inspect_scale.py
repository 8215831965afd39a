"""Scale benchmark for `recycle inspect`: DeepSeek-V3's full tensor layout as sparse files.

Lays out every tensor name, shape and dtype of DeepSeek-V3 (61 layers + the MTP layer 61, 256 routed
experts, FP8 block-scaled weights with their `weight_scale_inv`) in 163 shards named as DeepSeek names
them, with an index. Tensor data is left as holes (the files are truncated to size, never written),
so the ~690 GB checkpoint costs a few MB of disk. Then runs `recycle inspect --json` in a subprocess
and records wall time and peak RSS, for the full layout and for a 4-layer cut of it, to show that
memory does not grow with checkpoint size.

`--extra-rows N` runs the same inspect with N synthetic rows added to the family table (copies of real rows
under names no checkpoint uses), to show the matcher's cost does not grow with the table.

`--layout deepseek_v4_pro` lays out DeepSeek-V4-Pro instead, in DeepSeek's own names as released (`embed`,
`layers.{i}.attn|ffn.*`, `hc_*`, `head`; the MTP module at `mtp.0.`): 61 layers, 384 routed experts, FP8 attention
and shared experts with e8m0 `.scale` per 128x128 block, FP4 (e2m1, two per byte) routed experts with an e8m0
`.scale` per 32, BF16 compressors, float32 hyper-connections, one MTP module (sliding-window attention).
`--layout deepseek_v4_flash`: the same at V4-Flash's widths (43 layers, h4096, 256 routed experts).

`--phases` adds where one inspect's time goes (a separate run in a child, after the timed ones): the import, each step
of reading the checkpoint (shard list, headers, index check, the fold of packed weights), the family match, the report's
counts and each check, the JSON; each step's own CPU seconds (what the steps it calls took is theirs; CPU, not wall,
so that a busy machine's waits are left out), summing to the total.

Usage:  python benchmarks/inspect_scale.py [--dir /tmp/dsv3_sparse] [--layers 61] [--extra-rows 0 10] [--keep]
        python benchmarks/inspect_scale.py --layout deepseek_v4_pro --layers 61 --repeats 5 [--phases]
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

from _common import parser

H, V, E = 7168, 129280, 256
Q_LORA, KV_LORA, ROPE, NOPE, VDIM, HEADS = 1536, 512, 64, 128, 128, 128
DENSE_I, MOE_I, FIRST_DENSE = 18432, 2048, 3
SHARDS = 163
BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}


def fp8(name: str, shape: tuple[int, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    scale = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    return [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", scale)]


def layer(i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    t = [(p + "input_layernorm.weight", "BF16", (H,)), (p + "post_attention_layernorm.weight", "BF16", (H,))]
    a = p + "self_attn."
    t += fp8(a + "q_a_proj.weight", (Q_LORA, H)) + [(a + "q_a_layernorm.weight", "BF16", (Q_LORA,))]
    t += fp8(a + "q_b_proj.weight", (HEADS * (NOPE + ROPE), Q_LORA))
    t += fp8(a + "kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, H)) + [(a + "kv_a_layernorm.weight", "BF16", (KV_LORA,))]
    t += fp8(a + "kv_b_proj.weight", (HEADS * (NOPE + VDIM), KV_LORA))
    t += fp8(a + "o_proj.weight", (H, HEADS * VDIM))
    m = p + "mlp."
    if i < FIRST_DENSE:
        t += fp8(m + "gate_proj.weight", (DENSE_I, H)) + fp8(m + "up_proj.weight", (DENSE_I, H))
        t += fp8(m + "down_proj.weight", (H, DENSE_I))
        return t
    t += [(m + "gate.weight", "BF16", (E, H)), (m + "gate.e_score_correction_bias", "F32", (E,))]
    for e in [f"experts.{j}." for j in range(E)] + ["shared_experts."]:
        t += fp8(m + e + "gate_proj.weight", (MOE_I, H)) + fp8(m + e + "up_proj.weight", (MOE_I, H))
        t += fp8(m + e + "down_proj.weight", (H, MOE_I))
    return t


def mtp_extras(L: int) -> list[tuple[str, str, tuple[int, ...]]]:
    p = f"model.layers.{L}."
    return [(p + "embed_tokens.weight", "BF16", (V, H)), (p + "enorm.weight", "BF16", (H,)),
            (p + "hnorm.weight", "BF16", (H,)), (p + "eh_proj.weight", "BF16", (H, 2 * H)),
            (p + "shared_head.norm.weight", "BF16", (H,)), (p + "shared_head.head.weight", "BF16", (V, H))]


# DeepSeek-V4-Pro (config.json of deepseek-ai/DeepSeek-V4-Pro; attention widths as transformers' DeepseekV4 docs
# give them for Pro: 128 heads of 512, 16 output groups of rank 1024).
V4_PRO = {"H": 7168, "V": 129280, "E": 384, "MOE_I": 3072, "HEADS": 128, "HEAD_DIM": 512, "Q_LORA": 1536,
          "O_GROUPS": 16, "O_LORA": 1024, "INDEX_HEADS": 64, "INDEX_DIM": 128, "HC": 4, "HASH_LAYERS": 3, "TOPK": 6,
          "FP4_BLOCK": 32, "INDEX_TOPK": 1024}
# V4-Flash: transformers 5.23's DeepseekV4Config defaults (h4096, 43 layers, 256 routed experts; its layer_types give
# the compress ratios)
V4_FLASH = {**V4_PRO, "H": 4096, "E": 256, "MOE_I": 2048, "HEADS": 64, "Q_LORA": 1024, "O_GROUPS": 8, "INDEX_TOPK": 512}
V4 = dict(V4_PRO)  # the widths the v4_* builders read (build() sets them per layout)


def v4_ratios(layers: int, mtp: int = 1) -> list[int]:
    """Per-layer compress ratios (transformers' V4-Pro default: two heavily compressed layers, then compressed
    sparse (4) and heavily compressed (128) interleaved; V4-Flash: its DeepseekV4Config's layer_types), then the MTP
    layers' 0 (sliding window only)."""
    if V4["H"] == V4_FLASH["H"]:
        from transformers import DeepseekV4Config

        c = DeepseekV4Config()
        return [c.compress_rates[t] for t in c.layer_types][:layers] + [0] * mtp
    return ([128] * min(layers, 2) + [4 if i % 2 else 128 for i in range(max(layers - 2, 0))])[:layers] + [0] * mtp


def v4_fp8(name: str, shape: tuple[int, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    """An FP8 matrix as DeepSeek stores it: e4m3 `P.weight` and its e8m0 `P.scale` per 128x128 block."""
    base = name.removesuffix(".weight")
    return [(name, "F8_E4M3", shape), (base + ".scale", "F8_E8M0", (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)))]


def v4_fp4(name: str, shape: tuple[int, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    """A routed expert matrix: e2m1 pairs packed in bytes, an e8m0 `P.scale` per 32 inputs."""
    base = name.removesuffix(".weight")
    return [(name, "I8", (shape[0], shape[1] // 2)), (base + ".scale", "F8_E8M0", (shape[0], shape[1] // V4["FP4_BLOCK"]))]


def v4_compressor(p: str, ratio: int, dim: int) -> list[tuple[str, str, tuple[int, ...]]]:
    wide = (2 if ratio == 4 else 1) * dim
    return [(p + "ape", "F32", (ratio, wide)), (p + "wkv.weight", "BF16", (wide, V4["H"])),
            (p + "wgate.weight", "BF16", (wide, V4["H"])), (p + "norm.weight", "BF16", (dim,))]


def v4_hc(p: str, rows: int, scales: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(p + "fn", "F32", (rows, V4["HC"] * V4["H"])), (p + "base", "F32", (rows,)), (p + "scale", "F32", (scales,))]


def v4_layer(p: str, i: int, ratio: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """One V4 block under DeepSeek's names (as `layers.{i}.` or `mtp.{k}.`)."""
    h, heads, hd, ql, og, ol, hc = (V4[k] for k in ("H", "HEADS", "HEAD_DIM", "Q_LORA", "O_GROUPS", "O_LORA", "HC"))
    t = [(p + "attn_norm.weight", "BF16", (h,)), (p + "ffn_norm.weight", "BF16", (h,))]
    t += v4_hc(p + "hc_attn_", (2 + hc) * hc, 3) + v4_hc(p + "hc_ffn_", (2 + hc) * hc, 3)
    a = p + "attn."
    t += [(a + "q_norm.weight", "BF16", (ql,)), (a + "kv_norm.weight", "BF16", (hd,)), (a + "attn_sink", "F32", (heads,))]
    t += v4_fp8(a + "wq_a.weight", (ql, h)) + v4_fp8(a + "wq_b.weight", (heads * hd, ql))
    t += v4_fp8(a + "wkv.weight", (hd, h)) + v4_fp8(a + "wo_a.weight", (og * ol, heads * hd // og))
    t += v4_fp8(a + "wo_b.weight", (h, og * ol))
    if ratio:
        t += v4_compressor(a + "compressor.", ratio, hd)
    if ratio == 4:
        t += v4_fp8(a + "indexer.wq_b.weight", (V4["INDEX_HEADS"] * V4["INDEX_DIM"], ql))
        t += [(a + "indexer.weights_proj.weight", "BF16", (V4["INDEX_HEADS"], h))]
        t += v4_compressor(a + "indexer.compressor.", ratio, V4["INDEX_DIM"])
    f = p + "ffn."
    t += [(f + "gate.weight", "BF16", (V4["E"], h))]
    t += [(f + "gate.tid2eid", "I64", (V4["V"], V4["TOPK"]))] if i < V4["HASH_LAYERS"] else [(f + "gate.bias", "F32", (V4["E"],))]
    for e in range(V4["E"]):
        ep = f"{f}experts.{e}."
        t += v4_fp4(ep + "w1.weight", (V4["MOE_I"], h)) + v4_fp4(ep + "w2.weight", (h, V4["MOE_I"]))
        t += v4_fp4(ep + "w3.weight", (V4["MOE_I"], h))
    sp = f + "shared_experts."
    t += v4_fp8(sp + "w1.weight", (V4["MOE_I"], h)) + v4_fp8(sp + "w2.weight", (h, V4["MOE_I"]))
    t += v4_fp8(sp + "w3.weight", (V4["MOE_I"], h))
    return t


def v4_layout(layers: int) -> tuple[list, list, dict]:
    """(trunk and MTP block tensors, the MTP module's own leaves for the last shard, config.json) of V4-Pro."""
    h, hc = V4["H"], V4["HC"]
    ratios = v4_ratios(layers)
    body = [("embed.weight", "BF16", (V4["V"], h))]
    for i in range(layers):
        body += v4_layer(f"layers.{i}.", i, ratios[i])
    body += [("norm.weight", "BF16", (h,)), ("head.weight", "BF16", (V4["V"], h))] + v4_hc("hc_head_", hc, 1)
    body += v4_layer("mtp.0.", layers, ratios[layers])
    p = "mtp.0."
    last = [(p + "enorm.weight", "BF16", (h,)), (p + "hnorm.weight", "BF16", (h,)), (p + "norm.weight", "BF16", (h,))]
    last += v4_fp8(p + "e_proj.weight", (h, h)) + v4_fp8(p + "h_proj.weight", (h, h)) + v4_hc(p + "hc_head_", hc, 1)
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": h, "vocab_size": V4["V"],
        "num_hidden_layers": layers, "num_nextn_predict_layers": 1, "n_routed_experts": V4["E"], "n_shared_experts": 1,
        "num_experts_per_tok": V4["TOPK"], "moe_intermediate_size": V4["MOE_I"], "num_attention_heads": V4["HEADS"],
        "num_key_value_heads": 1, "head_dim": V4["HEAD_DIM"], "qk_rope_head_dim": 64, "q_lora_rank": V4["Q_LORA"],
        "o_groups": V4["O_GROUPS"], "o_lora_rank": V4["O_LORA"], "index_n_heads": V4["INDEX_HEADS"],
        "index_head_dim": V4["INDEX_DIM"], "index_topk": V4["INDEX_TOPK"], "compress_ratios": ratios, "compress_rope_theta": 160000,
        "num_hash_layers": V4["HASH_LAYERS"], "hc_mult": hc, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "sliding_window": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "swiglu_limit": 10.0,
        "tie_word_embeddings": False, "max_position_embeddings": 1048576, "expert_dtype": "fp4",
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    }
    return body, last, config


def write_sparse_shard(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]]) -> int:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)  # a hole: no data blocks are allocated
    return off


def build(out: Path, layers: int, layout: str = "deepseek_v3") -> dict:
    """Write the sparse checkpoint; MTP non-expert tensors go in the last shard, as DeepSeek ships them."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if layout.startswith("deepseek_v4"):
        V4.clear()
        V4.update(V4_FLASH if layout == "deepseek_v4_flash" else V4_PRO)
        body, last, config = v4_layout(layers)
    else:
        body = [("model.embed_tokens.weight", "BF16", (V, H))]
        for i in range(layers):
            body += layer(i)
        mtp_block = layer(layers)
        body += [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (V, H))] + mtp_block
        last = mtp_extras(layers)
        config = v3_config(layers)
    total = sum(math.prod(s) * BYTES[d] for _, d, s in body + last)
    shards = SHARDS if layers == 61 and layout == "deepseek_v3" else max(2, math.ceil(total / 4.3e9))
    per = total / (shards - 1)
    groups: list[list] = [[]]
    acc = 0
    for t in body:
        if acc >= per * len(groups) and len(groups) < shards - 1:
            groups.append([])
        groups[-1].append(t)
        acc += math.prod(t[2]) * BYTES[t[1]]
    groups += [[] for _ in range(shards - 1 - len(groups))]
    groups.append(last)
    weight_map = {}
    for k, g in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:06d}.safetensors"
        write_sparse_shard(out / fname, g)
        weight_map.update({name: fname for name, _, _ in g})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"layout": layout, "tensors": len(weight_map), "shards": shards, "apparent_bytes": total}


def v3_config(layers: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
        "vocab_size": V, "num_hidden_layers": layers, "num_nextn_predict_layers": 1, "n_routed_experts": E,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": MOE_I, "intermediate_size": DENSE_I,
        "first_k_dense_replace": FIRST_DENSE, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
        "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE, "v_head_dim": VDIM, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }


# The child that inspects with N synthetic rows in the table: each a real row under a model type, name and tensor
# prefix no checkpoint holds, placed before the real rows (every row is tried on every checkpoint).
EXTRA_ROWS = """
import sys
import recycle.families as fam
n = int(sys.argv[2])
base = fam.FAMILIES
extra = tuple(fam.derive(base[i % len(base)], name=f"synthetic_{i}", model_types=(f"synthetic_{i}",),
                          architectures=(), layout=dict(prefixes=(f"synthetic_{i}.",))) for i in range(n))
fam.FAMILIES = extra + base
fam.BY_NAME.update({f.name: f for f in extra})
from recycle.cli import app
app(["inspect", sys.argv[1], "--json"])
"""


# The child that times one inspect step by step: each step a function of the reader or the audit, wrapped so that its
# own time (less the wrapped steps it calls) is summed under its name.
PHASES = """
import json, sys, time
t0, w0 = time.process_time(), time.perf_counter()
import recycle.cli
import recycle.audit as audit
import recycle.checkpoint as ck
import recycle.families as fam
spent, stack = {"import": time.process_time() - t0}, []
def timed(label, fn):
    def run(*a, **k):
        start = time.process_time()
        stack.append(0.0)
        try:
            return fn(*a, **k)
        finally:
            took = time.process_time() - start
            inner = stack.pop()
            spent[label] = spent.get(label, 0.0) + took - inner
            if stack:
                stack[-1] += took
    return run
for label in sys.argv[2].split(","):
    where, name = label.split(".")
    owner = {"Checkpoint": ck.Checkpoint, "audit": audit, "families": fam, "Report": audit.Report}[where]
    if hasattr(owner, name):
        setattr(owner, name, timed(label, getattr(owner, name)))
t1 = time.process_time()
data = audit.inspect_checkpoint(sys.argv[1]).to_json()
t2 = time.process_time()
json.dumps(data, indent=2)
spent["json.dumps"] = time.process_time() - t2
spent["inspect_checkpoint (rest)"] = t2 - t1 - sum(v for k, v in spent.items() if k not in ("import", "json.dumps"))
spent["total"] = time.process_time() - t0
spent["total_wall"] = time.perf_counter() - w0
print(json.dumps({k: round(v, 3) for k, v in spent.items()}))
"""
STEPS = ("Checkpoint._shard_files", "Checkpoint._read_header", "Checkpoint._check_index", "Checkpoint._fold",
         "audit.match", "audit._module_summary", "Checkpoint.params", "Checkpoint.nbytes", "audit._check_modules",
         "audit._check_copies", "audit._check_quantization", "audit._check_parts", "audit._check_block_fp8",
         "audit._check_scheme", "audit._check_quant_stats", "Report.to_json")


def phases(ckpt: Path) -> dict:
    """One inspect in a child process, step by step (`PHASES`): seconds per step."""
    proc = subprocess.run([sys.executable, "-c", PHASES, str(ckpt), ",".join(STEPS)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"inspect failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def measure(ckpt: Path, extra_rows: int = 0) -> dict:
    """Run `recycle inspect --json` in a child process; wall time and the child's peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    cmd = ([sys.executable, "-m", "recycle.cli", "inspect", str(ckpt), "--json"] if not extra_rows else
           [sys.executable, "-c", EXTRA_ROWS, str(ckpt), str(extra_rows)])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"inspect failed: {proc.stderr.strip()}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    report = json.loads(proc.stdout)
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(max(peak, before) / 1024, 1),
            "family": report["family"], "mtp_found": report["mtp"]["found"],
            "params_total": report["params"]["total"], "params_mtp": report["params"]["mtp"],
            "findings": [f["code"] for f in report["findings"]]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dir", type=Path, default=None,
                    help="default: /tmp/recycle_dsv3_sparse, or /tmp/recycle_dsv4pro_sparse for --layout deepseek_v4_pro")
    ap.add_argument("--layout", choices=("deepseek_v3", "deepseek_v4_pro", "deepseek_v4_flash"), default="deepseek_v3",
                    help="whose full header layout to build (default: deepseek_v3)")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 61])
    ap.add_argument("--extra-rows", type=int, nargs="+", default=[0],
                    help="synthetic family rows added to the table, one inspect per count (default: 0)")
    ap.add_argument("--repeats", type=int, default=1, help="inspect runs per count; the median is reported")
    ap.add_argument("--keep", action="store_true", help="keep the sparse checkpoints")
    ap.add_argument("--phases", action="store_true", help="also time one inspect step by step (CPU seconds per step)")
    args = ap.parse_args()
    root = args.dir or Path({"deepseek_v4_pro": "/tmp/recycle_dsv4pro_sparse",
                             "deepseek_v4_flash": "/tmp/recycle_dsv4flash_sparse"}.get(args.layout,
                                                                                       "/tmp/recycle_dsv3_sparse"))
    rows = []
    for n in args.layers:
        d = root / f"layers{n}"
        t0 = time.perf_counter()
        info = build(d, n, args.layout)
        disk = sum(os.stat(p).st_blocks * 512 for p in d.iterdir())
        built = {"layers": n, **info, "disk_bytes": disk, "build_s": round(time.perf_counter() - t0, 1)}
        for extra in args.extra_rows:
            runs = [measure(d, extra) for _ in range(args.repeats)]
            walls = sorted(r["wall_s"] for r in runs)
            row = {**built, "extra_rows": extra, **runs[0], "wall_s": walls[len(walls) // 2], "walls": walls}
            if args.phases and not extra:
                row["phases_s"] = phases(d)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not args.keep:
            shutil.rmtree(d)


if __name__ == "__main__":
    main()
