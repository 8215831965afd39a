"""Deeper than stored (issue 13): one MTP module chained past depth 1, natively vs distilled.

The popular releases ship one MTP module (DeepSeek-V3, GLM-4.x, Qwen3.5, MiMo) and engines reuse it
for every draft step (vLLM `mtp`, TensorRT-LLM "MTP Eagle"), a depth it was never trained for. Here,
on one-module variants of the fixtures (`fixtures/derive.py --modules 1`):

  native   the target's module reused at every step (recycle bench --native-mtp --tree chain:N)
  eagle    `convert --to eagle` of the same module, distilled with N unrolled draft steps against
           the same target (`distill --draft-steps 4`), then decoded with the same chains

Both at chain:2, 3 and 4 on the same prompts: per-depth acceptance, τ, measured speedup over
autoregressive decoding with the same loop.

    python benchmarks/deeper_than_stored.py --threads 2 --json /tmp/deeper.json
"""

from __future__ import annotations

import time
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.preflight import parse_tokens
from recycle.prompts import code_prompts

from _common import ROOT, parser, stamp, write_json
from fixtures.derive import derive

CASES = {
    # name: (source checkpoint, distillation data / prompt corpus)
    "aligned": (ROOT / "fixtures/deepseek_v3_mtp", "stdlib"),
    "posttrained": (ROOT / "fixtures/deepseek_v3_mtp_posttrained", "py:transformers"),
}


def bench(drafter: str | None, target: Path, prompts: list, tree: str, tokens: int, repeats: int) -> dict:
    r = run_bench(BenchOptions(drafter=drafter, target=str(target), prompts=prompts, max_new_tokens=tokens, tree=tree,
                               native=drafter is None, repeats=repeats))
    o = r.overall
    return {"tree": r.tree, "tau": o.spec.tau, "acceptance": list(o.spec.acceptance), "speedup": o.speedup,
            "predicted": o.predicted.speedup, "greedy_match": o.greedy_match,
            "ar_tokens_per_s": o.ar.tokens_per_s, "spec_tokens_per_s": o.spec.tokens_per_s}


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-deeper", prompts=8, max_new_tokens=128, repeats=2, threads=None, json=True)
    ap.add_argument("--cases", default="aligned,posttrained")
    ap.add_argument("--tokens", default="aligned=512k,posttrained=1M", help="distillation budget per case")
    ap.add_argument("--draft-steps", type=int, default=4)
    ap.add_argument("--chains", default="2,3,4")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    budgets = {k: parse_tokens(v) for k, v in (kv.split("=") for kv in a.tokens.split(","))}
    chains = [int(c) for c in a.chains.split(",")]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {**stamp(), "cases": {}}
    t0 = time.perf_counter()
    for case in a.cases.split(","):
        src, corpus = CASES[case]
        target = Path(derive(src, work / f"{case}-one-module", 1, overwrite=True)["out"])
        prompts = [("code", p) for p in code_prompts(a.prompts, source=corpus)]
        eagle = convert_checkpoint(target, "eagle", work / f"{case}-eagle", overwrite=True, layouts="recycle")["out"]
        rec = distill(DistillOptions(drafter=eagle, target=str(target), tokens=budgets[case], data=corpus,
                                     draft_steps=a.draft_steps, out=str(work / f"{case}-eagle-distilled"),
                                     overwrite=True, threads=a.threads, checkpoint_every=10**9, eval_every=32))
        print(f"{case}: distilled {rec['tokens']:,} tokens in {rec['wall_s']:.0f} s; held-out estimate "
              f"{rec['final']['heldout_estimate_before']:.3f} → {rec['final']['heldout_estimate_after']:.3f} "
              f"(selected: {rec['selected']['why']})", flush=True)
        rows = []
        for chain in chains:
            for name, drafter in (("native module reused", None), ("eagle distilled", rec["out"])):
                m = bench(drafter, target, prompts, f"chain:{chain}", a.max_new_tokens, a.repeats)
                rows.append({"drafter": name, "chain": chain, **m})
                print(f"  {name:22s} chain:{chain} tau {m['tau']:.3f} speedup {m['speedup']:.2f}x acc "
                      f"{[round(x, 3) for x in m['acceptance']]} greedy {m['greedy_match']}", flush=True)
        out["cases"][case] = {"target": str(target), "source": str(src), "corpus": corpus, "distill": rec, "rows": rows}
    out["wall_s"] = round(time.perf_counter() - t0)
    print("\n| target (one module) | drafter | chain | τ | acceptance by depth | speedup | greedy = AR |")
    print("|---|---|---:|---:|---|---:|---|")
    for case, c in out["cases"].items():
        for r in c["rows"]:
            print(f"| {case} | {r['drafter']} | {r['chain']} | {r['tau']:.3f} | "
                  + " / ".join(f"{x:.3f}" for x in r["acceptance"]) + f" | {r['speedup']:.2f}× | {r['greedy_match']} |")
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
