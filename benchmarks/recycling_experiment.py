"""The recycling experiment: recycled vs scratch drafters, held-out τ versus distillation tokens.

Aligned fixture (issue 6: the modules were trained with this very trunk):

    python benchmarks/recycling_experiment.py --tokens 524288 --marks 0,65536,131072,262144,524288 --threads 2

Stale modules (issue 13: the post-trained fixture's trunk moved to the transformers source; its MTP
modules are the original's; the drafter is converted from the base and distilled on the new domain):

    python benchmarks/recycling_experiment.py --stale --formats eagle --threads 2

Gemma 4 assistant → EAGLE-3 (the fold) and Medusa (calibrated), against scratch (issue 19):

    python benchmarks/recycling_experiment.py --source fixtures/gemma4_assistant --target fixtures/gemma4_target \
        --formats eagle3,medusa --calibrate 64k --tokens 512k --marks 0,64k,128k,256k,512k --threads 2 \
        --work /tmp/recycle-gemma --plot benchmarks/recycling_gemma4.png --title "Gemma 4 assistant → EAGLE-3 / Medusa"

Writes WORK/experiment.json (every record and bench result), a PNG, and prints the markdown tables
that BENCHMARKS.md holds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.preflight import parse_tokens

from _common import BENCHMARKS, FIXTURE, POSTTRAINED, parser
from experiment import FORMATS, ExperimentOptions, plot, run_experiment


def markdown(result: dict) -> str:
    """The τ-per-checkpoint table and the scratch-multiple / native comparison tables."""
    marks = result["marks"]
    every = sorted({p["tokens"] for run in result["runs"].values() for p in run["curve"]})  # scratch-long has its own
    lines = ["| run | tree | " + " | ".join(f"τ @ {m:,}" for m in every) + " | tok/s | target fwd | overhead |",
             "|---|---|" + "---:|" * (len(every) + 3)]
    for name, run in result["runs"].items():
        rec = run["record"]
        at = {p["tokens"]: p["tau"] for p in run["curve"]}
        lines.append(f"| {name} | {run['curve'][0]['tree']} | " + " | ".join(f"{at[m]:.3f}" if m in at else ""
                                                                               for m in every)
                     + f" | {rec['tokens_per_s']:.0f} | {100 * rec['target_forward_share']:.1f}% | "
                       f"{100 * rec['overhead_share']:.1f}% |")
    lines += ["", "| format | scratch run | " + " | ".join(f"scratch × tokens to match recycled @ {m:,}"
                                                       for m in marks[1:]) + " | estimate vs bench (Pearson r, pairs) |",
              "|---|---|" + "---:|" * len(marks)]
    for fmt, s in result["summary"].items():
        ev = s["estimate_vs_bench"]
        r = f"{ev['pearson']:.3f}" if ev["pearson"] is not None else "-"
        lines.append(f"| {fmt} | {s['scratch_run']} | " + " | ".join(s["scratch_multiple"][str(m)] for m in marks[1:])
                     + f" | {r} ({ev['pairs']}) |")
    lines.append("")
    for key, label in (("native", "The target's native MTP"), ("reference", "The original pairing's native MTP")):
        ref = result.get(key)
        if ref:
            lines.append(f"{label} ({ref['tree']}) on the same prompts: τ {ref['tau']:.3f}, acceptance by depth "
                         + " / ".join(f"{a:.3f}" for a in ref["acceptance"]) + ".")
    lines += ["", "| EAGLE drafter on the native tree | tokens | τ | acceptance by depth | held-out estimate by step |",
              "|---|---:|---:|---|---|"]
    for name, run in result["runs"].items():
        if not name.startswith("eagle-"):
            continue
        for p in run["curve"]:
            if "chain" in p:
                lines.append(f"| {name} ({p['chain']['tree']}) | {p['tokens']:,} | {p['chain']['tau']:.3f} | "
                             + " / ".join(f"{a:.3f}" for a in p["chain"]["acceptance"]) + " | "
                             + " / ".join(f"{a:.3f}" for a in p.get("estimate") or []) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, work=None, prompts=8, max_new_tokens=64, threads=None)
    ap.add_argument("--stale", action="store_true", help="the post-trained fixture's setting (defaults below "
                    "change to it: target, source, reference, data, prompts, budgets, plot)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--source", default=None, help="convert this checkpoint's MTP modules (default: the target)")
    ap.add_argument("--reference", default=None, help="native MTP of this checkpoint as the original pairing")
    ap.add_argument("--data", default=None)
    ap.add_argument("--prompt-source", default=None)
    ap.add_argument("--scratch-tokens", default=None)
    ap.add_argument("--scratch-marks", default=None)
    ap.add_argument("--calibrate", default=None, help="--to medusa: calibrate the recycled heads on this many tokens")
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--marks", default=None)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--title", default=None, help="the plot's title")
    a = ap.parse_args()
    base, posttrained = str(FIXTURE), str(POSTTRAINED)
    defaults = dict(target=base, work="/tmp/recycle-experiment", tokens="512k", marks="0,64k,128k,256k,512k",
                    prompt_source="stdlib", plot=str(BENCHMARKS / "recycling_experiment.png"))
    if a.stale:
        defaults.update(target=posttrained, source=base, reference=base, data="py:transformers",
                        prompt_source="py:transformers", work="/tmp/recycle-stale", tokens="1M",
                        marks="0,64k,128k,256k,512k,1M", scratch_tokens="8M", scratch_marks="0,256k,1M,2M,4M,8M",
                        plot=str(BENCHMARKS / "recycling_stale.png"))
    for k, v in defaults.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    def counts(text: str | None) -> tuple[int, ...]:
        return tuple(parse_tokens(m) if m.strip() != "0" else 0 for m in text.split(",")) if text else ()

    opts = ExperimentOptions(target=a.target, work=a.work, tokens=parse_tokens(a.tokens), marks=counts(a.marks),
                             formats=tuple(a.formats.split(",")), source=getattr(a, "source", None),
                             reference=getattr(a, "reference", None), data=getattr(a, "data", None),
                             prompt_source=a.prompt_source,
                             scratch_tokens=parse_tokens(a.scratch_tokens) if getattr(a, "scratch_tokens", None) else None,
                             scratch_marks=counts(getattr(a, "scratch_marks", None)), prompts=a.prompts,
                             max_new_tokens=a.max_new_tokens, seq_len=a.seq_len, batch=a.batch, lr=a.lr,
                             threads=a.threads,
                             calibrate=parse_tokens(a.calibrate) if getattr(a, "calibrate", None) else None)
    t0 = time.perf_counter()
    result = run_experiment(opts, log=lambda s: print(s, flush=True))
    plot(result, a.plot, title=a.title or ("stale MTP: base modules on the post-trained fixture, transformers-domain "
                                           "prompts" if a.stale else
                                           "recycled vs scratch drafters on the trained DeepSeek-V3 fixture"))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; plot {a.plot}; data {Path(a.work) / 'experiment.json'}\n")
    print(markdown(result))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
