"""`recycle distill`: frozen-target distillation of a drafter directory, to an exact token budget.

This file is the loop, top to bottom: `prepare` (`distill/setup.py`: validation, then the models and the data,
sharded by `distill/sharding.py`) → `train` (restore or score the input, the steps, the held-out estimate, the
checkpoints and best weights of `distill/state.py`) → the record (`distill/record.py`) → the drafter written.
A caller may watch the run through `on_step` (the recycling experiment writes its snapshots from it).

The loop, per optimizer step: take `batch` packed sequences (per rank) → the frozen target gives
features and logits (no grad, bf16 autocast) → the drafter unrolls K draft steps (`recycle.distill.unroll`)
→ `recycle.distill.losses` → backward (FSDP2 reduce-scatter, several ranks) → clip → AdamW → LR schedule.

Choices and why:
  * Budget in *target tokens read* (`--tokens 2M`): the target's forward is the cost that scales
    with model size, so it is what a user budgets; the last batch is cut (whole rows, then one
    shorter row) so the run stops exactly at the budget.
  * AdamW (β 0.9/0.95, no weight decay: few steps from a good init), linear warm-up over 5% of the
    steps then cosine to 10% of the peak: a recycled module starts close to a solution, and a cold
    large step would erase it before the schedule can help. Clip at 0.5 (EAGLE/EAGLE-3).
  * Checkpoints every N steps hold everything a bit-exact continuation needs: drafter, optimizer,
    scheduler, step, tokens, data position, RNG states; written to a temp file, fsynced, renamed.
    A kill loses at most one interval. They live in a state directory beside the output
    (`OUT.distill/`, also holding metrics.jsonl); the checkpoint is removed once the output is whole.
  * Several ranks (`torchrun`): FSDP2 (`fully_shard`, each decoder layer a unit, then the drafter): each
    rank holds 1/world of the trainable weights, gradients and AdamW state, and trains on its slice of the
    global batch. Fused routed experts are split by expert instead (`distill/experts.py`: the rows go to the
    experts; no rank ever holds all of them). Every rank runs as many forward/backward passes per step as the
    others (the truncated last batch can leave a rank without rows: it runs held-out rows at weight 0). The
    drafter is built on the meta device and each rank reads only its shards (`recycle/drafters/sharded.py`). Every
    rank evaluates and keeps its shards of the best weights; every rank checkpoints its own shards
    (`torch.distributed.checkpoint` into safetensors, `distill/state.py`) and writes its part of the drafter
    (`converters/rewrite.py`, `write_drafter_sharded`); rank 0 logs.
  * A held-out estimate of acceptance every M steps: top-1 agreement of each draft step with the
    target's greedy token on a fixed held-out batch (the held-out side of `--data`), whose rows the
    target continues greedily after a short prompt once at the start: that is the text greedy
    decoding verifies, so the estimate tracks what `recycle bench` measures. It costs one drafter
    forward. Its scalar is the chain's expected accepted length, 1 + Σ_k Π_{j≤k} a_j.
  * Never worse: the run keeps the weights with the best held-out estimate seen (the input's
    included) and writes those, so a distillation cannot ship a drafter that scores below its input.
  * The target's own embedding and LM head: an EAGLE drafter's are frozen copies of its source's;
    when the target moved away (post-training, fine-tune), they are replaced by the target's before
    training, and the record says how far they had drifted.
  * Precision: bf16 autocast on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), fp32 on the
    rest, where emulated bf16 measured 12× slower than fp32.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from recycle.converters.rewrite import write_drafter, write_drafter_sharded
from recycle.distill import record, state
from recycle.distill.data import mask_steps, regenerate
from recycle.distill.losses import distill_loss, distill_terms
from recycle.distill.record import expected_length
from recycle.distill.schedule import Step, time_left
from recycle.distill.setup import Prepared, prepare
from recycle.distill.sharding import allreduce_grads
from recycle.distill.teacher import TeacherOut, autocast
from recycle.errors import Interrupted, RecycleError
from recycle.hardware import sync
from recycle.io.writer import OutputDir
from recycle.options import DistillOptions, Every
from recycle.preflight import duration

__all__ = ["Current", "DistillOptions", "agreement", "distill", "train", "train_step"]

# The time a budget takes, measured on the run's first steps: the rate from the end of the first step (which also
# packs the data and warms up) over at least ETA_STEPS more steps and ETA_MIN_S seconds, or over whatever steps the
# run's first ETA_AFTER_S seconds held; a budget whose rest takes longer than ETA_NOTE_S at that rate gets a note,
# within the run's first minute unless one step takes longer.
ETA_STEPS, ETA_MIN_S, ETA_AFTER_S, ETA_NOTE_S = 3, 5.0, 20.0, 600.0


def time_note(budget: int, done: int, tokens_per_s: float, where: str, device: str,
              threshold: float = ETA_NOTE_S) -> str | None:
    """The note for a budget whose rest takes longer than `threshold` seconds at the measured rate; None otherwise."""
    left = time_left(budget, done, tokens_per_s)
    if left <= threshold:
        return None
    advice = "train on a GPU" if device == "cpu" else "add ranks (torchrun)"
    return (f"note: --tokens {budget:,} takes about {duration(left)} more at this rate ({tokens_per_s:,.0f} tokens/s "
            f"{where}); lower --tokens or {advice}")


# -- one step ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def agreement(p: Prepared) -> list[float]:
    """Held-out top-1 agreement of each draft step with the target's greedy token."""
    p.model.eval()
    h = p.heldout
    with autocast(p.device, p.precision):
        te = h.teacher
        steps = mask_steps(p.unroller.unroll(h.ids, te.last, te.aux, te.logits, kv=te.kv), h.mask)
        agree = [float(t["agree"]) for t in distill_terms(steps, grad=False)]  # the teacher's logits once per chunk
    p.model.train()
    return agree


def _accumulate(info: dict | None, terms: dict, share: float) -> dict:
    """Per-step CE, KL and agreement of a micro-batch's slices, weighted by their share of its rows."""
    scaled = {k: [v * share for v in vs] for k, vs in terms.items()}
    if info is None:
        return scaled
    return {k: [a + b for a, b in zip(info[k], scaled[k])] for k in info}


def _passes(p: Prepared, ids: torch.Tensor, key: str, weight: float, mask: torch.Tensor | None = None) -> list[tuple]:
    """A micro-batch's forward/backward passes: the teacher's outputs for its rows, cut into --micro-batch slices,
    each with its share of the step's loss and its rows' assistant mask: (ids, teacher outputs, share, mask)."""
    t0 = time.perf_counter()
    with record_function("recycle.teacher"):  # named ranges: what a profiler (benchmarks/distill_gpu.py) attributes
        te = p.teacher(ids, key)
        sync(p.device)
    p.counters.timing["teacher_s"] += time.perf_counter() - t0
    if p.unroller.positions(ids.shape[1]) < 1:
        return []
    rows = ids.shape[0]
    size = min(p.opts.micro_batch or rows, rows)
    out = []
    for lo in range(0, rows, size):  # --micro-batch: the gradient accumulates over slices of the rows
        part = slice(lo, lo + size)
        frac = (min(rows, lo + size) - lo) / rows  # equal lengths: rows weigh as their anchors do
        kv = {k: (a[part], b[part]) for k, (a, b) in te.kv.items()} if te.kv else None
        sliced = TeacherOut(te.last[part], te.aux[part] if te.aux is not None else None, te.logits, kv)
        out.append((ids[part], sliced, weight * frac, mask[part] if mask is not None else None))
    return out


def _run_passes(p: Prepared, passes: list[tuple]) -> tuple[float, dict | None]:
    """Forward and backward of each pass. Sharded, every rank must run as many as the others (each pass gathers
    and reduces the same units): a rank with fewer runs held-out rows at weight 0; FSDP averages the gradients
    over ranks, so each pass's loss is scaled by the world size to keep the step's sum."""
    sharded, world = p.shard.sharded, p.run.ranks.world
    if sharded:
        count = torch.tensor([len(passes)], device=p.device)  # NCCL reduces device tensors only
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        h = p.heldout
        filler = TeacherOut(h.teacher.last[:1], h.teacher.aux[:1] if h.teacher.aux is not None else None,
                            h.teacher.logits,
                            {k: (a[:1], b[:1]) for k, (a, b) in h.teacher.kv.items()} if h.teacher.kv else None)
        passes = passes + [(h.ids[:1], filler, 0.0, None)] * (int(count) - len(passes))
    t1 = time.perf_counter()
    scale = world if sharded else 1
    total, info = 0.0, None
    weight = sum(x[2] for x in passes) or 1.0
    with record_function("recycle.drafter"):
        for ids, te, share, mask in passes:
            with autocast(p.device, p.precision):
                steps = mask_steps(p.unroller.unroll(ids, te.last, te.aux, te.logits,
                                                     with_features=bool(p.opts.loss.feature_weight), kv=te.kv), mask)
                loss, terms = distill_loss(steps, p.opts.loss)
            (loss * (share * scale)).backward()
            if share:  # logged CE/KL/agreement: the passes' average, weighted as the loss weighs them
                total += float(loss.detach()) * share
                info = _accumulate(info, terms, share / weight)
        sync(p.device)
    p.counters.timing["drafter_s"] += time.perf_counter() - t1
    return total, info


def _diverged(p: Prepared, what: str, value: float) -> None:
    """A non-finite loss or gradient: training diverged. Stop before the update, write no drafter (the output would
    be NaN or worse than the input) and keep the last checkpoint, whose weights were all finite."""
    c = p.counters
    kept = (f"the last good checkpoint (step {c.last_checkpoint}) stays in {p.run.outputs.state_dir}"
            if c.last_checkpoint is not None else "no checkpoint had been written")
    raise RecycleError(f"step {c.step + 1}: the {what} is {value} (training diverged at --lr {p.opts.lr:g}); "
                       f"stopped, no drafter written, {kept}; lower --lr and start over with --overwrite")


def train_step(p: Prepared, step: Step) -> dict:
    """One optimizer step: the step's rows (regenerated by the target under --self-distill), the teacher's outputs,
    forward and backward of every micro-batch, gradients reduced over the ranks, clip, AdamW, the LR schedule.
    Returns the step's metrics row."""
    o, c, ranks = p.opts, p.counters, p.run.ranks
    t0 = time.perf_counter()
    lengths = step.lengths
    generated = c.timing["generate_s"]
    rows, masks = p.stream.take_masked(len(lengths), step.seq_len)
    t0 += c.timing["generate_s"] - generated  # conversations regenerated as the stream read them
    # a harvested cache holds one process's keys: each rank reads its block of the step's rows from them
    block = o.batch if p.harvested else None
    keys = [(list(mb.rows), mb.length, mb.key) for mb in step.micro_batches(ranks.rank, ranks.world, block)]
    written = {}
    if o.self_distill and p.harvested:  # vLLM wrote the continuations: the cache holds each key's rows
        written = {key: p.teacher.cached_rows(key) for _, _, key in keys}  # (ids, assistant mask or None)
    elif o.self_distill and p.run.data.renderer is None:  # the target's generation is teacher compute, timed on its
        # own (conversations were regenerated turn by turn as the stream read them)
        tg = time.perf_counter()
        rows = regenerate(p.teacher.model, rows, o.prompt_len, o.sd_temperature, o.seed * 1_000_003 + c.step)
        masks = None  # the target wrote each row to its end: whole packing's padding is gone
        c.timing["generate_s"] += time.perf_counter() - tg
        t0 += time.perf_counter() - tg
    anchors = [max(0, p.unroller.positions(n)) for n in lengths]
    total_anchor = max(1, sum(anchors))
    micro = []
    for idx, n, key in keys:
        ids, mask = written.get(key, (rows[idx, :n], masks[idx, :n] if masks is not None else None))
        micro.append((ids.to(p.device), key, sum(anchors[i] for i in idx),
                      mask.to(p.device) if mask is not None else None))
    c.timing["data_s"] += time.perf_counter() - t0
    p.opt.zero_grad(set_to_none=True)
    passes = []
    for ids, key, n, mask in micro:
        passes += _passes(p, ids, key, n / total_anchor, mask)
    loss, info = _run_passes(p, passes)
    t1 = time.perf_counter()
    if ranks.world > 1:
        if not p.shard.sharded:
            allreduce_grads(p.unroller.trainable())
        lt = torch.tensor([loss], dtype=torch.float64, device=p.device)
        dist.all_reduce(lt)  # every rank has read its rows of the step's keys by now
        loss = float(lt)
    if p.producer is not None and ranks.is_main:  # online: consumed, deleted (disk stays at `ahead` keys)
        p.teacher.release([key for _, _, key in keys])
    if not math.isfinite(loss):  # every rank holds the reduced loss: all stop here, before the update
        _diverged(p, "loss", loss)
    params = p.unroller.trainable()
    if any(x.grad is not None for x in params):
        with record_function("recycle.optimizer"):
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, o.clip))  # the total norm: the same on every rank
            if not math.isfinite(gnorm):  # an update from it would make every weight NaN
                _diverged(p, "gradient norm", gnorm)
            p.opt.step()
    else:
        gnorm = 0.0
    p.sched.step()
    c.step += 1
    c.tokens += sum(lengths)
    c.timing["optimizer_s"] += time.perf_counter() - t1
    info = info or {"ce": [], "kl": [], "agree": []}
    return {"step": c.step, "tokens": c.tokens, "loss": loss, "grad_norm": gnorm,
            "lr": p.sched.get_last_lr()[0], "ce": info["ce"], "kl": info["kl"], "train_agree": info["agree"],
            **{k: v for k, v in info.items() if k not in ("ce", "kl", "agree")}}  # --loss's other terms: tv, kl@T


# -- around the steps: the best weights, checkpoints, the time estimate, signals, the output ----------------------


def _consider(p: Prepared, agree: list[float]) -> None:
    """Keep the current weights if their held-out estimate beats the best so far (the input counts)."""
    state.consider(p.run.outputs.state_dir, p.counters, expected_length(agree), agree, p.model, p.run.ranks.is_main,
                   p.shard.sharded)


def _checkpoint(p: Prepared) -> None:
    c = p.counters
    state.save(p.run.outputs.state_dir, p.run.fingerprint(), c, p.model, p.opt, p.sched, p.stream.pos, c.wall(),
               p.shard.sharded, p.run.ranks.is_main)


def _estimate_time(p: Prepared, tokens: int, seconds: float, where: str) -> None:
    """The rest of the budget at the rate the first steps measured (the record's `time_estimate`); a note when
    it is long (ETA_NOTE_S), so a budget no machine here can finish says so early."""
    c, budget = p.counters, p.opts.tokens
    rate = round(tokens / max(seconds, 1e-9), 1)  # one figure for the record and the note (they disagreed by 1 tok/s)
    left = time_left(budget, c.tokens, rate)
    note = time_note(budget, c.tokens, rate, where, p.device.type, ETA_NOTE_S)
    c.time_estimate = {"measured": where, "tokens_per_s": rate, "tokens_done": c.tokens,
                       "seconds_left": round(left, 1), "about": duration(left), "note": note}
    if note:
        p.run.note(note)


@contextlib.contextmanager
def _stop_between_steps(c: state.Counters):
    """While the loop runs, SIGINT/SIGTERM ask it to stop after the step in flight (and checkpoint); a second one
    stops at once. Before and after, they interrupt as usual (nothing to save yet, or the output is being written
    whole)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def on_signal(signum, frame) -> None:
        if c.stop is not None:
            raise KeyboardInterrupt
        c.stop = signal.Signals(signum).name

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _stopped(p: Prepared) -> None:
    """A signal asked the loop to stop: checkpoint the last finished step, then stop (resumable)."""
    c = p.counters
    if (p.run.ranks.is_main or p.shard.sharded) and c.step > 0:
        _checkpoint(p)
    where = (f"step {c.step} ({c.tokens:,} of {p.opts.tokens:,} tokens) is checkpointed in {p.run.outputs.state_dir}"
             if c.step > 0 else "no step had finished: nothing was saved")
    raise Interrupted(f"{c.stop}: stopped; {where}", resumable=c.step > 0)


def _write(p: Prepared, writer: OutputDir, entry: dict) -> None:
    """The drafter as it stands, in every layout of its input, `entry` appended to its recycle.json."""
    write_drafter(p.opts.drafter, writer, p.run.fmt, p.unroller.file_state(), p.model, entry)


@dataclass(frozen=True)
class Current:
    """What an `on_step` callback gets: the run as it stands, once before the first step of a fresh run (tokens 0,
    the input's weights) and after every step. One process only (not under torchrun); rank 0's metrics row is
    written by then. The recycling experiment (`benchmarks/experiment.py`) writes its snapshots from it."""

    prepared: Prepared

    @property
    def step(self) -> int:
        return self.prepared.counters.step

    @property
    def tokens(self) -> int:
        return self.prepared.counters.tokens

    def agreement(self) -> list[float]:
        """The held-out agreement per draft step now (one drafter forward)."""
        return agreement(self.prepared)

    def write(self, writer: OutputDir, entry: dict) -> None:
        """The current weights as a drafter directory, `entry` its recycle.json's newest distillation record."""
        _write(self.prepared, writer, entry)


# -- the run ------------------------------------------------------------------------------------------------------


def train(p: Prepared, progress: Callable[[dict], None] | None = None,
          on_step: Callable[[Current], None] | None = None) -> dict:
    """Train a prepared run to its budget and write the drafter with the best held-out estimate; returns the record.
    `progress` gets each step's metrics row (rank 0); `on_step` (one process only) the run after each step."""
    o, c, ranks = p.opts, p.counters, p.run.ranks
    state_dir = p.run.outputs.state_dir
    if on_step is not None and ranks.world > 1:
        raise RecycleError("on_step callbacks (the recycling experiment's snapshots) run in one process: "
                           "not under torchrun")
    c.t_start = time.perf_counter()
    resumed = o.resume and state.restore(state_dir, p.run.fingerprint(), c, p.model, p.opt, p.sched, p.stream,
                                         p.device, p.shard.sharded, ranks.is_main)
    if resumed and p.run.log:
        p.run.log(f"resuming from step {c.step} (tokens {c.tokens:,})")
    if p.producer is not None:
        p.producer.begin(c.step)
    if not resumed:  # the input's held-out estimate: the first candidate for the best weights
        torch.manual_seed(o.seed)
        c.before = agreement(p)
        _consider(p, c.before)
        if on_step is not None:
            on_step(Current(p))
    last: dict = {}
    start_tokens, start_step, t_run = c.tokens, c.step, time.perf_counter()
    first: tuple[float, int] | None = None  # (time, tokens) when this run's first step ended
    evals, checkpoints = Every.parse(o.eval_every, "--eval-every"), Every.parse(o.checkpoint_every, "--checkpoint-every")
    with _stop_between_steps(c):
        for step in p.schedule.steps(c.step):
            if c.stop is not None:
                _stopped(p)
            before = c.tokens  # --checkpoint-every/--eval-every in tokens: due when the step passes a multiple
            row = train_step(p, step)
            t0 = time.perf_counter()
            acting = ranks.is_main or p.shard.sharded  # sharded, every rank runs the drafter and gathers its weights
            if acting and (evals.due(c.step, before, c.tokens) or c.tokens >= o.tokens):
                row["heldout_agree"] = agreement(p)
                row["heldout_estimate"] = expected_length(row["heldout_agree"])
                _consider(p, row["heldout_agree"])
            if ranks.is_main:
                row["wall_s"] = round(c.wall(), 3)
                row["tokens_per_s"] = (c.tokens - start_tokens) / max(1e-9, time.perf_counter() - t_run)
                if c.time_estimate is None and c.tokens < o.tokens:
                    now, ran = time.perf_counter(), c.step - start_step
                    if first is None:
                        first = (now, c.tokens)
                    if now - t_run >= ETA_AFTER_S and ran == 1:  # one slow step: its own rate, warm-up and all
                        _estimate_time(p, c.tokens - start_tokens, now - t_run, "over the first step")
                    elif ran > 1 and (ran > ETA_STEPS and now - first[0] >= ETA_MIN_S or now - t_run >= ETA_AFTER_S):
                        _estimate_time(p, c.tokens - first[1], now - first[0], f"over steps {start_step + 2}-{c.step}")
                state.append_metrics(state_dir, row)
                if on_step is not None:
                    on_step(Current(p))
                if progress:
                    progress(row)
            if acting and checkpoints.due(c.step, before, c.tokens) and c.tokens < o.tokens:
                _checkpoint(p)
            if ranks.world > 1:
                dist.barrier()
            c.timing["log_s"] += time.perf_counter() - t0
            c.last_row = last = row
    wall = c.wall()
    final = agreement(p)
    _consider(p, final)
    if p.shard.sharded and c.best["step"] != c.step:  # every rank reads its shards of the best snapshot back
        state.load_best_sharded(state_dir, c.best["step"], p.model)
    elif ranks.is_main and c.best["step"] != c.step:  # rank 0 evaluates, chooses and writes
        p.model.load_state_dict(state.load_best(state_dir, c.best["step"]), strict=False)
    entry = record.build(p, last, final, wall, resumed)
    if p.shard.sharded:  # written from the shards: every rank its part, nothing whole on any host
        write_drafter_sharded(o.drafter, p.run.outputs.writer, p.run.fmt, p.model, entry, ranks.rank, ranks.world)
    if ranks.is_main:
        if not p.shard.sharded:
            _write(p, p.run.outputs.writer, entry)
        state.remove_checkpoint(state_dir)
        state.prune_best(state_dir, set())
    entry["wall_s"] = round(time.perf_counter() - p.run.t0, 3)  # the command's, setup included
    if ranks.world > 1:
        dist.barrier()
    return entry


def distill(opts: DistillOptions, progress: Callable[[dict], None] | None = None,
            log: Callable[[str], None] | None = None, on_step: Callable[[Current], None] | None = None) -> dict:
    """Library entry point (the CLI and the benchmarks call this): prepare, train, write. `log` gets one-line
    notices, `progress` each step's metrics row, `on_step` the run after each step (`train`)."""
    threads = torch.get_num_threads()
    p = None
    try:
        p = prepare(opts, log)
        entry = train(p, progress, on_step)
    except BaseException:
        if p is not None:
            p.run.discard_state()
        raise
    finally:
        if p is not None:
            p.close()  # the locks go, and the online vLLM job ends with the run, whatever ended it
        torch.set_num_threads(threads)  # --threads is this run's, not the caller's process-wide setting
    entry["out"] = str(p.run.outputs.out)
    entry["state_dir"] = str(p.run.outputs.state_dir)
    return entry
