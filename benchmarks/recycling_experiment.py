"""The recycling experiment (issue 6): recycled vs scratch drafters, held-out τ versus distillation tokens.

    python benchmarks/recycling_experiment.py --tokens 524288 --marks 0,65536,131072,262144,524288 --threads 2

Writes WORK/experiment.json (every record and bench result), benchmarks/recycling_experiment.png,
and prints the markdown tables that BENCHMARKS.md's "Recycling experiment (issue 6)" section holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.experiment import FORMATS, ExperimentOptions, plot, run_experiment  # noqa: E402
from distill.train import parse_tokens  # noqa: E402


def markdown(result: dict) -> str:
    """The τ-per-checkpoint table and the scratch-multiple / native comparison tables."""
    marks = result["marks"]
    lines = ["| run | tree | " + " | ".join(f"τ @ {m:,}" for m in marks) + " | tok/s | target fwd | overhead |",
             "|---|---|" + "---:|" * (len(marks) + 3)]
    for name, run in result["runs"].items():
        rec = run["record"]
        lines.append(f"| {name} | {run['curve'][0]['tree']} | " + " | ".join(f"{p['tau']:.3f}" for p in run["curve"])
                     + f" | {rec['tokens_per_s']:.0f} | {100 * rec['target_forward_share']:.1f}% | "
                       f"{100 * rec['overhead_share']:.1f}% |")
    lines += ["", "| format | " + " | ".join(f"scratch × tokens to match recycled @ {m:,}" for m in marks[1:]) + " |",
              "|---|" + "---:|" * (len(marks) - 1)]
    for fmt, s in result["summary"].items():
        lines.append(f"| {fmt} | " + " | ".join(s["scratch_multiple"][str(m)] for m in marks[1:]) + " |")
    nat = result["native"]
    lines += ["", f"Native MTP chain ({nat['tree']}) on the same prompts: τ {nat['tau']:.3f}, acceptance by depth "
              + " / ".join(f"{a:.3f}" for a in nat["acceptance"]) + ".", "",
              "| EAGLE drafter on the native tree | " + " | ".join(f"τ @ {m:,}" for m in marks)
              + " | acceptance at the end |", "|---|" + "---:|" * len(marks) + "---|"]
    for name in ("eagle-recycled", "eagle-scratch"):
        chain = (result["runs"].get(name) or {}).get("chain")
        if chain:
            end = chain[str(marks[-1])]
            lines.append(f"| {name} ({end['tree']}) | " + " | ".join(f"{chain[str(m)]['tau']:.3f}" if str(m) in chain else "-" for m in marks)
                         + " | " + " / ".join(f"{a:.3f}" for a in end["acceptance"]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "fixtures/deepseek_v3_mtp"))
    ap.add_argument("--work", default="/tmp/recycle-experiment")
    ap.add_argument("--tokens", default="512k")
    ap.add_argument("--marks", default="0,64k,128k,256k,512k")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--plot", default=str(ROOT / "benchmarks/recycling_experiment.png"))
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    marks = tuple(parse_tokens(m) if m.strip() != "0" else 0 for m in a.marks.split(","))
    opts = ExperimentOptions(target=a.target, work=a.work, tokens=parse_tokens(a.tokens), marks=marks,
                             formats=tuple(a.formats.split(",")), prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                             seq_len=a.seq_len, batch=a.batch, lr=a.lr, threads=a.threads)
    t0 = time.perf_counter()
    result = run_experiment(opts, log=lambda s: print(s, flush=True))
    plot(result, a.plot)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; plot {a.plot}; data {Path(a.work) / 'experiment.json'}\n")
    print(markdown(result))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
