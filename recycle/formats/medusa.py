"""Medusa heads over the target's last hidden state (`recycle convert --to medusa`), written in vLLM's layout
and FasterDecoding's; the one map between their tensor names is here. The module is
`recycle.drafters.medusa.MedusaDrafter`."""

from __future__ import annotations

from recycle.formats.record import DrafterFormat, Layout, Reads

WEIGHTS = "model.safetensors"  # vLLM's layout
FD_WEIGHTS = "medusa_lm_head.safetensors"  # FasterDecoding's (TGI, TensorRT-LLM)


def faster_decoding_names(heads: int, layers: int) -> dict[str, str]:
    """vLLM's tensor name → FasterDecoding Medusa v1's, for every tensor of `heads` heads of `layers` ResBlocks:
    blocks.{i}.layers.{j}.{weight,bias} → {i}.{j}.linear.{weight,bias}; lm_heads.{i}.weight → {i}.{layers}.weight."""
    names = {}
    for i in range(heads):
        for j in range(layers):
            for p in ("weight", "bias"):
                names[f"blocks.{i}.layers.{j}.{p}"] = f"{i}.{j}.linear.{p}"
        names[f"lm_heads.{i}.weight"] = f"{i}.{layers}.weight"
    return names


FORMAT = DrafterFormat(
    name="medusa",
    title="Medusa heads",
    summary="Medusa heads over the target's last hidden state",
    convertible=True,
    detect=lambda cfg: cfg.get("model_type") == "medusa" or "medusa_num_heads" in cfg,
    reads=lambda cfg, target: Reads(cfg.get("hidden_size"), cfg.get("vocab_size")),
    hooks=frozenset({"build", "engine", "unroller", "converter", "calibrate", "rewrite"}),
    options=frozenset({"heads", "calibrate", "target", "data"}),
    layouts={
        WEIGHTS: Layout("vLLM Medusa layout (blocks.*, lm_heads.*)", (
            "# vLLM (chain drafting)",
            "vllm serve {target} --speculative-config "
            "'{{\"model\": \"{repo}\", \"method\": \"medusa\", \"num_speculative_tokens\": {heads}}}'"),
            readers="vLLM 0.32 (`method: medusa`, chain drafting)"),
        FD_WEIGHTS: Layout("FasterDecoding Medusa v1 layout ({i}.{j}.linear.*, {i}.L.weight)", (
            "# TGI / TensorRT-LLM read medusa_lm_head.safetensors (FasterDecoding layout)",),
            readers="FasterDecoding's Medusa v1 readers (TGI, TensorRT-LLM; not run by recycle's tests)", whole=True),
    },
    serving_note="SGLang and llama.cpp have no Medusa support.",
    loading_note="config.json (`model_type: medusa`, `architectures: [MedusaModel]`) is what vLLM and FasterDecoding "
                 "read, so it stays as they expect; transformers has no Medusa class, and the directory is heads "
                 "over the target's last state, not a standalone model.",
    single_pass=True,
    static_tree=True,
)
