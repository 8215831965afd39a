"""Expert parallelism for a sharded distillation: each rank holds 1/world of every fused routed-expert tensor.

Why: transformers fuses a MoE block's routed experts into one 3-D parameter per projection (DeepSeek-V3's drafter:
256 experts, 11.3B parameters). Under FSDP2 alone that parameter sits in the decoder layer's unit, so the rank
running the layer gathers all of it, with its gradient in backward (42.9 GiB in bf16 at DeepSeek-V3 width), and the
plan for eight H100s with every expert trained stays over 70 GB per rank. Here the experts are instead split along
their first dimension (experts `rank*E/world .. (rank+1)*E/world` on each rank) and never gathered: the tokens go to
the experts. Each call all-gathers the ranks' rows (hidden states, routed indices, routing weights), runs this rank's
experts on every row routed to them (transformers' own experts forward, with its expert-parallel sentinel for the
rows routed elsewhere), and reduce-scatters the sum back to the rows' ranks. The collectives are torch's autograd
collectives, so the backward is their transpose (reduce-scatter of the inputs' gradients, all-gather of the
outputs'), and every rank's router and attention get the gradient of the experts on other ranks.

The shards are DTensors (`Shard(0)` on the run's device mesh, the one FSDP2 uses), so what reads parameters
already understands them: gradient clipping's global norm, AdamW, the per-rank DCP checkpoints, `full_tensor()` for
the best snapshot and the written drafter. FSDP2 ignores them (its reduce-scatter must not average them: an
expert's gradient is whole on its one rank). Their gradient arrives `world` times the step's, because distill scales
each rank's loss by the world size for FSDP2's averaging; a hook divides it back.

Equal row counts are not required: each call pads the ranks' rows to the largest (an all-reduce of one integer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard


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

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.inside:
            return self.inner(hidden, top_k_index, top_k_weights)
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
        local = {n: getattr(self.module, n).to_local() for n in self.names}
        if torch.is_autocast_enabled(hidden.device.type):  # one cast of the shard per call, as autocast would per expert
            low = torch.get_autocast_dtype(hidden.device.type)
            local = {n: t.to(low) if t.is_floating_point() else t for n, t in local.items()}
        self.inside = True
        try:
            out = torch.func.functional_call(self.module, local, (every, index, weights), strict=False)
        finally:
            self.inside = False
        out = funcol.wait_tensor(funcol.reduce_scatter_single_autograd(out, "sum", 0, self.group))
        return out[:rows]


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
