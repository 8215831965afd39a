"""Harvest throughput: vLLM's hidden-state extraction (`recycle harvest`) against the in-process teacher.

Both compute the same features for the same windows (distill's plan for --tokens/--seq-len/--batch): vLLM
prefills every window once (`extract_hidden_states`, timed inside its job from the first request to the
last file); the in-process teacher runs transformers' forward per micro-batch, as `distill` does without a
cache. Also reports the cache's bytes per token. With `--distill`, also distill tokens/s: an EAGLE-3 drafter
(`--to eagle3`, the aux layers harvested) trained from the harvested cache without the trunk, against the
same distillation with the target in the process (fp32, the same windows).

    RECYCLE_VLLM_PYTHON=/tmp/vllm-venv/bin/python python benchmarks/harvest_speed.py --tokens 64k [--distill [--online 4]]

`--engine transformers` harvests with the target in this process instead (fp32, as the in-process teacher runs): the
engine for DeepSeek-V4, whose cache holds its hyper-connection streams alone (`mixed_last_state`: how far the last state
a reader mixes back from them is from the trunk's own, against that state stored in bf16); with `--to eagle --aux ''`
the distillations train its `--to eagle` drafter:

    python benchmarks/harvest_speed.py --engine transformers --target fixtures/deepseek_v4_mtp --aux '' --to eagle --distill
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from recycle.distill.harvest import HarvestOptions, harvest, plan
from recycle.distill.teacher import Teacher
from recycle.preflight import parse_tokens

from _common import FIXTURE, parser, write_json


def main() -> None:
    ap = parser(__doc__, target=FIXTURE, work="/tmp/recycle-harvest-speed", json=True)
    ap.add_argument("--tokens", default="64k")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--aux", default="2,5,9", help="aux layer ids (EAGLE-3), or '' for the last state only")
    ap.add_argument("--distill", action="store_true", help="also time distill from the cache against in-process")
    ap.add_argument("--online", type=int, default=0, help="with --distill: also distill --online N (vLLM alongside)")
    ap.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    ap.add_argument("--to", default="eagle3", help="with --distill: the drafter format (eagle3 reads --aux)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    aux = tuple(int(x) for x in args.aux.split(",") if x)
    local = {"precision": "fp32"} if args.engine == "transformers" else {}
    opts = HarvestOptions(target=args.target, out=str(Path(args.work) / "cache"), tokens=parse_tokens(args.tokens),
                          seq_len=args.seq_len, batch=args.batch, aux_layers=aux, overwrite=True, engine=args.engine,
                          **local)
    rec = harvest(opts)
    from transformers import AutoTokenizer

    batches, _ = plan(opts, AutoTokenizer.from_pretrained(args.target))
    teacher = Teacher(args.target, torch.device("cpu"), list(aux), "fp32", streams=bool(rec["streams"]))
    t0 = time.perf_counter()
    for _, ids, _ in batches:
        teacher.features(ids)
    in_process = time.perf_counter() - t0
    report = {"target": args.target, "tokens": rec["tokens"], "seq_len": args.seq_len, "batch": args.batch,
              "aux_layers": list(aux), "engine": rec["engine"], "engine_tokens_per_s": rec["engine_tokens_per_s"],
              "streams": rec["streams"],
              "harvest_wall_s": rec["seconds"], "in_process_tokens_per_s": round(rec["tokens"] / in_process),
              "cache_bytes_per_token": rec["bytes_per_token"], "threads": torch.get_num_threads()}
    if rec["streams"]:
        report["mixed_last_state"] = mixed_last_error(args, opts, teacher, batches)
    if args.distill:
        report["distill"] = distill_speed(args, opts)
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(args.json, report)
    shutil.rmtree(args.work, ignore_errors=True)


def mixed_last_error(args, opts: HarvestOptions, trunk: Teacher, batches) -> dict:
    """DeepSeek-V4: the last state a reader without the trunk mixes from the cached (bf16) streams, against the
    trunk's own from unrounded streams, per key (relative norm); beside it, that unrounded state rounded to bf16 (what
    the cache stored before it held the streams alone)."""
    reader = Teacher(args.target, torch.device("cpu"), [], "fp32", cache_dir=opts.out, trunk=False, streams=True)
    mixed, rounded = [], []
    with torch.no_grad():
        for key, ids, _ in batches:
            exact, _ = trunk.features(ids)
            last, _ = reader._load(key, ids)
            mixed.append(((last - exact).norm() / exact.norm()).item())
            rounded.append(((exact.bfloat16().float() - exact).norm() / exact.norm()).item())
    return {"keys": len(mixed), "mixed_min": min(mixed), "mixed_max": max(mixed), "bf16_stored_min": min(rounded),
            "bf16_stored_max": max(rounded)}


def distill_speed(args, opts: HarvestOptions) -> dict:
    """tokens/s of the same distillation with the target in the process and from the harvested cache."""
    from recycle.converters.api import convert_checkpoint
    from recycle.distill.train import DistillOptions, distill

    e3 = convert_checkpoint(args.target, args.to, Path(args.work) / args.to, overwrite=True)["out"]
    aux = tuple(json.loads((Path(e3) / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids") or ())
    if aux != opts.aux_layers:
        raise SystemExit(f"--aux {opts.aux_layers} is not the drafter's {aux}")
    run = dict(drafter=e3, target=args.target, tokens=opts.tokens, seq_len=args.seq_len, batch=args.batch,
               eval_every=10**9, precision="fp32")
    out = {}
    runs = [("in_process", {}), ("from_cache", {"cache_hidden": opts.out})]
    if args.online:
        runs.append((f"online_{args.online}", {"cache_hidden": str(Path(args.work) / "online"), "online": args.online}))
    for name, extra in runs:
        r = distill(DistillOptions(out=str(Path(args.work) / name), **run, **extra))
        out[name] = {"tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"], "trunk_loaded": r["trunk_loaded"],
                     "target_forward_share": r["target_forward_share"], "timing": r["timing"], "online": r["online"]}
    return out


if __name__ == "__main__":
    main()
