"""Expert parallelism (distill/experts.py, issue 29): a MoE block whose routed experts are split over 2 gloo ranks
gives, on each rank's rows, the outputs and gradients of the whole block run on all the rows in one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import helpers

ROWS = (5, 3)  # unequal per rank: the padding path


def _worker(rank: int, world: int, init: str, impl: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from recycle.distill.experts import expert_modules, shard_experts, shardable

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        ref = helpers.moe_block(impl)
        moe = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(sum(ROWS), 32, generator=g)
        c = torch.randn(sum(ROWS), 32, generator=g)
        lo = sum(ROWS[:rank])
        mine = slice(lo, lo + ROWS[rank])

        whole = x.clone().requires_grad_()
        y = ref(whole[:, None, :]).squeeze(1)  # [rows, 1, hidden]: one row per sequence
        (y * c).sum().backward()

        assert shardable(moe, world) and len(expert_modules(moe)) == 1
        mesh = init_device_mesh("cpu", (world,))
        split = shard_experts(moe, mesh)
        assert {tuple(p.to_local().shape)[0] for p in split} == {8 // world}  # half the experts on each rank
        part = x[mine].clone().requires_grad_()
        out = moe(part[:, None, :]).squeeze(1)
        ((out * c[mine]).sum() * world).backward()  # distill scales each rank's loss by the world size

        torch.testing.assert_close(out, y[mine], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(part.grad / world, whole.grad[mine], rtol=1e-5, atol=1e-5)
        first = rank * (8 // world)
        for name in ("gate_up_proj", "down_proj"):  # this rank's experts: the gradient of every rank's rows
            got = getattr(moe.experts, name).grad.to_local()
            want = getattr(ref.experts, name).grad[first:first + 8 // world]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        router = moe.gate.weight.grad.clone()  # replicated weights: FSDP2 would sum (÷ world) what each rank has
        dist.all_reduce(router)
        torch.testing.assert_close(router / world, ref.gate.weight.grad, rtol=1e-4, atol=1e-5)
    finally:
        helpers.end_ranks()


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_split_experts_equal_the_whole_block(tmp_path: Path, impl: str) -> None:
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'init'}", impl), nprocs=2, join=True)


def test_not_shardable_when_the_ranks_do_not_divide_the_experts() -> None:
    from recycle.distill.experts import expert_modules, expert_params, shardable

    moe = helpers.moe_block("eager")
    assert shardable(moe, 2) and not shardable(moe, 3) and not shardable(moe, 1)
    assert expert_modules(moe) == [moe.experts]  # not the shared expert, router or the block
    assert [n for n, _ in expert_params(moe.experts)] == ["gate_up_proj", "down_proj"]


def _run_worker(rank: int, world: int, port: int, drafter: str, out: str, queue) -> None:
    """One rank of a real 2-rank distillation (gloo, `prepare`): after one step, the bytes it holds against the
    plan's."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from recycle.distill.experts import expert_modules
    from recycle.distill.memory import for_options
    from recycle.distill.setup import prepare
    from recycle.distill.train import DistillOptions, train_step

    from tests.helpers import TINY
    from tests.trained import FIXTURE

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)
    try:
        for groups in ((), ("experts",)):
            opts = DistillOptions(drafter=drafter, target=str(FIXTURE), tokens=400, out=f"{out}{len(groups)}",
                                  freeze=groups, precision="fp32", **TINY)
            run = prepare(opts)
            train_step(run, run.schedule.step(0))
            plan = for_options(opts, world=world).parts
            teachers = {id(p) for p in run.teacher.model.parameters()}
            held = {"weights": nbytes(p for p in run.model.parameters() if id(p) not in teachers),
                    "grads": nbytes(p.grad for p in run.model.parameters() if p.grad is not None),
                    "optimizer": nbytes(t for s in run.opt.state.values() for t in s.values()
                                        if torch.is_tensor(t) and t.dim() > 0)}
            split = [p for m in expert_modules(run.model) for p in m.parameters(recurse=False)]
            assert split and all(isinstance(p, DTensor) and p.to_local().shape[0] * world == p.shape[0] for p in split)
            whole = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            # gathered onto rank 0 (a collective)
            moved = None
            if rank == 0 and groups:  # frozen split experts come back bit-identical; attention trained
                from recycle.drafters import load_drafter

                before = load_drafter(drafter).state_dict()
                experts = [k for k in before if ".experts." in k and "shared" not in k]
                assert experts and all(torch.equal(before[k], whole[k].to(before[k].dtype)) for k in experts)
                moved = any(not torch.equal(before[k], whole[k]) for k in before if "self_attn" in k)
            queue.put((rank, groups, run.shard.expert_parallel, held, {k: plan[k] for k in held}, moved))
    finally:
        helpers.end_ranks()


@pytest.mark.slow  # two 2-rank distillations, ~40 s
def test_plan_counts_what_each_rank_holds_with_split_experts(tmp_path: Path, converted) -> None:
    """Under 2 ranks the routed experts are split (each rank holds half of every fused expert tensor, trained or
    frozen), and the plan's weights, gradients and AdamW state per rank are what each rank holds after a step (to
    FSDP2's rounding of uneven shards: 1%); with --freeze experts the gathered experts are the input's, bit for bit,
    while attention moved."""
    import socket

    drafter = str(converted("eagle"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_run_worker, args=(2, port, str(drafter), str(tmp_path / "out"), queue), nprocs=2, join=True)
    rows = [queue.get(timeout=5) for _ in range(4)]
    for rank, groups, parallel, held, planned, moved in rows:
        assert parallel, (rank, groups)
        assert moved is (True if rank == 0 and groups else None)
        for part, n in held.items():
            assert abs(n - planned[part]) <= 0.01 * planned[part] + 64, (rank, groups, part, n, planned[part])
