"""Several MTP modules in llama.cpp beyond n_max 1: its way of chaining them (`chain_heads`), measured against the
same way re-run with recycle's modules, and against recycle's own MTP chain.

llama.cpp drafts with a release's modules in turn (module k at draft step k) where the side file holds several:
MiMo-V2's three (mimo2 graph) and Step-3.5/3.7's three (step35). How it feeds them is its own
(`common/speculative.cpp`, read in `tests/engines/llama_interop.py` `chain_heads`): every module's cache over the
committed positions is filled from the trunk's states, as module 0's is, and the draft region is rebuilt per module
from the earlier steps' outputs. recycle's chain is MTP's (module k reads module k-1's state at every position, as
the modules were trained and as vLLM's DeepSeek MTP chains). So past n_max 1 the counts part, and this script says
by how much and why: per prompt, llama.cpp's counts; llama.cpp's scheme re-run with recycle's modules; recycle's
own chain (`bench --tree chain:N`, with its per-depth acceptance), and that chain again handing on the other state
(the `--to eagle` drafter with its `chained_state` switched: MiMo's row hands on the normed state, Step's the
pre-norm one), to see whether the state handed on is what parts the engines. τ as each engine states it: llama.cpp's
"mean len", 1 + accepted / the steps it drafted at; recycle's, the new tokens after the first / its steps.

The targets are the drafting copies (no trained MiMo or Step fixture exists): MiMo-V2.5's FP8 layout
(`mimo_v25_for_llama_cpp`) and Step-3.7's layout generator shaped to draft (`step_for_llama_cpp`). Trunk and side
files from llama.cpp's own converter (`--no-mtp`, `--mtp`). 6 held-out stdlib prompts × 48 new tokens, greedy.

    python benchmarks/llama_cpp_chain_heads.py --work /tmp/llama-chain-heads --depths 1,2,3
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.converters.api import convert_checkpoint
from recycle.engines.llama_cpp import convert_trunk

from _common import parser, stamp, write_json
from tests.engines.llama_interop import (
    chain_heads,
    llama_runs,
    mimo_v25_for_llama_cpp,
    prompt_ids,
    recycle_run,
    step_for_llama_cpp,
)

COPIES = {"MiMo-V2.5 (FP8, drafting copy)": mimo_v25_for_llama_cpp, "Step-3.7 (drafting copy)": step_for_llama_cpp}


def other_state(target: Path, work: Path) -> tuple[Path, str]:
    """The target's modules as a `--to eagle` drafter handing on the state its row does not."""
    out = work / f"{target.name}-eagle-other-state"
    convert_checkpoint(target, "eagle", out, overwrite=True)
    config = json.loads((out / "config.json").read_text())
    state = "post_norm" if config["recycle"]["chained_state"] == "pre_norm" else "pre_norm"
    config["recycle"]["chained_state"] = state
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out, state


def measure(name: str, target: Path, work: Path, depths: list[int], new_tokens: int) -> list[dict]:
    other, state = other_state(target, work)
    trunk = convert_trunk(target, work / f"{target.name}-trunk.gguf", mtp="no")
    side = convert_trunk(target, work / f"{target.name}-side.gguf", mtp="only")
    prompts, ids = prompt_ids(target, 6)
    plain = llama_runs(trunk, None, ids, new_tokens, 1)["tokens"]
    rows = []
    for n in depths:
        t0 = time.perf_counter()
        theirs = llama_runs(trunk, side, ids, new_tokens, n)
        sim = chain_heads(target, ids, new_tokens, n)
        ours = recycle_run(target, None, prompts, new_tokens, n)
        swapped = recycle_run(target, other, prompts, new_tokens, n)
        row = {"copy": name, "n_max": n, "llama_cpp": [[d["accepted"], d["drafted"]] for d in theirs["per_prompt"]],
               "llama_cpp_steps": theirs["steps"], "llama_cpp_tau": theirs["tau"],
               "scheme": [[c["accepted"], c["drafted"]] for c in sim],
               "scheme_steps": sum(c["steps"] for c in sim), "recycle": [ours["accepted"], ours["tried"]],
               "recycle_acceptance": ours["acceptance"], "recycle_tau": ours["tau"],
               "other_state": state, "recycle_other_state": [swapped["accepted"], swapped["tried"]],
               "lossless": theirs["tokens"] == plain, "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = parser(__doc__, work="/tmp/llama-chain-heads", json=True, max_new_tokens=48)
    ap.add_argument("--depths", default="1,2,3")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    depths = [int(x) for x in a.depths.split(",")]
    t0 = time.perf_counter()
    rows = [r for name, make in COPIES.items() for r in measure(name, make(work), work, depths, a.max_new_tokens)]
    if a.json:
        write_json(a.json, {**stamp(), "rows": rows})
    print("| copy | n_max | llama.cpp accepted/drafted per prompt (steps) | llama.cpp's scheme, recycle's modules "
          "| = | llama.cpp τ | recycle's chain accepted/tried (per-depth acceptance) | recycle τ "
          "| recycle's chain, the other state handed on | llama.cpp lossless |\n"
          "|---|---:|---|---|---|---:|---|---:|---|---|")
    for r in rows:
        per = ", ".join(f"{x}/{y}" for x, y in r["llama_cpp"])
        sim = ", ".join(f"{x}/{y}" for x, y in r["scheme"])
        same = r["llama_cpp"] == r["scheme"] and r["llama_cpp_steps"] == r["scheme_steps"]
        acc = ", ".join(f"{x:.2f}" for x in r["recycle_acceptance"])
        print(f"| {r['copy']} | {r['n_max']} | {per} ({r['llama_cpp_steps']}) | {sim} ({r['scheme_steps']}) | "
              f"{'yes' if same else 'NO'} | {r['llama_cpp_tau']:.3f} | {r['recycle'][0]}/{r['recycle'][1]} ({acc}) | "
              f"{r['recycle_tau']:.3f} | {r['recycle_other_state'][0]}/{r['recycle_other_state'][1]} "
              f"({r['other_state']}) | {'yes' if r['lossless'] else 'NO'} |")
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
