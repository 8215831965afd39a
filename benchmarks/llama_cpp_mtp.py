"""recycle's GGUF side files in llama.cpp (issue 31): agreement with recycle, and the stale case re-aligned.

1. Agreement, on both MTP fixtures: the trunk GGUF from llama.cpp's own converter (f32; DeepSeek-V3's drops MTP),
   recycle's side file (`convert --to gguf`, f32), `llama-server --spec-type draft-mtp --spec-draft-n-max N`
   against `recycle bench --tree chain:N` on the same prompt ids (stdlib held-out code), N = 1, 2, 3: τ, drafted /
   accepted, and whether the drafted greedy output equals plain llama.cpp's. llama.cpp applies its one module at
   every draft position, so recycle drafts with `convert --to eagle` of the same module (its one layer chained on
   its own output, as llama.cpp and vLLM chain it), not with the checkpoint's second module at depth 2.
2. The stale case: `fixtures/deepseek_v3_mtp_posttrained` (trunk trained on, its modules not), on its new domain
   (py:transformers held-out prompts): the stale module's side file against the side file of its module after
   `recycle distill --tokens BUDGET` (the distilled drafter converted with `--target TRUNK.gguf`), both engines.
3. Write time of the side files (seconds) for the fixtures.

    python benchmarks/llama_cpp_mtp.py --distill-tokens 256k --json /tmp/llama_cpp_mtp.json
    python benchmarks/llama_cpp_mtp.py --fixtures Qwen3.5 --no-stale --embedded --json /tmp/llama_cpp_qwen.json
    python benchmarks/llama_cpp_mtp.py --fixtures DeepSeek-V4 --json /tmp/llama_cpp_v4.json
    python benchmarks/llama_cpp_mtp.py --fixtures "Step-3.7 (drafting copy)" --no-stale --json /tmp/llama_cpp_step.json
    python benchmarks/llama_cpp_mtp.py --fixtures DeepSeek-V4 --no-stale --depths 1 --side-dtypes q8_0,fp16

Step-3.7 (`--fixtures "Step-3.7 (drafting copy)"`, part 1 with `--no-stale`): its layout generator shaped to draft
(`step_for_llama_cpp`: there is no trained Step fixture), all three modules in the side file, which llama.cpp
drafts with in turn, against recycle's native chain of the three.

DeepSeek-V4 (`--fixtures DeepSeek-V4`): its trained fixtures as llama.cpp takes them (`v4_for_llama_cpp`: FP4
routed experts, indexer heads widened, the same logits), parts 1 and 3, and part 2 on
`fixtures/deepseek_v4_mtp_posttrained` (its module distilled as `convert --to eagle` → `distill` → `--to gguf`).

Needs the managed llama.cpp (`recycle.engines.llama_cpp`: built on first use, 15-26 min on two cores).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.engines.llama_cpp import convert_trunk
from recycle.preflight import parse_tokens
from recycle.prompts import prompt_set

from _common import POSTTRAINED, parser, stamp, write_json
from tests.engines.llama_interop import (
    FIXTURES,
    STEP,
    V4,
    llama_runs,
    recycle_run,
    side_file,
    step_for_llama_cpp,
    trunk_gguf,
    v4_for_llama_cpp,
)


def ids_of(fixture: Path, prompts) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixture))
    return [tok(p, add_special_tokens=False)["input_ids"] for _, p in prompts]


def compare(target: Path, trunk: Path, side: Path, drafter: Path | None, prompts, new_tokens: int, depths) -> dict:
    ids = ids_of(target, prompts)
    plain = llama_runs(trunk, None, ids, new_tokens, 1)["tokens"]
    rows = {}
    for n in depths:
        ll = llama_runs(trunk, side, ids, new_tokens, n)
        rc = recycle_run(target, drafter, prompts, new_tokens, n)
        rows[n] = {"llama_cpp": {"tau": ll["tau"], "drafted": ll["drafted"], "accepted": ll["accepted"],
                                 "steps": ll["steps"], "lossless": ll["tokens"] == plain},
                   "recycle": {"tau": rc["tau"], "tried": rc["tried"], "accepted": rc["accepted"],
                               "acceptance": rc["acceptance"]}}
        print(target.name, side.parent.name, n, json.dumps(rows[n]), flush=True)
    return rows


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-llama-cpp", prompts=6, max_new_tokens=64, json=True)
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--distill-tokens", default="256k")
    ap.add_argument("--fixtures", default=None, help="comma list of the fixtures to compare (default: all)")
    ap.add_argument("--no-stale", action="store_true", help="skip part 2 (the post-trained DeepSeek re-aligned)")
    ap.add_argument("--side-dtypes", default="", help="also draft at n_max = 1 with the side file in these --dtype "
                    "values (e.g. q8_0,fp16), against the f32 one")
    ap.add_argument("--embedded", action="store_true", help="also draft with llama.cpp's own GGUF holding the module "
                    "(its converter keeps it: not DeepSeek-V3's)")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    depths = [int(x) for x in a.depths.split(",")]
    out: dict = {**stamp(), "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "agreement": {},
                 "write_s": {}}
    code = prompt_set("stdlib", a.prompts)
    chosen = a.fixtures.split(",") if a.fixtures else list(FIXTURES)
    v4 = "DeepSeek-V4" in chosen
    targets = {n: v4_for_llama_cpp(V4[n], work) if n in V4 else step_for_llama_cpp(work) if n == STEP
               else FIXTURES[n] for n in chosen}
    for name, fx in targets.items():
        trunk = trunk_gguf(fx, work)
        chained = name == STEP  # llama.cpp drafts with Step's three modules in turn: recycle's native chain
        t0 = time.perf_counter()
        side = side_file(fx, work, f"{fx.name}-side", module=None if chained else 0)
        out["write_s"][name] = round(time.perf_counter() - t0, 2)
        eagle = None if chained else Path(convert_checkpoint(fx, "eagle", work / f"{fx.name}-eagle",
                                                             overwrite=True)["out"])
        out["agreement"][name] = compare(fx, trunk, side, eagle, code, a.max_new_tokens, depths)
        if a.side_dtypes:  # the same module in smaller side files, llama.cpp at n_max = 1 on the same prompts
            ids = ids_of(fx, code)
            plain = llama_runs(trunk, None, ids, a.max_new_tokens, 1)["tokens"]
            for dt in a.side_dtypes.split(","):
                f = Path(convert_checkpoint(fx, "gguf", work / f"{fx.name}-side-{dt}", overwrite=True, dtype=dt,
                                            module=0)["out"]) / "mtp.gguf"
                ll = llama_runs(trunk, f, ids, a.max_new_tokens, 1)
                out.setdefault("side_dtypes", {}).setdefault(name, {})[dt] = {
                    "bytes": f.stat().st_size, "drafted": ll["drafted"], "accepted": ll["accepted"],
                    "lossless": ll["tokens"] == plain}
                print(name, "side file", dt, json.dumps(out["side_dtypes"][name][dt]), flush=True)
        if a.embedded:  # llama.cpp's own conversion with the module inside the one GGUF (no -md), at n_max = 1
            whole = convert_trunk(fx, work / f"{fx.name}-with-mtp-f32.gguf", mtp="keep")
            ids = ids_of(fx, code)
            ll = llama_runs(whole, None, ids, a.max_new_tokens, 1, embedded=True)
            plain = llama_runs(trunk, None, ids, a.max_new_tokens, 1)["tokens"]
            out.setdefault("embedded", {})[name] = {"tau": ll["tau"], "drafted": ll["drafted"],
                                                    "accepted": ll["accepted"], "lossless": ll["tokens"] == plain}
            print(name, "MTP inside the trunk GGUF, n_max 1", json.dumps(out["embedded"][name]), flush=True)
        if a.json:  # after every phase, so a long run leaves what it measured
            write_json(a.json, out)
    if a.no_stale:
        return _table(out)
    posttrained = v4_for_llama_cpp(V4["DeepSeek-V4 post-trained"], work) if v4 else POSTTRAINED
    out["stale"] = stale_case(posttrained, work, parse_tokens(a.distill_tokens), a.prompts, a.max_new_tokens, depths)
    if a.json:
        write_json(a.json, out)
    _table(out)


def stale_case(target: Path, work: Path, budget: int, n_prompts: int, new_tokens: int, depths) -> dict:
    """Part 2 on a post-trained target: its stale module's side file against its module distilled `budget` tokens
    on the post-training domain and converted against the trunk GGUF, in both engines, on that domain."""
    trunk = trunk_gguf(target, work)
    stale = side_file(target, work, f"{target.name}-stale")
    eagle = convert_checkpoint(target, "eagle", work / f"{target.name}-eagle", overwrite=True)["out"]
    t0 = time.perf_counter()
    rec = distill(DistillOptions(drafter=eagle, target=str(target), tokens=budget, data="py:transformers",
                                 out=str(work / f"{target.name}-eagle-d"), overwrite=True, checkpoint_every=10**9))
    distill_s = time.perf_counter() - t0
    realigned = side_file(Path(rec["out"]), work, f"{target.name}-realigned", trunk=trunk)
    domain = prompt_set("py:transformers", n_prompts)
    return {"target": target.name, "distill_tokens": budget, "distill_s": round(distill_s, 1),
            "stale": compare(target, trunk, stale, Path(eagle), domain, new_tokens, depths),
            "realigned": compare(target, trunk, realigned, Path(rec["out"]), domain, new_tokens, depths)}


def _table(out: dict) -> None:
    print("| fixture | side file | n_max | llama.cpp τ | recycle τ | llama.cpp accepted/drafted | recycle accepted/tried "
          "| lossless |")
    rows = [(n, "native", r) for n, r in out["agreement"].items()]
    rows += [(out["stale"]["target"], k, out["stale"][k]) for k in ("stale", "realigned") if "stale" in out]
    for fixture, what, by_n in rows:
        for n, r in by_n.items():
            ll, rc = r["llama_cpp"], r["recycle"]
            print(f"| {fixture} | {what} | {n} | {ll['tau']:.3f} | {rc['tau']:.3f} | {ll['accepted']}/{ll['drafted']} | "
                  f"{rc['accepted']}/{rc['tried']} | {'yes' if ll['lossless'] else 'NO'} |")


if __name__ == "__main__":
    main()
