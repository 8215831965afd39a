"""Ranks and sharding of a distillation under torchrun.

A run joins the process group when torchrun started it (one rank included: FSDP2 over a mesh of one is the sharded
code path on a single GPU, as a larger run takes it). Formats whose unroller runs the drafter through its own forward
(`shardable`) are sharded with FSDP2: every transformers decoder layer its own unit, then the rest of the drafter,
each rank holding 1/world of the trainable weights, their gradients and AdamW state (fp32; gradients reduced in
fp32). The others average gradients with one flat all-reduce per step, every rank holding the whole drafter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from recycle.distill import experts
from recycle.distill.memory import fsdp_units
from recycle.hardware import expandable_segments, resolve_device


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's: rank 0 logs, evaluates for the record and writes."""

    rank: int = 0
    world: int = 1
    device: torch.device | None = None  # where this rank runs (`join`: resolve_device; None: not resolved)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def join(device: str | None = None, timeout_s: float | None = None, expandable: bool = True) -> Ranks:
    """The run's ranks and this process's device (`--device`, resolved); joins the process group when torchrun started
    the process, one rank included. Nothing may touch CUDA before this (distill/setup.py calls it first).

    Under torchrun each rank is bound to its own GPU before the group exists: resolve_device's cuda:LOCAL_RANK,
    made the current device (`set_device`), then NCCL started with `device_id` on it. Both matter, from torch 2.13's
    code (read, not run on several GPUs here):
      - init_device_mesh picks a device only while CUDA is uninitialised (distributed/device_mesh.py:456-469);
      - fully_shard places every unit on the mesh's *current* device (fsdp/_fully_shard/_fully_shard.py:245,
        _fsdp_init.py:219-223) and moves the parameters and buffers it manages there (_fsdp_init.py:369-401):
        without set_device every rank would train on cuda:0;
      - NCCL's object collectives (DCP plans its saves and loads with them: checkpoint/utils.py:115-155) stage
        their bytes on torch.cuda.current_device() (distributed_c10d.py:865-928 gives "cuda"; the note at
        :3463-3468);
      - device_id forms the NCCL communicator at once on that GPU, so a bad device fails here rather than at the
        first collective (distributed_c10d.py:1741-1750, :2333-2335).
    `timeout_s` (--nccl-timeout): how long a collective waits for the slowest rank before the group fails; None:
    torch's default (NCCL 600 s, gloo 1,800 s: c10d/ProcessGroupNCCL.hpp:157, ProcessGroup.hpp:23). `expandable`:
    CUDA's allocator gets expandable segments (hardware.expandable_segments), set before set_device initialises
    CUDA. A CPU device joins over gloo, as before."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        on = resolve_device(device)
        if expandable and on.type == "cuda":
            expandable_segments()
        return Ranks(device=on)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    on = resolve_device(device, rank)  # cuda:LOCAL_RANK (refused in one line past this node's GPUs), or cpu
    if on.type == "cuda":
        if expandable:
            expandable_segments()
        torch.cuda.set_device(on)  # before the group, the mesh and FSDP2: they take the current device
    if not dist.is_initialized():
        wait = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        if on.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=on, **wait)
        else:
            dist.init_process_group(backend="gloo", **wait)
    return Ranks(dist.get_rank(), dist.get_world_size(), on)


@dataclass(frozen=True)
class Sharding:
    """How the drafter is spread over the ranks: FSDP2 units, and the routed experts split by expert."""

    sharded: bool = False  # FSDP2 under torchrun
    expert_parallel: bool = False  # the routed experts split over the ranks (distill.experts)

    @property
    def described(self) -> str | None:
        """The record's `data.sharding`."""
        if self.expert_parallel:
            return "FSDP2, routed experts split over the ranks"
        return "FSDP2" if self.sharded else None


def shard(model: torch.nn.Module, shardable: bool, device: torch.device, world: int, precision: str,
          note: Callable[[str], None]) -> Sharding:
    """Under torchrun, FSDP2 for a `shardable` unroller's drafter. Frozen weights (the embedding and head copies,
    `--freeze` groups) stay outside the units, plain and whole on every rank: the loss reads the head directly, a chunk
    of rows at a time. Fused routed experts, trained or frozen, stay outside too, split by expert over the ranks
    (`distill.experts`), where the rank count divides them: a MoE block's unit would otherwise gather every expert on
    every rank. The drafter may be on the meta device (distill builds it there under torchrun): both splits work on
    meta tensors, and `recycle.drafters.sharded.materialize` then reads each rank's own pieces."""
    if not dist.is_initialized() or not shardable:
        return Sharding()
    mesh = init_device_mesh(device.type, (world,))
    # fused routed experts: split by expert over the ranks, the tokens sent to them (distill.experts), not gathered
    split = experts.shard_experts(model, mesh) if experts.shardable(model, world) else []
    if split:
        note(f"expert parallelism: each rank holds {1 / world:.0%} of the routed experts")
    ignored = {p for p in model.parameters() if not p.requires_grad} | set(split)
    # bf16 compute: units gathered in bf16 (half the all-gather and the gathered copy), reduced in fp32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for module in fsdp_units(model):
        fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    return Sharding(sharded=True, expert_parallel=bool(split))


def allreduce_grads(params: list[torch.Tensor]) -> None:
    """Unsharded ranks: every trainable gradient summed over the ranks in one flat all-reduce."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    off = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[off:off + n].view_as(p)
        off += n
