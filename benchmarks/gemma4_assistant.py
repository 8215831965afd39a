"""Gemma 4 assistants (issue 19): native drafting in recycle's decoder against transformers' `assistant_model=`,
and re-alignment to a post-trained target.

On the Gemma 4 fixtures (`fixtures/build_gemma4.py`):
  native     the assistant on its own target, recycle bench (chains 1-4 and the default dynamic tree) on the
             default prompt sets, beside transformers' generate with `assistant_model=` on the same prompt ids
             (tokens/s, greedy output equal or not);
  realign    τ of the assistant on the post-trained target's domain (py:transformers prompts): on the original
             target, on the post-trained one (stale), and after `recycle distill ASSISTANT --target POSTTRAINED
             --data py:transformers --tokens N`; recovery = (τ_after − τ_stale) / (τ_original − τ_stale).

    python benchmarks/gemma4_assistant.py --tokens 256k --json /tmp/gemma4.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.bench import BenchOptions, BenchResult, run_bench
from recycle.distill.train import DistillOptions, distill
from recycle.preflight import parse_tokens
from recycle.prompts import prompt_set

from _common import FIXTURES as FX
from _common import parser, write_json

TARGET, ASSISTANT, POST = FX / "gemma4_target", FX / "gemma4_assistant", FX / "gemma4_target_posttrained"
DOMAIN = "py:transformers"


def summary(r: BenchResult) -> dict:
    o = r.overall
    return {"tree": r.tree, "tau": round(o.spec.tau, 3), "acceptance": [round(a, 3) for a in o.spec.acceptance],
            "speedup": round(o.speedup, 3), "predicted": round(o.predicted.speedup, 3),
            "ar_tok_s": round(o.ar.tokens_per_s, 1), "spec_tok_s": round(o.spec.tokens_per_s, 1),
            "greedy_match": o.greedy_match}


def native(new_tokens: int, repeats: int) -> dict:
    rows = {}
    for tree in ("chain:1", "chain:2", "chain:3", "chain:4", None):
        hf = tree == "chain:4"  # transformers drafts num_assistant_tokens (4) in a chain: compare there
        r = run_bench(BenchOptions(drafter=str(ASSISTANT), target=str(TARGET), max_new_tokens=new_tokens, tree=tree,
                                   compare_hf=hf, repeats=repeats))
        rows[tree or "default"] = summary(r)
        if hf:
            rows["hf"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.to_json().items()}
                          for row in r.hf]
        print(tree, json.dumps(rows[tree or "default"]), flush=True)
    return rows


def realign(tokens: int, new_tokens: int, out: Path, seq_len: int, batch: int) -> dict:
    prompts = prompt_set(DOMAIN)
    tree = "chain:4"

    def tau(drafter: Path, target: Path) -> dict:
        return summary(run_bench(BenchOptions(drafter=str(drafter), target=str(target), prompts=prompts,
                                              max_new_tokens=new_tokens, tree=tree)))

    res = {"original": tau(ASSISTANT, TARGET), "stale": tau(ASSISTANT, POST)}
    print("original", res["original"], "\nstale", res["stale"], flush=True)
    t0 = time.perf_counter()
    rec = distill(DistillOptions(drafter=str(ASSISTANT), target=str(POST), tokens=tokens, data=DOMAIN, out=str(out),
                                 overwrite=True, seq_len=seq_len, batch=batch))
    res["distill"] = {"tokens": rec["tokens"], "wall_s": round(time.perf_counter() - t0, 1),
                      "tokens_per_s": rec["tokens_per_s"], "selected": rec["selected"],
                      "heldout_estimate_before": rec["final"]["heldout_estimate_before"],
                      "heldout_estimate_after": rec["final"]["heldout_estimate_after"]}
    res["realigned"] = tau(out, POST)
    lost = res["original"]["tau"] - res["stale"]["tau"]
    res["recovered_fraction"] = round((res["realigned"]["tau"] - res["stale"]["tau"]) / lost, 3) if lost > 0 else None
    print("realigned", res["realigned"], "recovered", res["recovered_fraction"], flush=True)
    return res


def main() -> None:
    ap = parser(__doc__, first_line=True, out=Path("/tmp/gemma4-realigned"), repeats=1, json=True)
    ap.add_argument("--tokens", default="256k", help="distillation budget for the re-alignment")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip", choices=("native", "realign"), action="append", default=[])
    a = ap.parse_args()
    res = {}
    if "native" not in a.skip:
        res["native"] = native(a.new_tokens, a.repeats)
    if "realign" not in a.skip:
        res["realign"] = realign(parse_tokens(a.tokens), a.new_tokens, a.out, a.seq_len, a.batch)
    print(json.dumps(res, indent=2))
    if a.json:
        write_json(a.json, res, indent=2)


if __name__ == "__main__":
    main()
