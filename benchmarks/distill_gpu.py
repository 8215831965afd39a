"""`recycle distill` on one GPU (issue 29): single process against FSDP2 over a mesh of one, bf16, with the memory
plan's prediction beside the measured peak and a profiler's account of where a step's time goes.

    python benchmarks/distill_gpu.py [--tokens 1M] [--batch 16] [--seq-len 512] [--json OUT.json]

It converts `fixtures/deepseek_v3_mtp` (`--source`) to an EAGLE drafter, then runs three distillations of it
against the post-trained target (`--target`), each in its own process:

- `single`: `python benchmarks/distill_gpu.py run ...`, one process, no process group;
- `fsdp1`: the same under `torchrun --nproc_per_node 1`: distill joins a process group and shards the drafter
  with FSDP2 (`fully_shard` per decoder layer, bf16 params, fp32 reduce), the code path of a multi-GPU run;
- `profile`: `single` again, shorter, under `torch.profiler` (CPU + CUDA): the kernels that ran inside each of
  distill's named ranges (`recycle.teacher`, `recycle.drafter`, `recycle.optimizer`) against the steps' wall time.

Each run reports distill's own record (tokens/s, the CUDA allocator's peak) and `recycle.distill.memory`'s plan
for the same options. A CPU-only machine runs it too (`--device cpu`), without the kernel account.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import FIXTURE, POSTTRAINED, parser, write_json

LABELS = ("recycle.teacher", "recycle.drafter", "recycle.optimizer")


def kernel_account(prof, labels=LABELS) -> dict:
    """Device time of the kernels that started inside each named range, and the profiled steps' wall time.

    distill synchronises the device at the end of its teacher and drafter ranges, so a kernel launched inside one
    also starts (and ends) inside it; backward's kernels, launched by autograd's device thread while the main
    thread waits in `.backward()`, fall inside the drafter's range by their start times."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    ranges = {name: [] for name in labels}
    kernels = []
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in ranges:
            ranges[e.name].append((e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CUDA and not e.name.startswith(("recycle.", "ProfilerStep")):
            kernels.append((e.time_range.start, e.time_range.end - e.time_range.start))
    steps = [(e.time_range.start, e.time_range.end) for e in events
             if e.device_type == DeviceType.CPU and e.name.startswith("ProfilerStep")]
    wall = sum(b - a for a, b in steps) or (max(b for r in ranges.values() for _, b in r)
                                            - min(a for r in ranges.values() for a, _ in r))
    out = {"profiled_wall_ms": round(wall / 1e3, 3), "kernels": len(kernels),
           "kernel_ms_all": round(sum(d for _, d in kernels) / 1e3, 3)}
    for name, spans in ranges.items():
        inside = sum(d for t, d in kernels if any(a <= t <= b for a, b in spans))
        out[name] = {"wall_ms": round(sum(b - a for a, b in spans) / 1e3, 3), "kernel_ms": round(inside / 1e3, 3),
                     "kernel_share_of_step": round(inside / wall, 4) if wall else None}
    out["kernel_share_of_step"] = round(sum(d for _, d in kernels) / wall, 4) if wall else None
    return out


def run(a: argparse.Namespace) -> None:
    """One distillation in this process (under torchrun or not); its record, the plan and the kernel account as
    JSON on `--json`."""
    import torch
    import torch.distributed as dist

    from recycle.distill.memory import for_options
    from recycle.distill.train import distill
    from recycle.options import DistillOptions
    from recycle.preflight import parse_tokens

    opts = DistillOptions(drafter=a.drafter, target=a.target, out=a.out, tokens=parse_tokens(a.tokens),
                          batch=a.batch, seq_len=a.seq_len, device=a.device, precision=a.precision,
                          eval_every=10_000, overwrite=True)
    prof = None
    progress = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts, schedule=schedule(wait=a.profile_wait, warmup=2, active=a.profile_steps,
                                                          repeat=1))
        prof.start()
        progress = lambda row: prof.step()  # one profiler step per training step
    t0 = time.perf_counter()
    record = distill(opts, progress=progress)
    wall = time.perf_counter() - t0
    account = None
    if prof is not None:
        prof.stop()
        account = kernel_account(prof)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        device_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        p = for_options(replace(opts, precision=record["precision"]),
                        record["data"]["world_size"], device_bytes=device_bytes, fsdp=record["sharded"] is not None)
        out = {"label": a.label, "wall_s": round(wall, 2), "record": {k: record[k] for k in (
            "tokens", "steps", "train_s", "tokens_per_s", "timing", "target_forward_share", "device", "precision",
            "sharded", "peak_memory_bytes", "setup_s")},
               "heldout_estimate": [record["final"]["heldout_estimate_before"],
                                    record["final"]["heldout_estimate_after"]],
               "final_loss": record["final"]["loss"],
               "plan": p.as_dict(), "plan_over_measured": round(p.per_rank_bytes / record["peak_memory_bytes"], 3),
               "kernels": account,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "torch": torch.__version__}
        write_json(a.json, out)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    ap = parser(__doc__, target=POSTTRAINED, out=None, json=True)
    ap.add_argument("mode", nargs="?", default="all", choices=("all", "run"))
    ap.add_argument("--source", default=str(FIXTURE))
    ap.add_argument("--drafter", default=None, help="run: the EAGLE drafter (all: converted from --source)")
    ap.add_argument("--tokens", default="1M")
    ap.add_argument("--profile-tokens", default="256k")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default=None)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--label", default="single")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-wait", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=10)
    a = ap.parse_args()
    if a.mode == "run":
        return run(a)
    from recycle.converters.api import convert_checkpoint

    work = Path(tempfile.mkdtemp(prefix="distill-gpu-"))
    drafter = work / "eagle"
    convert_checkpoint(a.source, "eagle", drafter)
    me = [sys.executable, str(Path(__file__).resolve()), "run", "--drafter", str(drafter), "--target", a.target,
          "--batch", str(a.batch), "--seq-len", str(a.seq_len), "--precision", a.precision]
    if a.device:
        me += ["--device", a.device]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29533"]
    runs = {"single": me + ["--tokens", a.tokens],
            "fsdp1": torchrun + me[1:] + ["--tokens", a.tokens],
            "profile": me + ["--tokens", a.profile_tokens, "--profile"]}
    results = []
    for label, cmd in runs.items():
        out = work / f"{label}.json"
        cmd = cmd + ["--label", label, "--out", str(work / f"drafter-{label}"), "--json", str(out)]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode != 0:  # the next runs still measure; the summary says which failed
            print(f"{label}: failed (exit {done.returncode})", flush=True)
            results.append({"label": label, "failed": done.returncode})
            continue
        r = json.loads(out.read_text())
        r["process_wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        rec = r["record"]
        print(f"{label}: {rec['tokens_per_s']:,.0f} tok/s over {rec['tokens']:,} tokens; peak "
              f"{rec['peak_memory_bytes'] / 2**20:,.0f} MiB, plan {r['plan']['per_rank_bytes'] / 2**20:,.0f} MiB "
              f"({r['plan_over_measured']:.2f}x); held-out τ estimate {r['heldout_estimate'][0]:.3f} → "
              f"{r['heldout_estimate'][1]:.3f}", flush=True)
        if r["kernels"]:
            k = r["kernels"]
            print(f"  kernels: {k['kernel_share_of_step']:.1%} of the profiled steps' wall "
                  + ", ".join(f"{n.split('.')[1]} {k[n]['kernel_share_of_step']:.1%} (range wall "
                              f"{k[n]['wall_ms'] / k['profiled_wall_ms']:.1%})" for n in LABELS), flush=True)
        if a.json:  # after every run: a run cut short by a time limit keeps the ones before it
            write_json(a.json, {"runs": results, "options": vars(a)})


if __name__ == "__main__":
    main()
