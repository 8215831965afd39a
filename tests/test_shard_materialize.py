"""Sharded from the start (issue 49): under 2 gloo ranks the EAGLE drafter is built on the meta device, sharded
(experts split, then FSDP2), and each rank reads only its own shards from the drafter's safetensors files; the
best snapshot stays sharded and the written drafter comes from the shards, every rank writing its part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from tests import helpers
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]


class _Counted:
    """safe_open's handle with every get_slice read counted: (stored name, bytes read)."""

    reads: list[tuple[str, int]] = []

    def __init__(self, path: str, framework: str) -> None:
        self.inner = safe_open(path, framework)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name: str):
        sl = self.inner.get_slice(name)
        reads = self.reads

        class Slice:
            def __getitem__(self, idx):
                t = sl[idx]
                reads.append((name, t.numel() * t.element_size()))
                return t
        return Slice()


def _materialize_worker(rank: int, world: int, init: str, drafter: str, out: str, queue) -> None:
    import recycle.drafters.sharded as sharded
    from recycle.converters.rewrite import write_drafter_sharded
    from recycle.distill.sharding import shard
    from recycle.distill.unroll import EagleUnroller
    from recycle.drafters import load_drafter
    from recycle.formats import of_directory
    from recycle.io.writer import OutputDir

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        sharded.safe_open = _Counted  # every read this rank makes, counted
        model = sharded.meta_drafter(drafter)
        EagleUnroller(model, 3)  # the embedding and head frozen, as distill freezes them
        got = shard(model, True, torch.device("cpu"), world, "fp32", lambda _: None)
        assert got.sharded and got.expert_parallel
        assert all(p.is_meta for p in model.parameters())  # nothing allocated before the shards are known
        read = sharded.materialize(model, drafter, torch.device("cpu"))
        whole = load_drafter(drafter, dtype=torch.float32)
        ref = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
        mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        assert set(mine) == set(ref), set(mine) ^ set(ref)
        split = 0
        for name, t in mine.items():  # (a) every parameter and buffer: this rank's slice of the whole
            rows = sharded.local_rows(t)
            local = t.to_local() if rows is not None else t
            want = ref[name][rows[0]:rows[1]] if rows is not None else ref[name]
            assert local.device.type == "cpu" and torch.equal(local, want.to(local.dtype)), name
            split += rows is not None and rows[1] - rows[0] < t.shape[0]
        assert split > 0
        # (b) the bytes this rank read: of each split expert tensor only its own experts', never a whole one
        experts = [(n, b) for n, b in _Counted.reads if ".mlp.experts." in n]
        count = whole.layers[0].block.mlp.experts.num_experts if hasattr(whole.layers[0].block.mlp.experts,
                                                                          "num_experts") else 8
        first, last = rank * count // world, (rank + 1) * count // world
        ids = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n, _ in experts}
        assert ids == set(range(first, last)), ids
        queue.put((rank, read, sum(b for _, b in _Counted.reads), sum(b for _, b in experts)))
        with torch.no_grad():  # (c) the writer: changed weights, written from the shards by both ranks
            for p in model.parameters():
                if p.requires_grad:
                    (p.to_local() if sharded.local_rows(p) is not None else p).mul_(1.5)
        write_drafter_sharded(drafter, OutputDir(out), of_directory(drafter), model, {"run": "test"}, rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks importing transformers: about 8 s here
def test_meta_built_shards_equal_the_whole_drafter_and_read_only_their_bytes(converted, tmp_path: Path) -> None:
    """(a) each rank's local shards equal the slices of the drafter loaded whole in one process, every parameter
    and buffer (rotary inv_freq computed again); (b) a rank reads only its own experts and half the rest's rows."""
    drafter = str(converted("eagle"))
    sizes = {}
    for f in sorted(Path(drafter).glob("model*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)[:]
                sizes[k] = t.numel() * t.element_size()
    total = sum(sizes.values())
    experts = sum(v for k, v in sizes.items() if ".mlp.experts." in k)
    # whole on every rank: the frozen embedding and head, and the buffers FSDP2 leaves alone (the router's bias)
    whole = sum(v for k, v in sizes.items() if k in ("embed.weight", "head.weight") or k.endswith("_bias"))
    queue = mp.get_context("spawn").SimpleQueue()
    two = tmp_path / "two"
    mp.spawn(_materialize_worker, args=(2, f"file://{tmp_path / 'init'}", drafter, str(two), queue), nprocs=2,
             join=True)
    got = sorted(queue.get() for _ in range(2))
    for _, read, counted, expert in got:
        assert read == counted  # what materialize says it read is what safetensors handed over
        assert expert == experts // 2, (expert, experts)
    # every byte of what is split read once over the ranks (its rows or experts on one rank only), the rest by both
    assert sum(r for _, r, _, _ in got) == total + whole, (got, total, whole)
    # (c) the same changed weights written by one process from the whole drafter: the same output, tensor for tensor
    from recycle.converters.rewrite import write_drafter
    from recycle.distill.unroll import EagleUnroller
    from recycle.drafters import load_drafter
    from recycle.formats import of_directory
    from recycle.io.writer import OutputDir

    whole = load_drafter(drafter, dtype=torch.float32)
    unroller = EagleUnroller(whole, 3)
    with torch.no_grad():
        for p in whole.parameters():
            if p.requires_grad:
                p.mul_(1.5)
    one = tmp_path / "one"
    write_drafter(drafter, OutputDir(one), of_directory(drafter), unroller.file_state(), whole, {"run": "test"})
    _same_output(one, two, exact=True)
    assert load_drafter(two).state_dict().keys() == whole.state_dict().keys()


def _same_output(one: Path, two: Path, exact: bool) -> None:
    """Two drafter directories hold the same files. `exact`: byte for byte, every file (the same weights written).
    Otherwise: every layout's tensors with the same names, shapes and dtypes and values within one bf16 step (2 ranks
    and one process train to within 1e-7, which can round either way), the other files byte for byte
    (recycle.json aside: its records hold times and its digests the weights')."""
    files = sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two).as_posix() for p in two.rglob("*") if p.is_file())
    a, b = _tensors(one), _tensors(two)
    assert a.keys() == b.keys()
    for layout in a:
        assert list(a[layout]) == list(b[layout]), layout  # the same names in the same order
        for k, t in a[layout].items():
            u = b[layout][k]
            assert t.dtype == u.dtype and t.shape == u.shape, (layout, k)
            torch.testing.assert_close(u.float(), t.float(), rtol=0 if exact else 2 ** -7, atol=0 if exact else 1e-5,
                                       msg=f"{layout} {k}")
    for f in files:
        if exact or not (f.endswith(".safetensors") or f == "recycle.json"):
            assert (one / f).read_bytes() == (two / f).read_bytes(), f


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(*args: str) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    return helpers.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(_free_port()), "-m",
                        "recycle.cli", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)


def _tensors(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every weights layout of a drafter directory: layout (its folder) -> name -> tensor, shards merged."""
    layouts: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(out.rglob("*.safetensors")):
        rel = f.relative_to(out)
        with safe_open(str(f), "pt") as h:
            part = layouts.setdefault(str(rel.parent), {})
            for k in h.keys():
                assert k not in part, k
                part[k] = h.get_tensor(k)
    return layouts


@pytest.mark.slow  # a 2-rank and a one-process distillation, about 100 s here
def test_two_ranks_write_the_one_process_output(converted, tmp_path: Path) -> None:
    """(c) torchrun, gloo, 2 ranks, sharded from the start: the loss curve of one process with twice the rows (1e-3),
    and the written drafter the same as the one process writes (every layout's names, shapes, dtypes; values within
    one bf16 step; config.json and the other JSON files byte for byte), with no best snapshot left behind."""
    from recycle.drafters import load_drafter

    drafter = str(converted("eagle"))
    common = ["distill", drafter, "--target", str(FIXTURE), "--tokens", str(5 * 4 * 48 + 40), "--seq-len", "48",
              "--threads", "1", "--precision", "fp32", "--eval-every", "2", "--json"]
    res = _two_ranks(*common, "--batch", "2", "-o", str(tmp_path / "two"))
    assert res.returncode == 0, res.stderr[-2000:]
    two = json.loads(res.stdout[res.stdout.index("{"):])
    res = helpers.run([sys.executable, "-m", "recycle.cli", *common, "--batch", "4", "-o", str(tmp_path / "one")],
                      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                      timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    one = json.loads(res.stdout[res.stdout.index("{"):])
    la = [r["loss"] for r in helpers.metrics(tmp_path / "one.distill")]
    lb = [r["loss"] for r in helpers.metrics(tmp_path / "two.distill")]
    assert len(la) == len(lb) == 6 and all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(la, lb)), (la, lb)
    assert two["data"]["sharding"] == "FSDP2, routed experts split over the ranks"
    assert all(abs(x - y) <= 1e-3 for x, y in zip(one["final"]["heldout_agreement_after"],
                                                    two["final"]["heldout_agreement_after"]))
    _same_output(tmp_path / "one", tmp_path / "two", exact=False)
    assert not list((tmp_path / "two.distill").glob("best-*"))  # the sharded snapshots pruned at the end
    load_drafter(tmp_path / "two")


def test_meta_build_filled_in_one_process_equals_the_whole_load(converted) -> None:
    """Unsharded, the meta build filled from the files is the drafter `load_drafter` gives: every parameter and
    buffer (rotary inv_freq computed again), and every byte of the files read once."""
    from recycle.drafters import load_drafter
    from recycle.drafters.sharded import materialize, meta_drafter

    drafter = converted("eagle")
    model = meta_drafter(drafter)
    read = materialize(model, drafter, torch.device("cpu"))
    whole = load_drafter(drafter, dtype=torch.float32)
    a = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    b = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert a.keys() == b.keys()
    for k in a:
        assert not b[k].is_meta and b[k].dtype == a[k].dtype and torch.equal(a[k], b[k]), k
    assert read == (drafter / "model.safetensors").stat().st_size - _header_bytes(drafter / "model.safetensors")


def _header_bytes(path: Path) -> int:
    import struct

    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_prune_best_removes_sharded_snapshot_folders(tmp_path: Path) -> None:
    """A sharded run's best snapshots are folders (every rank's DCP shards): pruned like the one-process files."""
    from recycle.distill.state import best_dir, best_path, prune_best

    for step in (0, 3, 5):
        best_dir(tmp_path, step).mkdir()
        (best_dir(tmp_path, step) / "shard.safetensors").write_bytes(b"x")
    best_path(tmp_path, 7).write_bytes(b"x")
    prune_best(tmp_path, {3, 7})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-00000003", "best-00000007.safetensors"]
