"""Gemma 4's MTP assistants (`gemma4_assistant`): load one, run one drafting step.

Google ships Gemma 4's multi-token predictor as a separate model per instruct target
(`Gemma4AssistantForCausalLM`). It is already a drafter, so recycle runs it as transformers defines it:
  * one step reads `[target_embed(last token); last hidden]` (the target's scaled embedding and its
    final-normed state, 2·H_target wide) through `pre_projection`;
  * its layers are Q-only: every layer attends the K/V the target itself cached, taken from the target's
    last non-shared layer of each attention type (full, sliding), at the positions before the last token;
  * the position id stays that of the last committed token for the whole round, and the assistant keeps
    no cache of its own, so every node of a draft tree is one row, independent of its siblings;
  * `post_projection` maps the output back to the target's width: the next step's "last hidden";
  * logits from the tied head (`use_ordered_embeddings`: centroid-masked logits, transformers' own module).

What it needs of its target (`kv_source_layers`, the fit check) and the transformers 5.23.0 workaround every
assistant is built under (`assistant_kv_modes`) are read from configs alone: `recycle.formats.gemma4_assistant`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from recycle.drafters.registry import BUILDERS
from recycle.errors import RecycleError
from recycle.formats.gemma4_assistant import assistant_kv_modes, kv_source_layers


def new_assistant(config) -> nn.Module:
    """A Gemma4AssistantForCausalLM from its config (random weights), under the 5.23.0 workaround."""
    from transformers import Gemma4AssistantForCausalLM

    with assistant_kv_modes():
        return Gemma4AssistantForCausalLM(config)


def build_assistant(directory: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> nn.Module:
    """The assistant from its directory's config (and generation config) and its stored tensors (`load_drafter`
    reads them); the head is tied to the embedding, so it is not stored."""
    from transformers import Gemma4AssistantConfig, GenerationConfig

    try:
        config = Gemma4AssistantConfig.from_pretrained(directory)
    except Exception as e:  # whatever a malformed config makes transformers raise
        raise RecycleError(f"{directory}/config.json: not a Gemma 4 assistant config "
                           f"({' '.join(str(e).split())[:160]})") from None
    config.get_text_config()._attn_implementation = "sdpa"
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise RecycleError(f"{directory}: non-finite values in {bad[0]}")
    model = new_assistant(config)
    missing, unexpected = model.load_state_dict({"lm_head.weight": state.get("model.embed_tokens.weight"), **state},
                                                strict=False)
    missing = [k for k in missing if not k.endswith("layer_scalar")]
    if missing or unexpected:
        raise RecycleError(f"{directory}: assistant weights missing {missing[:3]} / unexpected {unexpected[:3]}")
    model.tie_weights()
    if (directory / "generation_config.json").is_file():  # num_assistant_tokens, for transformers' assistant_model=
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.to(dtype or torch.float32).eval()


def stored_state(assistant: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an assistant's model.safetensors holds: the head is tied to its embedding (not stored), the
    centroid tables only when the assistant uses them."""
    return {k: v.detach() for k, v in assistant.state_dict().items() if k != "lm_head.weight"
            and (assistant.config.use_ordered_embeddings or not k.startswith("masked_embedding."))}


def hidden(assistant: nn.Module, inputs: torch.Tensor, positions: torch.Tensor,
           kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
           mask: torch.Tensor | dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The assistant's final-normed output [B, N, h] for rows of inputs [B, N, 2·Hb] = [target embedding; state]
    at positions [B, N], attending kv {type: (keys, values) [B, kvh, S, d]} under an additive mask [B|1, 1, N, S]
    (one per layer type, or one for all; None: every row sees all of its type's keys); what transformers' forward
    does, with the mask given explicitly (its own builds a bidirectional mask from a padding mask, one row per
    query)."""
    x = assistant.pre_projection(inputs)
    if not isinstance(mask, dict):
        mask = {k: x.new_zeros(1, 1, x.shape[1], v[0].shape[-2]) if mask is None else mask for k, v in kv.items()}
    # logits_to_keep as a slice: transformers 5.23.0 otherwise "optimises" a multi-row call by slicing the
    # per-layer inputs, which an assistant does not have (None[...] raises)
    return assistant.model(inputs_embeds=x, attention_mask=mask, position_ids=positions,
                           shared_kv_states=kv, use_cache=False, logits_to_keep=slice(None)).last_hidden_state


def head(assistant: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Logits of final-normed outputs: the tied head, or its centroid-masked form (`use_ordered_embeddings`)."""
    if assistant.config.use_ordered_embeddings:
        return assistant.masked_embedding(out, assistant.lm_head.weight)
    return assistant.lm_head(out)


def step(assistant: nn.Module, inputs: torch.Tensor, positions: torch.Tensor,
         kv: dict[str, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafting step (see `hidden`): (logits [B, N, V], next state [B, N, Hb] = post_projection(output))."""
    out = hidden(assistant, inputs, positions, kv, mask)
    return head(assistant, out), assistant.post_projection(out)


def strictly_before(t: int, length: int, dtype: torch.dtype, device: torch.device,
                    window: int | None = None) -> torch.Tensor:
    """Additive mask [1, 1, t, length]: row r (position r+1) sees the target's K/V at positions ≤ r, and with a
    `window` only those within it of the query (`window_start`)."""
    allow = torch.ones(t, length, dtype=torch.bool, device=device).tril_()
    if window is not None:
        allow.triu_(1 - window)
    return torch.zeros(allow.shape, dtype=dtype, device=device).masked_fill_(~allow, torch.finfo(dtype).min)[None, None]


def window_start(position: int, window: int | None) -> int:
    """The first key a sliding layer's query at `position` reads: the `window` positions before it. The query's own
    token has no key yet (the target has not run it), so the keys are those the target's layer would read from the
    query's input token one position earlier, its own key included: what vLLM's Gemma 4 proposer reads, whose query
    sits there (`constant_draft_positions`). transformers' candidate generator reads what the target's sliding
    cache still holds, under a bidirectional window of `window` + 1 (`create_attention_masks`), which depends on
    how many tokens the last verification added."""
    return 0 if window is None else max(0, position - window)


def teacher_forced(assistant: nn.Module, embed: nn.Module, ids: torch.Tensor, last: torch.Tensor,
                   kv: dict[str, tuple[torch.Tensor, torch.Tensor]], steps: int, rows: int) -> list[torch.Tensor]:
    """A chain of `steps` at every anchor r < rows of a window: step k reads token r+k+1 of `ids` (the window
    itself, or the target's greedy tokens) and predicts token r+k+2; the first step reads the target's state at r,
    later ones the previous step's. Returns the final-normed output [B, rows, h] per step (`head` makes logits)."""
    b, length = ids.shape
    pos = torch.arange(1, rows + 1, device=ids.device)[None].expand(b, rows)
    window = assistant.config.get_text_config().sliding_window
    mask = {t: strictly_before(rows, length, last.dtype, ids.device, window if t == "sliding_attention" else None)
            for t in kv}
    state, out = last[:, :rows], []
    for k in range(steps):
        x = torch.cat([embed(ids[:, k + 1:k + 1 + rows]).to(state.dtype), state], dim=-1)
        normed = hidden(assistant, x, pos, kv, mask)
        state = assistant.post_projection(normed)
        out.append(normed)
    return out


def target_states_and_kv(decoder: nn.Module, config, ids: torch.Tensor, layers: dict[str, int] | None = None
                         ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The target's final-normed states and the K/V its assistant attends (`kv_source_layers`), for whole windows:
    the sliding layers keep every key (the model's mask applies their window; `teacher_forced` applies the
    assistant's)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(lyr) is DynamicSlidingWindowLayer else lyr for lyr in cache.layers]
    out = decoder(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.last_hidden_state, {t: (cache.layers[i].keys, cache.layers[i].values)
                                   for t, i in (layers or kv_source_layers(config)).items()}


@BUILDERS.register("gemma4-assistant")
def build(directory: Path, config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
          attn_implementation: str = "sdpa") -> nn.Module:
    return build_assistant(directory, state, dtype)
