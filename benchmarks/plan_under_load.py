"""`recycle plan` idle and beside a busy loop: does it refuse to recommend, or recommend what the idle run does?

Runs the README's short plan (the EAGLE conversion of the trained fixture, `docs/prompts.jsonl`, chains up to 3,
16 new tokens) as a `recycle plan --json` subprocess twice: once as the machine is, then with one busy-loop
process per CPU core spinning beside it (issue 45: "under load, verifying 16 tokens measured 3.66 s and 32
tokens 0.19 s, and plan recommended from that"). Prints, per prompt set, each run's verdict, recommendation
and the findings that made it refuse; the load average before each run; and whether the loaded run passed
(refused, or recommended the idle run's shape).

    python benchmarks/plan_under_load.py [--json out.json] [--threads 1] [--max-new-tokens 16] [--max-chain 3]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recycle.converters.api import convert_checkpoint

from _common import FIXTURE, ROOT, parser, write_json


def spin(stop) -> None:
    """Burn one core until told to stop."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def plan(drafter: str, target: str, args) -> dict:
    cmd = [sys.executable, "-m", "recycle.cli", "plan", drafter, "--target", target,
           "--prompts", str(ROOT / "docs/prompts.jsonl"), "--max-chain", str(args.max_chain),
           "--max-new-tokens", str(args.max_new_tokens), "--gpu", "H100", "--batch-sizes", "1,64", "--json"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if res.returncode:
        raise SystemExit(f"plan failed ({res.returncode}): {res.stderr.strip()}")
    data = json.loads(res.stdout)
    return {
        "load_before": load, "seconds": time.perf_counter() - t0,
        "verify_ms": {n: data["verify_s"][n - 1] * 1e3 for n in (1, 2, 4, 8, 16, 32)},
        "sets": {name: {"verdict": st["verdict"], "recommended": (st["recommended"] or {}).get("shape"),
                        "noise": st["noise"],
                        "candidates": {r["shape"]: round(r["predicted"], 3) for r in st["candidates"]}}
                 for name, st in data["sets"].items()},
    }


def main() -> None:
    ap = parser(__doc__, target=FIXTURE, max_new_tokens=16, threads=None, json=True)
    ap.add_argument("--max-chain", type=int, default=3)
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy-loop processes (default: one a core)")
    args = ap.parse_args()
    out = {"cpus": os.cpu_count(), "busy_processes": args.busy, "max_new_tokens": args.max_new_tokens,
           "max_chain": args.max_chain, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        drafter = str(Path(tmp) / "eagle")
        convert_checkpoint(args.target, "eagle", drafter)
        out["idle"] = plan(drafter, args.target, args)
        stop = mp.Event()
        procs = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
        for p in procs:
            p.start()
        try:
            time.sleep(2)  # let the load average see them
            out["loaded"] = plan(drafter, args.target, args)
        finally:
            stop.set()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
    ok = True
    print(f"{'set':6} {'run':7} {'load':>5} {'s':>5}  verdict / recommended")
    for name in out["idle"]["sets"]:
        for run in ("idle", "loaded"):
            r = out[run]
            st = r["sets"][name]
            pick = st["recommended"] or "-"
            print(f"{name:6} {run:7} {r['load_before']:5.1f} {r['seconds']:5.0f}  {st['verdict']} {pick}"
                  + (f"  ({'; '.join(st['noise'])})" if st["noise"] else ""))
        idle, loaded = out["idle"]["sets"][name], out["loaded"]["sets"][name]
        same = loaded["recommended"] is None or loaded["recommended"] == idle["recommended"]
        ok &= same
    out["passed"] = ok
    print(f"loaded run {'refused or agreed with the idle run' if ok else 'RECOMMENDED SOMETHING ELSE'} on every set")
    if args.json:
        write_json(args.json, out, indent=2)


if __name__ == "__main__":
    main()
