"""`recycle bench` on the trained fixture: native MTP chain vs the converted drafters vs transformers' peers.

    python benchmarks/bench_drafters.py [--threads 2] [--max-new-tokens 128] [--no-wait]

Greedy, the held-out code prompts, 128 new tokens. Converts the fixture to eagle / eagle3 / medusa in
a temporary directory, then benchmarks each drafter against AR decoding in one process per drafter
(recycle.bench.run_bench), and transformers' `generate` (plain, use_mtp, prompt lookup) once.
Asserts that the `--to eagle` drafter, before any distillation, reproduces the native chain's τ at
equal chain length (it is the same computation). Prints a markdown table for BENCHMARKS.md.

Waits for `fixtures/deepseek_v3_mtp/README.md` (written when the fixture's final build is in place)
unless --no-wait.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from recycle.bench import BenchOptions, BenchResult, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.prompts import code_prompts

from _common import FIXTURE, parser, write_json


def main() -> None:
    ap = parser(None, threads=2, max_new_tokens=128, json=True)
    ap.add_argument("--no-wait", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="time each prompt N times, keep the fastest")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    while not args.no_wait and not (FIXTURE / "README.md").is_file():
        print("waiting for the final fixture (fixtures/deepseek_v3_mtp/README.md)...", file=sys.stderr)
        time.sleep(60)
    prompts = [("code", p) for p in code_prompts()]
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for fmt in ("eagle", "eagle3", "medusa"):
            dirs[fmt] = Path(tmp) / fmt
            convert_checkpoint(FIXTURE, fmt, dirs[fmt])
        runs = [
            ("native MTP (target dir)", None, "chain:2", True),
            ("--to eagle", str(dirs["eagle"]), "chain:2", False),
            ("--to eagle", str(dirs["eagle"]), "chain:3", False),
            ("--to eagle", str(dirs["eagle"]), "chain:4", False),
            ("--to eagle", str(dirs["eagle"]), None, False),
            ("--to eagle", str(dirs["eagle"]), "dynamic:2,2,4", False),
            ("--to eagle", str(dirs["eagle"]), "dynamic:4,2,8", False),
            ("--to eagle", str(dirs["eagle"]), "dynamic:5,3,12", False),
            ("--to eagle3", str(dirs["eagle3"]), "chain:2", False),
            ("--to eagle3", str(dirs["eagle3"]), None, False),
            ("--to medusa", str(dirs["medusa"]), "chain:2", False),
            ("--to medusa", str(dirs["medusa"]), None, False),
        ]
        for i, (label, drafter, tree, native) in enumerate(runs):
            opts = BenchOptions(drafter=drafter, target=str(FIXTURE), prompts=prompts, max_new_tokens=args.max_new_tokens,
                                tree=tree, native=native, compare_hf=(i == 0), repeats=args.repeats)
            rep = run_bench(opts)
            reports.append((label, rep))
            o = rep.overall
            print(f"{label:26s} {rep.tree:28s} tau {o.spec.tau:.2f}  speedup {o.speedup:.2f}x", file=sys.stderr)
    native, eagle2 = reports[0][1].overall.spec, reports[1][1].overall.spec
    assert native.accepted == eagle2.accepted and native.tau == eagle2.tau, (
        "the --to eagle drafter must reproduce the native MTP chain exactly before distillation")
    if args.json:
        write_json(args.json, [rep.to_json() | {"label": label} for label, rep in reports], indent=2)
    print_table(reports, args)


def print_table(reports: list[tuple[str, BenchResult]], args: argparse.Namespace) -> None:
    ar = reports[0][1].overall.ar
    print("| drafter | tree | τ | acceptance by depth | target fwd | draft / verify s | tok/s | speedup | cost model | greedy = AR |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    print(f"| none (our AR loop) | - | 1.00 | - | {ar.target_forwards} | - / {ar.verify_s:.2f} | "
          f"{ar.tokens_per_s:.1f} | 1.00× | - | - |")
    for label, r in reports:
        o, sp = r.overall, r.overall.spec
        acc = " / ".join(f"{a:.2f}" for a in sp.acceptance)
        print(f"| {label} | {r.tree.split(' ', 1)[1]} | {sp.tau:.2f} | {acc} | {sp.target_forwards} | "
              f"{sp.draft_s:.2f} / {sp.verify_s:.2f} | {sp.tokens_per_s:.1f} | {o.speedup:.2f}× | "
              f"{o.predicted.speedup:.2f}× | {o.greedy_match} |")
    for h in reports[0][1].hf or []:
        tps = f"{h.tokens_per_s:.1f}" if h.tokens_per_s else "failed"
        sp = f"{h.speedup_vs_our_ar:.2f}×" if h.speedup_vs_our_ar else "-"
        print(f"| transformers: {h.method.removeprefix('hf ')} | - | - | - | - | - | {tps} | {sp} | - | "
              f"{h.greedy_match or h.error} |")
    print(f"\n(per-drafter AR baselines are re-measured in each run; the speedup column divides by that run's AR; "
          f"{len(reports[0]['prompts'])} prompts, {args.max_new_tokens} new tokens, {args.threads} threads, fastest of {args.repeats} per prompt)")


if __name__ == "__main__":
    main()
