"""`recycle distill --plan` for DeepSeek-V3 at its real size (issue 29), from its config alone (no weights):
per-rank bytes by part for 1, 8 and 16 H100s, all experts trained against `--freeze experts`, with the teacher
in process and from a harvested cache (that one also with `--micro-batch 2`, and with `--activation-checkpointing`), at `--batch 8 --seq-len 2048`, 3 draft
steps, bf16.

    python benchmarks/memory_plan.py [--config benchmarks/configs/deepseek_v3] [--json /tmp/plan.json]
"""

from __future__ import annotations

import time

from recycle.distill.memory import GIB, plan

from _common import CONFIGS, parser, write_json


def main() -> None:
    ap = parser(__doc__, json=True)
    ap.add_argument("--config", default=str(CONFIGS / "deepseek_v3"))
    ap.add_argument("--gpu", default="H100")
    a = ap.parse_args()
    rows = []
    t0 = time.perf_counter()
    # the harvested teacher also with --micro-batch 2, and with --activation-checkpointing
    for teacher, micro, ckpt in ((False, None, False), (True, None, False), (True, 2, False), (True, None, True)):
        for groups in ((), ("experts",)):
            for world in (1, 8, 16):
                p = plan(a.config, a.config, batch=8, seq_len=2048, draft_steps=3, world=world, precision="bf16",
                         cached_teacher=teacher, groups=groups, gpu=a.gpu, micro_batch=micro,
                         activation_checkpointing=ckpt)
                rows.append(p.as_dict())
    seconds = time.perf_counter() - t0
    if a.json:
        write_json(a.json, {"rows": rows, "seconds": round(seconds, 1)})
    parts = list(rows[0]["parts"])
    print(f"{len(rows)} plans in {seconds:.1f} s")
    print("| teacher | frozen | micro-batch | activation checkpointing | ranks | trained params | " + " | ".join(parts) +
          " | total per rank | GB | fits |")
    print("|---|---|---:|---|---:|---:|" + "---:|" * len(parts) + "---:|---:|---|")
    for r in rows:
        o = r["options"]
        cells = " | ".join(f"{r['parts'][k] / GIB:.1f}" for k in parts)
        print(f"| {o['teacher']} | {','.join(o['freeze']) or '-'} | {o['micro_batch'] or '-'} | "
              f"{'yes' if o['activation_checkpointing'] else '-'} | {o['world_size']} | "
              f"{r['trainable_params'] / 1e9:.2f}B | {cells} | {r['per_rank_bytes'] / GIB:.1f} GiB | "
              f"{r['per_rank_bytes'] / 1e9:.1f} | {'yes' if r['fits'] else 'no'} |")


if __name__ == "__main__":
    main()
