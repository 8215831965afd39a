"""`distill --teacher URL`: each step's teacher features from a vLLM server (`recycle teacher serve`), on any devices
or nodes; the trunk is loaded nowhere here (the teacher keeps the target's embedding and head only).

What crosses the network: per row one completion request (the row's token ids, `max_tokens` 1) and its answer, whose
`kv_transfer_params.hidden_states_path` names the file the server's hidden-states connector wrote on the shared
filesystem (vLLM 0.32: `example_hidden_states_connector.py:559` returns the path, `completion/serving.py:639` passes
it on; only the first prompt's, so one request per row, as speculators' `vllm_client.generate_hidden_states` sends).
The features themselves travel through that filesystem, read here once and deleted.

Prefetch: a thread fetches up to `ahead` steps ahead of the step training reads (as speculators' data loader prefetches
`--vllm-endpoint` samples): the shared directory holds at most `ahead` steps of this rank's rows. Each rank fetches its
own rows only: a step's micro-batches as `Step.micro_batches(rank, world, block=batch)` names them (the one-process
keys a harvested cache uses), its rows taken from a copy of the trainer's own data stream at the trainer's position.

Before training starts (`connect`): the server answers `/v1/models`, its served name carries the fingerprint of the
same target (`harvest.fingerprint`: config, tensor names/shapes/dtypes, tokenizer) and the layers distill needs, and its
`max_model_len` holds a window; then (`Remote.probe`, once the embedding and head are here) a fixed probe sequence's
last state, normed here, must give the server's own greedy next token among this head's top 5 and the target's hidden
size: a wrong norm, head, layer order or target fails it. Each refusal is one line (exit 2).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from recycle.checkpoint import Checkpoint
from recycle.distill.harvest import final_norm, fingerprint
from recycle.distill.memory import GIB, MARGIN, for_options
from recycle.distill.schedule import Schedule
from recycle.errors import RecycleError

NAME = "recycle-teacher"  # the served name's prefix: recycle-teacher:WEIGHTS:TOKENIZER:LAYER,LAYER
PROBE = (1, 2, 3, 5, 8, 13, 21, 34)  # the probe's token ids (every vocabulary holds them)
PROBE_TOP = 5  # the server's greedy token must be among this many of the local logits (bf16 servers round)
TIMEOUT_S = 600.0  # one request (a long prefill on a loaded server)
CONNECT_S = 10.0  # the first look at the URL


def served_name(target: str | os.PathLike, layers: list[int]) -> str:
    """The served model name `recycle teacher serve` gives: the target's fingerprint and the captured layers."""
    fp = fingerprint(target)
    return f"{NAME}:{fp['weights_layout']}:{fp['tokenizer'] or '-'}:{','.join(str(i) for i in layers)}"


def parse_name(name: str) -> dict | None:
    """(weights_layout, tokenizer, layers) of a served name, or None for a server recycle did not start."""
    parts = name.split(":")
    if len(parts) != 4 or parts[0] != NAME:
        return None
    try:
        layers = [int(i) for i in parts[3].split(",") if i]
    except ValueError:
        return None
    return {"weights_layout": parts[1], "tokenizer": None if parts[2] == "-" else parts[2], "layers": layers}


def needed_layers(n_layers: int, aux: list[int] | None) -> list[int]:
    """The layers distill reads: the aux layers (EAGLE-3), then the last (vLLM's id L, before the final norm)."""
    aux = list(aux or [])
    return aux if n_layers in aux else [*aux, n_layers]


def _request(url: str, body: dict | None = None, timeout: float = TIMEOUT_S) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class Server:
    """What `/v1/models` says of the server and what recycle reads from its name."""

    url: str
    model: str
    max_model_len: int
    layers: list[int]  # the captured layers, in the files' order


def connect(url: str, target: str, aux: list[int] | None, seq_len: int) -> Server:
    """Check the server before anything loads: it answers, serves this target, captures these layers, holds a window.
    A refusal is one RecycleError line."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    hint = f"start it with `recycle teacher serve {target} --shared-dir DIR`"
    try:
        models = _request(f"{base}/v1/models", timeout=CONNECT_S)
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise RecycleError(f"--teacher {url}: no answer ({why}); {hint}") from None
    data = models.get("data") if isinstance(models, dict) else None
    if not data:
        raise RecycleError(f"--teacher {url}: /v1/models lists no model (not a vLLM server?); {hint}")
    card = data[0]
    name = str(card.get("id", ""))
    got = parse_name(name)
    if got is None:
        raise RecycleError(f"--teacher {url}: serves {name!r}, not a recycle teacher (its name carries the target's "
                           f"fingerprint); {hint}")
    fp = fingerprint(target)
    if (got["weights_layout"], got["tokenizer"]) != (fp["weights_layout"], fp["tokenizer"]):
        raise RecycleError(f"--teacher {url}: serves another target than {target} (fingerprint {got['weights_layout']}"
                           f"/{got['tokenizer']}, the target's {fp['weights_layout']}/{fp['tokenizer']})")
    need = needed_layers(fp["num_hidden_layers"], aux)
    missing = [i for i in need if i not in got["layers"]]
    if missing:
        aux_flag = ",".join(str(i) for i in need if i != fp["num_hidden_layers"])
        raise RecycleError(f"--teacher {url}: captures layers {got['layers']}, distill needs {need}; serve it with "
                           + (f"--aux-layers {aux_flag}" if aux_flag else "no --aux-layers"))
    max_len = int(card.get("max_model_len") or 0)
    if max_len and max_len < seq_len + 1:
        raise RecycleError(f"--teacher {url}: its max_model_len {max_len} is shorter than --seq-len {seq_len} + 1; "
                           f"serve it with --max-model-len {seq_len + 8}")
    return Server(base, name, max_len, got["layers"])


def _read_locked(path: str) -> dict[str, torch.Tensor]:
    """A connector file once its writer is done: a shared flock on its `.lock` waits for the writer's exclusive one
    (vLLM 0.32 `example_hidden_states_connector.py:48-66`, `load_hidden_states`)."""
    lock = path + ".lock"
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
            return load_file(path, device="cpu")
    except FileNotFoundError:  # no lock file: the writer runs without one (use_synchronization_lock False)
        return load_file(path, device="cpu")


def _remove(path: str) -> None:
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


class Remote:
    """The client of one rank: fetches its rows' features `ahead` steps ahead, hands them to `Teacher` by key, deletes
    each file once read. `begin(step, position)` starts the prefetch; `close()` stops it and removes what is left."""

    POLL_S = 0.005

    def __init__(self, server: Server, target: str, aux: list[int] | None, ahead: int, rank: int = 0, world: int = 1,
                 workers: int = 8) -> None:
        if ahead < 1:
            raise RecycleError("--teacher-ahead: keep at least 1 step ahead")
        self.server, self.ahead, self.rank, self.world = server, ahead, rank, world
        fp = fingerprint(target)
        self.n_layers = fp["num_hidden_layers"]
        self.aux = list(aux or [])
        self.norm = final_norm(target)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recycle-teacher-fetch")
        self.ready: dict[str, tuple[torch.Tensor, list[str]]] = {}  # key → (ids, files), fetched, not yet read
        self.pending: dict[int, set[str]] = {}  # step → its keys not yet read
        self.max_present = self.max_bytes = 0  # the most files (and bytes) this rank had on disk at once
        self._lock = threading.Lock()
        self._closed = False
        self._future = None
        self._runner: ThreadPoolExecutor | None = None

    # -- requests ------------------------------------------------------------------------------------------------

    def _complete(self, row: list[int], **extra) -> tuple[dict, str]:
        """One row's greedy completion (max_tokens 1 unless `extra` says): the answer, and the path of the file the
        server's connector wrote for it."""
        res = _request(f"{self.server.url}/v1/completions",
                       {"model": self.server.model, "prompt": row, "max_tokens": 1, "temperature": 0.0, **extra})
        path = (res.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RecycleError(f"--teacher {self.server.url}: its answer names no hidden-states file (no "
                               "extract_hidden_states connector?)")
        return res, path

    def _one(self, row: list[int]) -> str:
        return self._complete(row)[1]

    def request(self, ids: torch.Tensor) -> list[str]:
        """Every row's file, requested at once (the server batches them)."""
        return list(self.pool.map(self._one, [r.tolist() for r in ids]))

    def read(self, ids: torch.Tensor, files: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-normed last state [n, T, H] and the concatenated aux layers [n, T, A·H] of `files` (the
        connector's [T, len(layers), H] each, whose token ids must be `ids`'); the files are deleted."""
        try:
            rows = []
            for row, f in zip(ids, files, strict=True):
                t = _read_locked(f)
                if not torch.equal(t["token_ids"].to(torch.long), row.cpu().to(torch.long)):
                    raise RecycleError(f"--teacher {self.server.url}: {Path(f).name} holds other tokens than asked")
                rows.append(t["hidden_states"])
        except FileNotFoundError as e:
            raise RecycleError(f"--teacher {self.server.url}: {e.filename} is not readable here: mount the server's "
                               "--shared-dir at the same path on every node") from None
        finally:
            for f in files:
                _remove(f)
        hs = torch.stack(rows)  # [n, T, len(layers), H]
        layers, n = self.server.layers, self.n_layers
        last = self.norm(hs[:, :, layers.index(n)])
        aux = None
        if self.aux:  # transformers' hidden_states[L] is the normed state
            aux = torch.cat([self.norm(hs[:, :, layers.index(i)]) if i == n else hs[:, :, layers.index(i)].float()
                             for i in self.aux], dim=-1)
        return last, aux

    def now(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features of `ids` fetched at once (the held-out rows, the probe)."""
        return self.read(ids, self.request(ids))

    def generate(self, prompts: torch.Tensor, new: int) -> torch.Tensor:
        """Greedy continuations of `prompts` by `new` tokens, written by the server (the held-out rows' text, as the
        in-process teacher writes them); the files the connector writes for them are deleted."""
        def one(row: list[int]) -> list[int]:
            res = _request(f"{self.server.url}/v1/completions",
                           {"model": self.server.model, "prompt": row, "max_tokens": new, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True})
            path = (res.get("kv_transfer_params") or {}).get("hidden_states_path")
            if path:
                with contextlib.suppress(OSError):
                    _read_locked(path)  # the writer is done: then it goes
                _remove(path)
            return list(res["choices"][0]["token_ids"])

        out = list(self.pool.map(one, [r.tolist() for r in prompts]))
        return torch.cat([prompts, torch.tensor(out, dtype=prompts.dtype)], dim=1)

    def probe(self, logits: Callable[[torch.Tensor], torch.Tensor], hidden: int) -> None:
        """The fixed probe through the server: its last state, normed here and put through this target's head, must
        rank the server's own greedy next token among the top PROBE_TOP, at the target's hidden size."""
        ids = torch.tensor([PROBE])
        res, path = self._complete(list(PROBE), return_token_ids=True)
        token = int(res["choices"][0]["token_ids"][0])
        last, _ = self.read(ids, [path])
        if last.shape[-1] != hidden:
            raise RecycleError(f"--teacher {self.server.url}: hidden size {last.shape[-1]}, the target's {hidden}")
        top = logits(last[0, -1:]).topk(PROBE_TOP, dim=-1).indices[0].tolist()
        if token not in top:
            raise RecycleError(f"--teacher {self.server.url}: the probe's next token {token} is not among this "
                               f"target's top {PROBE_TOP} {top}: the server runs other weights")

    # -- the prefetch ----------------------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Start fetching at `step` (a resumed run's), from the stream `attach` gave, where the trainer's stands."""
        # a future: the prefetch's failure is kept there and raised in the trainer (`features`), as its own line
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recycle-teacher-prefetch")
        self._future = self._runner.submit(self._run, step)

    def attach(self, schedule: Schedule, batch: int, stream_at: Callable) -> None:
        """What the prefetch walks: the run's schedule, rows per rank, and a copy of its data stream where it stands."""
        self.schedule, self.batch, self.stream_at = schedule, batch, stream_at

    def _run(self, start: int) -> None:
        stream = self.stream_at()
        for step in self.schedule.steps(start):
            while not self._closed and len(self.pending) >= self.ahead:
                time.sleep(self.POLL_S)
            if self._closed:
                return
            rows, _ = stream.take_masked(len(step.lengths))
            mbs = step.micro_batches(self.rank, self.world, self.batch)
            fetched = {mb.key: (ids, self.request(ids)) for mb in mbs for ids in [rows[list(mb.rows), :mb.length]]}
            with self._lock:
                self.ready.update(fetched)
                if fetched:  # a rank with no rows in a step has nothing to wait for
                    self.pending[step.index] = set(fetched)
                self._count()

    def _count(self) -> None:
        files = [f for _, fs in self.ready.values() for f in fs]
        size = 0
        for f in files:
            with contextlib.suppress(OSError):
                size += os.stat(f).st_size
        self.max_present = max(self.max_present, len(files))
        self.max_bytes = max(self.max_bytes, size)

    def features(self, key: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The features of `key` (waits for the prefetch); its files are deleted once read."""
        while key not in self.ready:
            if self._future is None or self._future.done():
                err = self._future.exception() if self._future is not None else None
                if isinstance(err, RecycleError):
                    raise err
                raise RecycleError(f"--teacher {self.server.url}: " + (f"{type(err).__name__}: {err}" if err else
                                                                       f"the prefetch stopped before {key}"))
            time.sleep(self.POLL_S)
        with self._lock:
            want, files = self.ready.pop(key)
        if not torch.equal(want, ids.cpu()):
            raise RecycleError(f"--teacher: the prefetched rows of {key} are not the step's (the data streams parted)")
        try:
            return self.read(want, files)
        finally:
            step = int(key[1:9])
            with self._lock:
                keys = self.pending.get(step)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self.pending[step]

    def close(self) -> None:
        self._closed = True
        if self._runner is not None:
            self._runner.shutdown(wait=True)
        with self._lock:
            for _, files in self.ready.values():
                for f in files:
                    _remove(f)
            self.ready.clear()
        self.pool.shutdown(wait=False)


# -- --online: the target beside the trainer, or a server elsewhere ---------------------------------------------------

VLLM_WEIGHTS_SHARE = 0.8  # of what the trainer leaves: vLLM's weights at most, the rest its KV cache and activations


def served_weight_bytes(target: str | os.PathLike, cpu: bool) -> int:
    """The target's weights as vLLM holds them (from the safetensors headers alone): fp32 on vLLM's CPU build; on a GPU
    bf16, or the stored width where it is narrower (FP8 stays FP8)."""
    total = 0
    for info in Checkpoint(target).stored.values():
        n = math.prod(info.shape)
        total += 4 * n if cpu else min(info.nbytes, 2 * n)
    return total


def device_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's, or the host's RAM where vLLM's CPU build runs."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_online_fits(opts, world: int, device: torch.device, precision: str, fsdp: bool) -> dict:
    """`--online` runs the target in vLLM on rank 0's device: refuse (one line, naming the server and --teacher) when its
    weights do not fit beside the trainer. The trainer's share is distill's memory plan with the teacher's trunk
    elsewhere (`memory.for_options`: embedding and head only) plus its margin; vLLM may take VLLM_WEIGHTS_SHARE of the
    rest for its weights (a stated rule: the KV cache and vLLM's activations need the remainder). A format the plan does
    not cover counts the weights against the device alone. Returns the numbers."""
    total = device_bytes(device)
    weights = served_weight_bytes(opts.target, device.type != "cuda")
    try:
        trainer = for_options(replace(opts, precision=precision), world, device_bytes=total, fsdp=fsdp).per_rank_bytes
    except RecycleError:  # the plan covers EAGLE drafters (and sources converted to them)
        trainer = 0
    room = total * (1 - MARGIN) - trainer
    out = {"weights_bytes": weights, "trainer_bytes": trainer, "device_bytes": total, "fits": weights <= room *
           VLLM_WEIGHTS_SHARE,
           # vLLM's --gpu-memory-utilization on a GPU: the share the trainer leaves (vLLM's default, 0.9 of the device,
           # would take what rank 0 trains in); vLLM's CPU build keeps its own default (0.5 of the RAM)
           "vllm_share": round(room / total, 4) if device.type == "cuda" else None}
    if not out["fits"]:
        raise RecycleError(
            f"--online: the target's weights in vLLM ({weights / GIB:.1f} GiB) do not fit beside the trainer "
            f"({trainer / GIB:.1f} GiB planned) on this device ({total / GIB:.1f} GiB, {MARGIN:.0%} kept free): serve "
            f"it on other devices with `recycle teacher serve {opts.target} --shared-dir DIR` and train with "
            "--teacher http://HOST:PORT")
    return out
