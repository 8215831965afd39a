"""The recycling experiment: does a recycled MTP drafter beat the same architecture from scratch?

For each format (eagle, eagle3, medusa) the MTP modules of `source` (default: the target itself)
are converted, then distilled against `target` with the same data, order, budget, schedule and
seed: (a) from the converted weights (`--init recycled`) and (b) re-initialised (`--init
scratch`); optionally (c) scratch again with a budget many times larger (its own schedule), so
that "how many more tokens does scratch need" is a measured number rather than a lower bound.
Snapshots written along the way (`snapshots`: the loop's `on_step` callback writes the drafter at each
mark, with the distiller's held-out estimate at that moment) are decoded with the bench library (`recycle.bench.run_bench`: greedy,
held-out code prompts of `prompt_source`, the format's default tree) to give held-out τ versus
tokens. References on the same prompts: the target's native MTP chain (stale, when the target was
post-trained after its modules), and optionally a `reference` checkpoint's native chain (the
original pairing the modules were trained with). The EAGLE drafter is also decoded with a chain
of the native depth, the like-for-like comparison.

"How many times more tokens does scratch need": the first snapshot where scratch reaches the
recycled drafter's τ at a given checkpoint, linearly interpolated between snapshots, divided by
that checkpoint's tokens; "> N×" when scratch never gets there within its budget.

A module the experiment scripts import (`recycling_experiment.py`, `eagle3_calibrated.py`, `aligned_headroom.py`);
not part of the installed package.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.distill.calibrate import convert_calibrated
from recycle.distill.record import expected_length
from recycle.distill.train import Current, DistillOptions, distill
from recycle.formats import convertible, get, of_config
from recycle.io.writer import OutputDir
from recycle.preflight import checkpoint_dir
from recycle.prompts import code_prompts

FORMATS = convertible()
INITS = ("recycled", "scratch")


@dataclass
class ExperimentOptions:
    target: str
    work: str
    tokens: int
    marks: tuple[int, ...]
    formats: tuple[str, ...] = FORMATS
    source: str | None = None  # checkpoint whose MTP modules are converted (default: the target)
    reference: str | None = None  # checkpoint whose native MTP is the "original pairing" on the same prompts
    data: str | None = None  # distillation data (`--data`); None: the stdlib train split
    prompt_source: str = "stdlib"  # corpus whose held-out code files give the bench prompts
    scratch_tokens: int | None = None  # a longer scratch run, to measure the tokens ratio
    scratch_marks: tuple[int, ...] = ()
    chain: int | None = None  # like-for-like chain length (default: the target's native depth)
    calibrate: int | None = None  # formats that calibrate (medusa, eagle3): the conversion's --calibrate tokens
    convert_options: dict = field(default_factory=dict)  # further ConvertOptions fields (e.g. eagle3_mlp)
    tree: str | None = None  # every snapshot decoded with this tree (default: each format's own)
    inits: tuple[str, ...] = INITS  # the same-budget runs (the long scratch run comes with scratch_tokens)
    prompts: int = 8
    max_new_tokens: int = 64
    seq_len: int = 256
    batch: int = 8
    lr: float = 5e-4
    threads: int | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)  # further DistillOptions fields
    converted: dict = field(default_factory=dict)  # format -> a directory converted already (not converted again)
    bench: bool = True  # False: convert and distill only (e.g. on a lent GPU), every bench left to a later run


def bench_tau(drafter: str | None, target: str, prompts: list[tuple[str, str]], max_new_tokens: int,
              tree: str | None = None) -> dict:
    """Held-out τ and per-depth acceptance of one drafter dir (None: the target's native MTP)."""
    r = run_bench(BenchOptions(drafter=drafter, target=target, prompts=prompts, max_new_tokens=max_new_tokens,
                               native=drafter is None, tree=tree, warmup=False))
    o = r.overall
    return {"tau": o.spec.tau, "acceptance": list(o.spec.acceptance), "tree": r.tree,
            "greedy_match": o.greedy_match, "speedup": o.speedup}


def tokens_to_reach(curve: list[tuple[int, float]], tau: float) -> float | None:
    """First token count where a τ curve reaches `tau` (linear between points), else None."""
    if curve and curve[0][1] >= tau:
        return float(curve[0][0])
    for (t0, y0), (t1, y1) in zip(curve, curve[1:]):
        if y1 >= tau:
            return t0 + (t1 - t0) * (tau - y0) / (y1 - y0)
    return None


def pearson(xs: list[float], ys: list[float]) -> float | None:
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def snapshots(marks: tuple[int, ...] | list[int], root: Path, init: str) -> Callable[[Current], None]:
    """An `on_step` callback for `distill`: at each mark (a token count; 0 is the input, before the first step) the
    drafter as it stands is written to ROOT/tokens_MARK, its recycle.json's newest distillation record holding the
    mark, the tokens trained and the held-out agreement and estimate at that moment. A step that passes several
    marks writes each."""
    pending = sorted(marks)

    def on_step(current: Current) -> None:
        while pending and current.tokens >= pending[0]:
            mark = pending.pop(0)
            agree = current.agreement()
            entry = {"snapshot_tokens": mark, "tokens": current.tokens, "init": init, "heldout_agree": agree,
                     "heldout_estimate": expected_length(agree)}
            current.write(OutputDir(root / f"tokens_{mark}", overwrite=True), entry)

    return on_step


def finished(out: Path, snap: Path, marks) -> dict | None:
    """The distillation record of a run done before (its output and a snapshot at every mark written, e.g. by a
    `bench=False` run on a GPU), else None: the run is distilled again."""
    if not (out / "recycle.json").is_file() or not all((snap / f"tokens_{m}" / "recycle.json").is_file() for m in marks):
        return None
    rec = json.loads((out / "recycle.json").read_text())["distillation"][-1]
    # the file keeps no wall time (distill returns it): its setup and training stand in, with a mark that it was read
    return rec | {"wall_s": rec["train_s"] + sum(rec["setup_s"].values()), "distilled_before": True}


def _estimate(snapshot: Path) -> list[float] | None:
    """The distiller's held-out agreement per draft step when it wrote this snapshot."""
    rec = json.loads((snapshot / "recycle.json").read_text()).get("distillation", [{}])[-1]
    return rec.get("heldout_agree")


def run_experiment(opts: ExperimentOptions, log: Callable[[str], None] = print) -> dict:
    work = Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = [("code", p) for p in code_prompts(opts.prompts, source=opts.prompt_source)]
    result: dict = {"target": opts.target, "source": opts.source or opts.target, "data": opts.data or "stdlib",
                    "prompt_source": opts.prompt_source, "tokens": opts.tokens, "marks": list(opts.marks),
                    "scratch_tokens": opts.scratch_tokens, "scratch_marks": list(opts.scratch_marks),
                    "prompts": len(prompts), "max_new_tokens": opts.max_new_tokens, "runs": {}, "native": None,
                    "reference": None}
    t0 = time.perf_counter()

    def save() -> None:
        (work / "experiment.json").write_text(json.dumps(result, indent=1))

    # A source that is itself a drafter (Gemma 4's separate assistant) is the native chain here, and the
    # converters read the target for what it does not store
    assistant = opts.source if opts.source and of_config(checkpoint_dir(opts.source)) is not None else None
    chain = opts.chain
    if opts.bench:
        native = bench_tau(assistant, opts.target, prompts, opts.max_new_tokens,
                           tree=f"chain:{opts.chain or 3}" if assistant else None)
        chain = opts.chain or len(native["acceptance"])
        if chain != len(native["acceptance"]):
            native = bench_tau(assistant, opts.target, prompts, opts.max_new_tokens, tree=f"chain:{chain}")
        result["native"] = native
        log(f"native MTP of the target {native['tree']}: tau {native['tau']:.3f} acc {_r(native['acceptance'])}")
    if opts.reference and opts.bench:
        ref = bench_tau(assistant, opts.reference, prompts, opts.max_new_tokens, tree=f"chain:{chain}")
        result["reference"] = {"checkpoint": opts.reference, **ref}
        log(f"reference pairing {ref['tree']}: tau {ref['tau']:.3f} acc {_r(ref['acceptance'])}")
    save()
    for fmt in opts.formats:
        src = work / f"{fmt}-converted"
        takes = get(fmt).options
        calibration = {"calibrate": opts.calibrate} if opts.calibrate and "calibrate" in takes else {}
        if assistant and "target" in takes and (calibration or "calibrate" not in takes):
            calibration["target"] = opts.target
        extra = {k: v for k, v in opts.convert_options.items() if k in takes}
        if fmt in opts.converted:  # e.g. a calibration made once, distilled under several recipes
            src, conv = Path(opts.converted[fmt]), {"seconds": None}
        else:
            conv = convert_calibrated(opts.source or opts.target, fmt, src, overwrite=True, **calibration, **extra)
        made = json.loads((src / "recycle.json").read_text())
        result.setdefault("conversions", {})[fmt] = {"seconds": conv["seconds"],
                                                     "options": made.get("target", {}).get("options"),
                                                     "calibration": made.get("calibration")}
        plan = [(init, opts.tokens, opts.marks) for init in opts.inits]
        if opts.scratch_tokens:
            plan.append(("scratch-long", opts.scratch_tokens, opts.scratch_marks))
        for init, budget, marks in plan:
            name = f"{fmt}-{init}"
            snap = work / f"{name}-snapshots"
            base = DistillOptions(drafter=str(src), target=opts.target, tokens=budget, out=str(work / name),
                                  init=init.split("-")[0], data=opts.data, seq_len=opts.seq_len, batch=opts.batch,
                                  lr=opts.lr, threads=opts.threads, seed=opts.seed, overwrite=True, eval_every=32,
                                  checkpoint_every=10**9)
            run = replace(base, **opts.extra)
            rec = finished(work / name, snap, marks)
            if rec is None:
                rec = distill(run, on_step=snapshots(marks, snap, run.init))
            log(f"{name}: {rec['tokens']} tokens in {rec['wall_s']:.0f} s ({rec['tokens_per_s']:.0f} tok/s, "
                f"{rec['device']}), target forward {100 * rec['target_forward_share']:.1f}%, overhead "
                f"{100 * rec['overhead_share']:.1f}%" + (" (distilled before)" if rec.get("distilled_before") else ""))
            if not opts.bench:
                result["runs"][name] = {"record": rec, "curve": []}
                save()
                continue
            curve = []
            for mark in marks:
                d = snap / f"tokens_{mark}"
                m = bench_tau(str(d), opts.target, prompts, opts.max_new_tokens, tree=opts.tree)
                point = {"tokens": mark, **m, "estimate": _estimate(d)}
                if get(fmt).native_chain:
                    point["chain"] = bench_tau(str(d), opts.target, prompts, opts.max_new_tokens, tree=f"chain:{chain}")
                curve.append(point)
                log(f"  {name} @ {mark}: tau {m['tau']:.3f} acc {_r(m['acceptance'])}"
                    + (f"; chain:{chain} tau {point['chain']['tau']:.3f} acc {_r(point['chain']['acceptance'])}"
                       if "chain" in point else "") + f"; estimate {_r(point['estimate'] or [])}")
            result["runs"][name] = {"record": rec, "curve": curve}
            save()
    result["wall_s"] = time.perf_counter() - t0
    result["summary"] = summarize(result) if opts.bench else None
    save()
    return result


def _r(xs: list[float]) -> list[float]:
    return [round(x, 3) for x in xs]


def summarize(result: dict) -> dict:
    """Per format: τ curves, scratch's token multiple to match recycled at each mark, and how well the
    distiller's held-out estimate tracked bench's acceptance."""
    out = {}
    for fmt in FORMATS:
        rec = result["runs"].get(f"{fmt}-recycled")
        scratch = [result["runs"][k] for k in (f"{fmt}-scratch-long", f"{fmt}-scratch") if k in result["runs"]]
        if not rec or not scratch:
            continue
        rc = [(p["tokens"], p["tau"]) for p in rec["curve"]]
        sc = [(p["tokens"], p["tau"]) for p in scratch[0]["curve"]]
        budget = sc[-1][0]
        multiples = {}
        for t, tau in rc:
            need = tokens_to_reach(sc, tau)
            if need is None:
                multiples[str(t)] = f"> {budget / t:.0f}×" if t else "never (τ not reached)"
            else:
                multiples[str(t)] = (f"{need / t:.1f}×" if t else f"{need:,.0f} tokens")
        row: dict = {"recycled": rc, "scratch": sc, "scratch_run": "long" if len(scratch) > 1 or
                     f"{fmt}-scratch-long" in result["runs"] else "same budget", "scratch_multiple": multiples}
        # Estimate vs bench: per (snapshot, depth) pairs over every run of this format, chain acceptance
        # for the EAGLE drafter (the estimate is a chain's), the default tree otherwise.
        xs, ys = [], []
        for name, run in result["runs"].items():
            if not name.startswith(f"{fmt}-"):
                continue
            for p in run["curve"]:
                acc = (p.get("chain") or p)["acceptance"]
                for a, b in zip(p.get("estimate") or [], acc):
                    xs.append(a)
                    ys.append(b)
        row["estimate_vs_bench"] = {"pairs": len(xs), "pearson": pearson(xs, ys)}
        out[fmt] = row
    return out


def plot(result: dict, path: str | Path, title: str | None = None) -> None:
    """τ versus tokens per format (recycled, scratch, references), plus per-depth acceptance of the
    EAGLE drafter on the native chain when the run measured it."""
    import matplotlib  # only for the figure: matplotlib is no dependency of recycle, and the experiment runs without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = [f for f in FORMATS if f"{f}-recycled" in result["runs"]]
    chained = next((f for f in fmts if result["runs"][f"{f}-recycled"]["curve"][0].get("chain")), None)
    has_chain = chained is not None
    panels = len(fmts) + 2 * has_chain
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.9), squeeze=False)
    styles = {"recycled": "o-", "scratch": "s--", "scratch-long": "^:"}
    colors = {"recycled": "C0", "scratch": "C1", "scratch-long": "C2"}
    log_x = any(p["tokens"] > 4 * result["tokens"] for r in result["runs"].values() for p in r["curve"])

    def axis(ax, ylabel: str) -> None:
        ax.set_xlabel("distillation tokens")
        ax.set_ylabel(ylabel)
        if log_x:
            ax.set_xscale("symlog", linthresh=max(1, min(m for m in result["marks"] if m) // 2))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="lower right")
        if log_x:
            ax.set_xlim(left=0)

    def refs(ax, key: str = "tau", depth: int | None = None) -> None:
        for ref, label, color in ((result["native"], "target's native MTP", "grey"),
                                  (result.get("reference"), "original pairing", "green")):
            if ref:
                y = ref[key] if depth is None else ref["acceptance"][depth]
                ax.axhline(y, color=color, lw=1, ls=":", label=f"{label} ({ref['tree']})")

    for ax, fmt in zip(axes[0], fmts):
        for init, style in styles.items():
            run = result["runs"].get(f"{fmt}-{init}")
            if run:
                ax.plot([p["tokens"] for p in run["curve"]], [p["tau"] for p in run["curve"]], style,
                        color=colors[init], label=f"{init} ({run['curve'][0]['tree']})")
        refs(ax)
        ax.set_title(f"--to {fmt}")
        axis(ax, "held-out τ (greedy)")
    if has_chain:
        tau_ax, acc_ax = axes[0][len(fmts)], axes[0][len(fmts) + 1]
        for init, style in styles.items():
            run = result["runs"].get(f"{chained}-{init}")
            if not run:
                continue
            xs = [p["tokens"] for p in run["curve"]]
            tau_ax.plot(xs, [p["chain"]["tau"] for p in run["curve"]], style, color=colors[init],
                        label=f"{chained} {init}")
            depths = max(len(p["chain"]["acceptance"]) for p in run["curve"])
            for d in range(depths):  # a depth never tried at a mark (nothing accepted before it) is left out
                acc_ax.plot(xs, [p["chain"]["acceptance"][d] if d < len(p["chain"]["acceptance"]) else float("nan")
                                 for p in run["curve"]], style, color=colors[init],
                            label=f"{init}, depth {d + 1}", alpha=1.0 if d == 0 else 0.45)
        refs(tau_ax)
        refs(acc_ax, depth=0)
        tree = result["native"]["tree"]
        tau_ax.set_title(f"--to {chained} on the native tree ({tree})")
        axis(tau_ax, "held-out τ")
        acc_ax.set_title("acceptance per depth (same chain)")
        axis(acc_ax, "acceptance rate")
    fig.suptitle(title or "recycled vs scratch drafters", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
