"""`recycle bench`: speculative decoding with a drafter vs plain autoregressive decoding, same process.

Both runs use the one decode loop (`recycle.decoding.generate`): the baseline is the same loop
with no drafter, so the speedup measures drafting, not two different KV-cache implementations.
Per prompt the baseline and the drafter run back to back after a warm-up on the first prompt, so
machine noise hits both alike.

Cost model (Leviathan et al. 2023, with per-position acceptance as in anchors.md §3.1):

    τ_pred    = 1 + Σ_d Π_{j ≤ d} α_j            α_j: measured acceptance rate at draft depth j
    c_draft   = draft time per step  / AR time per token
    c_verify  = verify time per step / AR time per token
    predicted = τ_pred / (c_draft + c_verify)

i.e. tokens per step over the step's cost in units of one autoregressive target step (prefill
excluded). It says how far the measured speedup is from what acceptance and per-step costs imply, and, where
τ is good but the speedup is below 1, why (`noise_notes`).

Every figure comes with its spread (`spread`): across prompts always, across repeats with --repeats > 1. On a
shared machine the speedup of one prompt can be 0.3× and of the next 3×; autoregressive decoding's own speed
ranging more than 2× across prompts gives such a run away, and the report says its speedups are noise.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from recycle.bench_result import (
    Bandwidth,
    BenchResult,
    HfPeer,
    Interval,
    Measure,
    Overall,
    Predicted,
    PromptRepeats,
    PromptResult,
    PromptRun,
    PromptSpread,
    Quartiles,
    RepeatSpread,
    Span,
    Spread,
    SweepRow,
)
from recycle.checkpoint import SHORT_DTYPES
from recycle.contexts import Streams, check_buckets, context_streams, given_tree_tokens
from recycle.contexts import measure as measure_contexts
from recycle.decoding import (
    DecodeStats,
    Drafter,
    Generation,
    MaskCache,
    Target,
    generate,
    load_target,
)
from recycle.decoding.drafting import load_engine
from recycle.decoding.tree import check_rule, default_rule, shape_tokens
from recycle.encode import load_tokenizer, quiet_transformers
from recycle.errors import RecycleError
from recycle.formats import BENCH_REPORT
from recycle.hardware import detect, resolve_device, sync
from recycle.options import BenchOptions
from recycle.preflight import DRAFTER_RECORD, OutputLock, load_json
from recycle.preflight import max_positions as _positions
from recycle.resample import interval, resamples

Progress = Callable[[int, int, str], None]


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's datasheet bandwidth in GB/s (recycle.hardware), None on CPU or an unlisted card."""
    g = detect(device)
    return g.bandwidth_gbs if g is not None else None


def summarize(stats: list[DecodeStats]) -> Measure:
    """One side's decodes summed over prompts."""
    tokens = sum(s.new_tokens for s in stats)
    secs = sum(s.total_s for s in stats)
    steps = sum(s.steps for s in stats)
    depth = max((len(s.tried) for s in stats), default=0)
    tried = [sum(s.tried[d] for s in stats if d < len(s.tried)) for d in range(depth)]
    acc = [sum(s.accepted[d] for s in stats if d < len(s.accepted)) for d in range(depth)]
    return Measure(
        new_tokens=tokens,
        seconds=secs,
        tokens_per_s=tokens / secs if secs else 0.0,
        target_forwards=sum(s.forwards for s in stats),
        steps=steps,
        tau=sum(s.new_tokens - 1 for s in stats) / steps if steps else 1.0,
        acceptance=tuple(a / t if t else 0.0 for a, t in zip(acc, tried)),
        accepted=tuple(acc),
        tried=tuple(tried),
        draft_s=sum(s.draft_s for s in stats),
        verify_s=sum(s.verify_s for s in stats),
        prefill_s=sum(s.prefill_s for s in stats),
        tree_nodes_per_step=sum(s.tree_nodes for s in stats) / steps if steps else 0.0,
        rollbacks=sum(s.rollbacks for s in stats),  # hybrid targets: steps whose recurrent states went back
    )


def predicted_speedup(spec: Measure, ar: Measure) -> Predicted:
    """The cost-model prediction from measured acceptance and per-step costs (module docstring)."""
    tau, run = 1.0, 1.0
    for a in spec.acceptance:
        run *= a
        tau += run
    ar_step = (ar.draft_s + ar.verify_s) / ar.steps if ar.steps else float("nan")
    steps = spec.steps or 1
    c_draft = spec.draft_s / steps / ar_step
    c_verify = spec.verify_s / steps / ar_step
    return Predicted(tau=tau, c_draft=c_draft, c_verify=c_verify, speedup=tau / (c_draft + c_verify))


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def hf_peers(model: torch.nn.Module, prompts: list[list[int]], ours: list[list[int]], opts: BenchOptions,
             eos: int | None, progress: Progress | None, assistant: torch.nn.Module | None = None,
             *, ar_tokens_per_s: float) -> list[HfPeer]:
    """transformers' own decoding on the same target and prompts: plain, use_mtp (where the target
    declares MTP layers), `assistant_model=` (a Gemma 4 assistant) and prompt lookup; tokens/s, whether greedy
    output equals ours, and the speed over our AR decoding's `ar_tokens_per_s`."""
    cfg = model.config
    methods: list[tuple[str, dict]] = [("hf greedy", {})]
    if assistant is not None:
        methods.append(("hf assistant_model", {"assistant_model": assistant}))
    n_mtp = int(getattr(cfg, "num_mtp_layers", 0) or getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if n_mtp and hasattr(cfg, "num_mtp_layers"):
        base = int(cfg.num_hidden_layers)
        # transformers 5.x hard-codes DeepSeek-V3's layer 61 in the regex MtpModel reads MTP weights by
        # (environment.md §2); point it at this checkpoint's layers.
        model._keys_to_ignore_on_load_unexpected = {rf"model\.layers\.{base + k}\..*" for k in range(n_mtp)}
        methods.append(("hf use_mtp", {"use_mtp": True}))
    methods.append(("hf prompt lookup", {"prompt_lookup_num_tokens": 3}))
    sampling = {"do_sample": True, "temperature": opts.temperature} if opts.temperature > 0 else {"do_sample": False}
    dev = next(model.parameters()).device
    rows = []
    for mi, (name, kw) in enumerate(methods):
        tokens = secs = 0.0
        match, err = 0, None
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=dev)
            try:
                with quiet_transformers():  # use_mtp re-reads the MTP weights on every call
                    if i == 0:  # warm-up
                        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, **sampling, **kw)
                    torch.manual_seed(opts.seed)
                    t0 = time.perf_counter()
                    o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=opts.max_new_tokens,
                                       eos_token_id=eos, pad_token_id=eos, **sampling, **kw)
                    sync(dev)
                    secs += time.perf_counter() - t0
            except Exception as e:  # a peer failing is a finding to report, not a crash of our bench
                err = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                break
            new = o[0, len(p):].tolist()
            tokens += len(new)
            match += int(new == ours[i])
            if progress:
                progress(mi * len(prompts) + i + 1, len(methods) * len(prompts), name)
        tps = tokens / secs if secs and err is None else None
        rows.append(HfPeer(
            method=name, new_tokens=int(tokens), seconds=secs, tokens_per_s=tps,
            greedy_match=f"{match}/{len(prompts)}" if opts.temperature <= 0 and err is None else None,
            error=err, speedup_vs_our_ar=tps / ar_tokens_per_s if tps else None,
        ))
    return rows


@dataclass
class Session:
    """A loaded target with one drafting engine, its tokenizer and the encoded prompts (bench and plan)."""

    model: torch.nn.Module
    target: Target
    masks: MaskCache
    engine: Drafter
    encoded: list[list[int]]
    eos: int | None
    positions: int | None = None  # the target's max_position_embeddings (None: its config names none)
    contexts: Streams | None = None  # --context-buckets: the held-out documents long prompts are cut from

    def engine_for(self, tree: str, opts: BenchOptions) -> Drafter:
        """Another engine of the same drafter with another tree shape."""
        with quiet_transformers():
            return load_engine(opts.drafter, self.target, self.masks, tree=tree, native=opts.native,
                               target_dir=opts.target)


def open_session(opts: BenchOptions) -> Session:
    """Load the target, the drafter (checked against the target) and the tokenizer; encode the prompts."""
    from recycle.prompts import default_prompts, encode_prompts

    opts.validate()
    device = resolve_device(opts.device)
    tdir = Path(opts.target)
    config = load_json(tdir / "config.json", "config.json")
    if opts.context_buckets:  # a bucket past the target's context, or too narrow: before anything loads
        check_buckets(opts.context_buckets, _positions(config), opts.max_new_tokens, given_tree_tokens(opts.tree),
                      f"--tree {opts.tree}")
    tokenizer = load_tokenizer(tdir, opts.drafter)  # the drafter's where the target ships none
    prompts = opts.prompts if opts.prompts is not None else default_prompts()
    with quiet_transformers():  # a prompt longer than the model is refused below, in one line
        encoded = encode_prompts(tokenizer, prompts, str(tdir), opts.chat_template)  # before any model loads
        streams = context_streams(opts, tokenizer, prompts) if opts.context_buckets else None
    if any(not ids for ids in encoded):
        raise RecycleError("a prompt encodes to no tokens")
    check_positions(encoded, opts.max_new_tokens, 0, _positions(config))
    model = load_target(tdir, device=device, dtype=SHORT_DTYPES[opts.precision])
    target = Target(model)
    masks = MaskCache(target.dtype, device)
    with quiet_transformers():
        engine = load_engine(opts.drafter, target, masks, tree=opts.tree, native=opts.native, target_dir=str(tdir))
    positions = _positions(model.config.to_dict())
    check_positions(encoded, opts.max_new_tokens, shape_tokens(engine.shape), positions, f"the tree {engine.describe()}")
    if streams is not None:  # the engine's own tree (no --tree) known now
        check_buckets(opts.context_buckets, positions, opts.max_new_tokens, shape_tokens(engine.shape),
                      f"the tree {engine.describe()}")
    target.set_taps(engine.taps)
    eos = getattr(tokenizer, "eos_token_id", None) if opts.stop_at_eos else None
    return Session(model, target, masks, engine, encoded, eos, positions, streams)


def check_positions(encoded: list[list[int]], max_new: int, extra: int, positions: int | None, what: str = "") -> None:
    """Refuse, before generating, a prompt whose tokens with --max-new-tokens (and `extra` draft tokens a round
    verifies, `what` names them) need more positions than the target has."""
    if positions is None:
        return
    i, longest = max(enumerate(map(len, encoded)), key=lambda x: x[1])
    if longest + max_new + extra > positions:
        plus = f" + {extra} draft tokens ({what})" if extra else ""
        raise RecycleError(f"prompt {i + 1} has {longest} tokens: with --max-new-tokens {max_new}{plus} it needs "
                           f"{longest + max_new + extra} positions, and the target has {positions} "
                           "(max_position_embeddings); shorten the prompt or lower --max-new-tokens")


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> BenchResult:
    """Benchmark one drafter against AR decoding of its target; its `to_json()` is the `--json` report. With --save,
    the drafter directory's output lock is held from before anything loads until the report is written: a second
    `bench --save`, or a distill/convert into the same directory, refuses in one line instead of the two
    read-modify-writes of recycle.json losing one, or a report landing on the weights another run just replaced."""
    if not opts.save:
        return measure_bench(opts, progress)
    lock = OutputLock(Path(opts.drafter)).acquire()
    try:
        result = measure_bench(opts, progress)
        return replace(result, saved=str(save_report(result, Path(opts.drafter)).resolve()))
    finally:
        lock.release()


def measure_bench(opts: BenchOptions, progress: Progress | None = None) -> BenchResult:
    """run_bench's measurement, without --save's write."""
    from recycle.prompts import default_prompts, prompt_text

    ses = open_session(opts)
    model, target, masks, engine, encoded, eos = ses.model, ses.target, ses.masks, ses.engine, ses.encoded, ses.eos
    device, tdir = target.device, Path(opts.target)
    prompts = opts.prompts if opts.prompts is not None else default_prompts()
    rules = draft_rules(opts.draft_samples, engine)
    run = dict(seed=opts.seed, eos=eos, masks=masks)
    if opts.warmup:
        engine.draft_sample = rules[0] if opts.temperature > 0 else "greedy"
        for d in (Drafter(), engine, Drafter(), engine):
            generate(target, d, encoded[0], min(16, opts.max_new_tokens), temperature=opts.temperature, **run)
    measured = measure_sweep(target, engine, encoded, opts, rules, run, progress)
    first = measured[0]
    rows, ours = [], [g.tokens for g in first.spec]
    for (kind, text), ids, ar, sp, times in zip(prompts, encoded, first.ar, first.spec, first.timings):
        rows.append(PromptResult(
            set=kind, prompt_tokens=len(ids), text=prompt_text(text)[:80],
            ar=_prompt_run(ar.stats), spec=_prompt_run(sp.stats, sp.stats.tau),
            speedup=_tps(sp.stats) / _tps(ar.stats) if _tps(ar.stats) else None,
            greedy_match=(ar.tokens == sp.tokens) if first.temperature <= 0 else None,
            repeats=None if opts.repeats == 1 else PromptRepeats(tuple(_tps(a) for a, _ in times),
                                                                 tuple(_tps(b) for _, b in times)),
        ))
    ar_stats, sp_stats = [g.stats for g in first.ar], [g.stats for g in first.spec]
    ar_sum, sp_sum = summarize(ar_stats), summarize(sp_stats)
    overall = Overall(
        ar=ar_sum,
        spec=sp_sum,
        speedup=sp_sum.tokens_per_s / ar_sum.tokens_per_s if ar_sum.tokens_per_s else None,
        predicted=predicted_speedup(sp_sum, ar_sum),
        greedy_match=f"{sum(bool(r.greedy_match) for r in rows)}/{len(rows)}" if opts.temperature <= 0 else None,
        spread=spread(ar_stats, sp_stats, first.timings),
    )
    sweep = tuple(sweep_row(m, opts.seed) for m in measured)
    bandwidth = None
    peak = peak_bandwidth(device)
    if peak is not None:
        nbytes = _param_bytes(model)
        bandwidth = Bandwidth(peak_gbs=peak, ar_gbs=nbytes * ar_sum.target_forwards / ar_sum.seconds / 1e9,
                              spec_gbs=nbytes * sp_sum.target_forwards / sp_sum.seconds / 1e9)
    hf = None
    if opts.compare_hf:
        hf = tuple(hf_peers(model, encoded, ours, opts, eos, progress, assistant=getattr(engine, "assistant", None),
                            ar_tokens_per_s=ar_sum.tokens_per_s))
    contexts = None
    if ses.contexts is not None:
        contexts = measure_contexts(ses.contexts, opts.context_buckets, opts.context_prompts, target=target,
                                    engine=engine, masks=masks, eos=eos, temperatures=opts.temperatures,
                                    draft_samples=rules, seed=opts.seed, max_new=opts.max_new_tokens,
                                    extra=shape_tokens(engine.shape), progress=progress)
    return BenchResult(
        target=str(tdir),
        drafter=opts.drafter if not opts.native else None,
        drafter_kind=engine.kind,
        tree=engine.describe(),
        device=str(device),
        dtype=opts.precision,
        threads=torch.get_num_threads(),
        temperature=opts.temperature,
        max_new_tokens=opts.max_new_tokens,
        seed=opts.seed,
        repeats=opts.repeats,
        prompts=tuple(rows),
        overall=overall,
        bandwidth=bandwidth,
        hf=hf,
        notes=tuple(noise_notes(overall)),
        saved=None,
        sweep=sweep,
        contexts=contexts,
    )


def draft_rules(given: tuple[str, ...], engine: Drafter) -> tuple[str, ...]:
    """--draft-sample's rules (none given: the engine's shape's default), each checked against the shape (without
    --tree the shape is the engine's default, known only now)."""
    rules = given or (default_rule(engine.shape),)
    for rule in rules:
        check_rule(rule, engine.shape)
    return rules


@dataclass
class Measured:
    """One temperature × rule: per prompt, the fastest AR and speculative decodes and every repeat's stats."""

    temperature: float
    draft_sample: str
    ar: list[Generation]
    spec: list[Generation]
    timings: list[list[tuple[DecodeStats, DecodeStats]]]  # per prompt, per repeat: (AR, spec)


def measure_sweep(target: Target, engine: Drafter, encoded: list[list[int]], opts: BenchOptions,
                  rules: tuple[str, ...], run: dict, progress: Progress | None) -> list[Measured]:
    """Every --temperature × rule, in order: per prompt and repeat, AR once at that temperature (shared by its rules),
    then each rule's speculative decode. At T = 0 drafts are the top-k whatever the rule: one row, named greedy."""
    out: list[Measured] = []
    before = engine.draft_sample
    try:
        for ti, t in enumerate(opts.temperatures):
            at = rules if t > 0 else ("greedy",)
            rows = {r: Measured(t, r, [], [], []) for r in at}
            for i, ids in enumerate(encoded):
                best: dict[str, Generation] = {}
                times: dict[str, list] = {r: [] for r in at}
                for _ in range(opts.repeats):  # same seed each time: identical tokens, only the timing varies
                    a = generate(target, Drafter(), ids, opts.max_new_tokens, temperature=t, **run)
                    best["ar"] = _faster(best.get("ar"), a)
                    for r in at:
                        engine.draft_sample = r
                        b = generate(target, engine, ids, opts.max_new_tokens, temperature=t, **run)
                        best[r] = _faster(best.get(r), b)
                        times[r].append((a.stats, b.stats))
                for r in at:
                    rows[r].ar.append(best["ar"])
                    rows[r].spec.append(best[r])
                    rows[r].timings.append(times[r])
                if progress:
                    progress(ti * len(encoded) + i + 1, len(encoded) * len(opts.temperatures),
                             f"decoding T={t:g}" if len(opts.temperatures) > 1 else "decoding")
            out.extend(rows.values())
    finally:
        engine.draft_sample = before
    return out


def _faster(a: Generation | None, b: Generation) -> Generation:
    return b if a is None or b.stats.total_s < a.stats.total_s else a


def bootstrap(stats: list[DecodeStats], seed: int) -> tuple[tuple[Interval, ...], Interval]:
    """95% intervals of the pooled per-depth acceptance and τ over resampled prompts (`recycle.resample`). A
    resample in which no prompt reached a depth adds nothing to that depth's interval."""
    depth = max((len(s.tried) for s in stats), default=0)
    acc: list[list[float]] = [[] for _ in range(depth)]
    taus = []
    for pick in resamples(len(stats), seed):
        m = summarize([stats[i] for i in pick])
        taus.append(m.tau)
        for d, t in enumerate(m.tried):
            if t:
                acc[d].append(m.accepted[d] / t)
    return tuple(Interval(*interval(a)) if a else Interval(0.0, 0.0) for a in acc), Interval(*interval(taus))


def sweep_row(m: Measured, seed: int) -> SweepRow:
    """One row of the sweep: pooled figures, their quartiles across prompts and their bootstrap intervals."""
    ar, sp = [g.stats for g in m.ar], [g.stats for g in m.spec]
    a, b = summarize(ar), summarize(sp)
    per_depth = [[s.accepted[d] / s.tried[d] for s in sp if d < len(s.tried) and s.tried[d]] for d in range(len(b.tried))]
    acc_iv, tau_iv = bootstrap(sp, seed)
    speedups = [_tps(y) / _tps(x) for x, y in zip(ar, sp) if _tps(x)]
    matched = sum(x.tokens == y.tokens for x, y in zip(m.ar, m.spec))
    return SweepRow(
        temperature=m.temperature, draft_sample=m.draft_sample, prompts=len(sp), acceptance=b.acceptance,
        accepted=b.accepted, tried=b.tried, acceptance_quartiles=tuple(_quartiles(v) for v in per_depth),
        acceptance_interval=acc_iv, tau=b.tau, tau_quartiles=_quartiles([s.tau for s in sp]), tau_interval=tau_iv,
        tokens_per_s=b.tokens_per_s, ar_tokens_per_s=a.tokens_per_s,
        speedup=b.tokens_per_s / a.tokens_per_s if a.tokens_per_s else None,
        speedup_quartiles=_quartiles(speedups) if speedups else None,
        greedy_match=f"{matched}/{len(sp)}" if m.temperature <= 0 else None,
    )


def _prompt_run(s: DecodeStats, tau: float | None = None) -> PromptRun:
    """One side's decode of one prompt as the report holds it (`tau`: the speculative side's)."""
    return PromptRun(new_tokens=s.new_tokens, forwards=s.forwards, rollbacks=s.rollbacks, steps=s.steps,
                     tree_nodes=s.tree_nodes, prefill_s=s.prefill_s, draft_s=s.draft_s, verify_s=s.verify_s,
                     total_s=s.total_s, tried=tuple(s.tried), accepted=tuple(s.accepted), tokens_per_s=_tps(s),
                     tau=tau)


LOADED_RATIO = 2.0  # AR decoding speed varying more than this across prompts: something else shares the machine
GOOD_TAU = 1.5  # τ above which a speedup below 1 is the per-round cost's doing, not the drafter's acceptance


def _quartiles(values: list[float]) -> Quartiles:
    """min, q1, median, q3, max (inclusive quartiles: a handful of prompts is the whole population)."""
    v = sorted(values)
    if len(v) == 1:
        return Quartiles(v[0], v[0], v[0], v[0], v[0])
    q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return Quartiles(v[0], q1, med, q3, v[-1])


def _decode_rate(s: DecodeStats) -> float | None:
    """Target steps per second after the prefill: AR decoding's speed with the prompt's length taken out (a
    long prompt's prefill, or a generation that stops after a few tokens, would move tokens/s by itself)."""
    secs = s.draft_s + s.verify_s
    return s.steps / secs if s.steps and secs > 0 else None


def _speedup(ar: list[DecodeStats], sp: list[DecodeStats]) -> float | None:
    a, b = summarize(ar).tokens_per_s, summarize(sp).tokens_per_s
    return b / a if a else None


def spread(ar: list[DecodeStats], sp: list[DecodeStats], timings: list[list[tuple[DecodeStats, DecodeStats]]]) -> Spread:
    """How much the figures move: across prompts (always: the IQR of per-prompt speedup and τ, and how far AR
    decoding speed ranged, which on an idle machine hardly moves) and, with --repeats > 1, across repeats (each
    repeat's overall figures, every prompt timed once)."""
    speedups = [_tps(b) / _tps(a) for a, b in zip(ar, sp) if _tps(a)]
    rates = [r for r in map(_decode_rate, ar) if r]
    span = Span(min(rates), max(rates), max(rates) / min(rates)) if rates else None
    prompts = PromptSpread(speedup=_quartiles(speedups) if speedups else None, tau=_quartiles([s.tau for s in sp]),
                           ar_decode_steps_per_s=span)
    repeats = None
    if timings and len(timings[0]) > 1:
        rounds = [[t[r] for t in timings] for r in range(len(timings[0]))]
        repeats = RepeatSpread(
            n=len(rounds),
            speedup=_quartiles([x for x in (_speedup([a for a, _ in r], [b for _, b in r]) for r in rounds)
                                if x is not None]),
            ar_tokens_per_s=_quartiles([summarize([a for a, _ in r]).tokens_per_s for r in rounds]),
            spec_tokens_per_s=_quartiles([summarize([b for _, b in r]).tokens_per_s for r in rounds]),
        )
    ratio = (span.ratio if span else None) or 1.0
    return Spread(prompts=prompts, repeats=repeats, loaded=ratio > LOADED_RATIO)


def noise_notes(overall: Overall) -> list[str]:
    """One line each: a loaded machine (speedups are noise there), and a good τ that still loses, explained by the
    cost model's per-round costs (in AR steps)."""
    notes = []
    loaded = overall.spread is not None and overall.spread.loaded
    if loaded:
        rates = overall.spread.prompts.ar_decode_steps_per_s
        notes.append(f"autoregressive decoding ran {rates.ratio:.1f}× faster on one prompt than on another "
                     f"({rates.min:.0f}–{rates.max:.0f} steps/s): the machine is busy with other work, so "
                     "these speedups are noise; re-run on an idle machine, or with --repeats 3")
    tau, speedup, pr = overall.spec.tau, overall.speedup, overall.predicted
    if speedup is not None and speedup < 1 and tau > GOOD_TAU:
        cd, cv = pr.c_draft, pr.c_verify
        cost = cd + cv
        if cost >= tau:
            why = ""
            if loaded:  # the costs are as noisy as the speedups: no advice follows from them
                why = "; measured on a busy machine, so no advice on the tree or the drafter follows from these costs"
            elif cv - 1 >= cd:  # verification's cost beyond one AR step is the larger share
                why = (f"; verifying costs {cv:.2f} target steps a round, not about one as where decoding is "
                       "memory-bound: try a smaller --tree")
            elif cd >= 0.5:
                why = (f"; drafting alone costs {cd:.2f} of a target step: a drafter that costly next to its target "
                       "pays only beside a much larger target")
            notes.append(f"τ is {tau:.2f} but the speedup {speedup:.2f}×: a round costs {cost:.2f} AR steps "
                         f"(drafting {cd:.2f}, verifying {cv:.2f}), more than the {tau:.2f} tokens it gains{why}")
        else:
            notes.append(f"τ is {tau:.2f} and the cost model predicts {pr.speedup:.2f}× from the per-round costs, "
                         f"yet {speedup:.2f}× was measured: the time went outside drafting and verifying (prefill, "
                         "the loop's own work) or to other work on the machine")
    return notes


def save_report(result: BenchResult, drafter: Path) -> Path:
    """Write the report as DRAFTER/bench.json (the model card's benchmark) and its sweep's summary under
    recycle.json's `bench` key (`bench_record`), each atomically (`write_json`). The file goes up with the drafter
    on `recycle push`, so where it was saved (a local path) stays out of it: the result's `saved` says it (run_bench
    sets it to the returned path)."""
    path = drafter / BENCH_REPORT
    write_json(path, result.file_json())
    record_path = drafter / DRAFTER_RECORD
    if record_path.is_file():  # a drafter recycle wrote (push publishes only those)
        record = load_json(record_path, DRAFTER_RECORD)
        write_json(record_path, record | {"bench": bench_record(result)})
    return path


def write_json(path: Path, obj: dict) -> None:
    """A JSON file written atomically: a temp file beside it, then a rename, so an interrupted write leaves the
    previous file or none, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def bench_record(result: BenchResult) -> dict:
    """recycle.json's `bench`: the temperatures and rules measured, per row acceptance by depth and τ, the tree,
    the prompts' count, and the file holding the full report."""
    rows = result.sweep or ()
    return {
        "file": BENCH_REPORT,
        "tree": result.tree,
        "prompts": len(result.prompts),
        "max_new_tokens": result.max_new_tokens,
        "temperatures": list(dict.fromkeys(r.temperature for r in rows)),
        "draft_samples": list(dict.fromkeys(r.draft_sample for r in rows)),
        "rows": [{"temperature": r.temperature, "draft_sample": r.draft_sample, "acceptance": list(r.acceptance),
                  "tau": r.tau} for r in rows],
    }


def _tps(s: DecodeStats) -> float:
    return s.new_tokens / s.total_s if s.total_s else 0.0


def set_threads(n: int | None) -> None:
    """Torch intra-op threads (default: leave torch's choice; RECYCLE_THREADS overrides)."""
    n = n or int(os.environ.get("RECYCLE_THREADS", "0") or 0)
    if n > 0:
        torch.set_num_threads(n)


__all__ = ["BenchOptions", "BenchResult", "run_bench", "summarize", "predicted_speedup", "peak_bandwidth", "set_threads",
           "spread", "noise_notes", "save_report"]
