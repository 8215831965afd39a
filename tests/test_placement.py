"""Every rank on its own device (issue 49): the LOCAL_RANK → cuda:N mapping and the order `join` binds it in
(set_device, then the process group with device_id and the timeout), on CUDA names with torch.cuda and the process
group monkeypatched (no GPU here); the allocator's expandable segments; --nccl-timeout's refusals; and, under 2 gloo
ranks on the CPU, every tensor a rank holds (parameters, DTensor shards, buffers, AdamW state, the DCP checkpoint's
objects) on the device resolve_device gives it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recycle.distill.setup import validate
from recycle.distill.sharding import join
from recycle.errors import RecycleError
from recycle.hardware import ALLOC_CONF, expandable_segments, resolve_device
from recycle.options import DistillOptions

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


class Calls(list):
    """What `join` called, in order; `launch(rank, world, local)` sets the launcher's variables for the next rank."""

    launch = None


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """A node of 8 GPUs as torch.cuda reports it, a process group that only records, and the launcher's variables
    and the allocator's cleared (restored after the test). Returns the calls, in order, as `join` makes them."""
    calls = Calls()
    up = {"group": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("set_device", torch.device(d), os.environ.get(ALLOC_CONF[0]))))

    def init_process_group(backend=None, **kw):
        calls.append(("init_process_group", backend, kw))
        up["group"] = True

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: up["group"])
    monkeypatch.setattr(dist, "get_rank", lambda: int(os.environ["RANK"]))
    monkeypatch.setattr(dist, "get_world_size", lambda: int(os.environ["WORLD_SIZE"]))
    for var in (*LAUNCH, *ALLOC_CONF):  # set, then removed: monkeypatch puts back what was there (or nothing)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)

    def launch(rank: int, world: int, local: int | None) -> None:
        calls.clear()
        up["group"] = False
        os.environ.pop(ALLOC_CONF[0], None)
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), TORCHELASTIC_RUN_ID="test")
        if local is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = str(local)

    calls.launch = launch
    return calls


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_rank_gets_cuda_local_rank_set_before_the_group(gpus, nodes: int) -> None:
    """8 ranks per node (2 nodes: LOCAL_RANK repeats, RANK runs 0-15): each is bound to cuda:LOCAL_RANK, made current
    before the group starts, and NCCL starts with device_id on it and the --nccl-timeout given."""
    world = 8 * nodes
    for rank in range(world):
        local = rank % 8
        gpus.launch(rank, world, local)
        assert resolve_device(None, rank) == torch.device("cuda", local)
        ranks = join(None, 120.0)
        cuda = torch.device("cuda", local)
        assert (ranks.rank, ranks.world, ranks.device) == (rank, world, cuda)
        assert gpus == [("set_device", cuda, "expandable_segments:True"),
                        ("init_process_group", "nccl", {"device_id": cuda, "timeout": timedelta(seconds=120)})]


def test_no_timeout_leaves_torchs_default_and_cpu_joins_over_gloo(gpus) -> None:
    gpus.launch(3, 8, 3)
    join(None, None)
    assert gpus[-1] == ("init_process_group", "nccl", {"device_id": torch.device("cuda", 3)})
    gpus.launch(3, 8, 3)  # --device cpu on a GPU node: gloo, no GPU made current, no device_id, no allocator setting
    ranks = join("cpu", 30.0)
    assert ranks.device == torch.device("cpu") and ALLOC_CONF[0] not in os.environ
    assert gpus == [("init_process_group", "gloo", {"timeout": timedelta(seconds=30)})]


def test_without_local_rank_the_rank_modulo_the_gpus(gpus) -> None:
    gpus.launch(13, 16, None)  # a launcher that sets RANK only (torch.multiprocessing)
    assert join(None, None).device == torch.device("cuda", 5)


def test_one_process_is_not_bound_and_keeps_its_device(gpus) -> None:
    """No launcher: no group, no set_device; --device cuda:2 stays cuda:2 (the rank mapping is for ranks only)."""
    for var in LAUNCH:
        os.environ.pop(var, None)
    assert join("cuda:2").device == torch.device("cuda", 2) and join().device == torch.device("cuda")
    assert gpus == [] and os.environ[ALLOC_CONF[0]] == "expandable_segments:True"


@pytest.mark.parametrize("local,device,needle", [
    (8, None, "LOCAL_RANK 8: this node shows 8 CUDA devices (cuda:0 to cuda:7)"),
    (2, "cuda:3", "--device cuda:3: under torchrun each rank runs on cuda:LOCAL_RANK (this rank's is cuda:2)"),
    (1, "cuda:x", "--device cuda:x: expected a GPU index"),
])
def test_a_device_the_rank_cannot_have_is_refused_in_one_line_before_the_group(gpus, local: int, device: str | None,
                                                                                needle: str) -> None:
    gpus.launch(local, 16, local)
    with pytest.raises(RecycleError) as e:
        join(device, 60.0)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert gpus == []  # nothing bound, no group
    gpus.launch(3, 16, 3)
    assert join("cuda:3").device == torch.device("cuda", 3)  # the rank's own GPU named: accepted


def test_distill_binds_the_rank_before_any_check(gpus, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """distill's set-up joins first: the rank's GPU made current and the group started before its first check (here
    a refused drafter path), and nothing initialised CUDA before set_device."""
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: gpus.append(("cuda initialised",)))
    gpus.launch(9, 16, 1)
    with pytest.raises(RecycleError, match="no such drafter directory"):
        validate(DistillOptions(drafter=str(tmp_path / "none"), target=str(FIXTURE), tokens=10_000, nccl_timeout=900))
    cuda = torch.device("cuda", 1)
    assert gpus == [("set_device", cuda, "expandable_segments:True"),
                    ("init_process_group", "nccl", {"device_id": cuda, "timeout": timedelta(seconds=900)})]


def test_one_process_cuda_index_past_the_gpus_is_refused(gpus) -> None:
    with pytest.raises(RecycleError, match=r"--device cuda:8: this machine shows 8 CUDA devices"):
        resolve_device("cuda:8")


@pytest.mark.parametrize("env,expect", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"},  # the user's variable: setting the other would hide it
     {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:64"},
     {"PYTORCH_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:64"}),
])
def test_expandable_segments_appends_and_never_overrides_the_user(env: dict, expect: dict) -> None:
    environ = dict(env, OTHER="x")
    expandable_segments(environ)
    assert environ == dict(expect, OTHER="x")


@pytest.mark.slow  # a fresh python importing torch: 2.4 s quiet, 7 s on these busy cores
def test_expandable_segments_reach_torchs_allocator_config() -> None:
    """The variable it sets is the one torch 2.13 parses (its allocator config, on this CPU build the same c10 code
    CUDA's allocator reads), the user's PYTORCH_ALLOC_CONF kept, set after `import torch` but before the first read."""
    code = ("import os; from recycle.hardware import expandable_segments; import torch; expandable_segments(); "
            "print(torch._C._accelerator_getAllocatorSettings())")
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF}
    res = subprocess.run([sys.executable, "-c", code], env={**env, "PYTORCH_ALLOC_CONF": "max_split_size_mb:512",
                                                             "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "max_split_size_mb:512,expandable_segments:True"


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_nccl_timeout_must_be_positive(tmp_path: Path, value: str) -> None:
    res = run_cli("distill", str(tmp_path), "--target", str(FIXTURE), "--tokens", "1k", "--nccl-timeout", value,
                  "-o", str(tmp_path / "o"))
    assert_bad_input(res, "--nccl-timeout")
    assert not (tmp_path / "o").exists()


# -- 2 gloo ranks on the CPU --------------------------------------------------------------------------------------


def _tensors(tree, path: str = ""):
    """(name, tensor) for every tensor of a nested state dict; a DTensor gives itself and its local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{path}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield path, tree
        if isinstance(tree, DTensor):
            yield f"{path} (local shard)", tree.to_local()


def _placement_rank(rank: int, world: int, port: int, run: dict, queue) -> None:
    """One rank: prepared as distill prepares it, one step trained, a DCP checkpoint saved and read back; every
    tensor it holds compared with resolve_device(--device, rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from recycle.distill import state
    from recycle.distill.setup import prepare
    from recycle.distill.train import train_step

    p = None
    try:
        p = prepare(DistillOptions(**run))
        want = resolve_device(run.get("device"), rank)
        train_step(p, next(iter(p.schedule.steps(0))))  # AdamW's state exists from the first step
        held = {"parameters": dict(p.model.named_parameters()), "buffers": dict(p.model.named_buffers()),
                "teacher": {"embed": p.teacher.embed.weight, "head": p.teacher.head.weight}}
        # AdamW's `step` counters are CPU scalars by torch's design unless capturable/fused (optim/adam.py:168-176)
        moments = {f"{i}.{k}": v for i, s in enumerate(p.opt.state.values()) for k, v in s.items()}
        model_state, opt_state = get_state_dict(p.model, p.opt)
        saved = {"model": model_state, "optimizer": opt_state["state"]}  # what state.save hands dcp.save
        state.save_sharded(p.run.outputs.state_dir, saved, {}, p.run.fingerprint())  # dcp.save under gloo
        model_state, opt_state = get_state_dict(p.model, p.opt)
        loaded = {"model": model_state, "optimizer": opt_state["state"]}
        state.load_sharded(p.run.outputs.state_dir, loaded)  # each rank reads its own pieces back
        wrong, counts = [], {}
        for what, tree in (("held", held), ("adamw", moments), ("dcp saved", saved), ("dcp loaded", loaded)):
            for name, t in _tensors(tree):
                expect = torch.device("cpu") if name.rsplit(".", 1)[-1] == "step" else want
                counts[what] = counts.get(what, 0) + 1
                counts["dtensors"] = counts.get("dtensors", 0) + isinstance(t, DTensor)
                if t.device != expect or isinstance(t, DTensor) and t.device_mesh.device_type != want.type:
                    wrong.append(f"{what} {name}: {t.device}")
        queue.put((rank, {"want": str(want), "ranks_device": str(p.run.ranks.device), "current": str(p.device),
                          "wrong": wrong, "counts": counts, "sharded": p.shard.sharded}))
    finally:
        if p is not None:
            p.close()
        helpers.end_ranks()


@pytest.mark.slow  # 2 ranks, one step and a DCP round trip each: ~50 s here (busy 2 cores)
def test_two_gloo_ranks_hold_everything_on_their_resolved_device(converted, tmp_path: Path) -> None:
    """Under 2 gloo ranks every tensor a rank holds is on resolve_device(--device, LOCAL_RANK) (here: cpu): the FSDP2
    drafter's parameters (DTensors and their local shards, the ignored plain ones), buffers, the teacher's embedding
    and head, AdamW's moments, and the checkpoint's objects as DCP saves them and reads them back."""
    import torch.multiprocessing as mp

    run = dict(drafter=str(converted("eagle")), target=str(FIXTURE), tokens=4 * 96, seq_len=48, batch=1, seed=0,
               eval_rows=2, precision="fp32", threads=1, out=str(tmp_path / "out"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.spawn(_placement_rank, args=(2, port, run, queue), nprocs=2, join=True)
    got = dict(queue.get(timeout=5) for _ in range(2))
    for rank, r in got.items():
        assert r["want"] == r["ranks_device"] == r["current"] == "cpu", (rank, r)
        assert r["sharded"] and r["wrong"] == [], (rank, r["wrong"][:10])
        assert r["counts"]["dtensors"] > 0 and all(r["counts"][k] > 0 for k in ("held", "adamw", "dcp saved",
                                                                                 "dcp loaded")), r["counts"]
