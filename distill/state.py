"""A distillation's resumable state: what a checkpoint holds, how it is written and read back, and the metrics log.

A checkpoint holds everything a bit-exact continuation needs (drafter, optimizer, scheduler, step, tokens,
data position, RNG states, which snapshot is the best so far) as tensors and plain containers only, so it loads with
`torch.load(weights_only=True)`: a planted pickle cannot run code. It is written to a temp file, fsynced and
renamed, so a kill mid-write leaves the previous one.

A sharded run (FSDP2 under torchrun) checkpoints per rank instead (`checkpoint/`): each rank writes its own shards
of the drafter and of AdamW's moments through `torch.distributed.checkpoint` into safetensors files
(`HuggingFaceStorageWriter`: no pickle anywhere, the layout read back from the files' headers), and rank 0 writes
the rest (step, data position, RNG, scheduler, optimizer hyper-parameters) as `state.json`; nothing is gathered
(at DeepSeek-V3 scale the whole state is about 200 GB). The directory is written beside the last one and renamed
into place when every rank is done. The run's state directory (`OUT.distill/`) holds it and
`metrics.jsonl`, one row per step, and the best snapshot's trained weights (`best-STEP.safetensors`); a resumed
run cuts the log back to the checkpoint's step.

The loop's side of it: `Counters` (step, tokens, timers, the best estimate so far), `save` and `restore` (the
checkpoint of a run, sharded or not), `consider` (never worse: the weights of the best held-out estimate kept on disk)
and `claim` (the state directory probed before any model loads, an earlier run's checkpoint refused or cleared).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from recycle.distill.data import Position
from recycle.errors import RecycleError
from recycle.preflight import sweep_dead_writes

CHECKPOINT = "checkpoint.pt"
SHARDED = "checkpoint"  # a sharded run's: every rank's safetensors shards and state.json
SHARDED_STATE = "state.json"
METRICS = "metrics.jsonl"
VERSION = 1


# Every option that changes what a run computes, with the name the refusal gives it (a flag where the CLI has one).
# A resumed run must share each with the checkpoint: the schedule, optimizer and data position it restores were made
# under them (a new --lr would train on the old schedule while the record claimed the new one).
RUN_OPTIONS = {
    "drafter": "DRAFTER", "target": "--target", "format": "the drafter's format", "data": "--data",
    "chat_template": "--chat-template", "tokens": "--tokens", "seq_len": "--seq-len", "packing": "--packing",
    "curriculum": "--curriculum", "batch": "--batch",
    "world": "the number of ranks", "seed": "--seed", "init": "--init", "self_distill": "--self-distill",
    "prompt_len": "--prompt-len", "sd_temperature": "--sd-temperature", "draft_steps": "--draft-steps",
    "lr": "--lr", "warmup": "warmup", "min_lr": "min_lr", "weight_decay": "weight_decay", "clip": "clip",
    "ce_weight": "--ce-weight", "kl_weight": "--kl-weight", "feature_weight": "--feature-weight",
    "step_decay": "--step-decay", "loss": "--loss", "freeze": "--freeze", "precision": "--precision", "eval_every": "--eval-every",
    "eval_rows": "eval_rows", "eval_prompt_len": "eval_prompt_len",
}


def fingerprint(opts, world: int, precision: str | None = None, fmt: str | None = None) -> dict:
    """Options a resumed run must share with the one it continues (RUN_OPTIONS), as JSON values (a sharded
    checkpoint keeps them in state.json). `precision`: the compute dtype the run resolved (--precision or the
    device's default); `fmt`: the drafter directory's format."""
    loss = opts.loss
    data = opts.data
    if data is not None and Path(data).expanduser().exists():  # a file or directory: the same one from any cwd
        data = str(Path(data).expanduser().resolve())
    fp = {"drafter": str(Path(opts.drafter).resolve()), "target": str(Path(opts.target).resolve()), "format": fmt,
          "data": data, "chat_template": str(Path(opts.chat_template).expanduser().resolve())
          if opts.chat_template else None, "tokens": opts.tokens, "seq_len": opts.seq_len,
          # None: stream packing and no curriculum, as checkpoints before --packing and --curriculum
          "packing": None if opts.packing == "stream" else opts.packing,
          "curriculum": [list(s) for s in opts.stages()] or None, "batch": opts.batch,
          "world": world, "seed": opts.seed, "init": opts.init, "self_distill": opts.self_distill,
          "prompt_len": opts.prompt_len if opts.self_distill else None,
          "sd_temperature": opts.sd_temperature if opts.self_distill else None, "draft_steps": opts.draft_steps,
          "lr": opts.lr, "warmup": opts.warmup, "min_lr": opts.min_lr, "weight_decay": opts.weight_decay,
          "clip": opts.clip, "ce_weight": loss.ce_weight if loss else None,
          "kl_weight": loss.kl_weight if loss else None, "feature_weight": loss.feature_weight if loss else None,
          "step_decay": loss.decay if loss else None,
          # --loss or --temperature's terms (None: --kl-weight and --ce-weight, as checkpoints before --loss)
          "loss": loss.described() if loss and (loss.loss is not None or loss.temperature) else None,
          "freeze": sorted(opts.freeze or ()),
          "precision": precision or opts.precision, "eval_every": opts.eval_every, "eval_rows": opts.eval_rows,
          "eval_prompt_len": opts.eval_prompt_len}
    return fp


def _shown(value) -> str:
    """An option's value as the refusal shows it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def rng_state() -> dict:
    """RNG states as tensors and plain containers, so the checkpoint loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng(state: dict) -> None:
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


def best_path(state_dir: Path, step: int) -> Path:
    return state_dir / f"best-{step:08d}.safetensors"


def save_best(state_dir: Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    """The best snapshot's trained weights on disk (not in RAM: at DeepSeek-V3 scale a host copy is 46 GB), written
    atomically; frozen weights are never saved, they are still the model's."""
    path = best_path(state_dir, step)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def load_best(state_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = best_path(state_dir, step)
    if not path.is_file():
        raise RecycleError(f"{path}: the best snapshot is missing from the state directory (resume with --overwrite)")
    return load_file(str(path))


def prune_best(state_dir: Path, keep: set[int]) -> None:
    """Remove best snapshots other than `keep` (the current best, and the one the last checkpoint names): a file, or
    a sharded run's folder of every rank's shards."""
    for p in state_dir.glob("best-*"):
        step = p.name.removesuffix(".safetensors").split("-")[1]
        if not step.isdigit() or int(step) in keep:
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def best_dir(state_dir: Path, step: int) -> Path:
    """A sharded run's best snapshot: every rank's shards of the trained weights (DCP, safetensors files)."""
    return state_dir / f"best-{step:08d}"


def _trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights as they are held (DTensors on a sharded run: each rank's own shards), by name. FSDP2
    keeps the root unit's weights gathered after a forward (the held-out estimate's): resharded first, so the
    names give the shards, which are what the optimizer updates."""
    if callable(getattr(model, "reshard", None)):
        model.reshard()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def save_best_sharded(state_dir: Path, step: int, model: torch.nn.Module) -> None:
    """Every rank: its shards of the trained weights into `best-STEP/` (written beside, renamed by rank 0 once every
    rank's files are whole); nothing gathered, as the checkpoints (`save_sharded`)."""
    rank = dist.get_rank()
    final = best_dir(state_dir, step)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}") if rank == 0 else None
    box = [str(tmp) if tmp else None]
    dist.broadcast_object_list(box, src=0)  # rank 0's pid names the folder: a stopped run's is swept
    tmp = Path(box[0])
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save(_trained(model), storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    dist.barrier()


def load_best_sharded(state_dir: Path, step: int, model: torch.nn.Module) -> None:
    """Every rank: its shards of the best snapshot read back into the model's trained weights, in place."""
    path = best_dir(state_dir, step)
    if not path.is_dir():
        raise RecycleError(f"{path}: the best snapshot is missing from the state directory (resume with --overwrite)")
    try:
        dcp.load(_trained(model), storage_reader=HuggingFaceStorageReader(str(path)))
    except Exception as e:  # a torn or foreign shard
        raise RecycleError(f"{path}: unreadable best snapshot ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]}); resume with --overwrite") from None


def save_checkpoint(state_dir: Path, state: dict, fp: dict) -> None:
    atomic_save({"version": VERSION, "fingerprint": fp, **state}, state_dir / CHECKPOINT)


def load_checkpoint(state_dir: Path, device: torch.device, fp: dict, mmap: bool = False) -> dict | None:
    """The checkpoint a run with fingerprint `fp` may continue, or None when there is none; RecycleError for
    an unreadable or unsafe file, or one from a run with other options. `mmap`: map the tensors instead of
    reading them (a check before anything is built costs a header read, not the checkpoint's size)."""
    path = state_dir / CHECKPOINT
    if not path.is_file():
        return None
    try:
        # weights_only: tensors and plain containers only; a planted pickle cannot run code here
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except Exception as e:
        raise RecycleError(f"{path}: unreadable or unsafe checkpoint ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]}); remove it to start over") from None
    return _same_run(state, fp, path, "it")


def _same_run(state, fp: dict, path: Path, what: str):
    """`state` if it is a recycle checkpoint of a run with fingerprint `fp`; else one line saying why."""
    if not isinstance(state, dict) or not isinstance(state.get("fingerprint"), dict):
        raise RecycleError(f"{path}: not a recycle distill checkpoint; remove {what} to start over")
    saved = state["fingerprint"]
    diff = [k for k in fp if saved.get(k) != fp[k]]  # RUN_OPTIONS' order: the refusal names the first
    if diff:
        first = diff[0]
        name = RUN_OPTIONS.get(first, first)
        was = f"{_shown(saved[first])} in the checkpoint" if first in saved else "not recorded in the checkpoint"
        more = f" (also differ: {', '.join(RUN_OPTIONS.get(k, k) for k in diff[1:])})" if diff[1:] else ""
        raise RecycleError(f"{path}: the checkpoint is from a run with other options: {name} is {_shown(fp[first])} "
                           f"here, {was}{more}; use the same options or --overwrite to start over")
    return state


def has_checkpoint(state_dir: Path) -> bool:
    return (state_dir / CHECKPOINT).is_file() or (state_dir / SHARDED / SHARDED_STATE).is_file()


def remove_checkpoint(state_dir: Path) -> None:
    (state_dir / CHECKPOINT).unlink(missing_ok=True)
    shutil.rmtree(state_dir / SHARDED, ignore_errors=True)


def _to_json(obj):
    """Tensors (RNG states) as tagged lists, so state.json round-trips them exactly."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": str(obj.dtype).removeprefix("torch."), "data": obj.tolist()}
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    return obj


def _from_json(obj):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["data"], dtype=getattr(torch, obj["__tensor__"]))
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


def save_sharded(state_dir: Path, tensors: dict, meta: dict, fp: dict) -> None:
    """Every rank: its shards of `tensors` (nested dicts of DTensors and tensors) into `checkpoint/`; rank 0 also
    `meta` (plain values and RNG tensors) as state.json. Written beside the previous checkpoint, renamed when whole."""
    rank = dist.get_rank()
    tmp, final = state_dir / f".{SHARDED}.tmp", state_dir / SHARDED
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    dist.barrier()  # every rank's files are complete
    if rank == 0:
        data = json.dumps(_to_json({"version": VERSION, "fingerprint": fp, **meta})).encode()
        with open(tmp / SHARDED_STATE, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        old = state_dir / f".{SHARDED}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_sharded_meta(state_dir: Path, fp: dict) -> dict | None:
    """state.json of a sharded checkpoint a run with fingerprint `fp` may continue (None when there is none);
    RecycleError for an unreadable one or one from a run with other options."""
    path = state_dir / SHARDED / SHARDED_STATE
    if not path.is_file():
        return None
    try:
        meta = _from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise RecycleError(f"{path}: unreadable checkpoint state ({type(e).__name__}); remove "
                           f"{state_dir / SHARDED} to start over") from None
    return _same_run(meta, fp, path, str(state_dir / SHARDED))


def load_sharded(state_dir: Path, tensors: dict) -> None:
    """Fill `tensors` (this rank's sharded state dicts, as templates) from `checkpoint/`: each rank reads its own
    pieces from the safetensors files."""
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(state_dir / SHARDED)))
    except Exception as e:  # a torn or foreign shard
        raise RecycleError(f"{state_dir / SHARDED}: unreadable checkpoint shards ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]}); remove it to start over") from None


def append_metrics(state_dir: Path, row: dict) -> None:
    with (state_dir / METRICS).open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def truncate_metrics(state_dir: Path, step: int) -> None:
    """Drop metrics rows written after the checkpoint: the resumed run writes those steps again."""
    path = state_dir / METRICS
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                keep.append(line)
        except (ValueError, AttributeError):
            continue  # a torn last line from the kill
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


# -- the loop's state: counters, the state directory, checkpoints, the best weights ------------------------------

TIMERS = ("data_s", "generate_s", "teacher_s", "drafter_s", "optimizer_s", "log_s")  # the record's `timing`


@dataclass
class Counters:
    """The loop's position and counters: what a checkpoint holds besides the tensors, and a resumed run restores."""

    step: int = 0
    tokens: int = 0
    timing: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMERS, 0.0))
    wall_before: float = 0.0  # the train time of the runs this one continues
    before: list[float] | None = None  # the input's held-out agreement
    best: dict | None = None  # the best held-out estimate so far: estimate, agree, step, tokens
    last_row: dict | None = None  # the last step's metrics row
    checkpointed_best: int = -1  # the step of the best snapshot the last checkpoint names (kept on disk)
    last_checkpoint: int | None = None  # the step the checkpoint on disk holds (written or resumed from)
    time_estimate: dict | None = None  # the budget's time at the first steps' rate (the record's)
    stop: str | None = None  # the signal that asked the loop to stop after its step
    t_start: float = field(default_factory=time.perf_counter)  # when this process's training began

    def wall(self) -> float:
        """The run's training time so far, the runs it continues included."""
        return self.wall_before + time.perf_counter() - self.t_start


def claim(state_dir: Path, resume: bool, overwrite: bool, note: Callable[[str], None]) -> None:
    """Rank 0, before any model loads: the state directory made and probed for writing, a killed run's partial
    files swept, and an earlier run's checkpoint refused (neither --resume nor --overwrite) or cleared (--overwrite)."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        probe = state_dir / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RecycleError(f"{state_dir}: cannot write the run's state here ({e.strerror or e})") from None
    for line in sweep_dead_writes(state_dir):  # a killed run's partial checkpoint or best snapshot
        note(f"note: {line}")
    if has_checkpoint(state_dir) and not resume:
        if not overwrite:
            raise RecycleError(f"{state_dir}: an earlier run's checkpoint exists; "
                               "pass --resume to continue it or --overwrite to start over")
        remove_checkpoint(state_dir)
        (state_dir / METRICS).unlink(missing_ok=True)
        prune_best(state_dir, set())


def save(state_dir: Path, fp: dict, c: Counters, model: torch.nn.Module, opt: torch.optim.Optimizer, sched,
         data_pos, wall_s: float, sharded: bool, is_main: bool) -> None:
    """A checkpoint of the run at `c.step` (every rank calls it when sharded: each writes its own shards, nothing
    is gathered; otherwise rank 0 writes one file), then the best snapshots it does not name pruned."""
    run = {"step": c.step, "tokens": c.tokens, "data": asdict(data_pos), "scheduler": sched.state_dict(),
           "rng": rng_state(), "timing": dict(c.timing), "wall_s": wall_s, "before": c.before,
           "history": c.last_row, "best": c.best}
    if sharded:
        model_state, opt_state = get_state_dict(model, opt)
        save_sharded(state_dir, {"model": model_state, "optimizer": opt_state["state"]},
                     {**run, "param_groups": opt_state["param_groups"]}, fp)
    elif is_main:
        save_checkpoint(state_dir, {**run, "model": model.state_dict(), "optimizer": opt.state_dict()}, fp)
    c.last_checkpoint = c.step
    if not is_main:
        return
    c.checkpointed_best = c.best["step"]
    prune_best(state_dir, {c.best["step"]})


def restore(state_dir: Path, fp: dict, c: Counters, model: torch.nn.Module, opt: torch.optim.Optimizer, sched,
            stream, device: torch.device, sharded: bool, is_main: bool) -> bool:
    """The run continued from its checkpoint (False when there is none): weights, AdamW, schedule, counters, the
    data position and the RNG states as they were; the metrics log cut back to the checkpoint's step."""
    if sharded:  # each rank reads its own shards of the drafter and of AdamW's moments
        saved = load_sharded_meta(state_dir, fp)
        if saved is None:
            return False
        model_state, opt_state = get_state_dict(model, opt)
        load_sharded(state_dir, {"model": model_state, "optimizer": opt_state["state"]})
        set_state_dict(model, opt, model_state_dict=model_state,
                       optim_state_dict={"state": opt_state["state"], "param_groups": saved["param_groups"]})
    else:
        saved = load_checkpoint(state_dir, device, fp)
        if saved is None:
            return False
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    c.step, c.tokens = int(saved["step"]), int(saved["tokens"])
    c.last_checkpoint = c.step
    stream.seek(Position(**saved["data"]))
    set_rng(saved["rng"])
    c.timing.update(saved["timing"])
    c.wall_before = float(saved["wall_s"])
    c.before = saved["before"]
    c.best = saved["best"]
    c.checkpointed_best = c.best["step"]
    if is_main:
        truncate_metrics(state_dir, c.step)
    return True


def consider(state_dir: Path, c: Counters, score: float, agree: list[float], model: torch.nn.Module,
             is_main: bool, sharded: bool = False) -> None:
    """Never worse: keep the current weights if their held-out `score` beats the best so far (the input counts). The
    trained weights go to disk, not RAM (sharded: every rank writes its own shards, a collective; nothing gathered)."""
    if not (c.best is None or score > c.best["estimate"]):
        return
    c.best = {"estimate": score, "agree": list(agree), "step": c.step, "tokens": c.tokens}
    if sharded:
        save_best_sharded(state_dir, c.step, model)
        if is_main:
            prune_best(state_dir, {c.step, c.checkpointed_best})
        return
    if is_main:  # only rank 0 writes the output (unsharded ranks each hold the whole drafter)
        save_best(state_dir, c.step, _trained(model))
        prune_best(state_dir, {c.step, c.checkpointed_best})
