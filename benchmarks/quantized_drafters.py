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
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fixtures.fp8 import make_fp8  # noqa: E402
from fixtures.rtn import make_rtn4  # noqa: E402
from recycle.bench import BenchOptions, run_bench, set_threads  # noqa: E402
from recycle.converters.api import convert_checkpoint, stitch_overlay  # noqa: E402
from recycle.distill.train import DistillOptions, distill, parse_tokens  # noqa: E402
from recycle.prompts import code_prompts  # noqa: E402

BASE, POST = ROOT / "fixtures/deepseek_v3_mtp", ROOT / "fixtures/deepseek_v3_mtp_posttrained"
DOMAIN = "py:transformers"


def chain2(target: Path, prompts: list, tokens: int, drafter: Path | None = None) -> dict:
    """`recycle bench --tree chain:2` (greedy) of a drafter, or of the target's own MTP modules: τ, α, losslessness."""
    r = run_bench(BenchOptions(drafter=str(drafter) if drafter else None, native=drafter is None, target=str(target),
                               prompts=prompts, max_new_tokens=tokens, tree="chain:2"))
    o = r["overall"]
    return {"tau": round(o["spec"]["tau"], 3), "acceptance": [round(a, 3) for a in o["spec"]["acceptance"]],
            "greedy_match": o["greedy_match"]}


def setup(doc: str, work: str) -> tuple[argparse.Namespace, Path, list]:
    """The options these re-alignment benchmarks share (work dir, budget, prompts, threads, JSON), the work dir made,
    and the held-out `py:transformers` code prompts every row is measured on."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=work)
    ap.add_argument("--tokens", default="256k")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
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
        Path(a.json).write_text(json.dumps(result, indent=1))
    print("| target | drafter | taught by | MTP weights | α1 | α2 | τ (chain:2) | greedy = AR |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for r in rows:
        acc = r["acceptance"] + [0.0] * (2 - len(r["acceptance"]))
        print(f"| {r['target']} | {r['drafter']} | {r['teacher'] or '-'} | {r['mtp_weights']} | {acc[0]:.3f} | "
              f"{acc[1]:.3f} | {r['tau']:.3f} | {r['greedy_match']} |")


if __name__ == "__main__":
    main()
