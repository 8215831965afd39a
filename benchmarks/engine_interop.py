"""The README's interop table: every output recycle writes for vLLM, run in vLLM's CPU build and in recycle.

Runs `tests/engines/interop.py` for each trained fixture (the same code the slow engine suite asserts on)
and prints the table rows; `--json` keeps every count. vLLM comes from the venv recycle manages
(`recycle.engines.vllm_env`; `RECYCLE_VLLM_PYTHON` points at an existing one).

    RECYCLE_VLLM_PYTHON=/tmp/vllm-venv/bin/python python benchmarks/engine_interop.py --json /tmp/interop.json
"""

from __future__ import annotations

import time
from pathlib import Path

from _common import parser, write_json
from tests.engines.interop import ENGINE, FIXTURES, interop

HEADER = ("| fixture | vLLM method | output | loads | greedy lossless | k=1 accepted/drafted: vLLM vs recycle bench |\n"
          "|---|---|---|---|---|---|")


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-interop", json=True)
    ap.add_argument("--fixtures", default=",".join(FIXTURES), help="comma list of " + ", ".join(FIXTURES))
    args = ap.parse_args()
    rows, t0 = [], time.time()
    for name in args.fixtures.split(","):
        rows += interop(name, FIXTURES[name], Path(args.work) / name.replace(".", ""))
    print(f"{ENGINE}, {time.time() - t0:.0f} s\n{HEADER}")
    for r in rows:
        print(r.table_row())
    if args.json:
        write_json(args.json, [r.as_dict() for r in rows])


if __name__ == "__main__":
    main()
