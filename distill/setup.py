"""A distillation's set-up: every check that needs no model (`validate`), then the models and the data (`build`).

`prepare(opts)` runs both and returns what the loop (`distill/train.py`) needs: the validated run (options, ranks,
format, outputs locked, tokenizer and data), the target as teacher, the drafter with its unroller, sharded under
torchrun (`distill/sharding.py`), AdamW with its schedule, the packed stream, the held-out rows and the loop's counters
(`distill/state.py`). A refused or failed set-up leaves nothing behind: the state directory it made goes (unless it
holds a checkpoint), the output locks are released and an online vLLM job is stopped.

Refusals come before anything loads: options, paths, the drafter's format and its fit to the target, the state
directory, a resumable checkpoint's options, the budget against one step, the data and the chat template.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from recycle.checkpoint import load_json
from recycle.distill import state
from recycle.distill.data import (
    PackedStream,
    Position,
    Staged,
    data_source,
    heldout_rows,
    in_process,
    regenerate,
    regenerate_turns,
)
from recycle.distill.freeze import check_groups, freeze, lower_frozen
from recycle.distill.harvest import Follower, OnlineFollower, OnlineHarvest, check_manifest
from recycle.distill.memory import check, for_options, plans, streams_of
from recycle.distill.remote import Remote, check_online_fits, connect
from recycle.distill.schedule import EVAL_KEY, Schedule, eval_prompt_len
from recycle.distill.sharding import Ranks, Sharding, join, shard
from recycle.distill.teacher import HARVEST_STREAMS, STREAMS_FROM_VLLM, Teacher, TeacherOut
from recycle.distill.unroll import Unroller, unroller_for
from recycle.drafters import load_drafter
from recycle.drafters.sharded import materialize, meta_drafter
from recycle.encode import load_tokenizer, quiet_transformers, source_renderer
from recycle.errors import RecycleError
from recycle.fit import check_drafter
from recycle.formats import DrafterFormat, of_directory
from recycle.hardware import default_precision
from recycle.io.writer import OutputDir
from recycle.mtp import chained_streams
from recycle.options import DistillOptions, HarvestOptions, LossConfig
from recycle.preflight import OutputLock
from recycle.texts import DataSource, plural

PASSES_WARN = 4  # a budget above this many passes over the training side gets a warning (it will overfit)
PHASE_QUIET_S = 2.0  # a setup phase that runs longer than this says so


def lr_lambda(total_steps: int, warmup: float, min_lr: float) -> Callable[[int], float]:
    """Linear warm-up over `warmup` of the steps, then cosine to `min_lr` of the peak."""
    warm = max(1, int(round(total_steps * warmup))) if warmup > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _passes(tokens: int, texts: list, tokenizer, sample: int = 64) -> float:
    """How many times a budget reads the training side: its tokens estimated from the characters and the
    tokenizer's characters per token on the first documents (tokenizing all of a large corpus takes minutes;
    a conversation counts its turns' characters, the template's own tokens aside)."""
    head = [t if isinstance(t, str) else "".join(m.get("content") or "" for m in t.messages) for t in texts[:sample]]
    chars = sum(len(t) for t in head)
    ids = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in head)  # one at a time: bounded
    total = sum(len(t) for t in texts) * (ids / chars if chars else 0.25)
    return tokens / max(total, 1.0)


@dataclass
class Outputs:
    """Where the run writes: the output directory (locked from validation to the run's end: one run at a time) and
    the state directory beside it (`OUT.distill/`, or --state-dir, locked too)."""

    out: Path | None = None
    writer: OutputDir | None = None
    state_dir: Path | None = None
    state_lock: OutputLock | None = None
    made_state_dir: bool = False  # this run made the state directory (a refused run removes it)

    def unlock(self) -> None:
        """The run's locks on its output (and its --state-dir) go when the run ends, however it ends."""
        for lock in (self.writer, self.state_lock):
            if lock is not None:
                lock.release()

    def discard_state(self) -> None:
        """A refused or failed run leaves nothing behind: the state directory goes unless it holds a checkpoint
        (an earlier run's, or this one's after an interrupt), which --resume continues."""
        if self.made_state_dir and not state.has_checkpoint(self.state_dir):
            shutil.rmtree(self.state_dir, ignore_errors=True)


@dataclass
class Data:
    """The training side of --data, read and checked before any model loads."""

    source: DataSource
    tokenizer: object
    renderer: object | None  # conversations: the chat template's renderer; None for text
    passes: float  # how many times the budget reads the training side


@dataclass
class Run:
    """A validated run: everything known before a model loads."""

    opts: DistillOptions
    ranks: Ranks
    log: Callable[[str], None] | None = None
    t0: float = field(default_factory=time.perf_counter)  # the command's start: the record's wall_s counts setup
    outputs: Outputs = field(default_factory=Outputs)
    fmt: DrafterFormat | None = None
    unroller: type[Unroller] | None = None  # the format's unroller class
    drafter_config: dict | None = None
    target_config: dict | None = None
    precision: str | None = None  # the compute dtype, resolved before anything loads (a resume must match it)
    data: Data | None = None
    phases: dict[str, float] = field(default_factory=dict)  # setup phases' seconds (the record's setup_s)
    server: object | None = None  # --teacher: the checked server (distill.remote.Server)

    def note(self, text: str) -> None:
        """A one-line notice, from rank 0 only."""
        if self.log and self.ranks.is_main:
            self.log(text)

    @contextlib.contextmanager
    def phase(self, name: str):
        """A setup phase that can take long (loading a model, reading a corpus, generating): once it has run for
        PHASE_QUIET_S it gets a line, and its end another with its time, so no stretch of a run is silent and quick
        phases (and refusals, which come early) stay quiet."""
        t0 = time.perf_counter()
        timer = threading.Timer(PHASE_QUIET_S, self.note, (f"distill: {name} ...",))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            took = time.perf_counter() - t0
            self.phases[name] = round(took, 3)
            if took >= PHASE_QUIET_S:
                self.note(f"distill: {name}: {took:.0f} s")

    def fingerprint(self) -> dict:
        """What a checkpoint records of this run's options, and a resumed run must match (state.RUN_OPTIONS)."""
        return state.fingerprint(self.opts, self.ranks.world, self.precision, self.fmt.name)

    def discard_state(self) -> None:
        self.outputs.discard_state()

    def unlock(self) -> None:
        self.outputs.unlock()


def validate(opts: DistillOptions, log: Callable[[str], None] | None = None) -> Run:
    """Every check that needs no model: options, paths, the drafter's format and its fit to the target, the state
    directory, a checkpoint to resume, the budget, the data and the tokenizer. A refusal leaves nothing behind."""
    # First, before anything touches CUDA: the rank's device resolved (cuda:LOCAL_RANK under torchrun), made current,
    # then the process group on it (sharding.join). Nothing before this line initialises CUDA (the CLI's checks import
    # no torch); the first CUDA use is join's set_device (torchrun), else build()'s get_device_properties. No
    # expandable segments for --online: its vLLM job inherits this environment (vllm_env.run_job's env), and vLLM 0.32
    # refuses a KV connector under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (vllm/config/vllm.py:1217-1235).
    run = Run(opts, join(opts.device, opts.nccl_timeout, expandable=opts.online is None), log)
    try:
        _check(run)
    except BaseException:
        run.discard_state()
        run.unlock()
        raise
    return run


def _check(run: Run) -> None:
    o, ranks = run.opts, run.ranks
    if o.loss is None:
        o.loss = LossConfig()
    o.validate()
    o.freeze = check_groups(o.freeze)
    src, tgt = Path(o.drafter).expanduser(), Path(o.target).expanduser()
    if not src.is_dir():
        raise RecycleError(f"{src}: no such drafter directory")
    if not (tgt / "config.json").is_file():
        raise RecycleError(f"--target {tgt}: not a model directory (no config.json)")
    source = data_source(o.data)
    if not (src / "config.json").is_file():
        raise RecycleError(f"{src}: not a drafter directory (no config.json)")
    run.fmt = of_directory(src)
    run.unroller = unroller_for(run.fmt)
    if o.activation_checkpointing and not run.unroller.checkpointable:
        raise RecycleError(f"--activation-checkpointing: not for {run.fmt.title} drafters (EAGLE drafters take it)")
    run.drafter_config = load_json(src / "config.json", "drafter config.json")
    run.target_config = load_json(tgt / "config.json", "target config.json")
    check_drafter(run.fmt, run.drafter_config, run.target_config, src, tgt, str(src))
    if (o.teacher is not None or o.online) and chained_streams(run.target_config):  # before a server is asked
        raise RecycleError(STREAMS_FROM_VLLM.format(what="--teacher" if o.teacher else "--online",
                                                    instead=HARVEST_STREAMS))
    if o.teacher is not None:  # the server answers, for this target and these layers: before anything loads or is written
        if run.unroller.needs_kv:
            raise RecycleError(f"--teacher: a {run.fmt.title} trains on the target's own K/V cache, which no server "
                               "returns; run it with the target loaded")
        aux = run.fmt.reads(run.drafter_config, run.target_config).aux_layers
        run.server = connect(o.teacher, o.target, list(aux) if aux is not None else None, o.seq_len)
    out = Path(o.out).expanduser() if o.out else src.resolve().parent / f"{src.resolve().name}-distilled"
    outputs = run.outputs
    outputs.out = out.resolve()
    outputs.writer = OutputDir(outputs.out, overwrite=o.overwrite or o.resume, protect=o.inputs())
    outputs.state_dir = Path(o.state_dir).expanduser().resolve() if o.state_dir else \
        outputs.out.parent / f"{outputs.out.name}.distill"
    if ranks.is_main:  # OUT (and a --state-dir elsewhere) locked from here to the run's end: one run at a time
        outputs.writer.acquire()
        outputs.state_lock = OutputLock(outputs.state_dir).acquire() if o.state_dir else None
        outputs.made_state_dir = not outputs.state_dir.exists()
        state.claim(outputs.state_dir, o.resume, o.overwrite, run.note)
    # the compute dtype, resolved now: a resumed run must compute in the checkpoint's (state.RUN_OPTIONS)
    run.precision = o.precision or default_precision(ranks.device)
    if o.resume and ranks.is_main:  # a resumable checkpoint: readable, safe, same options; before any model loads
        fp = run.fingerprint()
        state.load_sharded_meta(outputs.state_dir, fp)
        state.load_checkpoint(outputs.state_dir, torch.device("cpu"), fp, mmap=True)
    rows = o.batch * ranks.world
    if o.tokens < rows * o.seq_len:
        raise RecycleError(f"--tokens {o.tokens:,} is less than one optimizer step ({rows} sequences × {o.seq_len} "
                           f"tokens = {rows * o.seq_len:,}): raise --tokens, or lower --batch / --seq-len")
    with run.phase("reading the data and the tokenizer"):
        tokenizer = load_tokenizer(o.target, o.drafter)  # the drafter's where the target ships none
        texts = source.train()  # now: bad data surfaces before any model is built
        renderer = source_renderer(o, tokenizer, texts)  # conversations: the template, checked now
    if o.self_distill and renderer is None and not 1 <= o.prompt_len < o.seq_len:  # text: a window's prompt
        raise RecycleError(f"--prompt-len must be in [1, {o.seq_len - 1}], got {o.prompt_len}")
    if renderer is not None and o.self_distill and o.online is not None:
        raise RecycleError("--self-distill on conversations: not with --online (run recycle harvest --self-distill "
                           "first, then distill --cache-hidden on its cache)")
    run.data = Data(source, tokenizer, renderer, _passes(o.tokens, texts, tokenizer))
    if run.data.passes > PASSES_WARN:
        run.note(f"note: --tokens {o.tokens:,} is about {run.data.passes:.0f} passes over the training side of "
                 f"--data ({plural(len(texts), 'document')}): the drafter will fit that text, not the target's "
                 "distribution; give more data or fewer tokens")


@dataclass
class HeldOut:
    """The held-out rows the estimate scores, and the target's outputs on them (computed once)."""

    ids: torch.Tensor
    teacher: TeacherOut
    mask: torch.Tensor | None  # conversations: the assistant positions
    prompt: int  # text rows: the prompt the target continued greedily from (0: scored as they are)


@dataclass
class Prepared:
    """What the loop needs: the validated run, the models, the optimizer, the data and the counters."""

    run: Run
    device: torch.device
    precision: str
    schedule: Schedule
    teacher: Teacher
    model: torch.nn.Module
    unroller: Unroller
    target_io: dict
    frozen: dict  # what --freeze (and the format) keeps as it is: the record's `freeze`
    stream: Staged  # the packed windows (a curriculum's stages: one length at a time)
    shard: Sharding
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    heldout: HeldOut
    counters: state.Counters
    producer: OnlineHarvest | OnlineFollower | None = None  # --online: vLLM computing the windows ahead
    harvested: bool = False  # a harvested cache holds every window: the trunk was never loaded

    @property
    def opts(self) -> DistillOptions:
        return self.run.opts

    def close(self) -> None:
        """The run's end, however it ends: the output locks released, an online vLLM job stopped."""
        self.run.unlock()
        if self.producer is not None:
            self.producer.close()


class Regenerate:
    """`--self-distill` on conversations: the target writes the assistant turns of a chunk of documents (seeded by the
    chunk's place in the stream, so a resumed run writes the same); `--save-regenerated` keeps them."""

    def __init__(self, run: Run, teacher: Teacher, timing: dict[str, float] | None) -> None:
        self.run, self.teacher, self.timing = run, teacher, timing  # timing: None for the held-out set (set-up)

    def __call__(self, indices: list[int], docs: list, key: str) -> list:
        o, data = self.run.opts, self.run.data
        t0 = time.perf_counter()
        was = self.teacher.model.training
        out = regenerate_turns(in_process(self.teacher.model, data.tokenizer.pad_token_id), data.renderer, docs,
                               o.sd_temperature, o.seed * 1_000_003 + zlib.crc32(key.encode()), o.seq_len)
        self.teacher.model.train(was)
        if self.timing is not None:  # teacher compute, timed on its own
            self.timing["generate_s"] += time.perf_counter() - t0
        if o.save_regenerated and self.run.ranks.is_main:
            with open(Path(o.save_regenerated).expanduser(), "a", encoding="utf-8") as f:
                f.writelines(json.dumps(d.to_json()) + "\n" for d in out if hasattr(d, "to_json"))
        return out


def _online(run: Run, aux: list[int] | None, share: float | None = None) -> OnlineHarvest | OnlineFollower:
    """--online: vLLM computes each step's features while this process trains, `online` keys ahead; under torchrun
    it runs beside rank 0, on the global batch's one-process keys. `share`: vLLM's memory share of rank 0's GPU, what
    the trainer's plan leaves (`remote.check_online_fits`)."""
    o, ranks = run.opts, run.ranks
    producer = None
    try:
        with run.phase("starting vLLM for the online teacher (about a minute on a CPU)"):
            if ranks.is_main:
                producer = OnlineHarvest(HarvestOptions(
                    target=o.target, out=o.cache_hidden, tokens=o.tokens, data=o.data, seq_len=o.seq_len,
                    packing=o.packing,
                    batch=o.batch * ranks.world, seed=o.seed, aux_layers=tuple(aux or ()),
                    eval_rows=o.eval_rows, eval_prompt_len=o.eval_prompt_len, parallel=o.vllm_parallel,
                    gpu_memory_utilization=share, chat_template=o.chat_template), o.online)
            if ranks.world > 1:  # the other ranks look only once rank 0 has cleared an earlier run's keys
                dist.barrier()
                producer = producer or OnlineFollower(o.cache_hidden, o.online)
            producer.wait(EVAL_KEY)  # vLLM's engine start and the held-out rows come first
    except BaseException:
        if producer is not None:
            producer.close()
        raise
    return producer


def _remote(run: Run, aux: list[int] | None):
    """--teacher: this rank's client of the checked server (its prefetch starts with the loop)."""
    return Remote(run.server, run.opts.target, aux, run.opts.teacher_ahead, run.ranks.rank, run.ranks.world)


def build(run: Run) -> Prepared:
    """The models and the data of a validated run: the drafter and its unroller, the target as teacher (or only its
    embedding and head over a harvested cache), frozen groups, FSDP2 under torchrun, AdamW and its schedule, the
    packed stream and the held-out rows the target continues."""
    o, ranks = run.opts, run.ranks
    if o.threads:
        torch.set_num_threads(o.threads)
    device = ranks.device  # join's: resolve_device, made current under torchrun
    precision = o.precision or default_precision(device)
    if device.type == "cuda" and plans(o.drafter):  # refuse at once, with the advice, what the device cannot hold
        total = torch.cuda.get_device_properties(device).total_memory
        check(for_options(replace(o, precision=precision), ranks.world, device_bytes=total,
                          fsdp=dist.is_initialized()))
    if o.online:  # vLLM beside rank 0: the target must fit beside the trainer, else a server elsewhere (--teacher)
        share = check_online_fits(o, ranks.world, device, precision, dist.is_initialized())["vllm_share"]
    # Sharded from the start: under torchrun a sharded format's drafter is built on the meta device, sharded, and
    # each rank then reads only its own shards (`_models`, recycle/drafters/sharded.py); one process loads it whole.
    # --init scratch draws every weight in one process's order: it loads whole.
    from_meta = dist.is_initialized() and run.unroller.shardable and o.init != "scratch"
    with run.phase("loading the drafter"), quiet_transformers():
        model = meta_drafter(o.drafter) if from_meta else load_drafter(o.drafter, dtype=torch.float32)
    aux = run.fmt.reads(run.drafter_config, run.target_config).aux_layers
    aux = list(aux) if aux is not None else None
    producer = _online(run, aux, share) if o.online else _remote(run, aux) if o.teacher else \
        Follower(o.cache_hidden, main=run.ranks.is_main) if o.follow else None
    try:
        return _models(run, device, precision, model, aux, producer)
    except BaseException:
        if producer is not None:
            producer.close()
        raise


def _models(run: Run, device: torch.device, precision: str, model: torch.nn.Module, aux: list[int] | None,
            producer) -> Prepared:
    o, ranks, data = run.opts, run.ranks, run.data
    harvested = None
    if o.follow:  # a harvest still being written: its manifest and held-out rows come first
        with run.phase("waiting for the harvest's manifest"):
            producer.ready()
    if o.cache_hidden and (Path(o.cache_hidden) / "manifest.json").is_file():  # made by `recycle harvest`
        harvested = check_manifest(Path(o.cache_hidden), o, aux_layers=aux or [], world=ranks.world,
                                   streams=streams_of(model), follow=o.follow)
    # A harvested cache holds every window and the evaluation rows: the trunk is never loaded.
    remote = producer if o.teacher else None  # the server computes every feature: embedding and head alone here
    trunk = harvested is None and remote is None
    with run.phase("loading the target" if trunk else "loading the target's embedding and head"):
        teacher = Teacher(o.target, device, aux, precision, o.cache_hidden, trunk=trunk,
                          producer=None if remote else producer, kv=run.unroller.needs_kv, remote=remote,
                          streams=bool(streams_of(model)))
    if remote is not None:  # the probe: the server's greedy token from its last state, normed and projected here
        remote.probe(teacher.logits, int(teacher.embed.weight.shape[1]))
    from_meta = next(model.parameters()).is_meta  # sharded from the start (`build`): materialised once sharded
    (model if from_meta else model.to(device)).train()
    unroller = run.unroller.make(model, o.draft_steps, teacher.embed, aux)
    if o.activation_checkpointing:
        model.checkpoint_blocks = True
    target_io = None if from_meta else unroller.adopt_target_io(teacher.embed.weight, teacher.head.weight)
    if o.init == "scratch":
        unroller.reinit(o.seed)
    shortest = min([o.seq_len, *(length for length, _ in o.stages())])  # a --curriculum stage's windows too
    if unroller.positions(shortest) < 1:
        raise RecycleError(f"--seq-len {shortest} is too short for {unroller.steps} draft steps"
                           if shortest == o.seq_len else
                           f"--curriculum: {shortest}-token windows are too short for {unroller.steps} draft steps")
    counters = state.Counters()
    # conversations regenerated here, unless harvest's vLLM wrote them (the cache holds each key's rows and mask)
    regen = data.renderer is not None and o.self_distill
    rewrite = Regenerate(run, teacher, counters.timing) if regen and not harvested else None
    read: list = []

    def texts() -> list:  # the training side, read once for every stage
        if not read:
            read.append(data.source.train())
        return read[0]

    def windows(length: int) -> PackedStream:  # a curriculum stage's stream reads the documents in its own order
        seed = o.seed if length == o.seq_len else f"{o.seed}/{length}"
        return PackedStream(texts, data.tokenizer, length, seed, data.renderer, data.source.log, rewrite, o.packing)

    stream = Staged(windows, o.seq_len)
    stream.texts()  # read already (validation): the packing's cost is the first step's
    frozen = freeze(model, o.freeze)  # after the format's own (embedding, head)
    if precision == "bf16" and not from_meta:  # frozen weights bf16 holds exactly stay bf16: autocast casts them
        frozen["lowered_to_bf16_bytes"] = lower_frozen(model, keep=(teacher.embed.weight, teacher.head.weight))
    sharding = shard(model, unroller.shardable, device, ranks.world, precision, run.note)
    if from_meta:  # each rank allocates its own shards on its device and reads only them from the drafter's files
        with run.phase("reading this rank's shards of the drafter"):
            materialize(model, o.drafter, device)
        target_io = unroller.adopt_target_io(teacher.embed.weight, teacher.head.weight)
        if precision == "bf16":
            frozen["lowered_to_bf16_bytes"] = lower_frozen(model, keep=(teacher.embed.weight, teacher.head.weight))
    schedule = Schedule(o.tokens, o.batch, o.seq_len, ranks.world, o.stages())
    if remote is not None:  # the prefetch reads a copy of the stream, from where the loop's stands when it begins
        remote.attach(schedule, o.batch, lambda: _stream_copy(stream, run))
    opt = torch.optim.AdamW(unroller.trainable(), lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay,
                            foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(schedule.total_steps, o.warmup, o.min_lr))
    heldout = _heldout(run, device, teacher, unroller, harvested, Regenerate(run, teacher, None) if regen else None)
    return Prepared(run, device, precision, schedule, teacher, model, unroller, target_io, frozen, stream, sharding,
                    opt, sched, heldout, counters, producer, harvested is not None or remote is not None)


def _stream_copy(stream: Staged, run: Run) -> PackedStream:
    """The loop's data stream again, at its position (--teacher's prefetch reads its rows ahead of the loop), with a
    tokenizer of its own: a fast tokenizer's settings are mutated by each call, so two threads must not share one."""
    tokenizer, renderer = copy.deepcopy((run.data.tokenizer, run.data.renderer))  # the renderer's tokenizer too
    again = PackedStream(stream.texts, tokenizer, run.opts.seq_len, run.opts.seed, renderer, packing=run.opts.packing)
    again.seek(Position(stream.pos.epoch, stream.pos.taken))
    return again


def _heldout(run: Run, device: torch.device, teacher: Teacher, unroller: Unroller, harvested: dict | None,
             rewrite: Regenerate | None) -> HeldOut:
    """The held-out rows: from a harvested cache (vLLM wrote the continuations and their features), or continued by
    the target here (text: greedily after a short prompt, the text greedy decoding verifies; conversations with
    --self-distill: the target's own assistant turns)."""
    o, data = run.opts, run.data
    if teacher.remote is not None:  # --teacher: the server continues the rows and computes their features
        ev, mask = heldout_rows(data.tokenizer, o.seq_len, o.eval_rows, o.data, data.renderer)
        prompt = 0 if mask is not None else eval_prompt_len(ev.shape[1], o.eval_prompt_len, unroller.steps)
        if prompt:
            ev = teacher.remote.generate(ev[:, :prompt], ev.shape[1] - prompt)
        last, aux = teacher.remote.now(ev)
        dtype = torch.bfloat16 if teacher.precision == "bf16" else torch.float32
        out = TeacherOut(last.to(device, dtype), aux.to(device, dtype) if aux is not None else None, teacher.logits)
        return HeldOut(ev.to(device), out, mask.to(device) if mask is not None else None, prompt)
    if harvested is not None:
        prompt = int(harvested["eval"]["prompt_len"])
        ids, mask = teacher.cached_rows(EVAL_KEY)
        on_device = ids.to(device)
        out = teacher(on_device, EVAL_KEY)
        if data.renderer is not None and mask is None:  # an older cache: the same rows, their mask rebuilt here
            ev, mask = heldout_rows(data.tokenizer, o.seq_len, o.eval_rows, o.data, data.renderer)
            mask = mask if torch.equal(ev, ids) else None
        return HeldOut(on_device, out, mask.to(device) if mask is not None else None, prompt)
    with run.phase(f"the target continues {o.eval_rows} held-out rows (the held-out estimate's text)"):
        ev, mask = heldout_rows(data.tokenizer, o.seq_len, o.eval_rows, o.data, data.renderer, rewrite)
        mask = mask.to(device) if mask is not None else None
        # conversations are scored on their assistant turns as they are; text rows continue from a prompt
        prompt = 0 if mask is not None else eval_prompt_len(ev.shape[1], o.eval_prompt_len, unroller.steps)
        if prompt:  # the text greedy decoding verifies
            ev = regenerate(teacher.model, ev, prompt, 0.0, o.seed)
        ids = ev.to(device)
        return HeldOut(ids, teacher(ids), mask, prompt)


def prepare(opts: DistillOptions, log: Callable[[str], None] | None = None) -> Prepared:
    """A run validated and built: what the loop needs (`distill.train.train`). `log` gets one-line notices. A failure
    leaves nothing behind (the state directory it made, the locks, an online vLLM job)."""
    run = validate(opts, log)
    try:
        return build(run)
    except BaseException:
        run.discard_state()
        run.unlock()
        raise
