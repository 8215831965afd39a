"""`distill --freeze GROUP,...`: which of a drafter's weights stay as they are while the rest trains.

At DeepSeek-V3 scale the routed experts are 11.27B of the drafter's 11.61B trainable parameters: AdamW state
for them alone is ~135 GB in fp32. Freezing them leaves attention, `eh_proj`, the norms, the router and the
shared expert to re-align (0.34B parameters, one GPU), and keeps the experts' stored bytes untouched in every
written layout. The groups are data: a name and the parameter-name pattern it covers, matched against the
drafter module's own names (transformers' decoder-layer classes underneath, so the names are the same for
every family that uses them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from recycle.errors import RecycleError, did_you_mean

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Group:
    name: str
    pattern: str  # searched in the parameter's name
    what: str

    def matches(self, param: str) -> bool:
        return re.search(self.pattern, param) is not None


GROUPS: tuple[Group, ...] = (
    Group("experts", r"\.mlp\.experts\.", "the routed experts (fused or per expert)"),
    Group("shared_experts", r"\.mlp\.shared_experts?\.", "the shared expert(s)"),
    Group("router", r"\.mlp\.gate\.", "the MoE router (and its correction bias)"),
    Group("mlp", r"\.mlp\.", "the whole feed-forward part: dense MLP, or router, shared and routed experts"),
    Group("attention", r"\.self_attn\.", "attention projections and their norms"),
    Group("norms", r"(norm|layernorm)\.weight$", "every RMSNorm weight"),
    Group("projection", r"(^|\.)(proj|fc)\.weight$", "the input projection: EAGLE's eh_proj, EAGLE-3's fc"),
)
BY_NAME = {g.name: g for g in GROUPS}


def check_groups(names: Iterable[str]) -> tuple[str, ...]:
    """The group names of `--freeze experts,router` (split by the CLI), blanks and repeats dropped; an unknown name
    is bad input."""
    names = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise RecycleError(f"--freeze {','.join(unknown)}: unknown group (groups: {', '.join(BY_NAME)})"
                           f"{did_you_mean(unknown[0], BY_NAME)}")
    return names


def freeze(model: nn.Module, groups: Iterable[str]) -> dict:
    """Stop the gradient of every still-trainable parameter in `groups`; a group the drafter does not have is
    bad input (freezing nothing is never what was meant). Returns the record: groups, parameters frozen per
    group, and what still trains."""
    groups = check_groups(groups)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per_group = {}
    for name in groups:
        hit = [p for n, p in named if BY_NAME[name].matches(n)]
        if not hit:
            have = [g.name for g in GROUPS if any(g.matches(n) for n, _ in named)]
            raise RecycleError(f"--freeze {name}: this drafter has no {BY_NAME[name].what} to freeze "
                               f"(its trainable groups: {', '.join(have) or 'none'})")
        per_group[name] = sum(p.numel() for p in hit)
        for p in hit:
            p.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if groups and not trainable:
        raise RecycleError(f"--freeze {','.join(groups)} leaves nothing to train")
    return {"groups": list(groups), "frozen_params": per_group, "trainable_params": trainable,
            "params": sum(p.numel() for p in model.parameters())}


def lower_frozen(model: nn.Module, keep: tuple = ()) -> int:
    """Keep every frozen floating-point parameter in bf16 where that loses nothing (its values
    round-trip exactly: a drafter converted or stored in bf16), for a run that computes in bf16 anyway: autocast
    would cast it on every call, so the layers see the same values, in half the memory (DeepSeek-V3 with frozen
    experts: 45 GB of fp32 experts become 22.5 GB). A parameter two modules share stays shared; `keep` (the teacher's
    embedding and head, which the drafter holds as they are) is left alone. Returns the bytes saved."""
    import torch
    from torch import nn as tnn

    saved, lowered = 0, {id(p): None for p in keep}
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in lowered:
                    lowered[id(p)] = None
                    if p.requires_grad or not p.is_floating_point() or p.element_size() <= 2:
                        continue
                    low = p.to(torch.bfloat16)
                    if not torch.equal(low.to(p.dtype), p):
                        continue  # not exact in bf16: kept as it is
                    saved += p.numel() * (p.element_size() - low.element_size())
                    lowered[id(p)] = tnn.Parameter(low, requires_grad=False)
                if lowered[id(p)] is not None:
                    setattr(module, name, lowered[id(p)])
    return saved
