"""`recycle distill`: frozen-target distillation of a drafter directory, to an exact token budget.

The loop, per optimizer step: take `batch` packed sequences (per rank) → the frozen target gives
features and logits (no grad, bf16 autocast) → the drafter unrolls K draft steps (`recycle.distill.unroll`)
→ `recycle.distill.losses` → backward → gradient all-reduce (several ranks) → clip → AdamW → LR schedule.

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
  * Several ranks (`torchrun`): each rank trains on its slice of the global batch, gradients are
    averaged with one all_reduce over a flat buffer per step, as DistributedDataParallel does, but
    without DDP's rule that every rank runs a forward every step, which the truncated last batch
    breaks when it has fewer rows than ranks. Rank 0 logs, evaluates, checkpoints and writes.
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

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

from recycle.distill.data import PackedStream, Position, data_source, heldout_batch, regenerate
from recycle.distill.losses import LossConfig, distill_loss
from recycle.distill.teacher import Teacher, autocast
from recycle.distill.unroll import Unroller, make_unroller
from recycle import __version__
from recycle.checkpoint import load_json
from recycle.corpus import is_corpus_name
from recycle.drafters import ASSISTANT_FORMAT
from recycle.errors import RecycleError
from recycle.preflight import parse_tokens  # noqa: F401  (the CLI and benchmarks take it from here too)

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


@dataclass
class DistillOptions:
    drafter: str
    target: str
    tokens: int
    out: str | None = None  # default: DRAFTER-distilled beside the input
    data: str | None = None
    self_distill: bool = False
    prompt_len: int = 64
    sd_temperature: float = 0.0
    seq_len: int = 256
    batch: int = 8  # sequences per rank per step
    lr: float = 5e-4
    warmup: float = 0.05
    min_lr: float = 0.1  # fraction of lr at the end of the cosine
    weight_decay: float = 0.0
    clip: float = 0.5
    draft_steps: int | None = None
    loss: LossConfig = field(default_factory=LossConfig)
    init: str = "recycled"  # or "scratch"
    checkpoint_every: int = 50
    eval_every: int = 25
    eval_rows: int = 16
    eval_prompt_len: int = 64  # the held-out rows keep this many tokens; the target writes the rest
    resume: bool = False
    state_dir: str | None = None
    cache_hidden: str | None = None
    online: int | None = None  # harvest in vLLM while training into cache_hidden, this many steps' keys ahead
    vllm_parallel: dict | None = None  # with online: vLLM's own parallelism arguments
    device: str | None = None
    precision: str | None = None  # None: bf16 where the device has native bf16, else fp32
    seed: int = 0
    threads: int | None = None
    overwrite: bool = False
    snapshots: tuple[int, ...] = ()  # token counts at which to write a drafter dir (the experiment)
    snapshot_dir: str | None = None


def default_precision(device: torch.device) -> str:
    """bf16 autocast where the hardware has it (CUDA, AVX512-BF16, AMX); fp32 where bf16 is emulated."""
    if device.type == "cuda":
        return "bf16"
    caps = torch.cpu.get_capabilities()
    return "bf16" if caps.get("avx512_bf16") or caps.get("amx_bf16") else "fp32"


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
    """(rank, world); joins the process group when torchrun set WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def lr_lambda(total_steps: int, warmup: float, min_lr: float) -> Callable[[int], float]:
    warm = max(1, int(round(total_steps * warmup))) if warmup > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _rng_state() -> dict:
    """RNG states as tensors and plain containers, so the checkpoint loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss_np = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss_np))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: dict, path: Path) -> None:
    """torch.save to a temp file, fsync, rename: a kill mid-write leaves the previous checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- what a step consumes -------------------------------------------------------------------------

def plan_batch(remaining: int, rows: int, seq_len: int) -> list[int]:
    """Row lengths of the next global batch: `rows` full rows, or fewer plus one cut row at the end."""
    if remaining >= rows * seq_len:
        return [seq_len] * rows
    full, rest = divmod(remaining, seq_len)
    return [seq_len] * full + ([rest] if rest else [])


EVAL_KEY = "eval"  # the held-out rows' key in a --cache-hidden directory `recycle harvest` filled


def eval_prompt_len(length: int, wanted: int, steps: int = 1) -> int:
    """How many tokens of each held-out row stay as the prompt (the target writes the rest); 0 when the
    rows are too short to continue, and then they are scored on the held-out text itself."""
    p = min(wanted, length // 4)
    return p if p >= 1 and length - p > steps + 1 else 0


def micro_batches(step: int, lengths: list[int], rank: int, world: int, seq_len: int) -> list[tuple[list[int], int, str]]:
    """(row indices, length, cache key) of one rank's share of a step: its full rows together, each cut row
    alone. `--cache-hidden` files are named by these keys, which is how `recycle harvest` fills a cache ahead."""
    mine = list(range(rank, len(lengths), world))
    full = [i for i in mine if lengths[i] == seq_len]
    out = [(full, seq_len, f"s{step:08d}r{rank}f")] if full else []
    return out + [([i], lengths[i], f"s{step:08d}c{i}") for i in mine if lengths[i] != seq_len]


def _fingerprint(opts: DistillOptions, world: int) -> dict:
    """Options a resumed run must share with the one it continues."""
    return {"drafter": str(Path(opts.drafter).resolve()), "target": str(Path(opts.target).resolve()),
            "tokens": opts.tokens, "seq_len": opts.seq_len, "batch": opts.batch, "world": world,
            "init": opts.init, "data": opts.data, "self_distill": opts.self_distill, "seed": opts.seed,
            "draft_steps": opts.draft_steps, "eval_rows": opts.eval_rows, "eval_prompt_len": opts.eval_prompt_len}


def adopt_target_io(fmt: str, model: torch.nn.Module, teacher: Teacher) -> dict:
    """An EAGLE drafter's frozen embedding and LM head(s) become the target's own.

    They are copies of the source checkpoint's; when the target has moved since (post-training, a
    fine-tune), drafting against it with the old ones both feeds the module stale token vectors and
    scores its output with a head the target no longer has. Returns, per role, the relative
    Frobenius distance of the drafter's copy from the target's and whether it was replaced.
    """
    if fmt != "eagle":
        return {}
    pairs = {"embed": [model.embed] + [lyr.embed for lyr in model.layers if lyr.embed is not None],
             "head": [model.head] + [lyr.head for lyr in model.layers if lyr.head is not None]}
    theirs = {"embed": teacher.embed.weight, "head": teacher.head.weight}
    out = {}
    with torch.no_grad():
        for role, modules in pairs.items():
            ref = theirs[role].detach().float().cpu()
            dist = max(float((m.weight.detach().float().cpu() - ref).norm() / ref.norm().clamp_min(1e-12))
                       for m in modules)
            if dist > 0:
                for m in modules:
                    m.weight.copy_(ref.to(m.weight.dtype))
            out[role] = {"relative_difference": round(dist, 6), "replaced_by_target": dist > 0}
    return out


class Distiller:
    """One distillation run (build → train → write); `run()` returns the summary/record dict."""

    def __init__(self, opts: DistillOptions, log: Callable[[str], None] | None = None) -> None:
        self.opts, self.log = opts, log
        self.rank, self.world = _dist()
        self.is_main = self.rank == 0
        self._validate()

    # -- setup ------------------------------------------------------------------------------------

    def _validate(self) -> None:
        from recycle.converters.writer import OutputDir

        o = self.opts
        src, tgt = Path(o.drafter).expanduser(), Path(o.target).expanduser()
        if not src.is_dir():
            raise RecycleError(f"{src}: no such drafter directory")
        if not (tgt / "config.json").is_file():
            raise RecycleError(f"--target {tgt}: not a model directory (no config.json)")
        if o.init not in ("recycled", "scratch"):
            raise RecycleError(f"--init {o.init!r}: choose recycled or scratch")
        if o.precision not in (None, "bf16", "fp32"):
            raise RecycleError(f"--precision {o.precision!r}: choose bf16 or fp32")
        for name, v in (("--batch", o.batch), ("--checkpoint-every", o.checkpoint_every),
                        ("--eval-every", o.eval_every)):
            if v < 1:
                raise RecycleError(f"{name} must be at least 1")
        if not (o.lr > 0 and math.isfinite(o.lr)):
            raise RecycleError("--lr must be a positive number")
        if o.online is not None:
            if o.online < 1:
                raise RecycleError("--online must be at least 1 (steps' windows kept ahead)")
            if not o.cache_hidden:
                raise RecycleError("--online needs --cache-hidden DIR (where the windows pass through)")
            if o.self_distill or self.world > 1:
                raise RecycleError("--online trains one process on the data's own text: not with --self-distill "
                                   "or torchrun")
        self.source = data_source(o.data)
        if not (src / "config.json").is_file():
            raise RecycleError(f"{src}: not a drafter directory (no config.json)")
        from recycle.fit import check_fit

        check_fit(load_json(src / "config.json", "drafter config.json"), load_json(tgt / "config.json", "target config.json"),
                  src, tgt, str(src))
        out = Path(o.out).expanduser() if o.out else src.resolve().parent / f"{src.resolve().name}-distilled"
        self.out = out.resolve()
        self.writer = OutputDir(self.out, overwrite=o.overwrite or o.resume, protect=(src, tgt))
        self.state_dir = Path(o.state_dir).expanduser().resolve() if o.state_dir else \
            self.out.parent / f"{self.out.name}.distill"
        if self.is_main:
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                probe = self.state_dir / f".probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                raise RecycleError(f"{self.state_dir}: cannot write the run's state here ({e.strerror or e})") from None
            if (self.state_dir / CHECKPOINT).is_file() and not o.resume:
                if not o.overwrite:
                    raise RecycleError(f"{self.state_dir / CHECKPOINT}: an earlier run's checkpoint exists; "
                                       "pass --resume to continue it or --overwrite to start over")
                (self.state_dir / CHECKPOINT).unlink()
                (self.state_dir / METRICS).unlink(missing_ok=True)

    def _build(self) -> None:
        from transformers import AutoTokenizer

        from recycle.decoding.target import quiet_transformers
        from recycle.drafters import drafter_format, load_drafter

        o = self.opts
        if o.threads:
            torch.set_num_threads(o.threads)
        self.device = _device(o.device, self.rank)
        self.precision = o.precision or default_precision(self.device)
        self.fmt = drafter_format(o.drafter)
        with quiet_transformers():
            model = load_drafter(o.drafter, dtype=torch.float32)
        cfg = load_json(Path(o.drafter) / "config.json", "drafter config.json")
        aux = None
        if self.fmt == "eagle3":
            tcfg = load_json(Path(o.target) / "config.json", "target config.json")
            n = int(tcfg.get("num_hidden_layers", 0))
            aux = cfg.get("eagle_aux_hidden_state_layer_ids") or [min(2, n), n // 2, max(n - 3, 0)]
        harvested = None
        self.harvested = False
        self.producer = None
        if o.online:  # vLLM computes each step's features while this process trains, `online` keys ahead
            from recycle.distill.harvest import HarvestOptions, OnlineHarvest

            self.producer = OnlineHarvest(HarvestOptions(
                target=o.target, out=o.cache_hidden, tokens=o.tokens, data=o.data, seq_len=o.seq_len, batch=o.batch,
                seed=o.seed, aux_layers=tuple(aux or ()), eval_rows=o.eval_rows, eval_prompt_len=o.eval_prompt_len,
                parallel=o.vllm_parallel), o.online)
            self.producer.wait(EVAL_KEY)  # vLLM's engine start and the held-out rows come first
        if o.cache_hidden and (Path(o.cache_hidden) / "manifest.json").is_file():  # made by `recycle harvest`
            from recycle.distill.harvest import check_manifest

            harvested = check_manifest(Path(o.cache_hidden), target=o.target, aux_layers=aux or [], data=o.data,
                                       seq_len=o.seq_len, batch=o.batch, seed=o.seed, tokens=o.tokens,
                                       world=self.world, self_distill=o.self_distill, eval_rows=o.eval_rows,
                                       eval_prompt_len=o.eval_prompt_len, prompt_len=o.prompt_len,
                                       sd_temperature=o.sd_temperature)
        self.harvested = harvested is not None
        # A harvested cache holds every window and the evaluation rows: the trunk is never loaded.
        self.teacher = Teacher(o.target, self.device, aux, self.precision, o.cache_hidden, trunk=harvested is None,
                               producer=self.producer, kv=self.fmt == ASSISTANT_FORMAT)
        self._check_fit(model)
        self.target_io = adopt_target_io(self.fmt, model, self.teacher)
        model.to(self.device).train()
        self.unroller: Unroller = make_unroller(self.fmt, model, o.draft_steps, self.teacher.embed, aux)
        if o.init == "scratch":
            self.unroller.reinit(o.seed)
        self.model = model
        if self.unroller.positions(o.seq_len) < 1:
            raise RecycleError(f"--seq-len {o.seq_len} is too short for {self.unroller.steps} draft steps")
        tok_dir = o.target if (Path(o.target) / "tokenizer.json").is_file() or \
            (Path(o.target) / "tokenizer_config.json").is_file() else o.drafter
        try:
            with quiet_transformers():
                self.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        except Exception as e:  # noqa: BLE001 - a corrupt tokenizer file is bad input
            raise RecycleError(f"{tok_dir}: no usable tokenizer ({' '.join(str(e).split())[:160]})") from None
        self.stream = PackedStream(self.source.train, self.tokenizer, o.seq_len, o.seed)
        self.stream.texts()  # read the corpus now: a one-time cost, not a step's
        params = self.unroller.trainable()
        self.opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay,
                                     foreach=True)
        global_tokens = o.batch * self.world * o.seq_len
        self.total_steps = max(1, math.ceil(o.tokens / global_tokens))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.total_steps, o.warmup, o.min_lr))
        if harvested is not None:  # vLLM wrote the held-out continuations and their features
            self.eval_prompt = int(harvested["eval"]["prompt_len"])
            self.eval_ids = self.teacher.cached_ids(EVAL_KEY).to(self.device)
            self.eval_teacher = self.teacher(self.eval_ids, EVAL_KEY)
            return
        ev = heldout_batch(self.tokenizer, o.seq_len, o.eval_rows, o.data)
        self.eval_prompt = eval_prompt_len(ev.shape[1], o.eval_prompt_len, self.unroller.steps)
        if self.eval_prompt:
            ev = regenerate(self.teacher.model, ev, self.eval_prompt, 0.0, o.seed)  # the text greedy decoding verifies
        self.eval_ids = ev.to(self.device)
        self.eval_teacher = self.teacher(self.eval_ids)

    def _check_fit(self, model) -> None:
        tcfg = self.teacher.config
        if self.fmt == ASSISTANT_FORMAT:
            from recycle.drafters.gemma4 import check_fits

            check_fits(model, tcfg, where=str(self.opts.drafter))
            return
        h, v = int(tcfg.hidden_size), int(tcfg.vocab_size)
        if self.fmt == "eagle" and (model.config.hidden_size != h or model.config.vocab_size != v):
            raise RecycleError(f"{self.opts.drafter}: drafter (hidden {model.config.hidden_size}, vocab "
                               f"{model.config.vocab_size}) does not fit the target (hidden {h}, vocab {v})")
        if self.fmt == "eagle3" and (model.fc.in_features != len(self.teacher.aux_layers) * h
                                     or model.config.vocab_size != v):
            raise RecycleError(f"{self.opts.drafter}: EAGLE-3 drafter does not fit the target (fc width or vocab)")
        if self.fmt == "medusa" and (model.lm_heads[0].in_features != h or model.lm_heads[0].out_features != v):
            raise RecycleError(f"{self.opts.drafter}: Medusa heads do not fit the target (hidden {h}, vocab {v})")

    # -- state ------------------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        state = {
            "version": 1, "fingerprint": _fingerprint(self.opts, self.world), "step": self.step,
            "tokens": self.tokens, "data": asdict(self.stream.pos), "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "rng": _rng_state(),
            "timing": dict(self.timing), "wall_s": self.wall_before + time.perf_counter() - self.t_start,
            "before": self.before, "history": self.history[-1] if self.history else None, "best": self.best,
        }
        atomic_save(state, self.state_dir / CHECKPOINT)

    def _restore(self) -> bool:
        path = self.state_dir / CHECKPOINT
        if not path.is_file():
            return False
        try:
            # weights_only: tensors and plain containers only; a planted pickle cannot run code here
            state = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as e:
            raise RecycleError(f"{path}: unreadable or unsafe checkpoint ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:120]}); remove it to start over") from None
        if not isinstance(state, dict) or not isinstance(state.get("fingerprint"), dict):
            raise RecycleError(f"{path}: not a recycle distill checkpoint; remove it to start over")
        want = _fingerprint(self.opts, self.world)
        diff = sorted(k for k in want if state["fingerprint"].get(k) != want[k])
        if diff:
            raise RecycleError(f"{path}: the checkpoint is from a run with other options ({', '.join(diff)}); "
                               "use the same options or --overwrite to start over")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.stream.seek(Position(**state["data"]))
        _set_rng(state["rng"])
        self.timing.update(state["timing"])
        self.wall_before = float(state["wall_s"])
        self.before = state["before"]
        self.best = state["best"]
        self._truncate_metrics()
        if self.log:
            self.log(f"resuming from step {self.step} (tokens {self.tokens:,})")
        return True

    def _truncate_metrics(self) -> None:
        """Drop metrics rows written after the checkpoint: the resumed run writes those steps again."""
        path = self.state_dir / METRICS
        if not (self.is_main and path.is_file()):
            return
        keep = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= self.step:
                    keep.append(line)
            except (ValueError, AttributeError):
                continue  # a torn last line from the kill
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in keep), encoding="utf-8")
        os.replace(tmp, path)

    def _consider(self, agree: list[float]) -> None:
        """Keep the current weights if their held-out estimate beats the best so far (the input counts)."""
        score = expected_length(agree)
        if self.best is None or score > self.best["estimate"]:
            self.best = {"estimate": score, "agree": list(agree), "step": self.step, "tokens": self.tokens,
                         "state": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}}

    # -- steps ------------------------------------------------------------------------------------

    @torch.no_grad()
    def agreement(self) -> list[float]:
        """Held-out top-1 agreement of each draft step with the target's greedy token."""
        self.model.eval()
        with autocast(self.device, self.precision):
            te = self.eval_teacher
            steps = self.unroller.unroll(self.eval_ids, te.last, te.aux, te.logits, kv=te.kv)
            agree = [float((s.logits.argmax(-1) == s.target_logits.argmax(-1)).float().mean()) for s in steps]
        self.model.train()
        return agree

    def _micro(self, ids: torch.Tensor, key: str, weight: float) -> tuple[float, dict | None]:
        t0 = time.perf_counter()
        te = self.teacher(ids, key)
        self._sync()
        t1 = time.perf_counter()
        self.timing["teacher_s"] += t1 - t0
        if self.unroller.positions(ids.shape[1]) < 1:
            return 0.0, None
        with autocast(self.device, self.precision):
            steps = self.unroller.unroll(ids, te.last, te.aux, te.logits,
                                         with_features=bool(self.opts.loss.feature_weight), kv=te.kv)
            loss, info = distill_loss(steps, self.opts.loss)
        (loss * weight).backward()
        self._sync()
        self.timing["drafter_s"] += time.perf_counter() - t1
        return float(loss.detach()) * weight, info

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

    def train_step(self) -> dict:
        o = self.opts
        t0 = time.perf_counter()
        lengths = plan_batch(o.tokens - self.tokens, o.batch * self.world, o.seq_len)
        rows = self.stream.take(len(lengths))
        keys = micro_batches(self.step, lengths, self.rank, self.world, o.seq_len)
        written = {}
        if o.self_distill and self.harvested:  # vLLM wrote the continuations: the cache holds each key's rows
            written = {key: self.teacher.cached_ids(key) for _, _, key in keys}
        elif o.self_distill:  # the target's generation is teacher compute, timed on its own
            tg = time.perf_counter()
            rows = regenerate(self.teacher.model, rows, o.prompt_len, o.sd_temperature, o.seed * 1_000_003 + self.step)
            self.timing["generate_s"] += time.perf_counter() - tg
            t0 += time.perf_counter() - tg
        anchors = [max(0, self.unroller.positions(n)) for n in lengths]
        total_anchor = max(1, sum(anchors))
        micro = [(written.get(key, rows[idx, :n]).to(self.device), key, sum(anchors[i] for i in idx))
                 for idx, n, key in keys]
        self.timing["data_s"] += time.perf_counter() - t0
        self.opt.zero_grad(set_to_none=True)
        loss, infos = 0.0, []
        for ids, key, n in micro:
            part, info = self._micro(ids, key, n / total_anchor)
            loss += part
            if info is not None:
                infos.append(info)
        t1 = time.perf_counter()
        if self.world > 1:
            self._allreduce()
            lt = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(lt)
            loss = float(lt)
        params = self.unroller.trainable()
        if any(p.grad is not None for p in params):
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, o.clip))
            self.opt.step()
        else:
            gnorm = 0.0
        self.sched.step()
        self.step += 1
        self.tokens += sum(lengths)
        self.timing["optimizer_s"] += time.perf_counter() - t1
        info = infos[0] if infos else {"ce": [], "kl": [], "agree": []}
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
        self.t_start = time.perf_counter()
        resumed = o.resume and self._restore()
        if self.producer is not None:
            self.producer.begin(self.step)
        if not resumed:
            torch.manual_seed(o.seed)
            self.before = self.agreement()
            self._consider(self.before)
        start_tokens = self.tokens
        metrics = self.state_dir / METRICS
        snaps = sorted(n for n in o.snapshots if n > self.tokens)
        if self.is_main and 0 in o.snapshots and not resumed:
            self._snapshot(0)
        t_run = time.perf_counter()
        last: dict = {}
        while self.tokens < o.tokens:
            row = self.train_step()
            t0 = time.perf_counter()
            if self.is_main:
                if self.step % o.eval_every == 0 or self.tokens >= o.tokens:
                    row["heldout_agree"] = self.agreement()
                    row["heldout_estimate"] = expected_length(row["heldout_agree"])
                    self._consider(row["heldout_agree"])
                elapsed = self.wall_before + time.perf_counter() - self.t_start
                row["wall_s"] = round(elapsed, 3)
                row["tokens_per_s"] = (self.tokens - start_tokens) / max(1e-9, time.perf_counter() - t_run)
                with metrics.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                while snaps and self.tokens >= snaps[0]:
                    self._snapshot(snaps.pop(0))
                if self.step % o.checkpoint_every == 0 and self.tokens < o.tokens:
                    self._checkpoint()
                if progress:
                    progress(row)
            if self.world > 1:
                dist.barrier()
            self.timing["log_s"] += time.perf_counter() - t0
            self.history.append(row)
            last = row
        wall = self.wall_before + time.perf_counter() - self.t_start
        final = self.agreement()
        self._consider(final)
        if self.is_main and self.best["step"] != self.step:  # rank 0 evaluates, chooses and writes
            self.model.load_state_dict(self.best["state"])
        record = self._record(last, final, wall, resumed)
        if self.is_main:
            self._write(record)
            (self.state_dir / CHECKPOINT).unlink(missing_ok=True)
        if self.world > 1:
            dist.barrier()
        return record

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
            "data": {"source": o.data or "stdlib", "self_distill": o.self_distill,
                     "prompt_len": o.prompt_len if o.self_distill else None,
                     "temperature": o.sd_temperature if o.self_distill else None,
                     "seq_len": o.seq_len, "batch_per_rank": o.batch, "world_size": self.world, "seed": o.seed},
            "losses": {**asdict(o.loss), "draft_steps": self.unroller.steps, "objective":
                       "Σ_k decay^k/Z · (ce_weight·CE + kl_weight·KL(P_target ‖ P_draft) + feature_weight·SmoothL1)"},
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
                        else "none (the held-out text itself)"},
            "target_io": self.target_io,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(trained / wall, 1) if wall else None,
            "timing": {k: round(v, 3) for k, v in t.items()},
            "target_forward_share": round(t["teacher_s"] / step_s, 4) if step_s else None,
            "overhead_share": round((t["data_s"] + t["optimizer_s"] + t["log_s"]) / step_s, 4) if step_s else None,
            "device": str(self.device),
            "precision": self.precision,
            "resumed": resumed,
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

        write_drafter(self.opts.drafter, OutputDir(root / f"tokens_{tokens}", overwrite=True), self.unroller, record)

    def _write(self, record: dict) -> None:
        write_drafter(self.opts.drafter, self.writer, self.unroller, record)


# -- writing a drafter directory in its input's format --------------------------------------------

def _header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = (tuple(sl.get_shape()), _ST[sl.get_dtype()])
    return out


_ST = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
       "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F64": torch.float64,
       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _derived_files(src: Path, unroller: Unroller, main: dict[str, torch.Tensor]) -> tuple[dict, list[str], list[str]]:
    """Trained values for every other safetensors layout the converter wrote beside model.safetensors.

    Returns ({rel file: {name: tensor}}, dropped directories, notes). A layout whose key set cannot be
    rebuilt exactly from the trained weights (e.g. FP8 overlay tensors, non-canonical norm styles) is
    dropped with a note rather than shipped stale.
    """
    files: dict[str, dict[str, torch.Tensor]] = {}
    dropped, notes = [], []
    fmt = unroller.fmt
    if fmt == "medusa" and (src / "medusa_lm_head.safetensors").is_file():
        m = unroller.model
        fd = {}
        for i in range(m.num_heads):
            layers = len(m.blocks[i].layers)
            for j in range(layers):
                fd[f"{i}.{j}.linear.weight"] = main[f"blocks.{i}.layers.{j}.weight"]
                fd[f"{i}.{j}.linear.bias"] = main[f"blocks.{i}.layers.{j}.bias"]
            fd[f"{i}.{layers}.weight"] = main[f"lm_heads.{i}.weight"]
        files["medusa_lm_head.safetensors"] = fd
    if fmt == "eagle":
        from recycle.families import BY_NAME

        m = unroller.model
        rc = load_json(src / "config.json", "drafter config.json").get("recycle", {})
        fam = BY_NAME.get(rc.get("family", ""))
        canonical = fam is not None and fam.norm == "w" and fam.concat_order == "eh"
        for sub, base in (("nextn", 0), ("mtp_overlay", int(rc.get("source_num_hidden_layers", 0)))):
            for p in sorted((src / sub).glob("*.safetensors")) if (src / sub).is_dir() else []:
                head = _header(p)
                named = m.checkpoint_tensors(num_hidden_layers=base) if canonical else {}
                ok = canonical and all(k in named and tuple(named[k].shape) == shp and dt.is_floating_point
                                       and dt.itemsize >= 2 for k, (shp, dt) in head.items())
                if ok:
                    files[f"{sub}/{p.name}"] = {k: named[k] for k in head}
                else:
                    dropped.append(sub)
                    notes.append(f"{sub}/ dropped: its tensors cannot be rebuilt exactly from the trained weights "
                                 "(FP8 or non-canonical norms/concat); re-export it from the distilled drafter")
    return files, dropped, notes


def write_drafter(src_dir: str | os.PathLike, writer, unroller: Unroller, record: dict) -> dict[str, int]:
    """The trained drafter in exactly its input's layout (same files, same key sets and dtypes),
    through the one atomic writer, with `record` appended to recycle.json's `distillation` list."""
    from recycle.converters.roles import Lazy

    src = Path(src_dir)
    main = unroller.file_state()
    planned = {"model.safetensors": main}
    extra, dropped, notes = _derived_files(src, unroller, main)
    planned.update(extra)
    tensors: dict[str, dict[str, Lazy]] = {}
    for rel, state in planned.items():
        head = _header(src / rel)
        if set(head) != set(state):
            missing, unknown = sorted(set(head) - set(state)), sorted(set(state) - set(head))
            raise RecycleError(f"{src / rel}: trained weights do not match the stored key set "
                               f"(missing {missing[:3]}, unexpected {unknown[:3]})")
        tensors[rel] = {k: Lazy(shp, (lambda t=state[k], d=dt: t.detach().to("cpu", d).contiguous()), (k,),
                                "exact", dtype=dt) for k, (shp, dt) in head.items()}
    prov_path = src / "recycle.json"
    prov = load_json(prov_path, "recycle.json") if prov_path.is_file() else {}
    rec = dict(record)
    if notes:
        rec["notes"] = notes
    prov.setdefault("distillation", []).append(rec)
    with writer as d:
        d.write_safetensors(tensors, torch.float32, metadata={"recycle_format": unroller.fmt, "recycle_distilled": "1"})
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src).as_posix()
            if not p.is_file() or rel in tensors or rel == "recycle.json" or rel.split("/")[0] in dropped:
                continue
            d.copy_file(p, rel)
        d.write_json("recycle.json", prov)
        return dict(d.files)


def distill(opts: DistillOptions, progress: Callable[[dict], None] | None = None,
            log: Callable[[str], None] | None = None) -> dict:
    """Library entry point (the CLI and the experiment call this); `log` gets one-line notices."""
    threads = torch.get_num_threads()
    d = Distiller(opts, log)
    try:
        record = d.run(progress)
    finally:
        torch.set_num_threads(threads)  # --threads is this run's, not the caller's process-wide setting
        if getattr(d, "producer", None) is not None:
            d.producer.close()  # the online vLLM job ends with the run, whatever ended it
    record["out"] = str(d.out)
    record["state_dir"] = str(d.state_dir)
    return record


def remove_state(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)
