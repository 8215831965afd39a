"""What `distill --freeze experts` costs (issue 29): re-aligned acceptance with the routed experts frozen against
training everything, at equal tokens, on the MoE fixtures.

- DeepSeek: the base fixture's modules (`convert --to eagle`) re-aligned to the post-trained fixture (stale
  modules: the case re-alignment exists for);
- GLM-4.5: the fixture's own modules distilled against their own trunk on a domain neither was trained on
  (`py:transformers`), the fine-tune case.

Each drafter is measured by `recycle bench --tree chain:2` (greedy) on held-out `py:transformers` code prompts,
against the target it was distilled for; the record gives trainable parameters, tokens/s and the held-out
estimate. At DeepSeek-V3 scale freezing the experts takes the trainable count from 11.61B to 0.34B (see
`recycle distill --plan`).

    python benchmarks/freeze_experts.py --tokens 256k --threads 2 --json /tmp/freeze.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from quantized_drafters import DOMAIN, chain2, setup

from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.preflight import parse_tokens

from _common import FIXTURE, GLM_FIXTURE, POSTTRAINED, write_json

CASES = {  # name: (source of the modules, target)
    "deepseek (post-trained target)": (FIXTURE, POSTTRAINED),
    "glm-4.5 (new domain)": (GLM_FIXTURE, GLM_FIXTURE),
}


def main() -> None:
    a, work, prompts = setup(__doc__, "/tmp/recycle-freeze")
    t0 = time.perf_counter()
    tokens = parse_tokens(a.tokens)
    rows = []
    for i, (case, (source, target)) in enumerate(CASES.items()):
        eagle = Path(convert_checkpoint(source, "eagle", work / f"eagle-{i}", overwrite=True)["out"])
        rows.append({"case": case, "freeze": "-", "tokens": 0, **chain2(target, prompts, a.max_new_tokens, eagle)})
        print(json.dumps(rows[-1]), flush=True)
        for freeze in ((), ("experts",)):
            rec = distill(DistillOptions(drafter=str(eagle), target=str(target), tokens=tokens, data=DOMAIN,
                                         out=str(work / f"d-{i}-{'-'.join(freeze) or 'all'}"), overwrite=True,
                                         threads=a.threads, freeze=freeze))
            rows.append({"case": case, "freeze": ",".join(freeze) or "nothing", "tokens": rec["tokens"],
                         "trainable_params": rec["freeze"]["trainable_params"], "params": rec["freeze"]["params"],
                         "tokens_per_s": round(rec["tokens_per_s"]), "train_s": round(rec["train_s"]),
                         "estimate": [rec["final"]["heldout_estimate_before"], rec["final"]["heldout_estimate_after"]],
                         **chain2(target, prompts, a.max_new_tokens, Path(rec["out"]))})
            print(json.dumps(rows[-1]), flush=True)
    result = {"tokens": tokens, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "domain": DOMAIN,
              "rows": rows, "seconds": round(time.perf_counter() - t0)}
    if a.json:
        write_json(a.json, result)
    print("| case | frozen | tokens | trained params | tokens/s | held-out estimate | α1 | α2 | τ (chain:2) | greedy = AR |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        acc = r["acceptance"] + [0.0] * (2 - len(r["acceptance"]))
        est = f"{r['estimate'][0]:.3f} → {r['estimate'][1]:.3f}" if "estimate" in r else "-"
        params = f"{r['trainable_params']:,} of {r['params']:,}" if "params" in r else "-"
        print(f"| {r['case']} | {r['freeze']} | {r['tokens']:,} | {params} | {r.get('tokens_per_s', '-')} | {est} | "
              f"{acc[0]:.3f} | {acc[1]:.3f} | {r['tau']:.3f} | {r['greedy_match']} |")


if __name__ == "__main__":
    main()
