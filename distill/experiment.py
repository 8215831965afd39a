"""The recycling experiment: does a recycled MTP drafter beat the same architecture from scratch?

For each format (eagle, eagle3, medusa) the fixture's MTP modules are converted, then distilled
twice with the same data, order, budget, schedule and seed: (a) from the converted weights
(`--init recycled`) and (b) re-initialised (`--init scratch`). Snapshots written along the way
(`DistillOptions.snapshots`) are decoded with the bench library (`recycle.bench.run_bench`: greedy,
the held-out code prompts, the format's default tree) to give held-out τ versus tokens. The native
MTP chain runs on the same prompts as the reference the recycled drafter started from; the EAGLE
drafter is also decoded with that same chain (`chain:D`), the like-for-like comparison.

"How many times more tokens does scratch need": the first snapshot where scratch reaches the
recycled drafter's τ at a given checkpoint, linearly interpolated between snapshots, divided by
that checkpoint's tokens; "> budget/x" when scratch never gets there within the budget.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from distill.train import DistillOptions, distill

FORMATS = ("eagle", "eagle3", "medusa")
INITS = ("recycled", "scratch")


@dataclass
class ExperimentOptions:
    target: str
    work: str
    tokens: int
    marks: tuple[int, ...]
    formats: tuple[str, ...] = FORMATS
    prompts: int = 8
    max_new_tokens: int = 64
    seq_len: int = 256
    batch: int = 8
    lr: float = 5e-4
    threads: int | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)  # further DistillOptions fields


def bench_tau(drafter: str | None, target: str, prompts: list[tuple[str, str]], max_new_tokens: int,
              tree: str | None = None) -> dict:
    """Held-out τ and per-depth acceptance of one drafter dir (None: the target's native MTP)."""
    from recycle.bench import BenchOptions, run_bench

    r = run_bench(BenchOptions(drafter=drafter, target=target, prompts=prompts, max_new_tokens=max_new_tokens,
                               native=drafter is None, tree=tree, warmup=False))
    o = r["overall"]
    return {"tau": o["spec"]["tau"], "acceptance": o["spec"]["acceptance"], "tree": r["tree"],
            "greedy_match": o["greedy_match"], "speedup": o["speedup"]}


def tokens_to_reach(curve: list[tuple[int, float]], tau: float) -> float | None:
    """First token count where a τ curve reaches `tau` (linear between points), else None."""
    for (t0, y0), (t1, y1) in zip(curve, curve[1:]):
        if y0 >= tau:
            return float(t0)
        if y1 >= tau:
            return t0 + (t1 - t0) * (tau - y0) / (y1 - y0)
    if curve and curve[0][1] >= tau:
        return float(curve[0][0])
    return None


def run_experiment(opts: ExperimentOptions, log: Callable[[str], None] = print) -> dict:
    from converters.api import convert_checkpoint
    from recycle.prompts import code_prompts

    work = Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = [("code", p) for p in code_prompts(opts.prompts)]
    result: dict = {"target": opts.target, "tokens": opts.tokens, "marks": list(opts.marks), "prompts": len(prompts),
                    "max_new_tokens": opts.max_new_tokens, "runs": {}, "native": None}
    t0 = time.perf_counter()
    native = bench_tau(None, opts.target, prompts, opts.max_new_tokens)
    result["native"] = native
    log(f"native MTP {native['tree']}: tau {native['tau']:.3f}")
    for fmt in opts.formats:
        src = work / f"{fmt}-converted"
        convert_checkpoint(opts.target, fmt, src, overwrite=True)
        for init in INITS:
            name = f"{fmt}-{init}"
            snap = work / f"{name}-snapshots"
            base = DistillOptions(drafter=str(src), target=opts.target, tokens=opts.tokens, out=str(work / name),
                                  init=init, seq_len=opts.seq_len, batch=opts.batch, lr=opts.lr, threads=opts.threads,
                                  seed=opts.seed, overwrite=True, snapshots=tuple(opts.marks),
                                  snapshot_dir=str(snap), eval_every=32, checkpoint_every=10**9)
            rec = distill(replace(base, **opts.extra))
            log(f"{name}: {rec['tokens']} tokens in {rec['wall_s']:.0f} s ({rec['tokens_per_s']:.0f} tok/s), "
                f"target forward {100 * rec['target_forward_share']:.1f}%, overhead {100 * rec['overhead_share']:.1f}%")
            curve = []
            for mark in opts.marks:
                m = bench_tau(str(snap / f"tokens_{mark}"), opts.target, prompts, opts.max_new_tokens)
                curve.append({"tokens": mark, **m})
                log(f"  {name} @ {mark}: tau {m['tau']:.3f} acc {[round(a, 3) for a in m['acceptance']]}")
            run = {"record": rec, "curve": curve}
            if fmt == "eagle":
                depth = len(native["acceptance"])
                run["chain"] = {str(mark): bench_tau(str(snap / f"tokens_{mark}"), opts.target, prompts,
                                                     opts.max_new_tokens, tree=f"chain:{depth}")
                                for mark in opts.marks}
            result["runs"][name] = run
            (work / "experiment.json").write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.perf_counter() - t0
    result["summary"] = summarize(result)
    (work / "experiment.json").write_text(json.dumps(result, indent=1))
    return result


def summarize(result: dict) -> dict:
    """Per format: τ curves, scratch's token multiple to match recycled at each mark."""
    out = {}
    for fmt in FORMATS:
        rec, scr = result["runs"].get(f"{fmt}-recycled"), result["runs"].get(f"{fmt}-scratch")
        if not rec or not scr:
            continue
        rc = [(p["tokens"], p["tau"]) for p in rec["curve"]]
        sc = [(p["tokens"], p["tau"]) for p in scr["curve"]]
        budget = rc[-1][0]
        multiples = {}
        for t, tau in rc:
            need = tokens_to_reach(sc, tau)
            if need is None:
                multiples[str(t)] = f"> {budget / t:.0f}×" if t else "never (τ not reached)"
            else:
                multiples[str(t)] = "0 tokens" if t == 0 and need == 0 else (f"{need / t:.1f}×" if t else f"{need:.0f} tokens")
        out[fmt] = {"recycled": rc, "scratch": sc, "scratch_multiple": multiples}
    return out


def plot(result: dict, path: str | Path) -> None:
    """τ versus tokens, one panel per format, recycled vs scratch, native MTP as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = [f for f in FORMATS if f"{f}-recycled" in result["runs"]]
    chain = "eagle-recycled" in result["runs"] and result["runs"]["eagle-recycled"].get("chain")
    fig, axes = plt.subplots(1, len(fmts) + bool(chain), figsize=(4.3 * (len(fmts) + bool(chain)), 3.8), squeeze=False)
    if chain:  # like for like with the native MTP chain: the same tree
        ax = axes[0][-1]
        for init, style in (("recycled", "o-"), ("scratch", "s--")):
            pts = result["runs"][f"eagle-{init}"]["chain"]
            ax.plot([int(t) / 1e3 for t in pts], [m["tau"] for m in pts.values()], style,
                    label=f"eagle {init} ({next(iter(pts.values()))['tree']})")
        nat = result["native"]
        ax.axhline(nat["tau"], color="grey", lw=1, ls=":", label=f"native MTP ({nat['tree']})")
        ax.set_title("--to eagle, native MTP's tree")
        ax.set_xlabel("distillation tokens (k)")
        ax.set_ylabel("held-out τ (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax, fmt in zip(axes[0], fmts):
        for init, style in (("recycled", "o-"), ("scratch", "s--")):
            curve = result["runs"][f"{fmt}-{init}"]["curve"]
            ax.plot([p["tokens"] / 1e3 for p in curve], [p["tau"] for p in curve], style, label=f"{init} ({curve[0]['tree']})")
        nat = result["native"]
        ax.axhline(nat["tau"], color="grey", lw=1, ls=":", label=f"native MTP ({nat['tree']})")
        ax.set_title(f"--to {fmt}")
        ax.set_xlabel("distillation tokens (k)")
        ax.set_ylabel("held-out τ (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("recycled vs scratch drafters on the trained DeepSeek-V3 fixture", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
