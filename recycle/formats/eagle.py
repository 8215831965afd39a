"""EAGLE: the MTP modules themselves as a feature-chained drafter (`recycle convert --to eagle`), lossless.
The module is `recycle.drafters.eagle.EagleDrafter`; the converter `recycle.converters.eagle`.

Its config.json is the source's model config plus a `recycle` block, under a `model_type` of its own
(`MODEL_TYPE`): with the source's model type, `AutoModelForCausalLM.from_pretrained(DIR)` would quietly build
a randomly initialised source model (none of its tensor names match), whereas an unknown model type makes
transformers refuse the directory. The source's model type moves into the `recycle` block, where
`source_model_type` reads it back; directories written before keep it at the top level, and read the same."""

from __future__ import annotations

from collections.abc import Mapping

from recycle.formats.record import DrafterFormat, Layout, Reads

MODEL_TYPE = "recycle_eagle"  # config.json's model_type: no transformers class, so no plain model loads it


def source_model_type(config: Mapping) -> str | None:
    """The transformers model type of the block an EAGLE drafter's config describes (the source family's)."""
    own = (config.get("recycle") or {}).get("model_type")
    return own or (config.get("model_type") if config.get("model_type") != MODEL_TYPE else None)


FORMAT = DrafterFormat(
    name="eagle",
    title="EAGLE drafter (the MTP modules, feature-chained)",
    summary="an EAGLE-style feature-chained drafter (the MTP modules themselves, lossless)",
    convertible=True,
    detect=lambda cfg: isinstance(cfg.get("recycle"), dict),
    reads=lambda cfg, target: Reads(cfg.get("hidden_size"), cfg.get("vocab_size")),
    hooks=frozenset({"build", "engine", "unroller", "converter", "rewrite"}),
    options=frozenset({"layouts"}),
    layouts={
        "model.safetensors": Layout("recycle EAGLE drafter (recycle.drafters.load_drafter)", (
            "# recycle's own tree decoder (top-level model.safetensors)",
            "recycle bench {local} --target {target_dir}"),
            readers="recycle's own tree decoder (`recycle bench`, `recycle distill`); no serving engine"),
        "nextn/": Layout("SGLang NextN export (module 0, layer 0, num_hidden_layers 1)", (
            "# SGLang NextN (nextn/)",
            "python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE \\",
            "  --speculative-draft-model-path {local}/nextn --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4"),
            readers="SGLang's NextN loader (`--speculative-algorithm EAGLE`; layout checked against its source)"),
        "mtp_overlay/": Layout("MTP tensors under their original names, stored bytes; `recycle stitch` puts them back", (
            "# MTP overlay (mtp_overlay/): stitch into a local copy of the target, then vLLM",
            "recycle stitch {local}/mtp_overlay --target {target_dir} -o {local}-stitched",
            "vllm serve {local}-stitched --speculative-config "
            "'{{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}'"),
            readers="vLLM 0.32 (`method: mtp`), once `recycle stitch` has put the tensors back into the target"),
    },
    loading_note=f"config.json's `model_type` is `{MODEL_TYPE}`, which transformers does not know, so "
                 "`AutoModelForCausalLM` refuses the directory instead of building a random model from it: "
                 "recycle loads it (`recycle.drafters.load_drafter`).",
    tags=("mtp",),
    native_chain=True,
    source_layout="mtp_overlay",
)
