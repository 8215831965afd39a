"""What a new user waits for (issue 17): the quick start after the install, and how fast bad input fails.

Each command runs as the README writes it, in a fresh process (interpreter start and imports included),
timed by wall clock:

    python benchmarks/first_hour.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, parser

RECYCLE = str(Path(sys.executable).with_name("recycle"))


def timed(args: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - t0, res.returncode, (res.stderr.strip().splitlines() or [""])[-1][:90]


def main() -> None:
    parser(__doc__).parse_args()
    work = Path(tempfile.mkdtemp(prefix="recycle-first-hour-"))
    empty = work / "not-a-drafter"
    empty.mkdir()
    rows = [
        ("quick start: convert", [RECYCLE, "convert", "fixtures/deepseek_v3_mtp", "--to", "eagle", "-o",
                                  str(work / "drafter"), "--overwrite"]),
        ("quick start: bench --quick", [RECYCLE, "bench", str(work / "drafter"), "--target", "fixtures/deepseek_v3_mtp",
                                        "--quick"]),
        ("bad input: distill --tokens abc", [RECYCLE, "distill", str(work / "drafter"), "--target",
                                             "fixtures/deepseek_v3_mtp", "--tokens", "abc"]),
        ("bad input: push --dry-run, no recycle.json", [RECYCLE, "push", str(empty), "--repo", "me/x", "--dry-run"]),
        ("bad input: bench, missing target", [RECYCLE, "bench", str(work / "drafter"), "--target", str(work / "nope")]),
        ("bad input: inspect, missing directory", [RECYCLE, "inspect", str(work / "nope")]),
    ]
    print("| command | wall s | exit | last stderr line |\n|---|---:|---:|---|")
    for label, args in rows:
        secs, rc, last = timed(args)
        print(f"| {label} | {secs:.2f} | {rc} | {last} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
