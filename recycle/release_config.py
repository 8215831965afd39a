"""Config readers for releases whose model type transformers has no config class for.

A row names its reader (`ConfigKeys.release_config`); the reader turns the release's own config.json keys, the ones
the engines read, into the keys of the transformers config class whose decoder layers run the model. The block config
(`recycle.mtp.family_config`) and the target's config (`recycle.decoding.placed.model_config`) both go through
`transformers_keys`, so the MTP block and the trunk are built from one reading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from recycle.errors import RecycleError
from recycle.registry import Registry

Reader = Callable[[Mapping], dict]
READERS: Registry[Reader] = Registry("release config reader")


def transformers_keys(raw: Mapping, reader: str | None, title: str | None = None) -> dict:
    """`raw` (a config.json) as the transformers config class reads it: through the row's reader, if it names one."""
    return dict(raw) if reader is None else READERS.get(reader, title)(raw)


@READERS.register("mimo_v2")
def mimo_v2(raw: Mapping) -> dict:
    """XiaomiMiMo's `mimo_v2` (MiMo-V2.5, V2.5-Pro; MiMo-V2-Flash's release config too, where transformers' own keys
    are absent and its config class would fall back on defaults) as transformers' MiMoV2FlashConfig: the keys vLLM's
    `mimo_v2.py` reads (`hybrid_layer_pattern`: 1 = sliding window; `moe_layer_freq`: 1 = MoE; `layernorm_epsilon`;
    `rope_theta`, `swa_rope_theta`, `partial_rotary_factor`; `sliding_window_size`, which the config class widens by
    the query itself). transformers' layer gives a sliding-window layer the full-attention layers' heads and twice their KV
    heads, always with sink biases, and no full-attention layer sinks: a config that says otherwise is refused in one
    line rather than run as something else. `attention_value_scale` is taken as stored, None when absent (vLLM then
    scales nothing; the config class's default would scale by 0.707)."""
    out = {k: v for k, v in raw.items() if k != "quantization_config"}
    out["model_type"] = "mimo_v2_flash"
    layers = int(raw.get("num_hidden_layers") or 0)
    pattern = raw.get("hybrid_layer_pattern")
    if "layer_types" not in raw and isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if p == 1 else "full_attention" for p in pattern[:layers]]
    freq = raw.get("moe_layer_freq")
    if "mlp_layer_types" not in raw and freq is not None:
        out["mlp_layer_types"] = [("sparse" if f else "dense") for f in freq[:layers]] if isinstance(freq, list) \
            else ["dense"] * layers  # an int: vLLM builds no MoE layer (`is_moe_layer`)
    if "rms_norm_eps" not in raw and raw.get("layernorm_epsilon") is not None:
        out["rms_norm_eps"] = raw["layernorm_epsilon"]
    if "rope_parameters" not in raw:
        full = float(raw.get("rope_theta", 1_000_000))
        factor = float(raw.get("partial_rotary_factor", 1.0))
        out["rope_parameters"] = {
            kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
            for kind, theta in (("full_attention", full), ("sliding_attention", float(raw.get("swa_rope_theta", full))))
        }
    out["attention_value_scale"] = raw.get("attention_value_scale")
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    same = {"swa_num_attention_heads": heads, "swa_head_dim": raw.get("head_dim"),
            "swa_v_head_dim": raw.get("v_head_dim", raw.get("head_dim")),
            "swa_num_key_value_heads": 2 * kv if isinstance(kv, int) else None}
    for key, want in same.items():
        if key in raw and raw[key] != want:
            raise RecycleError(f"config.json: {key} is {raw[key]}, and transformers' MiMo-V2 sliding-window layer "
                               f"(which recycle runs) has {want}; recycle cannot run this release")
    if "add_swa_attention_sink_bias" in raw and not raw["add_swa_attention_sink_bias"]:
        raise RecycleError("config.json: add_swa_attention_sink_bias is false, and transformers' MiMo-V2 "
                           "sliding-window layer always has sink biases; recycle cannot run this release")
    if raw.get("add_full_attention_sink_bias"):
        raise RecycleError("config.json: add_full_attention_sink_bias is true, and transformers' MiMo-V2 full-attention "
                           "layer has no sink biases; recycle cannot run this release")
    return out
