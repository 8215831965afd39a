"""The transplant workflow on the Qwen3.5 fixture (issue 33): a stale MTP module re-aligned to a post-trained
hybrid target, stitched back, and drafted natively.

    python benchmarks/qwen_transplant.py [--tokens 256k] [--n 8] [--max-new-tokens 64] [--json OUT.json]

Steps, each the CLI's own library call:
1. the native MTP module of `fixtures/qwen3_5_mtp` (its own, aligned) and of `fixtures/qwen3_5_mtp_posttrained`
   (the same bytes against a trunk post-trained on `py:transformers`: stale), `recycle bench --native-mtp`;
2. `recycle convert fixtures/qwen3_5_mtp --to eagle`, `recycle distill` against the post-trained target on
   `py:transformers` (`--tokens`), `recycle stitch` of its `mtp_overlay/` into the post-trained target;
3. the stitched target's native module, `recycle bench --native-mtp`.
Prompts: the first `--n` held-out code prompts of `py:transformers`, greedy, chains of 1 and 3 (a hybrid target
verifies chains only; the one module is reused past depth 1, as vLLM and llama.cpp reuse it). Greedy output is
checked equal to plain decoding in every run.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from _common import FIXTURES, parser, write_json


def bench(target: Path, prompts, n_new: int, chain: int) -> dict:
    from recycle.bench import BenchOptions, run_bench

    r = run_bench(BenchOptions(drafter=None, native=True, target=str(target), prompts=prompts,
                               max_new_tokens=n_new, tree=f"chain:{chain}", stop_at_eos=False))
    spec = r.overall.spec
    return {"tau": round(spec.tau, 3), "acceptance": [round(a, 3) for a in spec.acceptance],
            "accepted": list(spec.accepted), "tried": list(spec.tried), "rollbacks": spec.rollbacks,
            "steps": spec.steps, "greedy_equal": r.overall.greedy_match, "speedup": r.overall.speedup}


def main() -> None:
    ap = parser(__doc__, target=FIXTURES / "qwen3_5_mtp_posttrained", work=None, max_new_tokens=64, json=True)
    ap.add_argument("--base", default=str(FIXTURES / "qwen3_5_mtp"))
    ap.add_argument("--tokens", default="256k")
    ap.add_argument("--data", default="py:transformers")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--chains", default="1,3")
    a = ap.parse_args()
    from recycle.converters.api import convert_checkpoint
    from recycle.converters.overlay import stitch
    from recycle.distill.train import DistillOptions, distill
    from recycle.preflight import parse_tokens
    from recycle.prompts import prompt_set

    work = Path(a.work or tempfile.mkdtemp(prefix="qwen-transplant-"))
    prompts = prompt_set(a.data, a.n)
    chains = [int(c) for c in a.chains.split(",")]
    out: dict = {"tokens": parse_tokens(a.tokens), "prompts": f"{a.data} held-out, first {a.n}",
                 "max_new_tokens": a.max_new_tokens, "runs": {}}

    def measure(label: str, target: Path) -> None:
        for c in chains:
            t0 = time.perf_counter()
            out["runs"][f"{label} chain:{c}"] = r = bench(target, prompts, a.max_new_tokens, c)
            print(f"{label} chain:{c}: τ {r['tau']:.3f}, acceptance {r['acceptance']}, greedy = plain "
                  f"{r['greedy_equal']} ({time.perf_counter() - t0:.0f} s)", flush=True)

    measure("aligned (base target, its own module)", Path(a.base))
    measure("stale (post-trained target, the base's module)", Path(a.target))
    t0 = time.perf_counter()
    eagle = convert_checkpoint(a.base, "eagle", work / "eagle", overwrite=True)["out"]
    rec = distill(DistillOptions(drafter=eagle, target=a.target, data=a.data, tokens=parse_tokens(a.tokens),
                                 out=str(work / "distilled"), overwrite=True))
    out["distill"] = {k: rec[k] for k in ("tokens", "steps", "train_s", "tokens_per_s")}
    out["distill"]["heldout_estimate"] = [rec["final"]["heldout_estimate_before"],
                                          rec["final"]["heldout_estimate_after"]]
    stitched = work / "stitched"
    stitch(Path(rec["out"]) / "mtp_overlay", a.target, stitched, overwrite=True)
    out["transplant_s"] = round(time.perf_counter() - t0, 1)
    print(f"convert + distill ({rec['tokens']:,} tokens, {rec['tokens_per_s']:,.0f} tok/s) + stitch: "
          f"{out['transplant_s']:.0f} s; held-out estimate {out['distill']['heldout_estimate']}", flush=True)
    measure("re-aligned (post-trained target, stitched module)", stitched)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
