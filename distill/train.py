"""`recycle distill`: frozen-target distillation of a drafter directory, to an exact token budget.

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
    others (the truncated last batch can leave a rank without rows: it runs held-out rows at weight 0). Every
    rank evaluates and gathers the weights it keeps; every rank checkpoints its own shards
    (`torch.distributed.checkpoint` into safetensors, `distill/state.py`), rank 0 logs and writes.
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
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from recycle import __version__
from recycle.checkpoint import load_json
from recycle.corpus import is_corpus_name
from recycle.distill import state
from recycle.distill.data import (
    PackedStream, Position, data_source, heldout_rows, in_process, mask_steps, regenerate, regenerate_turns,
    source_renderer)
from recycle.distill.freeze import check_groups, freeze, lower_frozen
from recycle.distill.losses import distill_loss, step_terms
from recycle.distill.schedule import EVAL_KEY, Schedule, Step, eval_prompt_len, time_left
from recycle.distill.teacher import Teacher, TeacherOut, autocast
from recycle.distill.unroll import Unroller
from recycle.hardware import peak_rss_bytes
from recycle.errors import Interrupted, RecycleError
from recycle.options import DistillOptions, LossConfig
from recycle.preflight import OutputLock, duration, sweep_dead_writes
from recycle.preflight import parse_tokens  # noqa: F401  (the CLI and benchmarks take it from here too)
from recycle.texts import plural

__all__ = ["DistillOptions", "Distiller", "distill", "default_precision", "expected_length", "parse_tokens"]


def _passes(tokens: int, texts: list, tokenizer, sample: int = 64) -> float:
    """How many times a budget reads the training side: its tokens estimated from the characters and the
    tokenizer's characters per token on the first documents (tokenizing all of a large corpus takes minutes;
    a conversation counts its turns' characters, the template's own tokens aside)."""
    head = [t if isinstance(t, str) else "".join(m.get("content") or "" for m in t.messages) for t in texts[:sample]]
    chars = sum(len(t) for t in head)
    ids = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in head)  # one at a time: bounded
    total = sum(len(t) for t in texts) * (ids / chars if chars else 0.25)
    return tokens / max(total, 1.0)


def default_precision(device: torch.device) -> str:
    """bf16 autocast where the hardware has it (CUDA, AVX512-BF16, AMX); fp32 where bf16 is emulated."""
    if device.type == "cuda":
        return "bf16"
    from recycle.hardware import cpu_has_bf16

    return "bf16" if cpu_has_bf16() else "fp32"


def expected_length(agree: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} a_j: tokens per step of a chain whose step k is accepted at rate a_k."""
    tau, run = 1.0, 1.0
    for a in agree:
        run *= a
        tau += run
    return tau


def _device(name: str | None, rank: int) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RecycleError("--device cuda: no CUDA device is available to torch here")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    if name != "cpu":
        raise RecycleError(f"--device {name!r}: choose cpu or cuda")
    return torch.device("cpu")


def _dist() -> tuple[int, int]:
    """(rank, world); joins the process group when torchrun started the process, one rank included (FSDP2 over
    a mesh of one: the sharded code path on a single GPU, as a larger run takes it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def _accumulate(info: dict | None, terms: dict, share: float) -> dict:
    """Per-step CE, KL and agreement of a micro-batch's slices, weighted by their share of its rows."""
    scaled = {k: [v * share for v in vs] for k, vs in terms.items()}
    if info is None:
        return scaled
    return {k: [a + b for a, b in zip(info[k], scaled[k])] for k in info}


def lr_lambda(total_steps: int, warmup: float, min_lr: float) -> Callable[[int], float]:
    warm = max(1, int(round(total_steps * warmup))) if warmup > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


PASSES_WARN = 4  # a budget above this many passes over the training side gets a warning (it will overfit)
# The time a budget takes, measured on the run's first steps: the rate from the end of the first step (which also
# packs the data and warms up) over at least ETA_STEPS more steps and ETA_MIN_S seconds, or over whatever steps the
# run's first ETA_AFTER_S seconds held; a budget whose rest takes longer than ETA_NOTE_S at that rate gets a note,
# within the run's first minute unless one step takes longer.
ETA_STEPS, ETA_MIN_S, ETA_AFTER_S, ETA_NOTE_S = 3, 5.0, 20.0, 600.0
PHASE_QUIET_S = 2.0  # a setup phase that runs longer than this says so


def time_note(budget: int, done: int, tokens_per_s: float, where: str, device: str,
              threshold: float = ETA_NOTE_S) -> str | None:
    """The note for a budget whose rest takes longer than `threshold` seconds at the measured rate; None otherwise."""
    left = time_left(budget, done, tokens_per_s)
    if left <= threshold:
        return None
    advice = "train on a GPU" if device == "cpu" else "add ranks (torchrun)"
    return (f"note: --tokens {budget:,} takes about {duration(left)} more at this rate ({tokens_per_s:,.0f} tokens/s "
            f"{where}); lower --tokens or {advice}")


class Distiller:
    """One distillation run (build → train → write); `run()` returns the summary/record dict."""

    def __init__(self, opts: DistillOptions, log: Callable[[str], None] | None = None) -> None:
        self.t_command = time.perf_counter()
        self.opts, self.log = opts, log
        self.rank, self.world = _dist()
        self.is_main = self.rank == 0
        self.made_state_dir = False
        self.sharded = False  # FSDP2 under torchrun (_shard)
        self.expert_parallel = False  # the routed experts split over the ranks (_shard, distill.experts)
        self.stop: str | None = None  # the signal that asked the loop to stop after its step
        try:
            self._validate()
        except BaseException:
            self.discard_state()
            self.unlock()
            raise

    def unlock(self) -> None:
        """The run's locks on its output (and its --state-dir) go when the run ends, however it ends."""
        for lock in (getattr(self, "writer", None), getattr(self, "state_lock", None)):
            if lock is not None:
                lock.release()

    def discard_state(self) -> None:
        """A refused or failed run leaves nothing behind: the state directory goes unless it holds a checkpoint
        (an earlier run's, or this one's after an interrupt), which --resume continues."""
        if self.made_state_dir and not state.has_checkpoint(self.state_dir):
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _note(self, text: str) -> None:
        if self.log and self.is_main:
            self.log(text)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """A setup phase that can take long (loading a model, reading a corpus, generating): once it has run for
        PHASE_QUIET_S it gets a line, and its end another with its time, so no stretch of a run is silent and quick
        phases (and refusals, which come early) stay quiet."""
        t0 = time.perf_counter()
        timer = threading.Timer(PHASE_QUIET_S, self._note, (f"distill: {name} ...",))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            took = time.perf_counter() - t0
            self.setup_phases[name] = round(took, 3)
            if took >= PHASE_QUIET_S:
                self._note(f"distill: {name}: {took:.0f} s")

    # -- setup ------------------------------------------------------------------------------------

    def _validate(self) -> None:
        """Every check that needs no model: options, paths, the drafter's format and its fit to the target."""
        from recycle.converters.writer import OutputDir
        from recycle.formats import of_directory
        from recycle.fit import check_drafter

        o = self.opts
        if o.loss is None:
            o.loss = LossConfig()
        o.validate()
        o.freeze = check_groups(o.freeze)
        src, tgt = Path(o.drafter).expanduser(), Path(o.target).expanduser()
        if not src.is_dir():
            raise RecycleError(f"{src}: no such drafter directory")
        if not (tgt / "config.json").is_file():
            raise RecycleError(f"--target {tgt}: not a model directory (no config.json)")
        if o.snapshots and self.world > 1:
            raise RecycleError("snapshots (the recycling experiment) are taken in one process: not under torchrun")
        self.source = data_source(o.data)
        if not (src / "config.json").is_file():
            raise RecycleError(f"{src}: not a drafter directory (no config.json)")
        self.fmt = of_directory(src)
        if o.activation_checkpointing and not self.fmt.resolve("unroller").checkpointable:
            raise RecycleError(f"--activation-checkpointing: not for {self.fmt.title} drafters (EAGLE drafters take it)")
        self.drafter_config = load_json(src / "config.json", "drafter config.json")
        self.target_config = load_json(tgt / "config.json", "target config.json")
        check_drafter(self.fmt, self.drafter_config, self.target_config, src, tgt, str(src))
        out = Path(o.out).expanduser() if o.out else src.resolve().parent / f"{src.resolve().name}-distilled"
        self.out = out.resolve()
        self.writer = OutputDir(self.out, overwrite=o.overwrite or o.resume, protect=o.inputs())
        self.state_dir = Path(o.state_dir).expanduser().resolve() if o.state_dir else \
            self.out.parent / f"{self.out.name}.distill"
        if self.is_main:  # OUT (and a --state-dir elsewhere) locked from here to the run's end: one run at a time
            self.writer.acquire()
            self.state_lock = OutputLock(self.state_dir).acquire() if o.state_dir else None
            try:
                self.made_state_dir = not self.state_dir.exists()
                self.state_dir.mkdir(parents=True, exist_ok=True)
                probe = self.state_dir / f".probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                raise RecycleError(f"{self.state_dir}: cannot write the run's state here ({e.strerror or e})") from None
            for line in sweep_dead_writes(self.state_dir):  # a killed run's partial checkpoint or best snapshot
                self._note(f"note: {line}")
            if state.has_checkpoint(self.state_dir) and not o.resume:
                if not o.overwrite:
                    raise RecycleError(f"{self.state_dir}: an earlier run's checkpoint exists; "
                                       "pass --resume to continue it or --overwrite to start over")
                state.remove_checkpoint(self.state_dir)
                (self.state_dir / state.METRICS).unlink(missing_ok=True)
                state.prune_best(self.state_dir, set())
        # the compute dtype, resolved now: a resumed run must compute in the checkpoint's (state.RUN_OPTIONS)
        self.precision = o.precision or default_precision(_device(o.device, self.rank))
        if o.resume and self.is_main:  # a resumable checkpoint: readable, safe, same options; before any model loads
            fp = self._fingerprint()
            state.load_sharded_meta(self.state_dir, fp)
            state.load_checkpoint(self.state_dir, torch.device("cpu"), fp, mmap=True)
        rows = o.batch * self.world
        if o.tokens < rows * o.seq_len:
            raise RecycleError(f"--tokens {o.tokens:,} is less than one optimizer step ({rows} sequences × {o.seq_len} "
                               f"tokens = {rows * o.seq_len:,}): raise --tokens, or lower --batch / --seq-len")
        self.setup_phases: dict[str, float] = {}
        with self._phase("reading the data and the tokenizer"):
            self.tokenizer = self._tokenizer()
            texts = self.source.train()  # now: bad data surfaces before any model is built
            self.renderer = source_renderer(o, self.tokenizer, texts)  # conversations: the template, checked now
        if o.self_distill and self.renderer is None and not 1 <= o.prompt_len < o.seq_len:  # text: a window's prompt
            raise RecycleError(f"--prompt-len must be in [1, {o.seq_len - 1}], got {o.prompt_len}")
        if self.renderer is not None and o.self_distill and o.online is not None:
            raise RecycleError("--self-distill on conversations: not with --online (run recycle harvest --self-distill "
                               "first, then distill --cache-hidden on its cache)")
        self.data_passes = _passes(o.tokens, texts, self.tokenizer)
        if self.data_passes > PASSES_WARN:
            self._note(f"note: --tokens {o.tokens:,} is about {self.data_passes:.0f} passes over the training side of "
                       f"--data ({plural(len(texts), 'document')}): the drafter will fit that text, not the target's "
                       "distribution; give more data or fewer tokens")

    def _tokenizer(self):
        from transformers import AutoTokenizer

        from recycle.decoding.target import quiet_transformers

        o = self.opts
        tok_dir = o.target if (Path(o.target) / "tokenizer.json").is_file() or \
            (Path(o.target) / "tokenizer_config.json").is_file() else o.drafter
        try:
            with quiet_transformers():
                tok = AutoTokenizer.from_pretrained(tok_dir)
        except Exception as e:  # noqa: BLE001 - a corrupt tokenizer file is bad input
            raise RecycleError(f"{tok_dir}: no usable tokenizer ({' '.join(str(e).split())[:160]})") from None
        tok.model_max_length = 1 << 62  # documents are cut into windows, never fed whole
        return tok

    def _build(self) -> None:
        from recycle.decoding.target import quiet_transformers
        from recycle.drafters import load_drafter

        o = self.opts
        if o.threads:
            torch.set_num_threads(o.threads)
        self.device = _device(o.device, self.rank)
        self.precision = o.precision or default_precision(self.device)
        if self.device.type == "cuda":  # refuse at once, with the advice, what the device cannot hold
            from recycle.distill.memory import check, for_options

            total = torch.cuda.get_device_properties(self.device).total_memory
            check(for_options(replace(o, precision=self.precision), self.world, device_bytes=total,
                              fsdp=dist.is_initialized()))
        with self._phase("loading the drafter"), quiet_transformers():
            model = load_drafter(o.drafter, dtype=torch.float32)
        aux = self.fmt.reads(self.drafter_config, self.target_config).aux_layers
        aux = list(aux) if aux is not None else None
        unroller_cls: type[Unroller] = self.fmt.resolve("unroller")
        self.schedule = Schedule(o.tokens, o.batch, o.seq_len, self.world)
        harvested = None
        self.harvested = False
        self.producer = None
        if o.online:  # vLLM computes each step's features while this process trains, `online` keys ahead
            from recycle.distill.harvest import OnlineFollower, OnlineHarvest
            from recycle.options import HarvestOptions

            with self._phase("starting vLLM for the online teacher (about a minute on a CPU)"):
                if self.is_main:  # under torchrun vLLM runs beside rank 0, on the global batch's one-process keys
                    self.producer = OnlineHarvest(HarvestOptions(
                        target=o.target, out=o.cache_hidden, tokens=o.tokens, data=o.data, seq_len=o.seq_len,
                        batch=o.batch * self.world, seed=o.seed, aux_layers=tuple(aux or ()),
                        eval_rows=o.eval_rows, eval_prompt_len=o.eval_prompt_len, parallel=o.vllm_parallel,
                        chat_template=o.chat_template), o.online)
                if self.world > 1:  # the other ranks look only once rank 0 has cleared an earlier run's keys
                    dist.barrier()
                    self.producer = self.producer or OnlineFollower(o.cache_hidden, o.online)
                self.producer.wait(EVAL_KEY)  # vLLM's engine start and the held-out rows come first
        if o.cache_hidden and (Path(o.cache_hidden) / "manifest.json").is_file():  # made by `recycle harvest`
            from recycle.distill.harvest import check_manifest

            harvested = check_manifest(Path(o.cache_hidden), o, aux_layers=aux or [], world=self.world)
        self.harvested = harvested is not None
        # A harvested cache holds every window and the evaluation rows: the trunk is never loaded.
        with self._phase("loading the target" if harvested is None else "loading the target's embedding and head"):
            self.teacher = Teacher(o.target, self.device, aux, self.precision, o.cache_hidden,
                                   trunk=harvested is None, producer=self.producer, kv=unroller_cls.needs_kv)
        model.to(self.device).train()
        self.unroller = unroller_cls.make(model, o.draft_steps, self.teacher.embed, aux)
        if o.activation_checkpointing:
            model.checkpoint_blocks = True
        self.target_io = self.unroller.adopt_target_io(self.teacher.embed.weight, self.teacher.head.weight)
        if o.init == "scratch":
            self.unroller.reinit(o.seed)
        self.model = model
        if self.unroller.positions(o.seq_len) < 1:
            raise RecycleError(f"--seq-len {o.seq_len} is too short for {self.unroller.steps} draft steps")
        # conversations regenerated here, unless harvest's vLLM wrote them (the cache holds each key's rows and mask)
        rewrite = self._regenerate_chunk if self.renderer is not None and o.self_distill and not harvested else None
        self.stream = PackedStream(self.source.train, self.tokenizer, o.seq_len, o.seed, self.renderer,
                                   self.source.log, rewrite)
        self.stream.texts()  # read already (validation): the packing's cost is the first step's
        self.frozen = freeze(model, o.freeze)  # after the format's own (embedding, head)
        if self.precision == "bf16":  # frozen weights bf16 holds exactly stay bf16: autocast casts them anyway
            self.frozen["lowered_to_bf16_bytes"] = lower_frozen(model, keep=(self.teacher.embed.weight,
                                                                              self.teacher.head.weight))
        self.sharded = self._shard(model)
        params = self.unroller.trainable()
        self.opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay,
                                     foreach=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.schedule.total_steps, o.warmup,
                                                                           o.min_lr))
        self.eval_mask = None
        if harvested is not None:  # vLLM wrote the held-out continuations and their features
            self.eval_prompt = int(harvested["eval"]["prompt_len"])
            ids, mask = self.teacher.cached_rows(EVAL_KEY)
            self.eval_ids = ids.to(self.device)
            self.eval_teacher = self.teacher(self.eval_ids, EVAL_KEY)
            if self.renderer is not None and mask is None:  # an older cache: the same rows, their mask rebuilt here
                ev, mask = heldout_rows(self.tokenizer, o.seq_len, o.eval_rows, o.data, self.renderer)
                mask = mask if torch.equal(ev, ids) else None
            self.eval_mask = mask.to(self.device) if mask is not None else None
            return
        with self._phase(f"the target continues {o.eval_rows} held-out rows (the held-out estimate's text)"):
            rewrite = None
            if self.renderer is not None and o.self_distill:  # the held-out conversations as the target answers them
                rewrite = lambda idx, docs, key: self._regenerate_chunk(idx, docs, key, timed=False)  # noqa: E731
            ev, mask = heldout_rows(self.tokenizer, o.seq_len, o.eval_rows, o.data, self.renderer, rewrite)
            self.eval_mask = mask.to(self.device) if mask is not None else None
            # conversations are scored on their assistant turns as they are; text rows continue from a prompt
            self.eval_prompt = 0 if mask is not None else eval_prompt_len(ev.shape[1], o.eval_prompt_len,
                                                                          self.unroller.steps)
            if self.eval_prompt:  # the text greedy decoding verifies
                ev = regenerate(self.teacher.model, ev, self.eval_prompt, 0.0, o.seed)
            self.eval_ids = ev.to(self.device)
            self.eval_teacher = self.teacher(self.eval_ids)

    def _regenerate_chunk(self, indices: list[int], docs: list, key: str, timed: bool = True) -> list:
        """`--self-distill` on conversations: the target writes the assistant turns of a chunk of documents (seeded
        by the chunk's place in the stream, so a resumed run writes the same); `--save-regenerated` keeps them."""
        import zlib

        o = self.opts
        t0 = time.perf_counter()
        was = self.teacher.model.training
        out = regenerate_turns(in_process(self.teacher.model, self.tokenizer.pad_token_id), self.renderer, docs,
                               o.sd_temperature, o.seed * 1_000_003 + zlib.crc32(key.encode()), o.seq_len)
        self.teacher.model.train(was)
        if timed:  # teacher compute, timed on its own (the held-out set's is set-up)
            self.timing["generate_s"] += time.perf_counter() - t0
        if o.save_regenerated and self.is_main:
            with open(Path(o.save_regenerated).expanduser(), "a", encoding="utf-8") as f:
                f.writelines(json.dumps(d.to_json()) + "\n" for d in out if hasattr(d, "to_json"))
        return out

    def _shard(self, model: torch.nn.Module) -> bool:
        """Under torchrun, FSDP2 for formats whose unroller runs the drafter through its own forward (the record's
        unroller says `shardable`; the others average gradients with one flat all-reduce per step, every rank holding
        the whole drafter): every transformers decoder layer its own unit, then the rest of the drafter, each
        rank holding 1/world of the trainable weights, their gradients and AdamW state (fp32; gradients reduced in
        fp32). Frozen weights (the embedding and head copies, `--freeze` groups) stay outside the units, plain and
        whole on every rank: the loss reads the head directly, a chunk of rows at a time. Fused routed experts,
        trained or frozen, stay outside too, split by expert over the ranks (`distill.experts`), where the rank
        count divides them: a MoE block's unit would otherwise gather every expert on every rank."""
        if not dist.is_initialized() or not self.unroller.shardable:
            return False
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from recycle.distill import experts
        from recycle.distill.memory import fsdp_units

        mesh = init_device_mesh(self.device.type, (self.world,))
        # fused routed experts: split by expert over the ranks, the tokens sent to them (distill.experts), not gathered
        split = experts.shard_experts(model, mesh) if experts.shardable(model, self.world) else []
        self.expert_parallel = bool(split)
        if split:
            self._note(f"expert parallelism: each rank holds {1 / self.world:.0%} of the routed experts")
        ignored = {p for p in model.parameters() if not p.requires_grad} | set(split)
        # bf16 compute: units gathered in bf16 (half the all-gather and the gathered copy), reduced in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.precision == "bf16" else None,
                                      reduce_dtype=torch.float32)
        for module in fsdp_units(model):
            fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        return True

    def _full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """The model's (and optimizer's) whole state: as it is in one process; gathered from every rank onto rank 0's
        CPU when sharded (a collective: every rank calls it)."""
        if not self.sharded:
            return self.model.state_dict(), self.opt.state_dict() if optimizer else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if optimizer:
            return get_state_dict(self.model, self.opt, options=whole)
        return get_model_state_dict(self.model, options=whole), None

    # -- state ------------------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        run = {"step": self.step, "tokens": self.tokens, "data": asdict(self.stream.pos),
               "scheduler": self.sched.state_dict(), "rng": state.rng_state(), "timing": dict(self.timing),
               "wall_s": self.wall_before + time.perf_counter() - self.t_start, "before": self.before,
               "history": self.history[-1] if self.history else None, "best": self.best}
        fp = self._fingerprint()
        if self.sharded:  # every rank writes its own shards; nothing is gathered
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, opt_state = get_state_dict(self.model, self.opt)
            state.save_sharded(self.state_dir, {"model": model_state, "optimizer": opt_state["state"]},
                               {**run, "param_groups": opt_state["param_groups"]}, fp)
        else:
            model_state, opt_state = self._full_state()
            if self.is_main:
                state.save_checkpoint(self.state_dir, {**run, "model": model_state, "optimizer": opt_state}, fp)
        self.last_checkpoint = self.step
        if not self.is_main:
            return
        self.checkpointed_best = self.best["step"]
        state.prune_best(self.state_dir, {self.best["step"]})

    def _fingerprint(self) -> dict:
        """What a checkpoint records of this run's options, and a resumed run must match (state.RUN_OPTIONS)."""
        return state.fingerprint(self.opts, self.world, self.precision, self.fmt.name)

    def _restore(self) -> bool:
        fp = self._fingerprint()
        if self.sharded:  # each rank reads its own shards of the drafter and of AdamW's moments
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            saved = state.load_sharded_meta(self.state_dir, fp)
            if saved is None:
                return False
            model_state, opt_state = get_state_dict(self.model, self.opt)
            state.load_sharded(self.state_dir, {"model": model_state, "optimizer": opt_state["state"]})
            set_state_dict(self.model, self.opt, model_state_dict=model_state,
                           optim_state_dict={"state": opt_state["state"], "param_groups": saved["param_groups"]})
        else:
            saved = state.load_checkpoint(self.state_dir, self.device, fp)
            if saved is None:
                return False
            self.model.load_state_dict(saved["model"])
            self.opt.load_state_dict(saved["optimizer"])
        self.sched.load_state_dict(saved["scheduler"])
        self.step, self.tokens = int(saved["step"]), int(saved["tokens"])
        self.last_checkpoint = self.step
        self.stream.seek(Position(**saved["data"]))
        state.set_rng(saved["rng"])
        self.timing.update(saved["timing"])
        self.wall_before = float(saved["wall_s"])
        self.before = saved["before"]
        self.best = saved["best"]
        self.checkpointed_best = self.best["step"]
        if self.is_main:
            state.truncate_metrics(self.state_dir, self.step)
        if self.log:
            self.log(f"resuming from step {self.step} (tokens {self.tokens:,})")
        return True

    def _consider(self, agree: list[float]) -> None:
        """Keep the current weights if their held-out estimate beats the best so far (the input counts)."""
        score = expected_length(agree)
        if self.best is None or score > self.best["estimate"]:
            self.best = {"estimate": score, "agree": list(agree), "step": self.step, "tokens": self.tokens}
            trained = {}
            for n, p in self.model.named_parameters():
                if p.requires_grad:  # sharded: gathered by every rank (a collective), one tensor on the device at once
                    whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                    if self.is_main:
                        trained[n] = whole.cpu() if isinstance(p, DTensor) else whole
            if self.is_main:  # only rank 0 writes the output; the trained weights go to disk, not RAM
                state.save_best(self.state_dir, self.step, trained)
                state.prune_best(self.state_dir, {self.step, self.checkpointed_best})

    # -- steps ------------------------------------------------------------------------------------

    @torch.no_grad()
    def agreement(self) -> list[float]:
        """Held-out top-1 agreement of each draft step with the target's greedy token."""
        self.model.eval()
        with autocast(self.device, self.precision):
            te = self.eval_teacher
            steps = mask_steps(self.unroller.unroll(self.eval_ids, te.last, te.aux, te.logits, kv=te.kv),
                               self.eval_mask)
            agree = [float(step_terms(s, grad=False)["agree"]) for s in steps]
        self.model.train()
        return agree

    def _passes(self, ids: torch.Tensor, key: str, weight: float, mask: torch.Tensor | None = None) -> list[tuple]:
        """A micro-batch's forward/backward passes: the teacher's outputs for its rows, cut into --micro-batch slices,
        each with its share of the step's loss and its rows' assistant mask: (ids, teacher outputs, share, mask)."""
        t0 = time.perf_counter()
        with record_function("recycle.teacher"):  # named ranges: what a profiler (benchmarks/distill_gpu.py) attributes
            te = self.teacher(ids, key)
            self._sync()
        self.timing["teacher_s"] += time.perf_counter() - t0
        if self.unroller.positions(ids.shape[1]) < 1:
            return []
        rows = ids.shape[0]
        size = min(self.opts.micro_batch or rows, rows)
        out = []
        for lo in range(0, rows, size):  # --micro-batch: the gradient accumulates over slices of the rows
            part = slice(lo, lo + size)
            frac = (min(rows, lo + size) - lo) / rows  # equal lengths: rows weigh as their anchors do
            kv = {k: (a[part], b[part]) for k, (a, b) in te.kv.items()} if te.kv else None
            sliced = TeacherOut(te.last[part], te.aux[part] if te.aux is not None else None, te.logits, kv)
            out.append((ids[part], sliced, weight * frac, mask[part] if mask is not None else None))
        return out

    def _run_passes(self, passes: list[tuple]) -> tuple[float, dict | None]:
        """Forward and backward of each pass. Sharded, every rank must run as many as the others (each pass gathers
        and reduces the same units): a rank with fewer runs held-out rows at weight 0; FSDP averages the gradients
        over ranks, so each pass's loss is scaled by the world size to keep the step's sum."""
        if self.sharded:
            count = torch.tensor([len(passes)], device=self.device)  # NCCL reduces device tensors only
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            rows = self.eval_ids[:1]
            filler = TeacherOut(self.eval_teacher.last[:1],
                                self.eval_teacher.aux[:1] if self.eval_teacher.aux is not None else None,
                                self.eval_teacher.logits,
                                {k: (a[:1], b[:1]) for k, (a, b) in self.eval_teacher.kv.items()}
                                if self.eval_teacher.kv else None)
            passes = passes + [(rows, filler, 0.0, None)] * (int(count) - len(passes))
        t1 = time.perf_counter()
        scale = self.world if self.sharded else 1
        total, info = 0.0, None
        weight = sum(p[2] for p in passes) or 1.0
        with record_function("recycle.drafter"):
            for ids, te, share, mask in passes:
                with autocast(self.device, self.precision):
                    steps = mask_steps(self.unroller.unroll(ids, te.last, te.aux, te.logits,
                                                            with_features=bool(self.opts.loss.feature_weight),
                                                            kv=te.kv), mask)
                    loss, terms = distill_loss(steps, self.opts.loss)
                (loss * (share * scale)).backward()
                if share:  # logged CE/KL/agreement: the passes' average, weighted as the loss weighs them
                    total += float(loss.detach()) * share
                    info = _accumulate(info, terms, share / weight)
            self._sync()
        self.timing["drafter_s"] += time.perf_counter() - t1
        return total, info

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allreduce(self) -> None:
        params = self.unroller.trainable()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(p)
            off += n

    def train_step(self, step: Step) -> dict:
        o = self.opts
        t0 = time.perf_counter()
        lengths = step.lengths
        generated = self.timing["generate_s"]
        rows, masks = self.stream.take_masked(len(lengths))
        t0 += self.timing["generate_s"] - generated  # conversations regenerated as the stream read them
        # a harvested cache holds one process's keys: each rank reads its block of the step's rows from them
        block = o.batch if self.harvested else None
        keys = [(list(mb.rows), mb.length, mb.key) for mb in step.micro_batches(self.rank, self.world, block)]
        written = {}
        if o.self_distill and self.harvested:  # vLLM wrote the continuations: the cache holds each key's rows
            written = {key: self.teacher.cached_rows(key) for _, _, key in keys}  # (ids, assistant mask or None)
        elif o.self_distill and masks is None:  # the target's generation is teacher compute, timed on its own
            # (conversations were regenerated turn by turn as the stream read them)
            tg = time.perf_counter()
            rows = regenerate(self.teacher.model, rows, o.prompt_len, o.sd_temperature, o.seed * 1_000_003 + self.step)
            self.timing["generate_s"] += time.perf_counter() - tg
            t0 += time.perf_counter() - tg
        anchors = [max(0, self.unroller.positions(n)) for n in lengths]
        total_anchor = max(1, sum(anchors))
        micro = []
        for idx, n, key in keys:
            ids, mask = written.get(key, (rows[idx, :n], masks[idx, :n] if masks is not None else None))
            micro.append((ids.to(self.device), key, sum(anchors[i] for i in idx),
                          mask.to(self.device) if mask is not None else None))
        self.timing["data_s"] += time.perf_counter() - t0
        self.opt.zero_grad(set_to_none=True)
        passes = []
        for ids, key, n, mask in micro:
            passes += self._passes(ids, key, n / total_anchor, mask)
        loss, info = self._run_passes(passes)
        t1 = time.perf_counter()
        if self.world > 1:
            if not self.sharded:
                self._allreduce()
            lt = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(lt)  # every rank has read its rows of the step's keys by now
            loss = float(lt)
        if self.producer is not None and self.is_main:  # online: consumed, deleted (disk stays at `ahead` keys)
            self.teacher.release([key for _, _, key in keys])
        if not math.isfinite(loss):  # every rank holds the reduced loss: all stop here, before the update
            self._diverged("loss", loss)
        params = self.unroller.trainable()
        if any(p.grad is not None for p in params):
            with record_function("recycle.optimizer"):
                gnorm = float(torch.nn.utils.clip_grad_norm_(params, o.clip))  # the total norm: the same on every rank
                if not math.isfinite(gnorm):  # an update from it would make every weight NaN
                    self._diverged("gradient norm", gnorm)
                self.opt.step()
        else:
            gnorm = 0.0
        self.sched.step()
        self.step += 1
        self.tokens += sum(lengths)
        self.timing["optimizer_s"] += time.perf_counter() - t1
        info = info or {"ce": [], "kl": [], "agree": []}
        return {"step": self.step, "tokens": self.tokens, "loss": loss, "grad_norm": gnorm,
                "lr": self.sched.get_last_lr()[0], "ce": info["ce"], "kl": info["kl"], "train_agree": info["agree"]}

    # -- run --------------------------------------------------------------------------------------

    def run(self, progress: Callable[[dict], None] | None = None) -> dict:
        o = self.opts
        self._build()
        self.step, self.tokens, self.wall_before = 0, 0, 0.0
        self.timing = {"data_s": 0.0, "generate_s": 0.0, "teacher_s": 0.0, "drafter_s": 0.0, "optimizer_s": 0.0,
                       "log_s": 0.0}
        self.history: list[dict] = []
        self.best: dict | None = None
        self.checkpointed_best = -1  # the step of the best snapshot the last checkpoint names (kept on disk)
        self.last_checkpoint: int | None = None  # the step the checkpoint on disk holds (written or resumed from)
        self.time_estimate: dict | None = None  # the budget's time at the first steps' rate (_estimate_time)
        self.t_start = time.perf_counter()
        resumed = o.resume and self._restore()
        if self.producer is not None:
            self.producer.begin(self.step)
        if not resumed:
            torch.manual_seed(o.seed)
            self.before = self.agreement()
            self._consider(self.before)
        if self.is_main and 0 in o.snapshots and not resumed:
            self._snapshot(0)
        with self._stop_between_steps():
            last = self._loop(progress)
        train = self.wall_before + time.perf_counter() - self.t_start
        final = self.agreement()
        self._consider(final)
        if self.sharded:  # rank 0 writes from a whole copy: gathered, into the drafter as it was loaded
            whole, _ = self._full_state(optimizer=False)
            if self.is_main:
                from recycle.drafters import load_drafter

                self.model = self.unroller.model = load_drafter(self.opts.drafter, dtype=torch.float32)
                self.model.load_state_dict(whole)
        if self.is_main and self.best["step"] != self.step:  # rank 0 evaluates, chooses and writes
            self.model.load_state_dict(state.load_best(self.state_dir, self.best["step"]), strict=False)
        record = self._record(last, final, train, resumed)
        if self.is_main:
            self._write(record)
            state.remove_checkpoint(self.state_dir)
            state.prune_best(self.state_dir, set())
        record["wall_s"] = round(time.perf_counter() - self.t_command, 3)  # the command's, setup included
        if self.world > 1:
            dist.barrier()
        return record

    def _loop(self, progress: Callable[[dict], None] | None) -> dict:
        """The training steps from the current one to the budget; returns the last step's row."""
        o, last = self.opts, {}
        start_tokens, start_step, t_run = self.tokens, self.step, time.perf_counter()
        first: tuple[float, int] | None = None  # (time, tokens) when this run's first step ended
        snaps = sorted(n for n in o.snapshots if n > self.tokens)
        for step in self.schedule.steps(self.step):
            if self.stop is not None:
                self._stopped()
            row = self.train_step(step)
            t0 = time.perf_counter()
            acting = self.is_main or self.sharded  # sharded, every rank runs the drafter and gathers its weights
            if acting and (self.step % o.eval_every == 0 or self.tokens >= o.tokens):
                row["heldout_agree"] = self.agreement()
                row["heldout_estimate"] = expected_length(row["heldout_agree"])
                self._consider(row["heldout_agree"])
            if self.is_main:
                elapsed = self.wall_before + time.perf_counter() - self.t_start
                row["wall_s"] = round(elapsed, 3)
                row["tokens_per_s"] = (self.tokens - start_tokens) / max(1e-9, time.perf_counter() - t_run)
                if self.time_estimate is None and self.tokens < o.tokens:
                    now, ran = time.perf_counter(), self.step - start_step
                    if first is None:
                        first = (now, self.tokens)
                    if now - t_run >= ETA_AFTER_S and ran == 1:  # one slow step: its own rate, warm-up and all
                        self._estimate_time(self.tokens - start_tokens, now - t_run, "over the first step")
                    elif ran > 1 and (ran > ETA_STEPS and now - first[0] >= ETA_MIN_S or now - t_run >= ETA_AFTER_S):
                        self._estimate_time(self.tokens - first[1], now - first[0],
                                            f"over steps {start_step + 2}-{self.step}")
                state.append_metrics(self.state_dir, row)
                while snaps and self.tokens >= snaps[0]:
                    self._snapshot(snaps.pop(0))
                if progress:
                    progress(row)
            if acting and self.step % o.checkpoint_every == 0 and self.tokens < o.tokens:
                self._checkpoint()
            if self.world > 1:
                dist.barrier()
            self.timing["log_s"] += time.perf_counter() - t0
            self.history.append(row)
            last = row
        return last

    def _estimate_time(self, tokens: int, seconds: float, where: str) -> None:
        """The rest of the budget at the rate the first steps measured (the record's `time_estimate`); a note when
        it is long (ETA_NOTE_S), so a budget no machine here can finish says so early."""
        rate = tokens / max(seconds, 1e-9)
        left = time_left(self.opts.tokens, self.tokens, rate)
        note = time_note(self.opts.tokens, self.tokens, rate, where, self.device.type, ETA_NOTE_S)
        self.time_estimate = {"measured": where, "tokens_per_s": round(rate, 1), "tokens_done": self.tokens,
                              "seconds_left": round(left, 1), "about": duration(left), "note": note}
        if note:
            self._note(note)

    @contextlib.contextmanager
    def _stop_between_steps(self):
        """While the loop runs, SIGINT/SIGTERM ask it to stop after the step in flight (and checkpoint); before and
        after, they interrupt as usual (nothing to save yet, or the output is being written whole)."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        old = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def on_signal(self, signum, frame) -> None:
        """SIGINT/SIGTERM in the loop: finish the step, checkpoint, stop (`_stopped`); a second one stops at once."""
        if self.stop is not None:
            raise KeyboardInterrupt
        self.stop = signal.Signals(signum).name

    def _stopped(self) -> None:
        if (self.is_main or self.sharded) and self.step > 0:
            self._checkpoint()
        where = (f"step {self.step} ({self.tokens:,} of {self.opts.tokens:,} tokens) is checkpointed in {self.state_dir}"
                 if self.step > 0 else "no step had finished: nothing was saved")
        raise Interrupted(f"{self.stop}: stopped; {where}", resumable=self.step > 0)

    def _diverged(self, what: str, value: float) -> None:
        """A non-finite loss or gradient: training diverged. Stop before the update, write no drafter (the output would
        be NaN or worse than the input) and keep the last checkpoint, whose weights were all finite."""
        step = self.step + 1
        kept = (f"the last good checkpoint (step {self.last_checkpoint}) stays in {self.state_dir}"
                if self.last_checkpoint is not None else "no checkpoint had been written")
        raise RecycleError(f"step {step}: the {what} is {value} (training diverged at --lr {self.opts.lr:g}); "
                           f"stopped, no drafter written, {kept}; lower --lr and start over with --overwrite")

    def _record(self, last: dict, final: list[float], wall: float, resumed: bool) -> dict:
        o = self.opts
        best = self.best
        selected = {"step": best["step"], "tokens": best["tokens"], "estimate": round(best["estimate"], 4),
                    "why": ("the last step" if best["step"] == self.step else
                            "the input: no step beat its held-out estimate, so its weights are written unchanged"
                            if best["step"] == 0 else
                            f"step {best['step']}: the best held-out estimate, better than the last step's")}
        t = self.timing
        step_s = sum(t.values())
        trained = self.tokens
        return {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "recycle_version": __version__,
            "from": str(Path(o.drafter).resolve()),
            "target": str(Path(o.target).resolve()),
            "init": o.init,
            "budget_tokens": o.tokens,
            "tokens": trained,
            "steps": self.step,
            "data": {"source": o.data or "stdlib", **self.source.log.to_json(), "passes": round(self.data_passes, 2),
                     "self_distill": o.self_distill,
                     "chat": None if self.renderer is None else {
                         "template": o.chat_template or "the target tokenizer's", "mask": self.renderer.method,
                         "counted": "assistant tokens only (empty reasoning blocks excluded)",
                         "self_distill": "every assistant turn written by the target, turn by turn" if o.self_distill
                         else None},
                     "prompt_len": o.prompt_len if o.self_distill and self.renderer is None else None,
                     "temperature": o.sd_temperature if o.self_distill else None,
                     "seq_len": o.seq_len, "batch_per_rank": o.batch, "world_size": self.world, "seed": o.seed,
                     "sharding": ("FSDP2, routed experts split over the ranks" if self.expert_parallel
                                  else "FSDP2" if self.sharded else None)},
            "losses": {**asdict(o.loss), "draft_steps": self.unroller.steps, "objective":
                       "Σ_k decay^k/Z · (ce_weight·CE + kl_weight·KL(P_target ‖ P_draft) + feature_weight·SmoothL1)"},
            "freeze": self.frozen,
            "optimizer": {"name": "AdamW", "lr": o.lr, "betas": [0.9, 0.95], "weight_decay": o.weight_decay,
                          "warmup": o.warmup, "schedule": "linear warm-up + cosine", "min_lr": o.min_lr, "clip": o.clip},
            "final": {"loss": last.get("loss"), "heldout_agreement_before": self.before,
                      "heldout_agreement_after": best["agree"], "heldout_agreement_last_step": final,
                      "heldout_estimate_before": round(expected_length(self.before), 4),
                      "heldout_estimate_after": round(best["estimate"], 4)},
            "selected": selected,
            "heldout": {"source": self.source.name + (" (held-out split)" if is_corpus_name(self.source.name)
                                                      else " (tail, not trained on)"),
                        "rows": int(self.eval_ids.shape[0]), "seq_len": int(self.eval_ids.shape[1]),
                        "continuation": f"target greedy after {self.eval_prompt} prompt tokens" if self.eval_prompt
                        else "the target's own assistant turns" if self.eval_mask is not None and o.self_distill
                        else "none (the held-out text itself)",
                        "counted": "assistant tokens" if self.eval_mask is not None else "every position"},
            "target_io": self.target_io,
            "train_s": round(wall, 3),
            "setup_s": self.setup_phases,
            "tokens_per_s": round(trained / wall, 1) if wall else None,
            "timing": {k: round(v, 3) for k, v in t.items()},
            "target_forward_share": round(t["teacher_s"] / step_s, 4) if step_s else None,
            "overhead_share": round((t["data_s"] + t["optimizer_s"] + t["log_s"]) / step_s, 4) if step_s else None,
            "device": str(self.device),
            "precision": self.precision,
            "sharded": "fsdp2" if self.sharded else None,
            # the most the run held at once: the CUDA allocator's peak, or the process's peak RSS on a CPU
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
            else peak_rss_bytes(),
            "resumed": resumed,
            "time_estimate": self.time_estimate,
            "cache_hits": self.teacher.cache_hits,
            "trunk_loaded": self.teacher.model is not None,
            "online": None if self.producer is None else {
                "ahead": self.producer.ahead, "max_key_files": self.producer.max_present,
                "max_key_bytes": self.producer.max_bytes},
        }

    # -- outputs ----------------------------------------------------------------------------------

    def _snapshot(self, tokens: int) -> None:
        root = Path(self.opts.snapshot_dir) if self.opts.snapshot_dir else self.state_dir / "snapshots"
        agree = self.agreement()
        record = {"snapshot_tokens": tokens, "tokens": self.tokens, "init": self.opts.init, "heldout_agree": agree,
                  "heldout_estimate": expected_length(agree)}
        from recycle.converters.writer import OutputDir

        self._write_to(OutputDir(root / f"tokens_{tokens}", overwrite=True), record)

    def _write(self, record: dict) -> None:
        self._write_to(self.writer, record)

    def _write_to(self, writer, record: dict) -> None:
        from recycle.converters.rewrite import write_drafter

        write_drafter(self.opts.drafter, writer, self.fmt, self.unroller.file_state(), self.model, record)


def distill(opts: DistillOptions, progress: Callable[[dict], None] | None = None,
            log: Callable[[str], None] | None = None) -> dict:
    """Library entry point (the CLI and the experiment call this); `log` gets one-line notices."""
    threads = torch.get_num_threads()
    d = None
    try:
        d = Distiller(opts, log)
        record = d.run(progress)
    except BaseException:
        if d is not None:
            d.discard_state()
        raise
    finally:
        if d is not None:
            d.unlock()
        torch.set_num_threads(threads)  # --threads is this run's, not the caller's process-wide setting
        if getattr(d, "producer", None) is not None:
            d.producer.close()  # the online vLLM job ends with the run, whatever ended it
    record["out"] = str(d.out)
    record["state_dir"] = str(d.state_dir)
    return record
