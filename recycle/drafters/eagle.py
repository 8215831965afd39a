"""The EAGLE-style feature-chained drafter made of a checkpoint's MTP modules, kept lossless.

It is the MTP runtime (`recycle.mtp.MTP`) with canonical weights (plain-`w` norms, [e; h]
projection) plus two things drafting needs:
  * one embedding and one LM head of its own (the source's copies, or the trunk's), so a drafter
    directory runs without the target checkpoint beside it;
  * steps past the stored depth: step k runs module min(k, n-1), fed the previous step's chained
    state (the family's pre- or post-final-norm feature) and the embedding of the token drafted at
    step k-1, exactly as EAGLE feeds its own output feature back. Within the stored depth step k
    *is* MTP depth k+1, so the first step's logits equal the MTP module's.

Directory layout (written by `recycle.converters.eagle`): config.json (the source's model config plus a
`recycle` block holding the source's model type; the top-level `model_type` is recycle's own, so transformers
refuses to load the directory as a plain model), model.safetensors with `embed.weight`, `head.weight`,
`layers.{k}.{embed_norm,hidden_norm,proj,final_norm}.weight` and `layers.{k}.block.*` in the
source checkpoint's block layout (per-expert tensors); a module whose head/embedding differs from
module 0's stores `layers.{k}.head.weight` / `layers.{k}.embed.weight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import nn

from recycle.drafters.registry import BUILDERS, RUNTIME_BUILDERS
from recycle.families import BY_NAME, Family, derive
from recycle.formats.eagle import source_model_type
from recycle.mtp import MTP, family_config, to_checkpoint_layout, to_runtime_layout

T = TypeVar("T")

CANONICAL = {"norm": "w", "concat_order": "eh"}  # fields of the row's `run`


def canonical_family(name: str, chained_state: str | None = None, zero_embed_at_pos0: bool | None = None) -> Family:
    """The family row with the canonical weight conventions the converters write."""
    fam = BY_NAME[name]
    changes: dict = dict(CANONICAL)
    if chained_state is not None:
        changes["chained_state"] = chained_state
    if zero_embed_at_pos0 is not None:
        changes["zero_embed_at_pos0"] = zero_embed_at_pos0
    return derive(fam, run=changes)


class ChainedSteps:
    """What makes MTP modules a drafter, mixed in before the runtime's class: any number of steps, step k running
    module min(k, n-1) (past the stored depth the last module repeats, as distill trains it)."""

    def layer_for(self, step: int):
        """Step k (0-based) runs module min(k, n-1): past the stored depth the last module repeats."""
        return self.layers[min(step, self.depth - 1)]

    def block_to_stored(self, k: int, block: Mapping[str, T]) -> dict[str, T]:
        """Module k's block tensors (names relative to its block) under the names model.safetensors stores them:
        transformers' conversion for the block run backwards (the row's renames and its `block_conversions`). The
        one mapping every reader and writer of a drafter directory uses (whole, or a rank's slices)."""
        fam = self.family
        return to_checkpoint_layout(block, self.config, fam.run.block_renames, fam.run.block_conversions)

    def block_to_runtime(self, k: int, stored: Mapping[str, T]) -> dict[str, T]:
        """The inverse of `block_to_stored`: stored block tensors as module k's block holds them (experts fused)."""
        fam = self.family
        return to_runtime_layout(stored, self.config, fam.run.block_renames, fam.run.block_conversions)

    def file_state(self) -> dict[str, torch.Tensor]:
        """The weights under the names model.safetensors stores (each block through `block_to_stored`)."""
        state = {k: v.detach() for k, v in self.state_dict().items()}
        out = {k: v for k, v in state.items() if ".block." not in k}
        for k in range(self.depth):
            prefix = f"layers.{k}.block."
            block = {n[len(prefix):]: v for n, v in state.items() if n.startswith(prefix)}
            out.update({prefix + name: t for name, t in self.block_to_stored(k, block).items()})
        return out

    def load_stored(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a drafter directory's stored tensors (the inverse of `file_state`), every key accounted for."""
        runtime: dict[str, torch.Tensor] = {}
        blocks: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in state.items():
            parts = name.split(".", 3)
            if parts[0] == "layers" and parts[2] == "block":
                blocks.setdefault(int(parts[1]), {})[parts[3]] = t
            else:
                runtime[name] = t
        for k, block in blocks.items():
            runtime.update({f"layers.{k}.block.{n}": v for n, v in self.block_to_runtime(k, block).items()})
        self.load_state_dict(runtime, strict=True)

    @property
    def max_steps(self) -> int | None:
        return None

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, steps: int | None = None, heads: bool = True):
        """The runtime's forward with no cap on the number of steps (n = input_ids.shape[1] - T, or `steps`)."""
        return super().forward(hidden, input_ids, position_ids, attention_mask, depth=steps, heads=heads)


class EagleDrafter(ChainedSteps, MTP):
    """MTP modules run as an EAGLE-style autoregressive drafter (any number of steps)."""

    def __init__(self, config, family: Family, depth: int, roles=("embed_norm", "hidden_norm", "proj", "final_norm"),
                 own_heads: tuple[int, ...] = (), own_embeds: tuple[int, ...] = ()) -> None:
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        super().__init__(config, family, depth, roles, shared={"embed": embed, "head": head})
        self.embed, self.head = embed, head
        for k in own_heads:
            self.layers[k].head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for k in own_embeds:
            self.layers[k].embed = nn.Embedding(config.vocab_size, config.hidden_size)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, input_ids: torch.Tensor, steps: int,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy chain of `steps` tokens after the last position.

        hidden [B, T, H] are the target's states for t_0..t_{T-1}; input_ids [B, T+1] are t_0..t_T
        (t_T: the token the target just produced). Each step appends its argmax at the last
        position, so step k reads the token drafted at step k-1. Reference implementation: it
        recomputes all positions each step (no KV cache); the decoder adds caching.
        """
        t = hidden.shape[1]
        if input_ids.shape[1] != t + 1:
            raise ValueError(f"input_ids must hold T+1 = {t + 1} tokens, got {input_ids.shape[1]}")
        ids = input_ids
        for k in range(steps):
            out = self(hidden, ids, position_ids=position_ids, steps=k + 1)
            ids = torch.cat([ids, out.logits[k][:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids[:, t + 1:]


def build_eagle(config_dict: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                attn_implementation: str = "sdpa") -> EagleDrafter:
    """An EagleDrafter from its config.json dict and its checkpoint-layout state dict."""
    rc = config_dict["recycle"]
    runtime = BY_NAME[rc["family"]].run.runtime if rc.get("family") in BY_NAME else None
    if runtime is not None:  # a family with a runtime of its own (DeepSeek-V4): its own drafter (RUNTIME_BUILDERS)
        return RUNTIME_BUILDERS.get(runtime, rc["family"])(None, config_dict, state, dtype, attn_implementation)
    # The block's own model type: the `recycle` block's (the top level names recycle's, which transformers does
    # not know), or the top level's in directories written before the two were split.
    cfg = {k: v for k, v in config_dict.items() if k != "recycle"} | {"model_type": source_model_type(config_dict)}
    fam = canonical_family(rc["family"], rc.get("chained_state"), rc.get("zero_embed_at_pos0"))
    config = family_config(cfg, fam, attn_implementation)
    depth = int(rc["depth"])
    own_heads = tuple(k for k in range(depth) if f"layers.{k}.head.weight" in state)
    own_embeds = tuple(k for k in range(depth) if f"layers.{k}.embed.weight" in state)
    roles = ("embed_norm", "hidden_norm", "proj") + (("final_norm",) if "layers.0.final_norm.weight" in state else ())
    model = EagleDrafter(config, fam, depth, roles, own_heads, own_embeds)
    model.load_stored(state)
    return model.to(dtype or torch.float32).eval()


@BUILDERS.register("eagle")
def build(directory, config: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
          attn_implementation: str = "sdpa") -> EagleDrafter:
    return build_eagle(config, state, dtype, attn_implementation)
