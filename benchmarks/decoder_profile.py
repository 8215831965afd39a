"""Where a speculative decoding step spends its time: the draft/verify split and torch.profiler's view.

Runs plain AR and the recycled EAGLE drafter (default tree) of the trained fixture on the same
prompts (fastest of `--repeats`) and prints tokens/s, speedup, τ, efficiency (speedup ÷ τ) and the
draft and verify milliseconds per step; `--profile` adds torch.profiler's table by self CPU time for
each (note: under the profiler, per-op overhead inflates small ops such as the KV cache's torch.cat).

    python benchmarks/decoder_profile.py [--tree dynamic:3,2,6] [--prompts 6] [--tokens 96] [--profile]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from recycle.bench import BenchOptions, open_session
from recycle.converters.api import convert_checkpoint
from recycle.decoding import Drafter, generate

from _common import FIXTURE, parser


def _run(ses, engine, prompts, tokens, repeats):
    run = dict(eos=ses.eos, masks=ses.masks)
    generate(ses.target, engine, prompts[0], 16, **run)
    best = None
    for _ in range(repeats):
        gens = [generate(ses.target, engine, p, tokens, **run) for p in prompts]
        if best is None or sum(g.stats.total_s for g in gens) < sum(g.stats.total_s for g in best):
            best = gens
    return best


def main() -> None:
    ap = parser(__doc__, target=FIXTURE, prompts=6, repeats=3)
    ap.add_argument("--tree", default="dynamic:3,2,6")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        drafter = str(Path(tmp) / "eagle")
        convert_checkpoint(args.target, "eagle", drafter)
        ses = open_session(BenchOptions(drafter=drafter, target=args.target, tree=args.tree))
        prompts = ses.encoded[: args.prompts]
        ar = _run(ses, Drafter(), prompts, args.tokens, args.repeats)
        sp = _run(ses, ses.engine, prompts, args.tokens, args.repeats)
        ta, ts = sum(g.stats.total_s for g in ar), sum(g.stats.total_s for g in sp)
        steps, ar_steps = sum(g.stats.steps for g in sp), sum(g.stats.steps for g in ar)
        tau = sum(g.stats.new_tokens - 1 for g in sp) / steps
        toks = sum(g.stats.new_tokens for g in sp)
        t_ar = sum(g.stats.draft_s + g.stats.verify_s for g in ar) / ar_steps
        draft, verify = (sum(getattr(g.stats, k) for g in sp) / steps for k in ("draft_s", "verify_s"))
        print(f"AR {toks / ta:.1f} tok/s ({t_ar * 1e3:.2f} ms per step); {args.tree} {toks / ts:.1f} tok/s: speedup "
              f"{ta / ts:.2f}, τ {tau:.2f}, efficiency {ta / ts / tau:.2f}; per step draft {draft * 1e3:.2f} ms "
              f"({draft / t_ar:.2f} AR steps) + verify {verify * 1e3:.2f} ms ({verify / t_ar:.2f} AR steps); "
              f"greedy = AR: {[g.tokens for g in ar] == [g.tokens for g in sp]}")
        import cProfile
        import pstats

        for name, engine in (("ar", Drafter()), (args.tree, ses.engine)):
            prof_c = cProfile.Profile()
            prof_c.enable()
            _run(ses, engine, prompts, args.tokens, 1)
            prof_c.disable()
            st = pstats.Stats(prof_c)
            total = st.total_tt
            modules = sum(v[3] for k, v in st.stats.items() if k[2] == "_wrapped_call_impl")  # outermost calls' cumtime
            print(f"{name}: {modules / total:.1%} of the decode time is inside nn.Module calls (the target's and the "
                  f"drafter's layers); the decoder's own Python, masks, KV surgery and verification: "
                  f"{1 - modules / total:.1%} (cProfile)")
        if args.profile:
            for name, engine in (("ar", Drafter()), (args.tree, ses.engine)):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    _run(ses, engine, prompts, args.tokens, 1)
                print(f"\n== {name} (under torch.profiler)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                max_name_column_width=40))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
