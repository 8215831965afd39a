"""`recycle plan` against `recycle bench` at batch 1 on this machine: predicted speedup vs measured.

Runs the plan once (its default measurements) for the recycled EAGLE drafter of the trained
fixture, then `recycle bench` for chain:1…4 and the default tree on each prompt set separately, with
the same prompts and token budget, and prints predicted, measured and the error; also the plan's
own wall time (target: under 2 minutes) and the draft/verify decomposition of the default tree.

    python benchmarks/plan_validate.py [--json out.json] [--max-new-tokens 64]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.plan import PlanOptions, run_plan
from recycle.prompts import default_prompts

from _common import FIXTURE, parser, write_json

SHAPES = ("chain:1", "chain:2", "chain:3", "chain:4", "dynamic:3,2,6")


def main() -> None:
    ap = parser(__doc__, target=FIXTURE, max_new_tokens=64, json=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        drafter = str(Path(tmp) / "eagle")
        convert_checkpoint(args.target, "eagle", drafter)
        t0 = time.perf_counter()
        plan = run_plan(PlanOptions(bench=BenchOptions(drafter=drafter, target=args.target,
                                                       max_new_tokens=args.max_new_tokens)))
        plan_s = time.perf_counter() - t0
        prompts = default_prompts()
        rows = []
        for set_name, st in plan["sets"].items():
            chosen = [p for p in prompts if p[0] == set_name]
            cands = {r["shape"]: r for r in st["candidates"]}
            for shape in SHAPES:
                rep = run_bench(BenchOptions(drafter=drafter, target=args.target, prompts=chosen, tree=shape,
                                             max_new_tokens=args.max_new_tokens))
                o = rep.overall
                c = cands[shape]
                rows.append({"set": set_name, "shape": shape, "tau_pred": c["tau"], "tau": o.spec.tau,
                             "predicted": c["predicted"], "measured": o.speedup,
                             "error": c["predicted"] / o.speedup - 1, "c_draft": c["c_draft"],
                             "c_verify": c["c_verify"], "efficiency": o.speedup / o.spec.tau,
                             "greedy_match": o.greedy_match})
                r = rows[-1]
                print(f"{set_name:5s} {shape:14s} τ {r['tau_pred']:.2f}/{r['tau']:.2f}  predicted {r['predicted']:.2f}× "
                      f"measured {r['measured']:.2f}×  error {r['error']:+.1%}  efficiency {r['efficiency']:.2f}  "
                      f"draft {r['c_draft']:.2f} + verify {r['c_verify']:.2f} AR steps  = AR {r['greedy_match']}",
                      flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"plan: {plan_s:.0f} s; worst |error| {worst:.1%}; recommended: "
          + ", ".join(f"{k}: {v['recommended']['shape']}" for k, v in plan["sets"].items()))
    if args.json:
        write_json(args.json, {"plan_seconds": plan_s, "rows": rows, "plan": plan})


if __name__ == "__main__":
    main()
