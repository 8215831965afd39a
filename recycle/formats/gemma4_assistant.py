"""Gemma 4's assistants (`Gemma4AssistantForCausalLM`): Google's own drafter, which recycle drafts with,
re-aligns in its own layout and converts from (to EAGLE-3 or Medusa). The module and its drafting step are in
`recycle.drafters.gemma4`."""

from __future__ import annotations

from recycle.formats.record import DrafterFormat, Layout, Reads

TARGET_TYPES = ("gemma4", "gemma4_text")
ASSISTANT_TYPE, ASSISTANT_FORMAT = "gemma4_assistant", "gemma4-assistant"  # config model_type; format name


def _reads(config: dict, target: dict) -> Reads:
    text = config.get("text_config") or {}
    return Reads(config.get("backbone_hidden_size"), text.get("vocab_size"), target_types=TARGET_TYPES,
                 hidden_key="backbone_hidden_size")


FORMAT = DrafterFormat(
    name=ASSISTANT_FORMAT,
    title="Gemma 4 assistant",
    summary="a Gemma 4 assistant (Q-only layers over the target's own KV cache)",
    detect=lambda cfg: cfg.get("model_type") == ASSISTANT_TYPE,
    reads=_reads,
    fit_extra="recycle.drafters.gemma4:check_fits",
    build="recycle.drafters.gemma4:build",
    engine="recycle.decoding.drafting:assistant_engine",
    unroller="recycle.distill.unroll:AssistantUnroller",
    layouts={"model.safetensors": Layout("Gemma4AssistantForCausalLM (transformers' assistant_model=, vLLM method mtp)")},
)
