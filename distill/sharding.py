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

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from recycle.distill import experts
from recycle.distill.memory import fsdp_units


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's: rank 0 logs, evaluates for the record and writes."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def join() -> Ranks:
    """The run's ranks; joins the process group when torchrun started the process, one rank included."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return Ranks()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return Ranks(dist.get_rank(), dist.get_world_size())


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
    every rank."""
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


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None, sharded: bool) -> tuple[dict, dict | None]:
    """The model's (and, given `opt`, the optimizer's) whole state: as it is in one process; gathered from every rank
    onto rank 0's CPU when sharded (a collective: every rank calls it)."""
    if not sharded:
        return model.state_dict(), opt.state_dict() if opt is not None else None
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if opt is not None:
        return get_state_dict(model, opt, options=whole)
    return get_model_state_dict(model, options=whole), None


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
