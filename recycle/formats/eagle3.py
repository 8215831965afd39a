"""EAGLE-3: one Llama (or MLA) layer over the target's fused aux features (`recycle convert --to eagle3`),
in the official/SpecForge layout with speculators' keys. The module is `recycle.drafters.eagle3.Eagle3Drafter`.

Which target layers it reads lives here, beside the record, as two rules: what a config names (else the
engines' own default), and what recycle writes for a drafter folded from MTP modules."""

from __future__ import annotations

from collections.abc import Mapping

from recycle.formats.record import DrafterFormat, Layout, Reads

MLA_MODEL_TYPE = "deepseek_v2"  # the MLA-attention variant's config (vLLM's Eagle3DeepseekV2ForCausalLM)


def engine_aux_layers(n: int) -> list[int]:
    """The layers engines capture for an EAGLE-3 drafter whose config names none: vLLM's and SGLang's
    default (2, N//2, N-3), clipped for tiny trunks."""
    return [min(2, n), n // 2, max(n - 3, 0)]


def fold_aux_layers(n: int) -> list[int]:
    """The layers recycle names (always, in config.json) for a drafter folded from MTP modules: three distinct
    ones like the engines' default, but ending at N-1 (the deepest state vLLM captures), since MTP modules
    were trained on the last state. Trunks of fewer than 3 layers get [0, 1, 2] (2 = N: the final state,
    which speculators accepts but vLLM does not capture)."""
    if n < 3:
        return [0, 1, 2]
    last = n - 1
    mid = n // 2 if n // 2 < last else last - 1
    first = 2 if 2 < mid else mid - 1
    return [first, mid, last]


def aux_layers(config: Mapping, n: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 drafter reads: its config's ids (top level, or speculators' eagle_config),
    else what the engines capture by default."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in (ids or engine_aux_layers(n)))


def _reads(config: Mapping, target: Mapping) -> Reads:
    n = int(target.get("num_hidden_layers") or 0)
    return Reads(config.get("target_hidden_size") or config.get("hidden_size"), config.get("vocab_size"),
                 aux_layers(config, n))


FORMAT = DrafterFormat(
    name="eagle3",
    title="EAGLE-3 drafter",
    summary="an EAGLE-3 drafter (one Llama layer over fused target features)",
    convertible=True,
    detect=lambda cfg: "draft_vocab_size" in cfg or cfg.get("speculators_model_type") == "eagle3",
    reads=_reads,
    hooks=frozenset({"build", "engine", "unroller", "converter", "calibrate"}),
    options=frozenset({"draft_vocab", "vocab_corpus", "eagle3_attention", "eagle3_mlp", "target", "calibrate", "data",
                       "eagle3_names"}),
    # SpecForge's and SGLang's `midlayer.*`, or speculators' `layers.0.*` (speculators 0.9 leaves a midlayer.* file's
    # layer randomly initialised; SGLang @03d5a777 drops layers.0.* silently; vLLM reads both)
    aliases=(("midlayer.", "layers.0."),),
    spellings={"official": None, "speculators": "layers.0."},
    layouts={"model.safetensors": Layout(
        "EAGLE-3 official/SpecForge layout (midlayer.*), speculators keys in config.json", (
            "# vLLM",
            "vllm serve {target} --speculative-config "
            "'{{\"model\": \"{repo}\", \"method\": \"eagle3\", \"num_speculative_tokens\": 3}}'",
            "vllm serve {repo}   # speculators config names the verifier {verifier}",
            "# SGLang",
            "python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 \\",
            "  --speculative-draft-model-path {repo} --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4"),
        readers="vLLM 0.32 (`method: eagle3`) and SGLang (`--speculative-algorithm EAGLE3`; layout checked against "
                "its loader); with `--eagle3-names speculators` (`layers.0.*`) vLLM and speculators 0.9.0 instead of "
                "SGLang; the MLA-attention variant loads in vLLM only",
        refused_by=lambda cfg: ("SGLang", "speculators") if cfg.get("model_type") == MLA_MODEL_TYPE else ())},
    loading_note="config.json is the engines' (`architectures: [LlamaForCausalLMEagle3]`, `model_type: llama`; the "
                 "MLA variant's `Eagle3DeepseekV2ForCausalLM`): vLLM, SGLang and speculators look those values up, so "
                 "they stay, and transformers' `AutoModelForCausalLM` would build an untrained one-layer model from "
                 "it. The directory is one draft layer over the target's features, not a standalone model.",
)
