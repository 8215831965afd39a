"""What each --loss term costs in memory: the peak of one chunked loss, forward and backward, per term list.

Three draft steps share one `TargetLogits` (as distill's unrollers set them), rows = one chunk of LOSS_CHUNK_ROWS
positions, vocabulary V: each configuration runs in a fresh process and reports its peak RSS above the process's
RSS once its inputs exist, in units of one [chunk, V] float32 tensor. distill/memory.py's plan counts the loss with
these units (`LOSS_TENSORS`, `TERM_TENSORS`).

    python benchmarks/loss_terms_memory.py --vocab 32768 --json /tmp/loss_terms.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from _common import parser, stamp, write_json

CONFIGS = ("kl,ce=0.1", "tv,ce=0.1", "kl,tv,ce=0.1", "kl@0.7,ce=0.1", "kl,tv,kl@0.7,tv@0.7,ce=0.1")


def one(loss: str, vocab: int, hidden: int) -> dict:
    """Run in this process: the peak RSS of the loss's forward and backward above the inputs' RSS."""
    import torch

    from recycle.distill.losses import LOSS_CHUNK_ROWS, StepOutput, TargetLogits, distill_loss
    from recycle.options import LossConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = LOSS_CHUNK_ROWS
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(rows + 3, hidden)
    teacher = TargetLogits(states, head)
    drafts = [torch.randn(rows, hidden, requires_grad=True) for _ in range(3)]
    steps = [StepOutput(d, states[k:k + rows], torch.randint(0, vocab, (rows,)), head=head, target_head=head,
                        shared=teacher, positions=torch.arange(k, k + rows)) for k, d in enumerate(drafts)]
    unit = rows * vocab * 4
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * resource.getpagesize()
    loss, _ = distill_loss(steps, LossConfig(loss=loss))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_above_inputs_bytes": peak - base, "tensors": round((peak - base) / unit, 2), "unit_bytes": unit}


def main() -> None:
    ap = parser(__doc__, json=True)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one configuration, in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.vocab, a.hidden)))
        return
    rows = []
    for loss in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--one", loss, "--vocab", str(a.vocab), "--hidden",
                              str(a.hidden)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1]) | {"loss": loss}
        rows.append(r)
        print(f"{loss:28s} peak above inputs {r['peak_above_inputs_bytes'] / 2**20:8.0f} MiB = {r['tensors']:.2f} "
              f"[chunk, V] fp32 tensors", flush=True)
    if a.json:
        write_json(a.json, {**stamp(), "vocab": a.vocab, "hidden": a.hidden, "rows": rows})


if __name__ == "__main__":
    main()
