"""Expert parallelism for a sharded distillation: each rank holds 1/world of every fused routed-expert tensor.

Why: transformers fuses a MoE block's routed experts into one 3-D parameter per projection (DeepSeek-V3's drafter:
256 experts, 11.3B parameters). Under FSDP2 alone that parameter sits in the decoder layer's unit, so the rank
running the layer gathers all of it, with its gradient in backward (42.9 GiB in bf16 at DeepSeek-V3 width), and the
plan for eight H100s with every expert trained stays over 70 GB per rank. Here the experts are instead split along
their first dimension (experts `rank*E/world .. (rank+1)*E/world` on each rank) and never gathered: the tokens go to
the experts. Each call sends each row (hidden state, routed indices, routing weights) once to every rank holding one
of its experts, an all-to-all whose split sizes come from the routing; each rank runs its experts on the rows it
received (transformers' own experts forward, with its expert-parallel sentinel for a row's slots on other ranks), and
a second all-to-all sends the weighted sums back, added per row. The bytes grow with the ranks a row visits (at most
top-k; DeepSeek-V3's group-limited routing at 8 ranks: at most 4 of them), not with the world size. The previous
exchange, kept for comparison (EXCHANGE_ENV=all_gather), all-gathers every rank's rows, runs this rank's experts on all
of them and reduce-scatters the sums: (world − 1) × rows × hidden each way on every rank. The collectives are torch's
autograd collectives, so the backward is their transpose (the all-to-all with its splits swapped; reduce-scatter and
all-gather), and every rank's router and attention get the gradient of the experts on other ranks. Tested and
measured under 2 gloo ranks on CPU (tests/test_throughput.py, tests/test_experts.py); NCCL not run.

The shards are DTensors (`Shard(0)` on the run's device mesh, the one FSDP2 uses), so what reads parameters
already understands them: gradient clipping's global norm, AdamW, the per-rank DCP checkpoints and best snapshots,
and the writer (`converters.rewrite.write_drafter_sharded`: each rank writes its own experts' tensors). Under torchrun
they are split on the meta device and each rank reads only its own experts (`recycle.drafters.sharded`). FSDP2
ignores them (its reduce-scatter must not average them: an expert's gradient is whole on its one rank). Their
gradient arrives `world` times the step's, because distill scales each rank's loss by the world size for FSDP2's
averaging; a hook divides it back.

Equal row counts are not required: the all-to-all's splits are per rank (the all-gather pads to the largest rank's).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard

EXCHANGES = ("all_to_all", "all_gather")
EXCHANGE = "all_to_all"  # the rows' exchange (module docstring); the environment variable below overrides it
EXCHANGE_ENV = "RECYCLE_EXPERT_EXCHANGE"  # benchmarks: the two exchanges side by side, from the same tree


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """transformers' fused experts modules (the classes `use_experts_implementation` decorates: they carry the
    expert-parallel flag and the experts as 3-D parameters, expert first)."""
    return [m for m in model.modules()
            if hasattr(m, "_is_expert_parallel") and isinstance(getattr(m, "num_experts", None), int)
            and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def expert_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's per-expert tensors (first dimension the expert): the projections and their biases (of a module
    not yet split: `shard_experts` sets its count to the rank's own)."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() >= 2
            and p.shape[0] == module.num_experts]


def shardable(model: nn.Module, world: int) -> bool:
    """Whether expert parallelism applies: several ranks, and every fused experts module's count divides by them."""
    mods = expert_modules(model)
    return world > 1 and bool(mods) and all(m.num_experts % world == 0 for m in mods)


class _ExpertShard:
    """The forward of one fused experts module whose experts are split over the ranks (see the module docstring).
    Installed as the module's `forward`; re-entered once per call, through `torch.func.functional_call`, to run
    transformers' forward on this rank's local shards."""

    def __init__(self, module: nn.Module, names: list[str], mesh, rank: int) -> None:
        self.module, self.names, self.group = module, names, mesh.get_group()
        self.count = module.num_experts  # this rank's (the module's count once sharded: the sentinel is one past it)
        self.first = rank * self.count
        self.inner = type(module).forward.__get__(module)  # transformers' dispatching forward
        self.inside = False
        self.world = mesh.size()
        self.exchange = os.environ.get(EXCHANGE_ENV, EXCHANGE)
        if self.exchange not in EXCHANGES:
            raise ValueError(f"{EXCHANGE_ENV}={self.exchange}: one of {', '.join(EXCHANGES)}")

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.inside:
            return self.inner(hidden, top_k_index, top_k_weights)
        if self.exchange == "all_gather":
            return self._gathered(hidden, top_k_index, top_k_weights)
        return self._routed(hidden, top_k_index, top_k_weights)

    def _local(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """transformers' forward on this rank's experts; `index` is local (the sentinel `count`: another rank's)."""
        local = {n: getattr(self.module, n).to_local() for n in self.names}
        if torch.is_autocast_enabled(hidden.device.type):  # one cast of the shard per call, as autocast would per expert
            low = torch.get_autocast_dtype(hidden.device.type)
            local = {n: t.to(low) if t.is_floating_point() else t for n, t in local.items()}
        self.inside = True
        try:
            out = torch.func.functional_call(self.module, local, (hidden, index, weights), strict=False)
        finally:
            self.inside = False
        if not bool((index < self.count).any()):  # no row for this rank's experts: transformers' forward used neither
            # them nor the exchanged rows, so their gradient would be None (AdamW and the clipped norm's collectives
            # must see every shard, zero as one process's whole tensor has it) and the exchange's backward collective
            # would never run here while the other ranks wait in it: both joined to the output at weight 0
            used = [t.sum() for t in local.values() if t.requires_grad]
            used += [t.sum() for t in (hidden, weights) if t.requires_grad]
            out = out + sum(used) * 0
        return out

    def _gathered(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every rank's rows all-gathered, this rank's experts run on all of them, the sums reduce-scattered back."""
        rows = hidden.shape[0]
        most = torch.tensor([rows], device=hidden.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        pad = int(most) - rows
        if pad:  # padded rows route nowhere on any rank (the sentinel) and come back zero
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            top_k_index = torch.cat([top_k_index, top_k_index.new_full((pad, top_k_index.shape[1]), -1)])
            top_k_weights = torch.cat([top_k_weights, top_k_weights.new_zeros(pad, top_k_weights.shape[1])])
        every = funcol.wait_tensor(funcol.all_gather_single_autograd(hidden, 0, self.group))
        weights = funcol.wait_tensor(funcol.all_gather_single_autograd(top_k_weights, 0, self.group))
        index = funcol.wait_tensor(funcol.all_gather_single(top_k_index, 0, self.group)) - self.first
        index = index.masked_fill((index < 0) | (index >= self.count), self.count)  # another rank's: the sentinel
        out = self._local(every, index, weights)
        out = funcol.wait_tensor(funcol.reduce_scatter_single_autograd(out, "sum", 0, self.group))
        return out[:rows]

    def _routed(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each row sent once to each rank holding one of its experts (all-to-all, split sizes from the routing), run
        there on the rank's experts (its other slots the sentinel), the weighted sums sent back the same way and
        added per row. The autograd all-to-all's backward is the all-to-all with the splits swapped."""
        world, count = self.world, self.count
        owner = top_k_index // count  # [R, k]: the rank holding each chosen expert
        wanted = (owner[None] == torch.arange(world, device=owner.device)[:, None, None]).any(-1)  # [world, R]
        dest, row = wanted.nonzero(as_tuple=True)  # ordered by destination rank, then row
        sent = torch.bincount(dest, minlength=world)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)  # how many rows each rank sends here
        sent, got = sent.tolist(), got.tolist()
        index = top_k_index[row] - (dest * count)[:, None]
        index = index.masked_fill((index < 0) | (index >= count), count)  # the destination's sentinel
        theirs = funcol.wait_tensor(funcol.all_to_all_single_autograd(hidden[row], got, sent, self.group))
        weights = funcol.wait_tensor(funcol.all_to_all_single_autograd(top_k_weights[row], got, sent, self.group))
        index = funcol.wait_tensor(funcol.all_to_all_single(index, got, sent, self.group))
        out = self._local(theirs, index, weights)
        back = funcol.wait_tensor(funcol.all_to_all_single_autograd(out, sent, got, self.group))
        return hidden.new_zeros(hidden.shape[0], back.shape[1], dtype=back.dtype).index_add(0, row, back)


def shard_experts(model: nn.Module, mesh) -> list[nn.Parameter]:
    """Split every fused experts module of `model` over `mesh`'s ranks in place (each rank keeps its block of
    experts, as DTensor parameters); returns the new parameters, for FSDP2 to ignore. Call only when `shardable`."""
    rank, world = mesh.get_local_rank(), mesh.size()
    out = []
    for module in expert_modules(model):
        count = module.num_experts // world
        names = []
        for name, p in expert_params(module):
            block = p.detach()[rank * count:(rank + 1) * count].clone()
            shard = nn.Parameter(DTensor.from_local(block, mesh, [Shard(0)], run_check=False,
                                                    shape=p.shape, stride=p.stride()),
                                 requires_grad=p.requires_grad)
            if shard.requires_grad:  # each rank's loss is scaled by the world size for FSDP2's mean
                shard.register_hook(lambda g, w=world: g / w)
            setattr(module, name, shard)
            names.append(name)
            out.append(shard)
        module.num_experts = count  # transformers' forward runs on the local experts, `count` its sentinel
        module._is_expert_parallel = True
        module.forward = _ExpertShard(module, names, mesh, rank)
    return out


__all__ = ["expert_modules", "expert_params", "shardable", "shard_experts"]
