"""EAGLE-3 from MTP module 0 with a Llama midlayer (the portable default) or the block's own MLA attention
(`--eagle3-attention mla`): acceptance at 0 tokens and after the same short distillation.

    python benchmarks/eagle3_attention.py --tokens 32k
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recycle.converters.api import convert_checkpoint  # noqa: E402
from recycle.distill.train import DistillOptions, distill, parse_tokens  # noqa: E402
from recycle.bench import BenchOptions, run_bench  # noqa: E402
from recycle.prompts import prompt_set  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "fixtures/deepseek_v3_mtp"))
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="chain:3")
    ap.add_argument("--work", default="/tmp/recycle-eagle3-attention")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work, budget = Path(args.work), parse_tokens(args.tokens)
    prompts = prompt_set("stdlib", args.prompts)
    rows = {}
    for attention in ("llama", "mla"):
        src = convert_checkpoint(args.target, "eagle3", work / attention, overwrite=True,
                                 eagle3_attention=attention)["out"]
        out = distill(DistillOptions(drafter=src, target=args.target, tokens=budget, out=str(work / f"{attention}-d"),
                                     overwrite=True, threads=2))["out"]
        for name, d in (("0", src), (args.tokens, out)):
            r = run_bench(BenchOptions(drafter=d, target=args.target, prompts=prompts, max_new_tokens=args.max_new_tokens,
                                       tree=args.tree, stop_at_eos=False))["overall"]
            rows[(attention, name)] = {"tau": round(r["spec"]["tau"], 3), "accepted": r["spec"]["accepted"],
                                       "tried": r["spec"]["tried"], "greedy_match": r["greedy_match"]}
            print(attention, name, json.dumps(rows[(attention, name)]), flush=True)
    print(f"| midlayer | tokens | τ ({args.tree}) | accepted/tried per depth |\n|---|---|---|---|")
    for (attention, name), r in rows.items():
        per = ", ".join(f"{a}/{t}" for a, t in zip(r["accepted"], r["tried"]))
        print(f"| {attention} | {name} | {r['tau']:.3f} | {per} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{a}@{n}": r for (a, n), r in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
