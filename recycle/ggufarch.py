"""How llama.cpp names an MTP module and its hyper-parameters in a GGUF file, per llama.cpp architecture, as data.

A family row of `recycle.families` points at one `GGUFArch` (`Family.gguf`); `recycle convert --to gguf`
(`recycle.converters.gguf`) reads nothing else to write a side file. llama.cpp, at the commit the
`llama-cpp-python` 0.3.36 sdist vendors (0c1e570; file:line below are of that tree), loads an MTP-only GGUF passed
with `-md` as a model of the trunk's architecture whose `block_count` is the trunk's plus one and whose only block
is `blk.{n}` (n = the trunk's layer count; `src/models/glm4-moe.cpp:32-36`, `src/models/deepseek2.cpp:59-63` tell
an MTP-only file by its missing `blk.0.attn_norm`): the module's decoder block under the trunk's own per-layer
names, plus `blk.{n}.nextn.{eh_proj,enorm,hnorm,embed_tokens,shared_head_head,shared_head_norm}`
(`gguf-py/gguf/constants.py:1992-1997`; embed_tokens, shared_head_* optional: `glm4-moe.cpp:118-120`,
`deepseek2.cpp:156-158`), and the trunk's `token_embd` and `output_norm`, which its loaders create as required
tensors (`glm4-moe.cpp:45,48`, `deepseek2.cpp:84,87`). Only one module: both MTP graphs assert
`n_layer_nextn == 1` (`glm4-moe.cpp:135`, `deepseek2.cpp:173`).

Block names: (regex over the block's tensor names relative to its prefix, GGUF name template). `{n}` is the
block index, `{0}`, `{1}` the regex's groups. Routed experts are stacked into one 3-D tensor per projection
(`ffn_{gate,up,down}_exps`, expert-major), as llama.cpp's converter stacks them (`conversion/glm.py:218`,
`conversion/deepseek.py:415`); MLA's `kv_b_proj` is split per head into `attn_k_b` (transposed) and `attn_v_b`
(`conversion/deepseek.py:434`).

Hyper-parameters: (key under `{arch}.`, GGUF value type, a function of the merged HF config returning the value,
or None to leave the key out), in the order llama.cpp's converter writes them. The side file's block_count and
nextn_predict_layers are set by the converter, not here. Values were checked against the converter's output for
the bundled fixtures (tests/engines/test_llama_cpp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# GGUF value types (gguf.GGUFValueType), by name: this module imports nothing heavy
U32, F32, BOOL, STR = "UINT32", "FLOAT32", "BOOL", "STRING"
I32_ARRAY, F32_ARRAY, BOOL_ARRAY = "ARRAY:INT32", "ARRAY:FLOAT32", "ARRAY:BOOL"  # "ARRAY:<element type>"
SIGMOID, SOFTMAX, SQRT_SOFTPLUS = 2, 1, 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* (src/llama-hparams.h)
YARN = "yarn"

Getter = Callable[[Mapping], object]


def _rope(cfg: Mapping) -> Mapping:
    """transformers 5 keeps rope settings under `rope_parameters`; older configs under `rope_scaling` + `rope_theta`."""
    return cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")}


def _yarn(cfg: Mapping, key: str):
    r = _rope(cfg)
    return r.get(key) if r.get("rope_type", r.get("type")) == YARN and r.get("factor") is not None else None


def _gating(cfg: Mapping, default: int | None = None):
    return {"sigmoid": SIGMOID, "softmax": SOFTMAX}.get(cfg.get("scoring_func"), default)


def _if_true(value):
    return True if value else None


@dataclass(frozen=True)
class GGUFArch:
    arch: str  # general.architecture: llama.cpp's LLM_ARCH name
    block: tuple[tuple[str, str], ...]  # (regex over block-relative names, GGUF template)
    hparams: tuple[tuple[str, str, Getter], ...]  # (key under "{arch}.", value type, getter)
    tokenizer_pre: str  # llama.cpp's pre-tokenizer name for the family's released tokenizer
    source: str  # where llama.cpp defines the MTP graph (file), for messages and the record
    split_kv_b: bool = False  # MLA: kv_b_proj -> attn_k_b (transposed per head) + attn_v_b
    experts: str = r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"  # stacked into ffn_{2}_exps
    f32: tuple[str, ...] = (".bias", "_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias")  # kept float32
    # Zero-centred norms ((1+w)·x̂, Qwen3-Next/3.5): llama.cpp's graph multiplies by the stored weight, so its
    # converter stores w + 1 (in the checkpoint's dtype, then cast); every tensor whose GGUF name ends so.
    norm_offset: float = 0.0
    norms: tuple[str, ...] = ("norm.weight",)
    # where the module's LM head goes: its own nextn tensor, or the file's `output` (llama.cpp's Qwen3.5 export)
    head: str = "blk.{n}.nextn.shared_head_head.weight"
    # routed experts' projection names (the `experts` regex's second group) → llama.cpp's ffn_{gate,up,down}_exps
    expert_names: Mapping[str, str] = field(default_factory=lambda: {p: p for p in ("gate", "up", "down")})
    # module roles beyond NEXTN's (a family runtime's own, DeepSeek-V4's hc_head) → their GGUF name
    leaves: Mapping[str, str] = field(default_factory=dict)
    # one GGUF tensor made of several roles, concatenated along the input (last) dim in this order
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # routed experts stored FP4 with e8m0 scales (DeepSeek-V4's `mxfp4_native`) are written as GGML MXFP4 blocks,
    # repacked bit for bit whatever --dtype says (as llama.cpp's converter does; f32 would be 8x the bytes)
    fp4_experts: bool = False


# The trunk tensors the side file carries (llama.cpp creates them as required tensors), by GGUF name.
TRUNK = {"token_embd.weight": "embed", "output_norm.weight": "final_norm"}
# The module's leaves (canonical roles of recycle.converters.roles) under blk.{n}.nextn.*
NEXTN = {"proj": "eh_proj", "embed_norm": "enorm", "hidden_norm": "hnorm", "embed": "embed_tokens",
         "head": "shared_head_head", "final_norm": "shared_head_norm"}

# Per-layer names every DeepSeek/GLM-style MoE block shares (llama.cpp's LLM_TENSOR_* names).
MOE_FFN = (
    (r"^input_layernorm\.weight$", "blk.{n}.attn_norm.weight"),
    (r"^mlp\.gate\.weight$", "blk.{n}.ffn_gate_inp.weight"),
    (r"^mlp\.gate\.e_score_correction_bias$", "blk.{n}.exp_probs_b.bias"),
    (r"^mlp\.shared_experts\.(gate|up|down)_proj\.weight$", "blk.{n}.ffn_{0}_shexp.weight"),
    (r"^mlp\.(gate|up|down)_proj\.weight$", "blk.{n}.ffn_{0}.weight"),  # a dense MTP block
)

COMMON_HPARAMS: tuple[tuple[str, str, Getter], ...] = (
    ("context_length", U32, lambda c: c.get("max_position_embeddings")),
    ("embedding_length", U32, lambda c: c.get("hidden_size")),
    ("feed_forward_length", U32, lambda c: c.get("intermediate_size")),
    ("attention.head_count", U32, lambda c: c.get("num_attention_heads")),
)
ROPE_AND_EXPERTS: tuple[tuple[str, str, Getter], ...] = (
    ("rope.scaling.type", STR, lambda c: YARN if _yarn(c, "factor") is not None else None),
    ("rope.scaling.factor", F32, lambda c: _yarn(c, "factor")),
    ("rope.scaling.original_context_length", U32, lambda c: _yarn(c, "original_max_position_embeddings")),
    ("rope.scaling.yarn_beta_fast", F32, lambda c: _yarn(c, "beta_fast")),
    ("rope.scaling.yarn_beta_slow", F32, lambda c: _yarn(c, "beta_slow")),
    ("rope.freq_base", F32, lambda c: _rope(c).get("rope_theta")),
    ("attention.layer_norm_rms_epsilon", F32, lambda c: c.get("rms_norm_eps")),
    ("expert_count", U32, lambda c: c.get("n_routed_experts")),
    ("expert_used_count", U32, lambda c: c.get("num_experts_per_tok")),
    ("expert_group_count", U32, lambda c: c.get("n_group")),
    ("expert_group_used_count", U32, lambda c: c.get("topk_group")),
)

GLM4MOE = GGUFArch(
    arch="glm4moe",
    block=(
        *MOE_FFN,
        (r"^self_attn\.(q|k|v)_proj\.(weight|bias)$", "blk.{n}.attn_{0}.{1}"),
        (r"^self_attn\.o_proj\.weight$", "blk.{n}.attn_output.weight"),
        (r"^self_attn\.(q|k)_norm\.weight$", "blk.{n}.attn_{0}_norm.weight"),
        (r"^post_attention_layernorm\.weight$", "blk.{n}.post_attention_norm.weight"),
    ),
    hparams=(
        *COMMON_HPARAMS,
        ("attention.head_count_kv", U32, lambda c: c.get("num_key_value_heads")),
        *ROPE_AND_EXPERTS,
        ("attention.key_length", U32, lambda c: c.get("head_dim")),
        ("attention.value_length", U32, lambda c: c.get("head_dim")),
        ("rope.dimension_count", U32, lambda c: int((c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
                                                    * (_rope(c).get("partial_rotary_factor")
                                                       or c.get("partial_rotary_factor") or 0.5))),
        ("expert_feed_forward_length", U32, lambda c: c.get("moe_intermediate_size")),
        ("expert_shared_count", U32, lambda c: c.get("n_shared_experts")),
        ("leading_dense_block_count", U32, lambda c: c.get("first_k_dense_replace")),
        ("expert_gating_func", U32, lambda c: SIGMOID),
        ("expert_weights_scale", F32, lambda c: c.get("routed_scaling_factor")),
        ("expert_weights_norm", BOOL, lambda c: c.get("norm_topk_prob")),
    ),
    tokenizer_pre="glm4",
    source="src/models/glm4-moe.cpp",
)

DEEPSEEK2 = GGUFArch(
    arch="deepseek2",
    block=(
        *MOE_FFN,
        (r"^self_attn\.q_a_proj\.weight$", "blk.{n}.attn_q_a.weight"),
        (r"^self_attn\.q_a_layernorm\.weight$", "blk.{n}.attn_q_a_norm.weight"),
        (r"^self_attn\.q_b_proj\.weight$", "blk.{n}.attn_q_b.weight"),
        (r"^self_attn\.q_proj\.weight$", "blk.{n}.attn_q.weight"),  # no q LoRA (V2-Lite style)
        (r"^self_attn\.kv_a_proj_with_mqa\.weight$", "blk.{n}.attn_kv_a_mqa.weight"),
        (r"^self_attn\.kv_a_layernorm\.weight$", "blk.{n}.attn_kv_a_norm.weight"),
        (r"^self_attn\.o_proj\.weight$", "blk.{n}.attn_output.weight"),
        (r"^post_attention_layernorm\.weight$", "blk.{n}.ffn_norm.weight"),
    ),
    hparams=(
        *COMMON_HPARAMS,
        ("attention.head_count_kv", U32, lambda c: 1),  # MLA runs as MQA over the compressed cache
        *ROPE_AND_EXPERTS,
        ("expert_gating_func", U32, lambda c: _gating(c)),
        ("attention.key_length", U32, lambda c: c["kv_lora_rank"] + c["qk_rope_head_dim"]),
        ("attention.value_length", U32, lambda c: c["kv_lora_rank"]),
        ("leading_dense_block_count", U32, lambda c: c.get("first_k_dense_replace") or 0),
        ("vocab_size", U32, lambda c: c.get("vocab_size")),
        ("attention.q_lora_rank", U32, lambda c: c.get("q_lora_rank")),
        ("attention.kv_lora_rank", U32, lambda c: c["kv_lora_rank"]),
        ("attention.key_length_mla", U32, lambda c: c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
        ("attention.value_length_mla", U32, lambda c: c["v_head_dim"]),
        ("expert_feed_forward_length", U32, lambda c: c.get("moe_intermediate_size") or c.get("intermediate_size")),
        ("expert_shared_count", U32, lambda c: c.get("n_shared_experts") or 0),
        ("expert_weights_scale", F32, lambda c: c.get("routed_scaling_factor")),
        ("expert_weights_norm", BOOL, lambda c: _if_true(c.get("norm_topk_prob"))),
        ("rope.dimension_count", U32, lambda c: c["qk_rope_head_dim"]),
        # llama.cpp divides this by 0.1 when it reads it (its TAG_DEEPSEEK2_YARN_LOG_MUL_FIX)
        ("rope.scaling.yarn_log_multiplier", F32, lambda c: (0.1 * _rope(c)["mscale_all_dim"])
         if _rope(c).get("mscale_all_dim") is not None else None),
    ),
    tokenizer_pre="deepseek-v3",
    source="src/models/deepseek2.cpp",
    split_kv_b=True,
)


def _head_dim(c: Mapping) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _qwen_rope_sections(c: Mapping) -> list[int]:
    """Qwen3.5's interleaved MRoPE sections, padded to llama.cpp's four (its default when the config has none)."""
    sec = list(_rope(c).get("mrope_section") or [11, 11, 10])
    return sec + [0] * (4 - len(sec))


def _recurrent_layers(c: Mapping) -> list[bool]:
    """Which blocks are Gated DeltaNet: the trunk's from layer_types (or every full_attention_interval-th is
    attention), the MTP block (appended, as llama.cpp's converter does) is not."""
    n = c["num_hidden_layers"]
    kinds = c.get("layer_types") or ["full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0
                                     else "linear_attention" for i in range(n)]
    return [k == "linear_attention" for k in kinds[:n]] + [False]


# Qwen3.5 / 3.6 dense (`conversion/qwen.py` Qwen3_5TextModel over Qwen3NextModel and _QwenMtpMixin; graph
# `src/models/qwen35.cpp` graph_mtp): mtp.fc/pre_fc_norm_*/norm become nextn.eh_proj/enorm/hnorm/shared_head_norm
# of blk.{n}, the gated full-attention block keeps the trunk's per-layer names (q_proj with its gate half as attn_q),
# every norm but linear_attn's is stored +1, and the export carries the trunk's lm_head as `output`.
QWEN35 = GGUFArch(
    arch="qwen35",
    block=(
        (r"^input_layernorm\.weight$", "blk.{n}.attn_norm.weight"),
        (r"^post_attention_layernorm\.weight$", "blk.{n}.post_attention_norm.weight"),
        (r"^self_attn\.(q|k|v)_proj\.weight$", "blk.{n}.attn_{0}.weight"),
        (r"^self_attn\.o_proj\.weight$", "blk.{n}.attn_output.weight"),
        (r"^self_attn\.(q|k)_norm\.weight$", "blk.{n}.attn_{0}_norm.weight"),
        (r"^mlp\.(gate|up|down)_proj\.weight$", "blk.{n}.ffn_{0}.weight"),
    ),
    hparams=(
        ("context_length", U32, lambda c: c.get("max_position_embeddings")),
        ("embedding_length", U32, lambda c: c.get("hidden_size")),
        ("feed_forward_length", U32, lambda c: c.get("intermediate_size")),
        ("attention.head_count", U32, lambda c: c.get("num_attention_heads")),
        ("attention.head_count_kv", U32, lambda c: c.get("num_key_value_heads")),
        ("rope.dimension_sections", I32_ARRAY, _qwen_rope_sections),
        ("rope.freq_base", F32, lambda c: _rope(c).get("rope_theta")),
        ("attention.layer_norm_rms_epsilon", F32, lambda c: c.get("rms_norm_eps")),
        ("attention.key_length", U32, _head_dim),
        ("attention.value_length", U32, _head_dim),
        ("ssm.conv_kernel", U32, lambda c: c["linear_conv_kernel_dim"]),
        ("ssm.state_size", U32, lambda c: c["linear_key_head_dim"]),
        ("ssm.group_count", U32, lambda c: c["linear_num_key_heads"]),
        ("ssm.time_step_rank", U32, lambda c: c["linear_num_value_heads"]),
        ("ssm.inner_size", U32, lambda c: c["linear_value_head_dim"] * c["linear_num_value_heads"]),
        ("attention.recurrent_layers", BOOL_ARRAY, _recurrent_layers),
        ("full_attention_interval", U32, lambda c: c.get("full_attention_interval", 4)),
        ("rope.dimension_count", U32, lambda c: int(_head_dim(c) * (_rope(c).get("partial_rotary_factor")
                                                                     or c.get("partial_rotary_factor") or 0.25))),
    ),
    tokenizer_pre="qwen35",
    source="src/models/qwen35.cpp",
    f32=(".bias", "norm.weight"),
    norm_offset=1.0,
    head="output.weight",
)


# Qwen3-Next (`conversion/qwen.py` Qwen3NextModel over Qwen2MoeModel and _QwenMtpMixin; `src/models/qwen3next.cpp`):
# Qwen3.5's MTP wiring and norms, a MoE block (routed experts stacked, one shared expert with its sigmoid gate),
# plain (not multimodal) RoPE.
QWEN_ATTENTION = QWEN35.block[:5]
QWEN3NEXT = GGUFArch(
    arch="qwen3next",
    block=(
        *QWEN_ATTENTION,
        (r"^mlp\.gate\.weight$", "blk.{n}.ffn_gate_inp.weight"),
        (r"^mlp\.shared_expert\.(gate|up|down)_proj\.weight$", "blk.{n}.ffn_{0}_shexp.weight"),
        (r"^mlp\.shared_expert_gate\.weight$", "blk.{n}.ffn_gate_inp_shexp.weight"),
    ),
    hparams=(
        *QWEN35.hparams[:5],
        ("rope.freq_base", F32, lambda c: _rope(c).get("rope_theta")),
        ("attention.layer_norm_rms_epsilon", F32, lambda c: c.get("rms_norm_eps")),
        ("expert_count", U32, lambda c: c.get("num_experts")),
        ("expert_used_count", U32, lambda c: c.get("num_experts_per_tok")),
        ("attention.key_length", U32, _head_dim),
        ("attention.value_length", U32, _head_dim),
        ("expert_feed_forward_length", U32, lambda c: c.get("moe_intermediate_size")),
        ("expert_shared_feed_forward_length", U32, lambda c: c.get("shared_expert_intermediate_size")),
        *QWEN35.hparams[10:],
    ),
    tokenizer_pre="qwen2",
    source="src/models/qwen3next.cpp",
    f32=(".bias", "norm.weight"),
    norm_offset=1.0,
    head="output.weight",
)


# Qwen3.5 / 3.6 MoE (`conversion/qwen.py` Qwen3_5MoeTextModel; `src/models/qwen35moe.cpp`): Qwen3-Next's MoE block
# with Qwen3.5's MRoPE header (no dense feed_forward_length: the text config has no intermediate_size).
QWEN35MOE = GGUFArch(
    arch="qwen35moe",
    block=QWEN3NEXT.block,
    hparams=(*QWEN35.hparams[:10], *QWEN3NEXT.hparams[7:9], *QWEN3NEXT.hparams[11:13], *QWEN35.hparams[10:]),
    tokenizer_pre="qwen35",
    source="src/models/qwen35moe.cpp",
    f32=(".bias", "norm.weight"),
    norm_offset=1.0,
    head="output.weight",
)


def _v4_layers(c: Mapping) -> int:
    """The side file's block count: the trunk's layers and the one MTP block (llama.cpp's per-layer arrays)."""
    return c["num_hidden_layers"] + 1


# DeepSeek-V4 (`conversion/deepseek.py` DeepseekV4Model with `--mtp`; graph `src/models/deepseek4.cpp` graph_mtp):
# DeepSeek's own names. The module's e_proj and h_proj become one `nextn.eh_proj` [H, 2H] (e's columns first: the
# graph concatenates enorm(e) before hnorm(h) for each hyper-connection stream); its hc_head is the side file's
# root `output_hc_*` (a -md file is a model of its own, whose MTP graph reads the model's hc_head); its norm is
# `nextn.shared_head_norm`; the head is the trunk's, as `output`. Routed experts stored FP4 (the releases) are
# repacked into GGML's MXFP4 blocks, bit for bit, as the converter does (`repack_mxfp4_blocks`, conversion/base.py).
DEEPSEEK4 = GGUFArch(
    arch="deepseek4",
    block=(
        (r"^attn\.attn_sink$", "blk.{n}.attn_sinks.weight"),
        (r"^attn\.wq_a\.weight$", "blk.{n}.attn_q_a.weight"),
        (r"^attn\.wq_b\.weight$", "blk.{n}.attn_q_b.weight"),
        (r"^attn\.q_norm\.weight$", "blk.{n}.attn_q_a_norm.weight"),
        (r"^attn\.wkv\.weight$", "blk.{n}.attn_kv.weight"),
        (r"^attn\.kv_norm\.weight$", "blk.{n}.attn_kv_a_norm.weight"),
        (r"^attn\.wo_(a|b)\.weight$", "blk.{n}.attn_output_{0}.weight"),
        (r"^attn\.compressor\.(ape|norm)(\.weight)?$", "blk.{n}.attn_compressor_{0}.weight"),
        (r"^attn\.compressor\.wkv\.weight$", "blk.{n}.attn_compressor_kv.weight"),
        (r"^attn\.compressor\.wgate\.weight$", "blk.{n}.attn_compressor_gate.weight"),
        (r"^attn\.indexer\.compressor\.(ape|norm)(\.weight)?$", "blk.{n}.indexer_compressor_{0}.weight"),
        (r"^attn\.indexer\.compressor\.wkv\.weight$", "blk.{n}.indexer_compressor_kv.weight"),
        (r"^attn\.indexer\.compressor\.wgate\.weight$", "blk.{n}.indexer_compressor_gate.weight"),
        (r"^attn\.indexer\.wq_b\.weight$", "blk.{n}.indexer.attn_q_b.weight"),
        (r"^attn\.indexer\.weights_proj\.weight$", "blk.{n}.indexer.proj.weight"),
        (r"^(attn|ffn)_norm\.weight$", "blk.{n}.{0}_norm.weight"),
        (r"^hc_(attn|ffn)_(fn|base|scale)$", "blk.{n}.hc_{0}_{1}.weight"),
        (r"^ffn\.gate\.weight$", "blk.{n}.ffn_gate_inp.weight"),
        (r"^ffn\.gate\.bias$", "blk.{n}.exp_probs_b.bias"),
        (r"^ffn\.shared_experts\.w1\.weight$", "blk.{n}.ffn_gate_shexp.weight"),
        (r"^ffn\.shared_experts\.w2\.weight$", "blk.{n}.ffn_down_shexp.weight"),
        (r"^ffn\.shared_experts\.w3\.weight$", "blk.{n}.ffn_up_shexp.weight"),
    ),
    hparams=(
        ("context_length", U32, lambda c: c.get("max_position_embeddings")),
        ("embedding_length", U32, lambda c: c.get("hidden_size")),
        ("attention.head_count", U32, lambda c: c.get("num_attention_heads")),
        ("attention.head_count_kv", U32, lambda c: c.get("num_key_value_heads")),
        *ROPE_AND_EXPERTS[:7],
        ("expert_count", U32, lambda c: c.get("n_routed_experts")),
        ("expert_used_count", U32, lambda c: c.get("num_experts_per_tok")),
        ("expert_gating_func", U32, lambda c: {"sqrtsoftplus": SQRT_SOFTPLUS}.get(c.get("scoring_func"), _gating(c))),
        ("attention.key_length", U32, lambda c: c.get("head_dim")),
        ("attention.value_length", U32, lambda c: c.get("head_dim")),
        ("rope.dimension_count", U32, lambda c: c["qk_rope_head_dim"]),
        ("attention.q_lora_rank", U32, lambda c: c["q_lora_rank"]),
        ("attention.sliding_window", U32, lambda c: c["sliding_window"]),
        ("expert_feed_forward_length", U32, lambda c: c["moe_intermediate_size"]),
        ("expert_shared_count", U32, lambda c: c["n_shared_experts"]),
        ("expert_weights_scale", F32, lambda c: c["routed_scaling_factor"]),
        ("expert_weights_norm", BOOL, lambda c: bool(c["norm_topk_prob"])),
        ("swiglu_clamp_exp", F32_ARRAY, lambda c: [float(c["swiglu_limit"])] * _v4_layers(c)),
        ("swiglu_clamp_shexp", F32_ARRAY, lambda c: [float(c["swiglu_limit"])] * _v4_layers(c)),
        ("attention.indexer.head_count", U32, lambda c: c["index_n_heads"]),
        ("attention.indexer.key_length", U32, lambda c: c["index_head_dim"]),
        ("attention.indexer.top_k", U32, lambda c: c["index_topk"]),
        ("attention.output_group_count", U32, lambda c: c["o_groups"]),
        ("attention.output_lora_rank", U32, lambda c: c["o_lora_rank"]),
        ("attention.compress_ratios", I32_ARRAY, lambda c: [int(r) for r in c["compress_ratios"]]),
        ("attention.compress_rope_freq_base", F32, lambda c: c["compress_rope_theta"]),
        ("hyper_connection.count", U32, lambda c: c["hc_mult"]),
        ("hyper_connection.sinkhorn_iterations", U32, lambda c: c["hc_sinkhorn_iters"]),
        ("hyper_connection.epsilon", F32, lambda c: c["hc_eps"]),
        ("hash_layer_count", U32, lambda c: c["num_hash_layers"]),
        ("embedding_length_out", U32, lambda c: c["hidden_size"] * c["hc_mult"]),
    ),
    tokenizer_pre="deepseek-v3",
    source="src/models/deepseek4.cpp",
    experts=r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$",
    expert_names={"w1": "gate", "w2": "down", "w3": "up"},
    # float32 where the release stores float32 (the hyper-connection mixers, sinks, the compressors' position
    # embeddings, the router bias), as the converter keeps them
    f32=(".bias", "norm.weight", "attn_sinks.weight", "_fn.weight", "_base.weight", "_scale.weight", "_ape.weight"),
    head="output.weight",
    leaves={"hc_head_fn": "output_hc_fn.weight", "hc_head_base": "output_hc_base.weight",
            "hc_head_scale": "output_hc_scale.weight"},
    fused={"blk.{n}.nextn.eh_proj.weight": ("e_proj", "h_proj")},
    fp4_experts=True,
)
