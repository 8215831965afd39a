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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from recycle import roofline
from recycle.bench import Session, _summary, open_session, resolve_device
from recycle.decoding import Drafter, generate
from recycle.decoding import cache as kv
from recycle.decoding.drafting import describe_shape
from recycle.decoding.tree import Tree, chain_parents
from recycle.decoding.verify import verify
from recycle.errors import RecycleError
from recycle.hardware import GPUS, gpu
from recycle.options import BenchOptions, PlanOptions

Progress = Callable[[int, int, str], None]
# Trees tried besides the chains (the format's bench default first): formats with a static tree draft its one
# fixed-depth Medusa-style tree; the recursive drafters grow EAGLE-2 dynamic trees.
DYNAMIC_TREES = ("dynamic:3,2,6", "dynamic:2,2,4", "dynamic:4,2,8")


def _model_config(path: str) -> dict:
    from recycle.preflight import load_json

    p = Path(path)
    cfg = load_json(p / "config.json" if p.is_dir() else p, "--model-config")
    try:
        roofline.target_cost(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise RecycleError(f"--model-config {path}: not a decoder config this roofline reads ({e})") from None
    return cfg


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def verify_curve(ses: Session, context: int, max_n: int, reps: int = 7) -> list[float]:
    """Seconds for the decode loop's verification of n = 1 … max_n chain tokens after `context` cached
    tokens (forward, greedy verify, cache crop), median of `reps`."""
    target, dev = ses.target, ses.target.device
    pool = [t for ids in ses.encoded for t in ids]
    ids = (pool * ((context + max_n) // max(len(pool), 1) + 1))[: context + max_n]
    cache = target.new_cache()
    with torch.inference_mode():
        target.forward(torch.tensor([ids[:context]], device=dev), torch.arange(context, device=dev)[None], None, cache,
                       logits_for=slice(-1, None))
        out = []
        for n in range(1, max_n + 1):
            toks = ids[context : context + n]
            tree = Tree(list(toks), chain_parents(n - 1), list(range(n)))
            if n == 1:
                mask, pos = None, torch.tensor([[context]], device=dev)
            else:
                mask, pos = ses.masks.mask(tree.parents, tree.depths, context)
            times = []
            for _ in range(reps + 1):  # the first is a warm-up
                _sync(dev)
                t0 = time.perf_counter()
                logits, _ = target.forward(torch.tensor([toks], device=dev), pos, mask, cache)
                verify(tree, logits, 0.0, None)
                kv.crop(cache, context)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times[1:]))
    return out


def _decode(ses: Session, engine: Drafter, prompts: list[list[int]], opts: BenchOptions) -> dict:
    run = dict(temperature=0.0, seed=opts.seed, eos=ses.eos, masks=ses.masks)
    generate(ses.target, engine, prompts[0], min(16, opts.max_new_tokens), **run)  # warm-up
    stats = [generate(ses.target, engine, p, opts.max_new_tokens, **run).stats for p in prompts]
    s = _summary(stats)
    s["accept_lengths"] = [n for st in stats for n in st.accept_lengths]
    s["round_s"] = (s["draft_s"] + s["verify_s"]) / s["steps"] if s["steps"] else 0.0
    s["draft_step_s"] = s["draft_s"] / s["steps"] if s["steps"] else 0.0
    s["prompts"] = len(prompts)
    return s


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
    trees = [None] if fmt.static_tree or ses.target.recurrent else [None, *DYNAMIC_TREES]
    engines: list[tuple[str, Drafter]] = [("ar", Drafter()), ("chain:1", ses.engine_for("chain:1", bopts)),
                                          (f"chain:{k_max}", chain_max)]
    for t in trees:
        e = ses.engine if t is None else ses.engine_for(t, bopts)
        name = describe_shape(e.shape)
        if name not in {n for n, _ in engines}:
            engines.append((name, e))
    mean_ctx = round(statistics.mean(len(p) for p in ses.encoded) + bopts.max_new_tokens / 2)
    total = len(sets) * len(engines) + 1
    done = 0
    curve = verify_curve(ses, mean_ctx, opts.verify_max)
    done += 1
    if progress:
        progress(done, total, "verification cost")
    measured: dict[str, dict] = {}
    for set_name, ids in sets.items():
        runs = {}
        for name, engine in engines:
            runs[name] = _decode(ses, engine, ids, bopts)
            runs[name]["info"] = _shape_info(engine)
            done += 1
            if progress:
                progress(done, total, f"{set_name}: {name}")
        measured[set_name] = runs

    def t_verify(n: int) -> float:
        if n <= len(curve):
            return curve[n - 1]
        slope = (curve[-1] - curve[-2])
        return curve[-1] + slope * (n - len(curve))

    report_sets = {}
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
            rows.append(_row(name, r["tau"], r["draft_step_s"], t_verify(round(r["tree_nodes_per_step"]) + 1),
                             t_ar, r, ar, info))
        acc = _acceptance(lengths, k_max)
        report_sets[set_name] = {
            "prompts": len(sets[set_name]),
            "ar_step_s": t_ar,
            "acceptance_by_depth": acc,
            "candidates": rows,
            "recommended": _recommend(rows),
        }
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


__all__ = ["PlanOptions", "run_plan", "parse_batches", "plot", "GPUS"]
