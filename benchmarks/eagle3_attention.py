"""EAGLE-3 from MTP module 0 with a Llama midlayer (the portable default) or the block's own MLA attention
(`--eagle3-attention mla`): acceptance at 0 tokens and after the same short distillation.

    python benchmarks/eagle3_attention.py --tokens 32k
"""

from __future__ import annotations

import json
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.preflight import parse_tokens
from recycle.prompts import prompt_set

from _common import FIXTURE, parser, write_json


def main() -> None:
    ap = parser(__doc__, target=FIXTURE, work="/tmp/recycle-eagle3-attention", prompts=8, max_new_tokens=64, json=True)
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--tree", default="chain:3")
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
                                       tree=args.tree, stop_at_eos=False)).overall
            rows[(attention, name)] = {"tau": round(r.spec.tau, 3), "accepted": list(r.spec.accepted),
                                       "tried": list(r.spec.tried), "greedy_match": r.greedy_match}
            print(attention, name, json.dumps(rows[(attention, name)]), flush=True)
    print(f"| midlayer | tokens | τ ({args.tree}) | accepted/tried per depth |\n|---|---|---|---|")
    for (attention, name), r in rows.items():
        per = ", ".join(f"{a}/{t}" for a, t in zip(r["accepted"], r["tried"]))
        print(f"| {attention} | {name} | {r['tau']:.3f} | {per} |")
    if args.json:
        write_json(args.json, {f"{a}@{n}": r for (a, n), r in rows.items()})


if __name__ == "__main__":
    main()
