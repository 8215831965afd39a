"""EAGLE: the MTP modules themselves as a feature-chained drafter (`recycle convert --to eagle`), lossless.
The module is `recycle.drafters.eagle.EagleDrafter`; the converter `recycle.converters.eagle`."""

from __future__ import annotations

from recycle.formats.record import DrafterFormat, Layout, Reads

FORMAT = DrafterFormat(
    name="eagle",
    title="EAGLE drafter (the MTP modules, feature-chained)",
    summary="an EAGLE-style feature-chained drafter (the MTP modules themselves, lossless)",
    convertible=True,
    detect=lambda cfg: isinstance(cfg.get("recycle"), dict),
    reads=lambda cfg, target: Reads(cfg.get("hidden_size"), cfg.get("vocab_size")),
    build="recycle.drafters.eagle:build",
    engine="recycle.decoding.drafting:eagle_engine",
    unroller="recycle.distill.unroll:EagleUnroller",
    converter="recycle.converters.eagle:convert",
    options=frozenset({"layouts"}),
    layouts={
        "model.safetensors": Layout("recycle EAGLE drafter (recycle.drafters.load_drafter)", (
            "hf download {repo} --local-dir {local}",
            "# recycle's own tree decoder (top-level model.safetensors)",
            "recycle bench {local} --target {target}")),
        "nextn/": Layout("SGLang NextN export (module 0, layer 0, num_hidden_layers 1)", (
            "# SGLang NextN (nextn/)",
            "python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE \\",
            "  --speculative-draft-model-path {local}/nextn --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4")),
        "mtp_overlay/": Layout("MTP tensors under their original names, stored bytes; `recycle stitch` puts them back", (
            "# MTP overlay (mtp_overlay/): stitch into a local copy of the target, then vLLM / llama.cpp",
            "recycle stitch {local}/mtp_overlay {target} -o {local}-stitched",
            "vllm serve {local}-stitched --speculative-config '{{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}'",
            "llama-server -m {local}-stitched.gguf --spec-type draft-mtp   # after convert_hf_to_gguf.py")),
    },
    rewrite="recycle.converters.eagle:rewrite",
    tags=("mtp",),
    native_chain=True,
)
