"""DeepSeek-V4's MTP modules as a `--to eagle` drafter directory's module (`HyperEagleDrafter`): the runtime
`recycle.mtp.deepseek_v4.DeepseekV4MTP` with an embedding and a head of its own (copies of the trunk's), and any
number of steps, step k running module min(k, n−1), as `EagleDrafter` does for the common layout. It reads the
target's hyper-connection streams [B, T, C, H] (the decoder's "streams" tap, the teacher's streams), never one state.

Directory layout (`recycle.converters.eagle` writes it; `RUNTIME_BUILDERS["deepseek_v4"]` reads it): config.json
(the source's config, `compress_ratios` included, under recycle's model type), model.safetensors with `embed.weight`,
`head.weight`, `layers.{k}.{embed_norm,hidden_norm,e_proj,h_proj,final_norm}.weight`,
`layers.{k}.hc_head.{hc_fn,hc_base,hc_scale}` and `layers.{k}.block.*` in DeepSeek's own names (`attn.wq_a.weight`,
`ffn.experts.3.w2.weight`, ...), the module's tensors as the release stores them under `mtp.{k}.`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import nn

from recycle.drafters.eagle import ChainedSteps, canonical_family
from recycle.drafters.registry import RUNTIME_BUILDERS
from recycle.families import Family
from recycle.formats.eagle import source_model_type
from recycle.mtp import family_config, to_checkpoint_layout, to_runtime_layout
from recycle.mtp.deepseek_v4 import NATIVE_FIXES, DeepseekV4MTP, mtp_types_from_ratios

T = TypeVar("T")


class HyperEagleDrafter(ChainedSteps, DeepseekV4MTP):
    """DeepSeek-V4's modules chained for any number of steps, with their own embedding and head."""

    def __init__(self, config, family: Family, depth: int) -> None:
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        super().__init__(config, family, depth, shared={"embed": embed, "head": head})
        self.embed, self.head = embed, head

    def block_to_stored(self, k: int, block: Mapping[str, T]) -> dict[str, T]:
        """`ChainedSteps.block_to_stored` for V4: transformers' conversion run backwards at the module's layer index
        (its renames need the layer's prefix), then DeepSeek's own spellings (`NATIVE_FIXES`)."""
        at = f"layers.{int(self.config.num_hidden_layers) + k}."
        out = {}
        for name, t in to_checkpoint_layout({at + n: v for n, v in block.items()}, self.config,
                                            self.family.run.block_renames).items():
            for wrong, right in NATIVE_FIXES:
                name = name.replace(wrong, right)
            out[name.removeprefix(at)] = t
        return out

    def block_to_runtime(self, k: int, stored: Mapping[str, T]) -> dict[str, T]:
        """The inverse of `block_to_stored` (at the module's layer index)."""
        at = f"layers.{int(self.config.num_hidden_layers) + k}."
        return {name.removeprefix(at): t for name, t in to_runtime_layout(
            {at + n: v for n, v in stored.items()}, self.config, self.family.run.block_renames).items()}


@RUNTIME_BUILDERS.register("deepseek_v4")
def build(directory, config_dict: Mapping, state: Mapping[str, torch.Tensor] | None,
          dtype: torch.dtype | None = None, attn_implementation: str = "eager") -> HyperEagleDrafter:
    """A HyperEagleDrafter from its config.json dict and its stored tensors (RuntimeError/KeyError where they do
    not fit: `load_drafter` makes that one line); `state` None: its shape alone, nothing loaded (the memory plan
    builds it so, on the meta device)."""
    rc = config_dict["recycle"]
    raw = {k: v for k, v in config_dict.items() if k != "recycle"} | {"model_type": source_model_type(config_dict)}
    fam = canonical_family(rc["family"])
    config = family_config(raw, fam, fam.run.attn_implementation or attn_implementation)
    base = int(config.num_hidden_layers)
    mtp_types_from_ratios(config, raw, base)
    model = HyperEagleDrafter(config, fam, int(rc["depth"]))
    if state is None:
        return model
    model.load_stored(state)
    return model.to(dtype or torch.float32).keep_fp32().eval()
