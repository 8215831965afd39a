"""Sharded from the start (issue 49): under 2 gloo ranks the EAGLE drafter is built on the meta device, sharded
(experts split, then FSDP2), and each rank reads only its own shards from the drafter's safetensors files; the
best snapshot stays sharded and the written drafter comes from the shards, every rank writing its part."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from tests import helpers

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
        helpers.end_ranks()


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
    helpers.same_drafter_output(one, two, exact=True)
    assert load_drafter(two).state_dict().keys() == whole.state_dict().keys()


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
