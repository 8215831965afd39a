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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# GGUF value types (gguf.GGUFValueType), by name: this module imports nothing heavy
U32, F32, BOOL, STR = "UINT32", "FLOAT32", "BOOL", "STRING"
I32_ARRAY, F32_ARRAY, BOOL_ARRAY = "ARRAY:INT32", "ARRAY:FLOAT32", "ARRAY:BOOL"  # "ARRAY:<element type>"
# Per-layer arrays: one entry per layer of the trunk and then per MTP layer the config stores; the converter keeps
# the trunk's entries and those of the modules it writes (`--module K` writes one), as an ARRAY of the element type.
I32_LAYERS, F32_LAYERS, BOOL_LAYERS = "LAYERS:INT32", "LAYERS:FLOAT32", "LAYERS:BOOL"
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
    # whole-model tensors computed from config.json (GGUF name → getter returning float32 values, or None to leave
    # the tensor out): Step's llama3 `rope_freqs`, which llama.cpp's converter adds and the MTP graph reads
    computed: Mapping[str, Getter] = field(default_factory=dict)
    # where the module's final norm goes (MiMo's mimo2 reads it as the block's `layer_output_norm`)
    final_norm: str = "blk.{n}.nextn.shared_head_norm.weight"
    # one GGUF block tensor made of several block tensors, stacked along the output (first) dim in this order: the
    # unsharded [Q; K; V] llama.cpp's fused attention reads
    block_fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


# llama.cpp architectures whose MTP graph drafts with every stored module, module k as blk.{n+k} at draft step k
# (`cparams.nextn_layer_offset`: src/models/step35.cpp, src/models/mimo2.cpp; common/speculative.cpp chain_heads):
# a side file holds them all unless `--module K` picks one. The other graphs assert n_layer_nextn == 1, so a
# checkpoint of several modules needs `--module K`.
CHAINED = ("step35", "mimo2")

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


# GQA with q/k norms and a dense SwiGLU MLP under the trunk's per-layer names (Qwen3.5's and Step's blocks)
GQA_QK_NORM = (
    (r"^self_attn\.(q|k|v)_proj\.weight$", "blk.{n}.attn_{0}.weight"),
    (r"^self_attn\.o_proj\.weight$", "blk.{n}.attn_output.weight"),
    (r"^self_attn\.(q|k)_norm\.weight$", "blk.{n}.attn_{0}_norm.weight"),
)
DENSE_FFN = ((r"^mlp\.(gate|up|down)_proj\.weight$", "blk.{n}.ffn_{0}.weight"),)


# Qwen3.5 / 3.6 dense (`conversion/qwen.py` Qwen3_5TextModel over Qwen3NextModel and _QwenMtpMixin; graph
# `src/models/qwen35.cpp` graph_mtp): mtp.fc/pre_fc_norm_*/norm become nextn.eh_proj/enorm/hnorm/shared_head_norm
# of blk.{n}, the gated full-attention block keeps the trunk's per-layer names (q_proj with its gate half as attn_q),
# every norm but linear_attn's is stored +1, and the export carries the trunk's lm_head as `output`.
QWEN35 = GGUFArch(
    arch="qwen35",
    block=(
        (r"^input_layernorm\.weight$", "blk.{n}.attn_norm.weight"),
        (r"^post_attention_layernorm\.weight$", "blk.{n}.post_attention_norm.weight"),
        *GQA_QK_NORM,
        *DENSE_FFN,
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
        ("attention.recurrent_layers", BOOL_LAYERS, _recurrent_layers),
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
        ("swiglu_clamp_exp", F32_LAYERS, lambda c: [float(c["swiglu_limit"])] * _v4_layers(c)),
        ("swiglu_clamp_shexp", F32_LAYERS, lambda c: [float(c["swiglu_limit"])] * _v4_layers(c)),
        ("attention.indexer.head_count", U32, lambda c: c["index_n_heads"]),
        ("attention.indexer.key_length", U32, lambda c: c["index_head_dim"]),
        ("attention.indexer.top_k", U32, lambda c: c["index_topk"]),
        ("attention.output_group_count", U32, lambda c: c["o_groups"]),
        ("attention.output_lora_rank", U32, lambda c: c["o_lora_rank"]),
        ("attention.compress_ratios", I32_LAYERS, lambda c: [int(r) for r in c["compress_ratios"]]),
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


def _step_layers(c: Mapping) -> list[str]:
    """Step's layer types over the trunk's layers and then the MTP layers the config declares, padded with
    full attention where the config cut the list short, as llama.cpp's converter pads it (conversion/step3.py)."""
    n = c["num_hidden_layers"] + int(c.get("num_nextn_predict_layers") or 0)
    types = list(c.get("layer_types") or [])[:n]
    return types + ["full_attention"] * (n - len(types))


def _step_per_type(c: Mapping, full, sliding) -> list:
    return [sliding if t == "sliding_attention" else full for t in _step_layers(c)]


def _step_heads(c: Mapping, key: str) -> list[int]:
    """Query (key "num_attention_heads") or key/value ("num_attention_groups") heads per layer: sliding-window
    layers take `attention_other_setting`'s count."""
    other = c.get("attention_other_setting") or {}
    return _step_per_type(c, c[key], other.get(key, c[key]))


def _step_theta(c: Mapping, i: int):
    """Step's rope_theta is per layer type in the releases, a list whose first entry llama.cpp takes as the full
    layers' base and second as the sliding layers' (conversion/step3.py)."""
    theta = c.get("rope_theta")
    return float(theta[i]) if isinstance(theta, list) else (float(theta) if i == 0 and theta is not None else None)


def _step_clamps(c: Mapping, key: str):
    limits = c.get(key)
    if limits is None:
        return None
    n = len(_step_layers(c))
    values = [0.0 if v is None else float(v) for v in limits][:n]  # MTP layers default to no clamp
    return values + [0.0] * (n - len(values))


def _step_leading_dense(c: Mapping) -> int:
    layers = str(c.get("moe_layers_enum") or "").strip()
    return max(0, min(int(i) for i in layers.split(","))) if layers else 0


def _llama3_rope_freqs(c: Mapping):
    """Llama-3 rope scaling factors for the full-attention layers' rotary dims (partial_rotary_factor · head_dim),
    padded with 1.0 to head_dim / 2, in float32 as llama.cpp's converter computes them (Step35Model
    .generate_extra_tensors); None without llama3 scaling."""
    import torch  # ggufarch is imported by every family row; only this getter needs torch

    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    if str(rope.get("rope_type") or rope.get("type") or "").lower() != "llama3":
        return None
    base = _step_theta(c, 0) or 10000.0
    dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    factors = c.get("partial_rotary_factors") or []
    full = next((float(f) for t, f in zip(_step_layers(c), factors) if t == "full_attention"), 1.0)
    rot = int(dim * full)
    freqs = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    factor, low, high = (float(rope.get(k, d)) for k, d in (("factor", 8.0), ("low_freq_factor", 1.0),
                                                           ("high_freq_factor", 4.0)))
    old = int(rope.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return out + [1.0] * (dim // 2 - len(out))


# Step-3.5 / 3.7-Flash (`conversion/step3.py` Step35Model with `--mtp`; graph `src/models/step35.cpp` graph_mtp): the
# modules appended at blk.{n+k} under the trunk's per-layer names, each with its own nextn leaves and head
# (`transformer.shared_head.output` → nextn.shared_head_head); every `norm.weight` stored +1 (Step's RMSNorm is
# zero-centred); per-layer head counts, sliding pattern and SwiGLU clamps over the trunk's and the modules'
# layers; the head-wise attention gate g_proj as attn_gate. llama.cpp drafts with all the modules in turn.
STEP35 = GGUFArch(
    arch="step35",
    block=(
        (r"^input_layernorm\.weight$", "blk.{n}.attn_norm.weight"),
        (r"^post_attention_layernorm\.weight$", "blk.{n}.ffn_norm.weight"),
        *GQA_QK_NORM,
        (r"^self_attn\.g_proj\.weight$", "blk.{n}.attn_gate.weight"),
        *DENSE_FFN,  # the releases' MTP blocks are dense
    ),
    hparams=(
        *COMMON_HPARAMS[:3],
        ("attention.head_count", I32_LAYERS, lambda c: _step_heads(c, "num_attention_heads")),
        ("rope.freq_base", F32, lambda c: _step_theta(c, 0)),
        ("rope.freq_base_swa", F32, lambda c: _step_theta(c, 1)),
        ("attention.layer_norm_rms_epsilon", F32, lambda c: c.get("rms_norm_eps", 1e-5)),
        ("expert_gating_func", U32, lambda c: {"sigmoid": SIGMOID, "softmax": SOFTMAX}.get(
            c.get("moe_router_activation"))),
        ("attention.key_length", U32, lambda c: c.get("head_dim")),
        ("attention.value_length", U32, lambda c: c.get("head_dim")),
        ("attention.head_count_kv", I32_LAYERS, lambda c: _step_heads(c, "num_attention_groups")),
        ("attention.sliding_window", U32, lambda c: c["sliding_window"]),
        ("attention.sliding_window_pattern", BOOL_LAYERS, lambda c: _step_per_type(c, False, True)),
        ("expert_count", U32, lambda c: c["moe_num_experts"]),
        ("expert_used_count", U32, lambda c: c["moe_top_k"]),
        ("expert_feed_forward_length", U32, lambda c: c["moe_intermediate_size"]),
        ("expert_shared_feed_forward_length", U32, lambda c: c["share_expert_dim"]),
        ("expert_weights_scale", F32, lambda c: c.get("moe_router_scaling_factor")),
        ("expert_weights_norm", BOOL, lambda c: c.get("norm_expert_weight")),
        ("leading_dense_block_count", U32, _step_leading_dense),
        ("moe_every_n_layers", U32, lambda c: int(c.get("moe_every_n_layer", 1))),
        ("swiglu_clamp_exp", F32_LAYERS, lambda c: _step_clamps(c, "swiglu_limits")),
        ("swiglu_clamp_shexp", F32_LAYERS, lambda c: _step_clamps(c, "swiglu_limits_shared")),
    ),
    # this llama.cpp lists no pre-tokenizer hash for Step's tokenizer (conversion/base.py): the name written when the
    # source's tokenizer.json is not a plain GPT-2 regex one; `--target TRUNK.gguf` takes the trunk file's instead
    tokenizer_pre="gpt-2",
    source="src/models/step35.cpp",
    f32=(".bias", "norm.weight"),
    norm_offset=1.0,
    computed={"rope_freqs.weight": _llama3_rope_freqs},
)


def _mimo_layers(c: Mapping) -> list[int]:
    """MiMo's attention pattern over the trunk's layers (`hybrid_layer_pattern`, 1 = sliding window) and then the
    three MTP layers, which are sliding-window layers (llama.cpp's converter extends it so: conversion/mimo.py)."""
    return [int(p) for p in c["hybrid_layer_pattern"]][: c["num_hidden_layers"]] + [1] * 3


# MiMo-V2-Flash, V2.5, V2.5-Pro (`conversion/mimo.py` MimoV2Model with `--mtp`; graph `src/models/mimo2.cpp`): the
# module's sliding-window block under the trunk's names, its q/k/v as one `attn_qkv` (the MTP graph asserts it:
# mimo2.cpp:285; V2.5's pre-sharded qkv_proj re-grouped to one [Q; K; V], as the converter's `_tp_aware_qkv_dequant`
# does; V2-Flash's separate q/k/v stacked so), `pre_mlp_layernorm` as `ffn_norm`, `final_layernorm` as
# `layer_output_norm`, the trunk's head as `output`. The release's own config keys (the converter reads them).
MIMO2 = GGUFArch(
    arch="mimo2",
    block=(
        (r"^input_layernorm\.weight$", "blk.{n}.attn_norm.weight"),
        (r"^pre_mlp_layernorm\.weight$", "blk.{n}.ffn_norm.weight"),
        (r"^self_attn\.o_proj\.weight$", "blk.{n}.attn_output.weight"),
        (r"^self_attn\.attention_sink_bias$", "blk.{n}.attn_sinks.weight"),
        *DENSE_FFN,
    ),
    hparams=(
        *COMMON_HPARAMS,
        ("attention.head_count_kv", I32_LAYERS,
         lambda c: [c["swa_num_key_value_heads"] if p else c["num_key_value_heads"] for p in _mimo_layers(c)]),
        ("rope.freq_base", F32, lambda c: c.get("rope_theta")),
        ("rope.freq_base_swa", F32, lambda c: c.get("swa_rope_theta")),
        *ROPE_AND_EXPERTS[7:],  # the expert counts
        ("attention.key_length", U32, lambda c: c.get("head_dim")),
        ("attention.value_length", U32, lambda c: c.get("v_head_dim")),
        ("attention.sliding_window", U32, lambda c: c["sliding_window"]),
        ("attention.sliding_window_pattern", I32_LAYERS, _mimo_layers),
        ("expert_feed_forward_length", U32, lambda c: c.get("moe_intermediate_size")),
        ("rope.dimension_count", U32, lambda c: int(c["head_dim"] * float(c.get("partial_rotary_factor", 1.0)))),
        ("attention.layer_norm_rms_epsilon", F32, lambda c: c.get("layernorm_epsilon", 1e-5)),
        ("attention.value_scale", F32, lambda c: c.get("attention_value_scale")),
    ),
    tokenizer_pre="qwen2",
    source="src/models/mimo2.cpp",
    f32=(".bias", "norm.weight", "attn_sinks.weight"),
    head="output.weight",
    final_norm="blk.{n}.layer_output_norm.weight",
    block_fused={"blk.{n}.attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight")},
)
