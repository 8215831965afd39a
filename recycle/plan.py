"""`recycle plan`: choose K and the tree from measured acceptance; carry the choice across batch sizes and GPUs.

What is measured here, once per prompt set (bench's sets: code and English prose):
  - the accepted length of every step of the drafter's longest chain (chain:K_max) and of a few
    trees, so τ(chain:K) = mean(min(accepted + 1, K + 1)) for every K ≤ K_max without one run per K;
  - the draft time per step of chain:1 and chain:K_max (linear between them: one drafter pass per
    depth) and of each tree, and plain decoding's step time;
  - the target's verification time for n = 1 … 32 tokens (the decode loop's own forward, verify and
    cache crop, at the sets' mean context).

Predicted speedup on this device at batch 1 = τ · t_AR / (t_draft + t_verify(nodes + 1)). Across
batch sizes and GPUs the same τ is carried through `recycle.roofline`'s model of the target's and
the drafter's forward, from the target's config.

Every timing is repeated (each verification size `VERIFY_REPS` times, each decode run `REPEATS` times, the
repeats interleaved so a burst of other work hits every candidate alike) and its median kept. The plan then
checks its own measurements (`curve_findings`, `set_findings`): a cost whose repeats spread (IQR / median)
beyond `SPREAD_MAX`, verification of more tokens measured cheaper than of fewer (beyond `MONOTONE_TOL`), a
longer chain drafting cheaper than chain:1, or a candidate's prediction off its own measured speedup by more
than `AGREE_MAX`×. Any of these and it says "too noisy to recommend" instead of recommending (on a shared
machine: a busy neighbour).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from recycle import roofline
from recycle.bench import Session, check_positions, open_session, summarize
from recycle.decoding import Drafter, generate
from recycle.decoding import cache as kv
from recycle.decoding.tree import Tree, chain_parents, describe_shape, shape_tokens
from recycle.decoding.verify import verify
from recycle.errors import RecycleError
from recycle.hardware import GPUS, gpu, resolve_device, sync
from recycle.options import BenchOptions, PlanOptions

Progress = Callable[[int, int, str], None]
# Trees tried besides the chains (the format's bench default first): formats with a static tree draft its one
# fixed-depth Medusa-style tree; the recursive drafters grow EAGLE-2 dynamic trees.
DYNAMIC_TREES = ("dynamic:3,2,6", "dynamic:2,2,4", "dynamic:4,2,8")
REPEATS = 3  # decode runs per candidate and prompt set (interleaved across candidates); the median is kept
VERIFY_REPS = 5  # timings per verification size (interleaved across sizes); the median is kept
SPREAD_MAX = 0.3  # a cost whose repeats' IQR / median exceeds this is noise
MONOTONE_TOL = 0.25  # verifying (or drafting) more may measure this much cheaper than less before it is noise
AGREE_MAX = 2.0  # a prediction more than this factor off the candidate's own measured speedup: the costs are noise
NOISY = "too noisy to recommend"


def _model_config(path: str) -> dict:
    from recycle.preflight import load_json

    p = Path(path)
    cfg = load_json(p / "config.json" if p.is_dir() else p, "--model-config")
    try:
        roofline.target_cost(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise RecycleError(f"--model-config {path}: not a decoder config this roofline reads ({e})") from None
    return cfg


def verify_curve(ses: Session, context: int, max_n: int, reps: int = VERIFY_REPS) -> list[list[float]]:
    """Seconds for the decode loop's verification of n = 1 … max_n chain tokens after `context` cached
    tokens (forward, greedy verify, cache crop): `reps` timings per n (after one warm-up pass over every n),
    taken in rounds over all n, so other work on the machine lands on every size alike."""
    target, dev = ses.target, ses.target.device
    pool = [t for ids in ses.encoded for t in ids]
    ids = (pool * ((context + max_n) // max(len(pool), 1) + 1))[: context + max_n]
    cache = target.new_cache()
    with torch.inference_mode():
        target.forward(torch.tensor([ids[:context]], device=dev), torch.arange(context, device=dev)[None], None, cache,
                       logits_for=slice(-1, None))
        steps = []
        for n in range(1, max_n + 1):
            toks = ids[context : context + n]
            tree = Tree(list(toks), chain_parents(n - 1), list(range(n)))
            if n == 1:
                mask, pos = None, torch.tensor([[context]], device=dev)
            else:
                mask, pos = ses.masks.mask(tree.parents, tree.depths, context)
            steps.append((torch.tensor([toks], device=dev), pos, mask, tree))
        out: list[list[float]] = [[] for _ in steps]
        for rep in range(reps + 1):  # the first round is a warm-up
            for n, (toks, pos, mask, tree) in enumerate(steps):
                sync(dev)
                t0 = time.perf_counter()
                logits, _ = target.forward(toks, pos, mask, cache)
                verify(tree, logits, 0.0, None)
                kv.crop(cache, context)
                sync(dev)
                if rep:
                    out[n].append(time.perf_counter() - t0)
    return out


def spread(samples: list[float]) -> float:
    """IQR / median of repeated timings (inclusive quartiles: the repeats are the whole population); 0 for one."""
    if len(samples) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / med if med > 0 else math.inf


def curve_findings(samples: list[list[float]], used: set[int]) -> list[str]:
    """What makes the verification curve noise: a size measured cheaper than a smaller one beyond MONOTONE_TOL
    (its medians), or a size a candidate's prediction uses whose repeats spread beyond SPREAD_MAX."""
    out = []
    med = [statistics.median(s) for s in samples]
    top = 0
    for i in range(1, len(med)):
        if med[i] < (1 - MONOTONE_TOL) * med[top]:
            out.append(f"verifying {i + 1} tokens measured {med[i] * 1e3:.1f} ms, less than {top + 1} tokens' "
                       f"{med[top] * 1e3:.1f} ms")
            break
        if med[i] > med[top]:
            top = i
    wide = [(spread(samples[n - 1]), n) for n in sorted(used) if 0 < n <= len(samples)]
    worst = max(wide, default=(0.0, 0))
    if worst[0] > SPREAD_MAX:
        out.append(f"verifying {worst[1]} tokens: its {len(samples[worst[1] - 1])} timings spread "
                   f"{worst[0]:.0%} of their median (IQR)")
    return out


def set_findings(runs: dict[str, dict], rows: list[dict], k_max: int, multi_pass: bool) -> list[str]:
    """What makes one prompt set's decode costs noise: a run whose repeats spread beyond SPREAD_MAX (its step
    time, or its draft time per step), chain:K_max drafting cheaper than chain:1 where each depth is a pass, or a
    candidate run on its own whose predicted speedup is more than AGREE_MAX× off its measured one."""
    out = []
    wide = [(spread(r["samples"][key]), name, what) for name, r in runs.items()
            for key, what in (("round_s", "step time"), ("draft_step_s", "draft time per step"))
            if name != "ar" or key == "round_s"]
    worst = max(wide, default=(0.0, "", ""))
    if worst[0] > SPREAD_MAX:
        out.append(f"{worst[1]}: its {worst[2]} over {len(runs[worst[1]]['samples']['round_s'])} runs spread "
                   f"{worst[0]:.0%} of its median (IQR)")
    d1, dk = runs["chain:1"]["draft_step_s"], runs[f"chain:{k_max}"]["draft_step_s"]
    if multi_pass and k_max > 1 and dk < (1 - MONOTONE_TOL) * d1:
        out.append(f"chain:{k_max} drafted in {dk * 1e3:.1f} ms a step, less than chain:1's {d1 * 1e3:.1f} ms")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        if m and p and max(m / p, p / m) > AGREE_MAX:
            out.append(f"{r['shape']}: predicted {p:.2f}× but measured {m:.2f}× on its own run")
            break
    return out


TIMINGS = ("seconds", "tokens_per_s", "draft_s", "verify_s", "prefill_s", "round_s", "draft_step_s")


def _decode(ses: Session, engine: Drafter, prompts: list[list[int]], opts: BenchOptions) -> dict:
    """One timed decode of every prompt of a set at the first --temperature (seeded: the tokens, τ and accepted
    lengths are the same each time; only the timings move)."""
    run = dict(temperature=opts.temperature, seed=opts.seed, eos=ses.eos, masks=ses.masks)
    stats = [generate(ses.target, engine, p, opts.max_new_tokens, **run).stats for p in prompts]
    s = summarize(stats).to_json()
    s["accept_lengths"] = [n for st in stats for n in st.accept_lengths]
    s["round_s"] = (s["draft_s"] + s["verify_s"]) / s["steps"] if s["steps"] else 0.0
    s["draft_step_s"] = s["draft_s"] / s["steps"] if s["steps"] else 0.0
    s["prompts"] = len(prompts)
    return s


def _decode_repeated(ses: Session, engines: list[tuple[str, Drafter]], prompts: list[list[int]],
                     opts: BenchOptions, tick: Callable[[str], None]) -> dict[str, dict]:
    """Every engine's decode `REPEATS` times, in rounds over the engines (after one warm-up each): the first
    run's counts, each timing's median, and every timing's samples (`samples`)."""
    run = dict(temperature=opts.temperature, seed=opts.seed, eos=ses.eos, masks=ses.masks)
    for _, engine in engines:
        generate(ses.target, engine, prompts[0], min(16, opts.max_new_tokens), **run)  # warm-up
    reps: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for rep in range(REPEATS):
        for name, engine in engines:
            reps[name].append(_decode(ses, engine, prompts, opts))
            tick(f"{name} ({rep + 1}/{REPEATS})")
    out = {}
    for name, runs in reps.items():
        s = dict(runs[0])
        s["samples"] = {k: [r[k] for r in runs] for k in TIMINGS}
        s.update({k: statistics.median(v) for k, v in s["samples"].items()})
        out[name] = s
    return out


def _shape_info(engine: Drafter) -> dict:
    """Drafter passes per step, verified tokens per step (root included), rows per pass. Times from
    the runs include the loop's own per-step work (propose, commit), as AR's step time does."""
    shape = engine.shape
    if isinstance(shape, int):
        nodes, depth = shape, shape
    elif hasattr(shape, "total_tokens"):
        nodes, depth = shape.total_tokens, shape.depth
    else:
        nodes, depth = len(shape.parents) - 1, shape.depth
    passes = 1 if engine.format is not None and engine.format.single_pass else depth
    return {"passes": passes, "verify_tokens": nodes + 1, "pass_tokens": max(1, round(nodes / max(passes, 1)))}


def _pass_module(engine: Drafter) -> torch.nn.Module:
    """The module one drafter pass runs (one MTP module of a stack; the whole EAGLE-3 / Medusa model)."""
    if getattr(engine, "layers", None):
        return engine.layers[0]
    return getattr(engine, "model", None) or engine.heads


def _mtp_cost(cfg: dict, like: roofline.ForwardCost) -> roofline.ForwardCost:
    """An MTP module of a config: one decoder layer of the trunk's (MoE) kind, eh_proj [h, 2h], the head."""
    one = dict(cfg, num_hidden_layers=1, first_k_dense_replace=0)
    c = roofline.target_cost(one, like.weight_bytes)
    h = int((cfg.get("text_config") or cfg)["hidden_size"])
    return roofline.ForwardCost(1, c.moe_layers, c.dense_params + 2 * h * h, c.expert_params, c.experts, c.topk,
                                c.kv_bytes, c.attn_flops, c.weight_bytes, c.stored_params + 2 * h * h)


def _recommend(rows: list[dict]) -> dict:
    """The candidate with the best predicted speedup, and why not one step deeper (or shallower)."""
    best = max(rows, key=lambda r: r["predicted"])
    reason = (f"{best['shape']}: τ {best['tau']:.2f} tokens per round for {best['cost']:.2f} AR steps "
              f"(draft {best['c_draft']:.2f} + verify {best['c_verify']:.2f}) → {best['predicted']:.2f}×")
    chains = {r["shape"]: r for r in rows if r["shape"].startswith("chain:")}
    if best["shape"].startswith("chain:"):
        k = int(best["shape"].split(":")[1])
        nxt = chains.get(f"chain:{k + 1}")
        if nxt is not None:
            reason += (f"; chain:{k + 1} adds {nxt['tau'] - best['tau']:.2f} tokens for "
                       f"{nxt['cost'] - best['cost']:.2f} more AR steps ({nxt['predicted']:.2f}×)")
    else:
        top_chain = max(chains.values(), key=lambda r: r["predicted"], default=None)
        if top_chain is not None:
            reason += (f"; the best chain, {top_chain['shape']}, reaches τ {top_chain['tau']:.2f} "
                       f"({top_chain['predicted']:.2f}×)")
    return {"shape": best["shape"], "predicted": best["predicted"], "reason": reason}


def run_plan(opts: PlanOptions, progress: Progress | None = None) -> dict:
    """Measure, predict, recommend and roofline (module docstring); returns the JSON-ready report."""
    from recycle.prompts import default_prompts

    opts.validate()
    if opts.model_config is not None:
        _model_config(opts.model_config)
    t_start = time.perf_counter()
    bopts = opts.bench
    ses = open_session(bopts)
    kind = ses.engine.kind
    prompts = bopts.prompts if bopts.prompts is not None else default_prompts()
    sets: dict[str, list[list[int]]] = {}
    for (name, _), ids in zip(prompts, ses.encoded):
        sets.setdefault(name, []).append(ids)
    limit = getattr(_pass_module(ses.engine), "num_heads", None)  # heads draft a fixed depth
    chain_max = ses.engine_for(f"chain:{min(opts.max_chain, limit or opts.max_chain)}", bopts)
    k_max = chain_max.shape
    fmt = ses.engine.format
    # a hybrid target (recurrent layers) verifies chains only: its default engine is already a chain
    trees = [None] if fmt.static_tree or ses.target.rolls_back else [None, *DYNAMIC_TREES]
    engines: list[tuple[str, Drafter]] = [("ar", Drafter()), ("chain:1", ses.engine_for("chain:1", bopts)),
                                          (f"chain:{k_max}", chain_max)]
    for t in trees:
        e = ses.engine if t is None else ses.engine_for(t, bopts)
        name = describe_shape(e.shape)
        if name not in {n for n, _ in engines}:
            engines.append((name, e))
    engines = list(dict(engines).items())  # chain:1 is also chain:K_max where the drafter drafts one deep
    widest = max((shape_tokens(e.shape) for _, e in engines), default=0)
    check_positions(ses.encoded, bopts.max_new_tokens, max(widest, opts.verify_max), ses.positions,
                    f"plan drafts {widest} in its widest candidate and verifies up to {opts.verify_max}")
    mean_ctx = round(statistics.mean(len(p) for p in ses.encoded) + bopts.max_new_tokens / 2)
    total = len(sets) * len(engines) * REPEATS + 1
    done = 0
    samples = verify_curve(ses, mean_ctx, opts.verify_max)
    curve = [statistics.median(s) for s in samples]
    done += 1
    if progress:
        progress(done, total, "verification cost")
    measured: dict[str, dict] = {}
    for set_name, ids in sets.items():

        def tick(what: str, set_name: str = set_name) -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, total, f"{set_name}: {what}")

        runs = _decode_repeated(ses, engines, ids, bopts, tick)
        for name, engine in engines:
            runs[name]["info"] = _shape_info(engine)
        measured[set_name] = runs

    def t_verify(n: int) -> float:
        if n <= len(curve):
            return curve[n - 1]
        slope = (curve[-1] - curve[-2])
        return curve[-1] + slope * (n - len(curve))

    report_sets = {}
    used: set[int] = set()
    for set_name, runs in measured.items():
        ar = runs["ar"]
        t_ar = ar["round_s"]
        lengths = runs[f"chain:{k_max}"]["accept_lengths"]
        d1, dk = runs["chain:1"]["draft_step_s"], runs[f"chain:{k_max}"]["draft_step_s"]
        rows = []
        for k in range(1, k_max + 1):
            tau = statistics.mean(min(n, k + 1) for n in lengths) if lengths else 1.0
            draft = d1 + (dk - d1) * (k - 1) / (k_max - 1) if k_max > 1 else d1
            rows.append(_row(f"chain:{k}", tau, draft, t_verify(k + 1), t_ar, runs.get(f"chain:{k}"),
                             ar, {"passes": 1 if fmt.single_pass else k, "verify_tokens": k + 1, "pass_tokens": 1}))
        for name, r in runs.items():
            if name == "ar" or name.startswith("chain:"):
                continue
            info = r["info"]
            n = round(r["tree_nodes_per_step"]) + 1
            used.add(n)
            rows.append(_row(name, r["tau"], r["draft_step_s"], t_verify(n), t_ar, r, ar, info))
        acc = _acceptance(lengths, k_max)
        used |= set(range(2, k_max + 2))
        report_sets[set_name] = {
            "prompts": len(sets[set_name]),
            "ar_step_s": t_ar,
            "acceptance_by_depth": acc,
            "candidates": rows,
            "noise": set_findings(runs, rows, k_max, not fmt.single_pass),
        }
    overall = curve_findings(samples, used)
    for st in report_sets.values():
        st["noise"] = overall + st["noise"]
        st["verdict"] = NOISY if st["noise"] else "recommended"
        st["recommended"] = None if st["noise"] else _recommend(st["candidates"])
    report = {
        "target": bopts.target,
        "drafter": bopts.drafter if not bopts.native else None,
        "drafter_kind": kind,
        "device": str(resolve_device(bopts.device)),
        "dtype": bopts.precision,
        "threads": torch.get_num_threads(),
        "max_new_tokens": bopts.max_new_tokens,
        "context_measured": mean_ctx,
        "verify_s": curve,
        "noise": {"verdict": NOISY if any(st["noise"] for st in report_sets.values()) else "recommended",
                  "findings": overall, "repeats": REPEATS, "verify_reps": len(samples[0]),
                  "verify_spread": [spread(s) for s in samples], "spread_max": SPREAD_MAX,
                  "monotone_tol": MONOTONE_TOL, "agree_max": AGREE_MAX},
        "sets": report_sets,
    }
    report["roofline"] = _roofline(opts, ses, report_sets, chain_max, engines)
    report["seconds"] = time.perf_counter() - t_start
    if opts.plot:
        report["plot"] = plot(report, opts.plot)
    return report


def _acceptance(lengths: list[int], k_max: int) -> list[float]:
    """Per-depth acceptance along the chain: P(depth d accepted | depth d-1 accepted)."""
    out = []
    for d in range(1, k_max + 1):
        reached = sum(n >= d for n in lengths)
        out.append(sum(n >= d + 1 for n in lengths) / reached if reached else 0.0)
    return out


def _row(shape: str, tau: float, draft: float, verify_s: float, t_ar: float, run: dict | None,
         ar: dict, info: dict) -> dict:
    """One candidate: its cost per round in AR steps; `steady` = τ / cost (long generations) and
    `predicted` = the whole generation as bench times it, prefill and a half-used last round included:
    (P + (N−1)·t_AR) / (P + ((N−1)/τ + ½)·round), P and N the AR run's mean prefill time and new tokens."""
    cost = (draft + verify_s) / t_ar
    n = ar["new_tokens"] / ar["prompts"]
    prefill = ar["prefill_s"] / ar["prompts"]
    whole = (prefill + (n - 1) * t_ar) / (prefill + ((n - 1) / tau + 0.5) * (draft + verify_s))
    row = {
        "shape": shape, "tau": tau, "draft_s": draft, "verify_s": verify_s,
        "c_draft": draft / t_ar, "c_verify": verify_s / t_ar, "cost": cost,
        "steady": tau / cost if cost else 0.0, "predicted": whole,
        "measured": None, "measured_tau": None, **info,
    }
    if run is not None and run["tokens_per_s"] and ar["tokens_per_s"]:
        row["measured"] = run["tokens_per_s"] / ar["tokens_per_s"]
        row["measured_tau"] = run["tau"]
    return row


def _roofline(opts: PlanOptions, ses: Session, sets: dict, chain_max: Drafter, engines) -> dict:
    """Speedup per GPU, batch size and candidate; the crossover batch size where it drops below 1×."""
    if opts.model_config is not None:
        cfg = _model_config(opts.model_config)
        source = opts.model_config
    else:  # the config transformers built the target from (a Meta-layout checkpoint's is mapped onto Llama's)
        cfg = ses.model.config.to_dict()
        source = opts.bench.target
    tcost = roofline.target_cost(cfg)
    if opts.model_config is not None or not isinstance(_pass_module(chain_max), torch.nn.Module):
        dcost = _mtp_cost(cfg, tcost)
        dsource = "one MTP module of the config (a decoder layer, eh_proj, the head)"
    else:
        dcost = roofline.module_cost(_pass_module(chain_max), tcost)
        dsource = "the drafter's own parameters (one pass)"
    out = {
        "config": source, "context": opts.context, "batch_grid": list(roofline.BATCH_GRID), "eta_mem": roofline.ETA_MEM, "eta_flops": roofline.ETA_FLOPS,
        "target": {"dense_params": tcost.dense_params, "active_params": tcost.active_params,
                   "stored_params": tcost.stored_params, "weight_bytes": tcost.weight_bytes,
                   "kv_bytes_per_token": tcost.kv_bytes * tcost.layers,
                   "bytes_per_step_batch1": tcost.bytes(1, 1, opts.context),
                   "flops_per_token": tcost.flops(1, 1, opts.context)},
        "drafter": {"source": dsource, "active_params": dcost.active_params,
                    "bytes_per_pass_batch1": dcost.bytes(1, 1, opts.context)},
        "gpus": [],
    }
    for key in opts.gpus:
        g = gpu(key)
        count = roofline.gpus_needed(tcost, g)
        box = roofline.node(g, count)
        entry = {"gpu": g.key, "title": g.title, "count": count, "bandwidth_gbs": g.bandwidth_gbs,
                 "bf16_tflops": g.bf16_tflops, "source": g.source, "sets": {}}
        for set_name, s in sets.items():
            cands = []
            for row in s["candidates"]:
                kw = dict(verify_tokens=row["verify_tokens"], passes=row["passes"], pass_tokens=row["pass_tokens"],
                          context=opts.context)
                cands.append({
                    "shape": row["shape"], "tau": row["tau"],
                    "speedup": {str(b): roofline.speedup(row["tau"], tcost, dcost, box, b, **kw) for b in opts.batches},
                    "crossover_batch": roofline.crossover(row["tau"], tcost, dcost, box, **kw),
                    "curve": [roofline.speedup(row["tau"], tcost, dcost, box, b, **kw) for b in roofline.BATCH_GRID],
                    "bound_at": {str(b): tcost.bound(box, b, row["verify_tokens"], opts.context) for b in opts.batches},
                })
            best = {str(b): max(cands, key=lambda c: c["speedup"][str(b)])["shape"] for b in opts.batches}
            entry["sets"][set_name] = {"candidates": cands, "best": best}
        out["gpus"].append(entry)
    return out


def plot(report: dict, path: str) -> str:
    """Speedup against batch size, one line per chain length, one panel per (GPU, prompt set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = report["roofline"]["gpus"]
    sets = list(report["sets"])
    fig, axes = plt.subplots(len(sets), len(gpus), figsize=(3.2 * len(gpus), 2.8 * len(sets)), squeeze=False,
                             sharey=True)
    ctx = report["roofline"]["context"]
    for i, set_name in enumerate(sets):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            for c in g["sets"][set_name]["candidates"]:
                if not c["shape"].startswith("chain:") and not c["shape"].startswith("dynamic:3"):
                    continue
                ax.plot(report["roofline"]["batch_grid"], c["curve"], lw=1.2, label=c["shape"])
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{g['gpu']}{'' if g['count'] == 1 else ' ×' + str(g['count'])} · {set_name}", fontsize=9)
            if i == len(sets) - 1:
                ax.set_xlabel("batch size")
            if j == 0:
                ax.set_ylabel(f"speedup (context {ctx})")
    axes[0][-1].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return str(path)


__all__ = ["PlanOptions", "run_plan", "plot", "GPUS"]
