"""Why a short distillation does not raise τ on the aligned fixture (issue 13).

On `fixtures/deepseek_v3_mtp` the MTP modules were trained jointly with the very trunk they serve.
Distilling the recycled EAGLE drafter for 300k tokens with the defaults moved τ within noise. This
script separates the suspects, each a 300k-token run from the same recycled drafter, same data
order and seed, with the drafter's *last-step* weights benchmarked (not the best snapshot the
never-worse rule would ship):

  default       lr 5e-4, 0.1·CE + 1.0·KL, 3 unrolled steps, the default precision
  lr 2e-3       4× the learning rate
  fp32          no bf16 autocast (numerics)
  kl only       CE weight 0 (the data label can pull away from the target's argmax)
  1 step        only the first draft step trains (no later-step pressure on shared modules)

For each: the held-out estimate before / best / last, train KL and agreement at the start and the
end (mean of 10 steps), and `recycle bench` chain:2 and chain:3 τ on 8 held-out code prompts.

    python benchmarks/aligned_headroom.py --threads 2 --json /tmp/headroom.json
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.options import LossConfig
from recycle.preflight import parse_tokens
from recycle.prompts import code_prompts

from _common import FIXTURE, parser, stamp, write_json
from experiment import snapshots

VARIANTS = {
    "default": {},
    "lr 2e-3": {"lr": 2e-3},
    "fp32": {"precision": "fp32"},
    "kl only": {"loss": LossConfig(ce_weight=0.0)},
    "1 step": {"draft_steps": 1},
}


def tau(drafter: str, target: str, prompts: list, chain: int, tokens: int) -> dict:
    r = run_bench(BenchOptions(drafter=drafter, target=target, prompts=prompts, max_new_tokens=tokens,
                               tree=f"chain:{chain}", warmup=False))
    return {"tau": r.overall.spec.tau, "acceptance": list(r.overall.spec.acceptance)}


def _mean(rows: list[dict], key: str) -> list[float]:
    vals = [r[key] for r in rows if r.get(key)]
    return [sum(v[k] for v in vals) / len(vals) for k in range(len(vals[0]))] if vals else []


def main() -> None:
    ap = parser(__doc__, target=FIXTURE, work="/tmp/recycle-headroom", prompts=8, max_new_tokens=64, threads=None,
                json=True)
    ap.add_argument("--tokens", default="300k")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    budget = parse_tokens(a.tokens)
    work = Path(a.work)
    src = convert_checkpoint(a.target, "eagle", work / "converted", overwrite=True, layouts="recycle")["out"]
    prompts = [("code", p) for p in code_prompts(a.prompts)]
    base = {c: tau(src, a.target, prompts, c, a.max_new_tokens) for c in (2, 3)}
    print(f"undistilled: chain:2 tau {base[2]['tau']:.3f}, chain:3 tau {base[3]['tau']:.3f}", flush=True)
    out: dict = {**stamp(), "undistilled": base, "runs": {}}
    for name in a.variants.split(","):
        snap = work / f"{name.replace(' ', '_')}-snapshots"
        opts = replace(DistillOptions(drafter=src, target=a.target, tokens=budget, out=str(work / name.replace(" ", "_")),
                                      overwrite=True, threads=a.threads, checkpoint_every=10**9, eval_every=16),
                       **VARIANTS[name])
        rec = distill(opts, on_step=snapshots((budget,), snap, opts.init))  # the last step's weights, as trained
        rows = [json.loads(line) for line in (Path(rec["state_dir"]) / "metrics.jsonl").read_text().splitlines()]
        last = str(snap / f"tokens_{budget}")
        benches = {c: tau(last, a.target, prompts, c, a.max_new_tokens) for c in (2, 3)}
        estimates = [r["heldout_estimate"] for r in rows if "heldout_estimate" in r]
        run = {"precision": rec["precision"], "estimate_before": rec["final"]["heldout_estimate_before"],
               "estimate_best": rec["final"]["heldout_estimate_after"], "estimate_last": estimates[-1],
               "train_kl_first10": _mean(rows[:10], "kl"), "train_kl_last10": _mean(rows[-10:], "kl"),
               "train_agree_first10": _mean(rows[:10], "train_agree"),
               "train_agree_last10": _mean(rows[-10:], "train_agree"), "tokens_per_s": rec["tokens_per_s"],
               "bench_last_step": benches}
        out["runs"][name] = run
        print(f"{name}: estimate {run['estimate_before']:.3f} → best {run['estimate_best']:.3f} / last "
              f"{run['estimate_last']:.3f}; train KL {[round(x, 3) for x in run['train_kl_first10']]} → "
              f"{[round(x, 3) for x in run['train_kl_last10']]}; agree {[round(x, 3) for x in run['train_agree_first10']]}"
              f" → {[round(x, 3) for x in run['train_agree_last10']]}; chain:2 tau {benches[2]['tau']:.3f}, chain:3 "
              f"{benches[3]['tau']:.3f} ({rec['tokens_per_s']:.0f} tok/s, {rec['precision']})", flush=True)
        if a.json:
            write_json(a.json, out)
    print("\n| run | precision | held-out estimate before → best / last | train KL step 1 (first → last 10 steps) "
          "| train agreement step 1 | chain:2 τ | chain:3 τ |")
    print("|---|---|---|---|---|---:|---:|")
    print(f"| undistilled | - | - | - | - | {base[2]['tau']:.3f} | {base[3]['tau']:.3f} |")
    for name, r in out["runs"].items():
        print(f"| {name} | {r['precision']} | {r['estimate_before']:.3f} → {r['estimate_best']:.3f} / "
              f"{r['estimate_last']:.3f} | {r['train_kl_first10'][0]:.3f} → {r['train_kl_last10'][0]:.3f} | "
              f"{r['train_agree_first10'][0]:.3f} → {r['train_agree_last10'][0]:.3f} | "
              f"{r['bench_last_step'][2]['tau']:.3f} | {r['bench_last_step'][3]['tau']:.3f} |")


if __name__ == "__main__":
    main()
