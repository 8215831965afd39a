"""Where a distill step's memory goes, against `recycle distill --plan` (issue 29: the plan's activation terms).

    python benchmarks/activation_account.py --drafter EAGLE --target T --batch 16 --seq-len 512 [--device cuda]

Prepares a real run (`recycle.distill.setup.prepare`, the options distill takes), runs one step to warm up (AdamW's moments exist), then one
measured step with every tensor autograd saves for backward recorded by `recycle.distill.memory.SavedAccount` (the
plan's own account: each storage once, sorted into params, loss, expert and weight copies, and the layers' blocks;
attention counted as a fused kernel saves it, so a CPU run stands for a GPU one).

On CUDA it also reads the allocator: bytes held before the step (weights, grads, AdamW, teacher, features), at the
end of the forward (the loss computed, before backward) and the step's peak. Prints one JSON object.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from _common import parser


def main() -> None:
    ap = parser(__doc__, threads=None)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default=None)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    args = ap.parse_args()

    import recycle.distill.train as train
    from recycle.distill.memory import SavedAccount, for_options
    from recycle.distill.setup import prepare
    from recycle.options import DistillOptions

    work = Path(tempfile.mkdtemp(prefix="recycle-act-"))
    opts = DistillOptions(drafter=args.drafter, target=args.target, out=str(work / "out"),
                          tokens=args.batch * args.seq_len * 3, batch=args.batch, seq_len=args.seq_len,
                          device=args.device, precision=args.precision, micro_batch=args.micro_batch,
                          threads=args.threads, eval_every=1000, checkpoint_every=1000)
    d = prepare(opts)  # the counters at zero, as the loop starts them
    cuda = d.device.type == "cuda"
    steps = list(d.schedule.steps(0))
    train.train_step(d, steps[0])  # warm-up: AdamW's moments allocated
    vocab = d.teacher.head.weight.shape[0]
    account = SavedAccount(d.model, vocab)  # distill's own account (attention counted as a fused kernel saves it)
    marks: dict[str, int] = {}
    loss_fn = train.distill_loss

    def measured_loss(*a, **k):  # the end of the forward: every saved tensor exists, backward has not begun
        out = loss_fn(*a, **k)
        if cuda:
            marks.setdefault("allocated_end_of_forward", torch.cuda.memory_allocated(d.device))
            marks.setdefault("peak_in_forward", torch.cuda.max_memory_allocated(d.device))
        return out

    train.distill_loss = measured_loss
    if cuda:
        torch.cuda.synchronize(d.device)
        marks["allocated_before_step"] = torch.cuda.memory_allocated(d.device)
        torch.cuda.reset_peak_memory_stats(d.device)
    with account.active():
        train.train_step(d, steps[1])
    if cuda:
        torch.cuda.synchronize(d.device)
        marks["peak_in_step"] = torch.cuda.max_memory_allocated(d.device)
    train.distill_loss = loss_fn
    plan = for_options(replace(opts, precision=d.precision), d.run.ranks.world,
                       device_bytes=torch.cuda.get_device_properties(d.device).total_memory if cuda else None)
    saved = account.totals()
    out = {"device": str(d.device), "precision": d.precision, "batch": args.batch, "seq_len": args.seq_len,
           "micro_batch": args.micro_batch, "draft_steps": d.unroller.steps, "vocab": vocab,
           "saved_for_backward": saved,
           "saved_activation_bytes": sum(v for k, v in saved.items() if k != "params"),
           "allocator": marks, "plan_parts": plan.parts, "plan_per_rank_bytes": plan.per_rank_bytes}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
