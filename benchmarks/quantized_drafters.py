"""What quantization costs the drafter (issue 30), on the post-trained DeepSeek fixture (stale MTP modules).

Targets: the post-trained fixture in BF16; its block-FP8 build (`fixtures/fp8.make_fp8`: trunk and MTP e4m3,
128×128 scales, DeepSeek's release layout); a 4-bit round-to-nearest trunk (`fixtures/rtn.make_rtn4`, group 128,
the stand-in for AWQ/GPTQ/GGUF builds). Drafters, each measured by `recycle bench` (chain:2, greedy, held-out
py:transformers code prompts) on the target it is served with:

  native            the target's own (stale) MTP modules, as released (BF16, or FP8 in the FP8 build)
  realigned         the base's modules, distilled against a teacher (`--tokens` of py:transformers), stitched back
                    (`recycle stitch`): into BF16 as BF16, into the FP8 build re-quantized to FP8 (`--mtp-dtype auto`)
                    and kept BF16 (`--mtp-dtype bf16`); the same distilled weights, so the difference is FP8's
  teacher           which target taught it: the BF16 one, or the quantized build it is served with

    python benchmarks/quantized_drafters.py --tokens 256k --threads 2 --json /tmp/quantized.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recycle.bench import BenchOptions, run_bench, set_threads
from recycle.converters.api import convert_checkpoint
from recycle.converters.overlay import stitch as stitch_overlay
from recycle.distill.train import DistillOptions, distill
from recycle.preflight import parse_tokens
from recycle.prompts import code_prompts

from _common import FIXTURE, POSTTRAINED, parser, write_json
from fixtures.fp8 import make_fp8
from fixtures.rtn import make_rtn4

BASE, POST = FIXTURE, POSTTRAINED
DOMAIN = "py:transformers"


def chain2(target: Path, prompts: list, tokens: int, drafter: Path | None = None) -> dict:
    """`recycle bench --tree chain:2` (greedy) of a drafter, or of the target's own MTP modules: τ, α, losslessness."""
    r = run_bench(BenchOptions(drafter=str(drafter) if drafter else None, native=drafter is None, target=str(target),
                               prompts=prompts, max_new_tokens=tokens, tree="chain:2"))
    o = r.overall
    return {"tau": round(o.spec.tau, 3), "acceptance": [round(a, 3) for a in o.spec.acceptance],
            "greedy_match": o.greedy_match}


def setup(doc: str, work: str) -> tuple[argparse.Namespace, Path, list]:
    """The options these re-alignment benchmarks share (work dir, budget, prompts, threads, JSON), the work dir made,
    and the held-out `py:transformers` code prompts every row is measured on."""
    ap = parser(doc, work=work, prompts=8, max_new_tokens=64, threads=None, json=True)
    ap.add_argument("--tokens", default="256k")
    a = ap.parse_args()
    set_threads(a.threads)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    return a, Path(a.work), [("code", p) for p in code_prompts(a.prompts, source=DOMAIN)]


def main() -> None:
    a, work, prompts = setup(__doc__, "/tmp/recycle-quantized")
    t0 = time.perf_counter()
    targets = {"bf16": POST, "fp8": make_fp8(POST, work / "post-fp8"), "rtn4": make_rtn4(POST, work / "post-rtn4")}
    eagle = Path(convert_checkpoint(BASE, "eagle", work / "base-eagle", layouts="recycle,overlay",
                                    overwrite=True)["out"])
    rows: list[dict] = []

    def row(target: str, drafter: str, teacher: str | None, mtp: str, directory: Path) -> None:
        r = chain2(directory, prompts, a.max_new_tokens)
        rows.append({"target": target, "drafter": drafter, "teacher": teacher, "mtp_weights": mtp, **r})
        print(json.dumps(rows[-1]), flush=True)

    for name, t in targets.items():
        row(name, "native (stale, as released)", None, "FP8" if name == "fp8" else "BF16", t)
    tokens = parse_tokens(a.tokens)
    distilled = {}
    for teacher in ("bf16", "fp8", "rtn4"):
        out = work / f"realigned-{teacher}"
        rec = distill(DistillOptions(drafter=str(eagle), target=str(targets[teacher]), tokens=tokens, data=DOMAIN,
                                     out=str(out), overwrite=True, threads=a.threads))
        distilled[teacher] = out / "mtp_overlay"
        print(f"distilled against {teacher}: {rec['tokens']} tokens in {rec['train_s']:.0f} s, estimate "
              f"{rec['final']['heldout_estimate_before']:.3f} → {rec['final']['heldout_estimate_after']:.3f}", flush=True)
    for teacher, overlay in distilled.items():
        served = ["bf16", "fp8", "rtn4"] if teacher == "bf16" else [teacher]
        for name in served:
            modes = ["auto", "bf16"] if name == "fp8" else ["auto"]
            for mode in modes:
                st = Path(stitch_overlay(overlay, targets[name], work / f"st-{teacher}-{name}-{mode}",
                                         overwrite=True, mtp_dtype=mode)["out"])
                row(name, "realigned", teacher, "FP8" if name == "fp8" and mode == "auto" else "BF16", st)
    result = {"tokens": tokens, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "domain": DOMAIN,
              "rows": rows, "seconds": round(time.perf_counter() - t0)}
    if a.json:
        write_json(a.json, result)
    print("| target | drafter | taught by | MTP weights | α1 | α2 | τ (chain:2) | greedy = AR |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for r in rows:
        acc = r["acceptance"] + [0.0] * (2 - len(r["acceptance"]))
        print(f"| {r['target']} | {r['drafter']} | {r['teacher'] or '-'} | {r['mtp_weights']} | {acc[0]:.3f} | "
              f"{acc[1]:.3f} | {r['tau']:.3f} | {r['greedy_match']} |")


if __name__ == "__main__":
    main()
