"""Parallel heads into Medusa heads (issue 14): what each conversion keeps, measured on the same prompts and tree.

On the trained parallel-heads fixture (`fixtures/meta_mtp_parallel`, Meta's layout):
  native      the checkpoint's own extra heads drafting (recycle bench FIXTURE --target FIXTURE)
  identity    `convert --to medusa`: the shared output head behind identity ResBlocks (Medusa's init)
  calibrated  `convert --to medusa --calibrate N`: each ResBlock fitted to its source head
and the same two conversions from the DeepSeek fixture's sequential MTP modules. Every drafter runs
the same Medusa-style static tree (and chain:1, the depth-1 acceptance) on held-out code prompts.

    python benchmarks/parallel_heads.py --calibrate 64k --json /tmp/parallel.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.decoding.tree import DEFAULT_MEDUSA_CHOICES
from recycle.distill.calibrate import convert_calibrated
from recycle.preflight import parse_tokens
from recycle.prompts import code_prompts

from _common import FIXTURE, FIXTURES, parser, stamp, write_json

SOURCES = {"parallel": FIXTURES / "meta_mtp_parallel", "deepseek": FIXTURE}


def measure(drafter: str, target: str, prompts: list, tokens: int, tree: str) -> dict:
    r = run_bench(BenchOptions(drafter=drafter, target=target, prompts=prompts, max_new_tokens=tokens, tree=tree,
                               warmup=False))
    o = r.overall
    return {"tree": r.tree, "tau": o.spec.tau, "acceptance": list(o.spec.acceptance),
            "greedy_match": o.greedy_match}


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-parallel", prompts=8, max_new_tokens=64, json=True)
    ap.add_argument("--sources", default="parallel,deepseek")
    ap.add_argument("--calibrate", default="64k")
    ap.add_argument("--heads", type=int, default=3)
    a = ap.parse_args()
    work = Path(a.work)
    prompts = [("code", p) for p in code_prompts(a.prompts)]
    static = json.dumps([c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= a.heads])
    out: dict = {**stamp(), "calibrate_tokens": a.calibrate, "rows": []}
    for name in a.sources.split(","):
        src = str(SOURCES[name])
        drafters = {}
        if name == "parallel":
            drafters["native parallel heads"] = src
        drafters["medusa, identity ResBlocks"] = convert_checkpoint(src, "medusa", work / f"{name}-identity",
                                                                    heads=a.heads, overwrite=True)["out"]
        t0 = time.perf_counter()
        cal = convert_calibrated(src, "medusa", work / f"{name}-calibrated", heads=a.heads, overwrite=True,
                                 calibrate=parse_tokens(a.calibrate, "--calibrate"))
        seconds = time.perf_counter() - t0
        drafters["medusa, calibrated"] = cal["out"]
        fit = json.loads((Path(cal["out"]) / "recycle.json").read_text())["calibration"]
        print(f"{name}: calibrated in {seconds:.0f} s on {fit['tokens']:,} tokens; per head held-out KL / top-1 "
              "agreement with the source head, identity → calibrated: "
              + "; ".join(f"{h['identity']['kl']:.3f}/{h['identity']['top1_agreement']:.3f} → "
                          f"{h['calibrated']['kl']:.3f}/{h['calibrated']['top1_agreement']:.3f}" for h in fit["heads"]),
              flush=True)
        for label, d in drafters.items():
            for tree in (static, "chain:1"):
                m = measure(d, src, prompts, a.max_new_tokens, tree)
                row = {"source": name, "drafter": label, **m}
                out["rows"].append(row)
                print(f"  {label:28s} {m['tree']:28s} tau {m['tau']:.3f} acc {[round(x, 3) for x in m['acceptance']]}"
                      f" greedy {m['greedy_match']}", flush=True)
        out.setdefault("calibration", {})[name] = {"seconds": round(seconds, 1), **fit}
        if a.json:
            write_json(a.json, out)
    print("\n| source | drafter | tree | τ | acceptance by depth |\n|---|---|---|---:|---|")
    for r in out["rows"]:
        print(f"| {r['source']} | {r['drafter']} | {r['tree']} | {r['tau']:.3f} | "
              + " / ".join(f"{x:.3f}" for x in r["acceptance"]) + " |")


if __name__ == "__main__":
    main()
