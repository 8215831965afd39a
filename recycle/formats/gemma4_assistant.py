"""Gemma 4's assistants (`Gemma4AssistantForCausalLM`): Google's own drafter, which recycle drafts with,
re-aligns in its own layout and converts from (to EAGLE-3 or Medusa). The module and its drafting step are in
`recycle.drafters.gemma4`.

What an assistant needs of its target is read from the two configs alone, here beside the record: which target
layer's K/V each attention type attends (`kv_source_layers`) and whether the target caches K/V of the kinds,
head counts and sizes the assistant's layers expect (`check_fits`, the record's `fit_extra`). transformers'
config classes are imported on use, so the record itself stays as light as the others.

transformers 5.23.0 cannot build an assistant's config: `Gemma4TextConfig.kv_sharing_modes` raises for a config
whose every layer reuses K/V, which is what every assistant's text config is (5.22.2 and 5.24.0 build it).
`assistant_kv_modes()` answers "reuse" for every layer there, as 5.24.0 does, while a config or a module is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from recycle.errors import RecycleError
from recycle.formats.record import DrafterFormat, Layout, Reads

TARGET_TYPES = ("gemma4", "gemma4_text")
ASSISTANT_TYPE, ASSISTANT_FORMAT = "gemma4_assistant", "gemma4-assistant"  # config model_type; format name


@contextlib.contextmanager
def assistant_kv_modes() -> Iterator[None]:
    """transformers 5.23.0 workaround (see the module docstring); a no-op where the installed version copes."""
    from transformers.models.gemma4 import configuration_gemma4 as cg

    cls = cg.Gemma4TextConfig
    original = cls.__dict__["kv_sharing_modes"]

    def modes(self) -> list[str | None]:
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    cls.kv_sharing_modes = property(modes)
    try:
        yield
    finally:
        cls.kv_sharing_modes = original


def kv_source_layers(config) -> dict[str, int]:
    """The target layer whose K/V the assistant attends, per attention type: the last layer of that type
    before the target's own KV-shared tail (transformers' "store" layers)."""
    types = list(config.layer_types)
    first_shared = len(types) - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    out: dict[str, int] = {}
    for i, t in enumerate(types[:first_shared]):
        out[t] = i
    return out


def check_fits(assistant_config, target_config, where: str = "assistant") -> None:
    """The assistant's part of the fit check (`recycle.fit.check_drafter` has compared width and vocabulary):
    every assistant layer attends K/V of a type the target caches, with its head count and size. Configs may be
    transformers objects or config.json dicts."""
    from transformers import AutoConfig, Gemma4AssistantConfig

    a, t = assistant_config, target_config
    if isinstance(a, dict):
        with assistant_kv_modes():
            a = Gemma4AssistantConfig.from_dict(a)
    if isinstance(t, dict):
        t = AutoConfig.for_model(**t)
    t = t.get_text_config()
    text = a.get_text_config()
    sources = kv_source_layers(t)
    for i, kind in enumerate(text.layer_types):
        if kind not in sources:
            raise RecycleError(f"{where}: layer {i} attends {kind} K/V; the target caches none")
        mine, theirs = text.per_layer_config[i], t.per_layer_config[sources[kind]]
        if (mine.head_dim, mine.num_key_value_heads) != (theirs.head_dim, theirs.num_key_value_heads):
            raise RecycleError(f"{where}: layer {i} ({kind}) expects {mine.num_key_value_heads} K/V heads of "
                               f"{mine.head_dim}; the target caches {theirs.num_key_value_heads} of {theirs.head_dim}")


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
    fit_extra=check_fits,
    hooks=frozenset({"build", "engine", "unroller"}),
    layouts={"model.safetensors": Layout("Gemma4AssistantForCausalLM (transformers' assistant_model=, vLLM method mtp)")},
)
