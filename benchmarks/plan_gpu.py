"""`recycle plan` on a GPU: the roofline against measured batched verification, and bench/plan at batch 1.

Run on a CUDA machine (the lent H100 here); writes one JSON:

  fixture   recycle bench (bf16) on the trained DeepSeek-V3-layout fixture for chain:1…4 and the
            default tree: τ, tokens/s, speedup, achieved bandwidth against the datasheet peak; and
            recycle plan on the same device (predicted against measured at batch 1).
  slabs     verification cost T(B, n) of randomly initialised bf16 models whose weights dominate
            (a dense Llama-3-8B-shaped slab, a Qwen3-30B-A3B-shaped MoE slab, 8 layers each), for
            B = 1, 8, 32, 128 and n = 1, 2, 4, 8 tokens per sequence after `--context` cached
            tokens, and the cost of one drafter pass (one layer of the same shape plus the head) at
            each B. `--analyze` turns these into measured-vs-roofline speedups with the fixture's τ.

    python benchmarks/plan_gpu.py --out /tmp/plan_gpu.json [--prompts prompts.jsonl]
    python benchmarks/plan_gpu.py --analyze /tmp/plan_gpu.json --plan /tmp/plan_cpu.json
"""

from __future__ import annotations

import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from _common import FIXTURE, date, parser, write_json

SLABS = {
    "dense-llama8b-8L": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                             max_position_embeddings=8192, tie_word_embeddings=False),
    "moe-qwen3-30b-a3b-8L": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                 num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 vocab_size=151936, max_position_embeddings=8192, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
}
BATCHES = (1, 8, 32, 128)
TOKENS = (1, 2, 3, 4, 5, 8)


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, reps: int = 5) -> float:
    fn()
    _sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def slab(name: str, cfg: dict, context: int) -> dict:
    """T(B, n) for the slab and T(B, 1) for its one-layer drafter stand-in, seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from recycle.decoding import cache as kv

    dev = DEV
    res = {"config": cfg, "context": context, "verify": {}, "draft": {}}
    for role, layers in (("verify", cfg["num_hidden_layers"]), ("draft", 1)):
        c = dict(cfg, num_hidden_layers=layers)
        conf = AutoConfig.for_model(**c)
        torch.manual_seed(0)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16).eval()
        if role == "verify":
            res["params"] = sum(p.numel() for p in model.parameters())
            res["experts_implementation"] = getattr(conf, "_experts_implementation", None)
        for b in BATCHES:
            ids = torch.randint(0, cfg["vocab_size"], (b, context), device=dev)
            with torch.inference_mode():
                cache = DynamicCache(config=conf)
                for lo in range(0, b, 16):  # prefill in slices: 128 × context tokens at once needs too much
                    part = DynamicCache(config=conf)
                    model(input_ids=ids[lo:lo + 16], past_key_values=part, use_cache=True)
                    if lo == 0:
                        cache = part
                    else:
                        for dst, src in zip(cache.layers, part.layers):
                            dst.keys = torch.cat([dst.keys, src.keys])
                            dst.values = torch.cat([dst.values, src.values])
                for n in (TOKENS if role == "verify" else (1,)):
                    new = torch.randint(0, cfg["vocab_size"], (b, n), device=dev)
                    pos = torch.arange(context, context + n, device=dev)[None].expand(b, n)

                    def step(new=new, pos=pos, cache=cache, model=model):
                        model(input_ids=new, position_ids=pos, past_key_values=cache, use_cache=True)
                        kv.crop(cache, context)

                    res[role][f"{b}x{n}"] = _time(step)
                del cache, part  # free the KV before the next batch size
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del model
    return res


def fixture(prompts: str | None, out: dict, max_new: int = 128, limit: int | None = None, dtype: str = "bf16",
            trees: tuple[str, ...] = ("chain:1", "chain:2", "chain:3", "chain:4", "dynamic:3,2,6"),
            with_plan: bool = True) -> None:
    from recycle.bench import BenchOptions, run_bench
    from recycle.converters.api import convert_checkpoint
    from recycle.plan import PlanOptions, run_plan
    from recycle.prompts import prompt_set

    target = str(FIXTURE)
    drafter = "/tmp/plan-gpu-eagle"
    convert_checkpoint(target, "eagle", drafter, overwrite=True)
    chosen = prompt_set(prompts, limit) if prompts else None
    rows = []
    for tree in trees:
        rep = run_bench(BenchOptions(drafter=drafter, target=target, prompts=chosen, max_new_tokens=max_new, tree=tree,
                                     device=DEV.type, precision=dtype))
        o = rep.overall
        rows.append({"tree": tree, "tau": o.spec.tau, "speedup": o.speedup,
                     "predicted_cost_model": o.predicted.speedup, "ar_tokens_per_s": o.ar.tokens_per_s,
                     "spec_tokens_per_s": o.spec.tokens_per_s,
                     "bandwidth": rep.bandwidth.to_json() if rep.bandwidth else None, "greedy_match": o.greedy_match})
        print(json.dumps(rows[-1]), flush=True)
    out[f"fixture_bench_{dtype}"] = rows
    if not with_plan:
        return
    plan = run_plan(PlanOptions(bench=BenchOptions(drafter=drafter, target=target, prompts=chosen, max_new_tokens=max_new,
                                                   device=DEV.type, precision="bf16"), gpus=["H100"]))
    out["fixture_plan"] = plan


def profile_fixture() -> str:
    """Where one single-token forward of the fixture's target spends its time on this device."""
    from torch.profiler import ProfilerActivity, profile

    from recycle.decoding import Target, load_target

    dtype = torch.bfloat16
    target = Target(load_target(FIXTURE, device=DEV, dtype=dtype))
    cache = target.new_cache()
    ids = torch.arange(3, 103, device=DEV)[None]
    with torch.inference_mode():
        target.forward(ids, torch.arange(100, device=DEV)[None], None, cache)
        step = lambda i: target.forward(torch.tensor([[5]], device=DEV), torch.tensor([[100 + i]], device=DEV),
                                        None, cache)
        for i in range(3):
            step(i)
        _sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            for i in range(5):
                step(3 + i)
            _sync()
        wall = (time.perf_counter() - t0) / 5
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    return f"one AR forward: {wall * 1e3:.2f} ms (profiled, 5 steps)\n{table}"


def main() -> None:
    ap = parser(__doc__, out=None)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--skip", default="", help="comma-separated: fixture, slabs")
    ap.add_argument("--fixture-dtype", default="bf16")
    ap.add_argument("--fixture-prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--fixture-tokens", type=int, default=128)
    ap.add_argument("--fixture-trees", default="chain:1;chain:2;chain:3;chain:4;dynamic:3,2,6",
                    help="semicolon-separated tree shapes")
    ap.add_argument("--profile", action="store_true", help="profile one AR forward of the fixture (torch.profiler)")
    ap.add_argument("--no-plan", action="store_true", help="skip recycle plan on the fixture")
    ap.add_argument("--analyze", default=None, help="a JSON this script wrote on the GPU")
    ap.add_argument("--plan", default=None, help="with --analyze: a `recycle plan --json` report for τ")
    args = ap.parse_args()
    if args.analyze:
        analyze(args.analyze, args.plan)
        return
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu", "date": date()}
    skip = set(args.skip.split(","))

    def save() -> None:  # after every section: a run stopped at its time limit keeps what it measured
        if args.out:
            write_json(args.out, out)

    if "slabs" not in skip:
        out["slabs"] = {}
        for name, cfg in SLABS.items():
            try:
                out["slabs"][name] = slab(name, cfg, args.context)
                print(name, json.dumps(out["slabs"][name]["verify"]), json.dumps(out["slabs"][name]["draft"]), flush=True)
            except Exception:
                out["slabs"][name] = {"error": traceback.format_exc()[-2000:]}
                print(out["slabs"][name]["error"], flush=True)
            save()
    if args.profile:
        out["fixture_profile"] = profile_fixture()
        print(out["fixture_profile"], flush=True)
        save()
    if "fixture" not in skip:
        try:
            fixture(args.prompts, out, args.fixture_tokens, args.fixture_prompts, args.fixture_dtype,
                    tuple(t for t in args.fixture_trees.split(";") if t), not args.no_plan)
        except Exception:  # record and go on to the slabs
            out["fixture_error"] = traceback.format_exc()[-2000:]
            print(out["fixture_error"], flush=True)
        save()


def analyze(path: str, plan_path: str | None) -> None:
    """Measured T(B, n) → bandwidth and speedup with the plan's τ; against the roofline's prediction."""
    from recycle import roofline
    from recycle.hardware import gpu

    data = json.loads(Path(path).read_text())
    h100 = gpu("H100")
    taus = {}
    if plan_path:
        plan = json.loads(Path(plan_path).read_text())
        first = next(iter(plan["sets"].values()))
        taus = {r["shape"]: r["tau"] for r in first["candidates"] if r["shape"] in ("chain:1", "chain:2", "chain:3",
                                                                                    "chain:4")}
    for name, s in data.get("slabs", {}).items():
        if "error" in s:
            print(name, "error:", s["error"].splitlines()[-1])
            continue
        cost = roofline.target_cost(s["config"])
        one = roofline.target_cost(dict(s["config"], num_hidden_layers=1))
        ctx = s["context"]
        print(f"\n{name}: {s['params'] / 1e9:.2f}B params, context {ctx}")
        print("B n  measured_ms  roofline_ms  achieved_GB/s  bound")
        for key, t in s["verify"].items():
            b, n = (int(x) for x in key.split("x"))
            pred = cost.seconds(h100, b, n, ctx)
            print(f"{b:3d} {n}  {t * 1e3:9.3f}  {pred * 1e3:9.3f}  {cost.bytes(b, n, ctx) / t / 1e9:9.0f}  "
                  f"{cost.bound(h100, b, n, ctx)}")
        for k, tau in taus.items():
            kk = int(k.split(":")[1])
            row = []
            for b in BATCHES:
                meas = tau * s["verify"][f"{b}x1"] / (kk * s["draft"][f"{b}x1"] + s["verify"][f"{b}x{kk + 1}"]) \
                    if f"{b}x{kk + 1}" in s["verify"] else None
                pred = roofline.speedup(tau, cost, one, h100, b, verify_tokens=kk + 1, passes=kk, pass_tokens=1,
                                        context=ctx)
                row.append(f"B={b}: {meas:.2f}/{pred:.2f}" if meas else f"B={b}: -/{pred:.2f}")
            print(f"{k} τ {tau:.2f} measured/roofline speedup: " + "  ".join(row))


if __name__ == "__main__":
    main()
