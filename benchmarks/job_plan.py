"""`recycle distill --plan` for the whole job (issue 49): DeepSeek-V3 and GLM-4.5 from their configs alone (no
weights), 1B tokens from a harvested cache (or a teacher server: the trainer holds the same), `--batch 8 --seq-len
2048`, 3 draft steps, bf16, on 8×H200 (one node) and on 16×H100 (two nodes of 8): memory per rank with its margin,
host RAM per node, storage, FLOPs per token and hours at the stated MFU range, and where the teacher can run.
`configs/glm4_5/config.json` holds GLM-4.5's size-setting fields (bf16 release; the widths as slime's
scripts/models/glm4.5-355B-A32B.sh gives them: 92 layers, hidden 5120, 96 heads, 8 KV heads, 160 experts of 1536,
top-8, vocabulary 151,552).

    python benchmarks/job_plan.py [--tokens 1B] [--host-ram 2048] [--json /tmp/job_plan.json]
"""

from __future__ import annotations

import time

from recycle.distill.jobplan import lines, plan_job
from recycle.options import DistillOptions
from recycle.preflight import parse_tokens

from _common import CONFIGS, parser, write_json

# (model, GPU, ranks, micro-batch): the whole batch where it fits the GPU with the margin, else micro-batch 2
JOBS = (("deepseek_v3", "H200", 8, None), ("deepseek_v3", "H100", 16, 2),
        ("glm4_5", "H200", 8, None), ("glm4_5", "H100", 16, 2))


def main() -> None:
    ap = parser(__doc__, json=True)
    ap.add_argument("--tokens", default="1B")
    ap.add_argument("--host-ram", type=float, default=2048.0, help="GB per node (a DGX H100/H200 node: 2 TB)")
    a = ap.parse_args()
    tokens = parse_tokens(a.tokens)
    rows = []
    t0 = time.perf_counter()
    for model, gpu, world, micro in JOBS:
        cfg = str(CONFIGS / model)
        opts = DistillOptions(drafter=cfg, target=cfg, out="/nonexistent", tokens=tokens, batch=8, seq_len=2048,
                              micro_batch=micro, cache_hidden="/cache", precision="bf16")
        d = plan_job(opts, world, gpu, tokens, 8, a.host_ram).as_dict()
        rows.append({"model": model, "gpu": gpu, "world": world, "micro_batch": micro, "plan": d})
        print(f"## {model} on {world}×{gpu} (micro-batch {micro or '-'})")
        print("\n".join(lines(d)))
    seconds = time.perf_counter() - t0
    if a.json:
        write_json(a.json, {"rows": rows, "seconds": round(seconds, 1), "tokens": tokens})
    print(f"\n{len(rows)} plans in {seconds:.1f} s")
    print("| model | GPUs | micro-batch | per rank GB (usable) | host RAM/node GB: start-up / checkpoint / end | "
          "cache TB (files) | checkpoint / best / output GB | GFLOP/token distill / teacher | distill h | "
          "teacher prefill h (GPUs) | teacher |")
    print("|---|---|---:|---:|---|---|---|---|---:|---|---|")
    for r in rows:
        d = r["plan"]
        h, s, f, t = d["host"], d["storage"], d["flops_per_token"], d["time_hours"]
        print(f"| {r['model']} | {r['world']}×{r['gpu']} | {r['micro_batch'] or '-'} | "
              f"{d['per_rank_bytes'] / 1e9:.1f} ({d['usable_bytes'] / 1e9:.1f}) | "
              f"{h['startup']['per_node'] / 1e9:.0f} / {h['checkpoint']['per_node'] / 1e9:.0f} / "
              f"{h['end']['per_node'] / 1e9:.0f} | {s['cache_bytes'] / 1e12:.2f} ({s['cache_files']}) | "
              f"{s['checkpoint_bytes'] / 1e9:.0f} / {s['best_bytes'] / 1e9:.0f} / {s['output_bytes'] / 1e9:.0f} | "
              f"{f['distill'] / 1e9:.1f} / {f['teacher_prefill'] / 1e9:.0f} | "
              f"{t['distill'][0]:.1f}-{t['distill'][1]:.1f} | {t['teacher'][0]:.1f}-{t['teacher'][1]:.1f} "
              f"({t['teacher_gpus']}) | {d['teacher_placement']['verdict']} |")
    print("\nHow each term is counted:")
    for k, v in rows[0]["plan"]["derivation"].items():
        print(f"- {k}: {v}")


if __name__ == "__main__":
    main()
