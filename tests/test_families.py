"""Every row of the family table against a fixture in that family's exact on-disk layout.

The expectations below are written out by hand from the reference (formats-source.md), not derived
from the generator, so a typo in either the table or the generator shows up as a failure here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from recycle.checkpoint import INDEX_FILE, Checkpoint
from recycle.families import FAMILIES, MTPMatch, eval_shape, match
from recycle.quant import SCALE_SUFFIX, expected_scale_shape

from fixtures.families import FAULTS, VARIANTS, main, make


def nextn(p: str, copies: bool = True) -> dict[str, list[str]]:
    """DeepSeek/GLM role names of the module at prefix `p`."""
    roles = {
        "embed_norm": [p + "enorm.weight"],
        "hidden_norm": [p + "hnorm.weight"],
        "proj": [p + "eh_proj.weight"],
        "final_norm": [p + "shared_head.norm.weight"],
    }
    if copies:
        roles |= {"head": [p + "shared_head.head.weight"], "embed": [p + "embed_tokens.weight"]}
    return roles


QWEN_ROLES = {
    "embed_norm": ["mtp.pre_fc_norm_embedding.weight"],
    "hidden_norm": ["mtp.pre_fc_norm_hidden.weight"],
    "proj": ["mtp.fc.weight"],
    "final_norm": ["mtp.norm.weight"],
}
LLAMA_SHARED = {"head": "lm_head.weight", "embed": "model.embed_tokens.weight"}


def nemotron(outer: str = "") -> dict[str, list[str]]:
    return {
        "embed_norm": [outer + "mtp.layers.0.enorm.weight"],
        "hidden_norm": [outer + "mtp.layers.0.hnorm.weight"],
        "proj": [outer + "mtp.layers.0.eh_proj.weight"],
        "final_norm": [outer + "mtp.layers.1.final_layernorm.weight"],
    }


@dataclass(frozen=True)
class Expect:
    family: str
    declared: int
    modules: int
    roles: dict[str, list[str]]  # module 0, weights only (scales are checked in the FP8 tests)
    shared: dict[str, str | None]  # module 0: role -> trunk tensor standing in for it
    block: int  # block tensors of module 0, FP8 scales included
    prefix: str | None  # module 0's prefix
    trunk: tuple[str, ...]  # trunk tensors that must be stored
    outer: str = ""
    concat: str | None = "eh"
    norm: str = "w"
    kind: str = "mtp"
    dims: dict[str, int] = field(default_factory=dict)


DS_TRUNK = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight")
# DeepSeek MTP block: 2 layer norms + 7 MLA + router weight and bias + 4 experts x 3 + 3 shared = 26.
DEEPSEEK = Expect("deepseek_v3", 1, 1, nextn("model.layers.2."), {}, 26, "model.layers.2.", DS_TRUNK)
# FP8: + 5 attention scales + 12 expert scales + 3 shared-expert scales.
DEEPSEEK_FP8 = Expect("deepseek_v3", 1, 1, nextn("model.layers.2."), {}, 46, "model.layers.2.", DS_TRUNK,
                      dims={"H": 192})
GLM_TRUNK = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.gate.e_score_correction_bias")

EXPECT: dict[str, Expect] = {
    "deepseek_v3": DEEPSEEK,
    "deepseek_v3_fp8": DEEPSEEK_FP8,
    # + the DSA indexer: wq_b, wk, k_norm weight and bias, weights_proj.
    "deepseek_v32": Expect("deepseek_v32", 1, 1, nextn("model.layers.2."), {}, 31, "model.layers.2.",
                           DS_TRUNK + ("model.layers.0.self_attn.indexer.wk.weight",)),
    # GLM block: 2 norms + q/k/v weight+bias + o + q_norm/k_norm + router 2 + 12 experts + 3 shared = 28.
    "glm4_5": Expect("glm4_moe", 1, 1, nextn("model.layers.2."), {}, 28, "model.layers.2.", GLM_TRUNK),
    "glm4_6": Expect("glm4_moe", 1, 1, nextn("model.layers.2.", copies=False), LLAMA_SHARED, 28,
                     "model.layers.2.", GLM_TRUNK),
    # Qwen3-Next's released config.json carries no MTP count: engines (vLLM) assume 1.
    # Block: 2 norms + q/k/v/o + q_norm/k_norm + router + 12 experts + 3 shared + shared gate = 25.
    "qwen3_next": Expect("qwen3_next", 1, 1, QWEN_ROLES, LLAMA_SHARED, 25, "mtp.layers.0.",
                         ("model.embed_tokens.weight", "lm_head.weight",
                          "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.self_attn.q_norm.weight"),
                         norm="1+w"),
    "qwen3_5": Expect("qwen3_5", 1, 1, QWEN_ROLES,
                      {"head": "lm_head.weight", "embed": "model.language_model.embed_tokens.weight"}, 11,
                      "mtp.layers.0.", ("model.language_model.norm.weight", "model.visual.patch_embed.proj.weight",
                                        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"), norm="1+w"),
    # Qwen3.5 MoE: Qwen3-Next's MoE block (25 tensors) in Qwen3.5's multimodal layout.
    "qwen3_5_moe": Expect("qwen3_5_moe", 1, 1, QWEN_ROLES,
                          {"head": "lm_head.weight", "embed": "model.language_model.embed_tokens.weight"}, 25,
                          "mtp.layers.0.", ("model.language_model.norm.weight",
                                            "model.language_model.layers.0.mlp.experts.3.down_proj.weight"),
                          norm="1+w"),
    "mimo": Expect("mimo", 1, 1, {
        "embed_norm": ["model.mtp_layers.0.token_layernorm.weight"],
        "hidden_norm": ["model.mtp_layers.0.hidden_layernorm.weight"],
        "proj": ["model.mtp_layers.0.input_proj.weight"],
        "final_norm": ["model.mtp_layers.0.final_layernorm.weight"],
    }, LLAMA_SHARED, 12, "model.mtp_layers.0.", ("model.layers.1.self_attn.k_proj.bias", "lm_head.weight"),
        concat="he"),
    # ERNIE: 12 MTP tensors on the 21B = 3 role tensors + 9 in the dense block; tied, no final norm.
    "ernie4_5": Expect("ernie4_5", 1, 1, {
        "embed_norm": ["model.mtp_emb_norm.0.weight"],
        "hidden_norm": ["model.mtp_hidden_norm.0.weight"],
        "proj": ["model.mtp_linear_proj.0.weight"],
    }, {"final_norm": None, "head": "model.embed_tokens.weight", "embed": "model.embed_tokens.weight"}, 9,
        "model.mtp_block.0.", ("model.layers.1.mlp.moe_statics.e_score_correction_bias", "model.norm.weight")),
    "longcat_flash": Expect("longcat_flash", 1, 1, {
        "embed_norm": ["model.mtp.layers.0.enorm.m.weight"],
        "hidden_norm": ["model.mtp.layers.0.hnorm.m.weight"],
        "proj": ["model.mtp.layers.0.eh_proj.weight"],
        "final_norm": ["model.mtp.norm.weight"],
        "embed": ["model.mtp.embed_tokens.weight"],
    }, {"head": "lm_head.weight"}, 12, "model.mtp.layers.0.",
        ("model.layers.0.self_attn.1.kv_b_proj.weight", "model.layers.0.mlp.router.classifier.weight")),
    # Nemotron-H '*E': norm + q/k/v/o, then norm + router 2 + 4 experts x 2 (no gate_proj) + 2 shared = 18.
    "nemotron_h": Expect("nemotron_h", 1, 1, nemotron(),
                         {"head": "lm_head.weight", "embed": "backbone.embeddings.weight"},
                         18, "mtp.layers.0.", ("backbone.norm_f.weight", "backbone.layers.0.mixer.A_log")),
    "nemotron_h_vl": Expect("nemotron_h", 1, 1, nemotron("language_model."),
                            {"head": "language_model.lm_head.weight",
                             "embed": "language_model.backbone.embeddings.weight"},
                            18, "language_model.mtp.layers.0.", ("language_model.backbone.norm_f.weight",),
                            outer="language_model."),
    "meta_mtp": Expect("meta_mtp", 3, 3, {}, {"final_norm": "norm.weight", "head": "output.weight",
                                             "embed": "tok_embeddings.weight"}, 9, "extra_heads.0.",
                       ("tok_embeddings.weight", "layers.1.feed_forward.w3.weight"),
                       concat=None, kind="parallel_heads"),
    # 2 layers x (q_proj, q_norm, o_proj, 3 MLP, 4 norms, layer_scalar) + post_projection + 2 masked_embedding.
    "gemma4_assistant": Expect("gemma4_assistant", 0, 1, {
        "proj": ["pre_projection.weight"],
        "final_norm": ["model.norm.weight"],
        "embed": ["model.embed_tokens.weight"],
    }, {"head": "model.embed_tokens.weight"}, 25, "model.layers.0.", ("masked_embedding.token_ordering",),
        kind="drafter", dims={"H": 64, "Hb": 96}),
    "minimax_m2_declared_missing": Expect("minimax_m2", 3, 0, {}, {}, 0, None,
                                          ("model.layers.1.block_sparse_moe.experts.0.w1.weight",)),
    "deepseek_v3_undeclared": Expect("deepseek_v3", 0, 1, nextn("model.layers.2."), {}, 26, "model.layers.2.",
                                     DS_TRUNK),
    "deepseek_v3_nan": DEEPSEEK,
    "deepseek_v3_zero": DEEPSEEK,
    "deepseek_v3_bad_shape": DEEPSEEK,
    "deepseek_v3_fp8_bad_scale": DEEPSEEK_FP8,
    "deepseek_v3_stray": DEEPSEEK,
    # deepseek_v4 (v4): DeepSeek's own names; block = 2 norms + 6 hyper-connection tensors + 8 attention (wq_a,
    # q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink; no compressor: the MTP layer's ratio is 0) + router
    # weight and bias + 4 experts x 3 + 3 shared = 33. Embed and head are the trunk's.
    "deepseek_v4": Expect("deepseek_v4", 1, 1, {
        "embed_norm": ["mtp.0.enorm.weight"],
        "hidden_norm": ["mtp.0.hnorm.weight"],
        "e_proj": ["mtp.0.e_proj.weight"],
        "h_proj": ["mtp.0.h_proj.weight"],
        "hc_head_fn": ["mtp.0.hc_head_fn"],
        "hc_head_base": ["mtp.0.hc_head_base"],
        "hc_head_scale": ["mtp.0.hc_head_scale"],
        "final_norm": ["mtp.0.norm.weight"],
    }, {"head": "head.weight", "embed": "embed.weight"}, 33, "mtp.0.",
        ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.indexer.compressor.ape",
         "layers.0.ffn.gate.tid2eid", "layers.1.attn.compressor.wgate.weight", "layers.1.ffn.gate.bias"),
        dims={"H": 64, "V": 256, "E": 4, "C": 4}),
    # glm_moe_dsa (GLM-5/5.1/5.2): V3.2's block (31 = 26 + the indexer's 5), no embed/head copies in the module.
    "glm5": Expect("glm_moe_dsa", 1, 1, nextn("model.layers.2.", copies=False), LLAMA_SHARED, 31, "model.layers.2.",
                   DS_TRUNK + ("model.layers.1.self_attn.indexer.wk.weight",), dims={"H": 64, "V": 256, "E": 4}),
    # GLM-5.2: trunk layer 1 is "shared" (no indexer of its own); the MTP layer keeps a full one.
    "glm5_2": Expect("glm_moe_dsa", 1, 1, nextn("model.layers.2.", copies=False), LLAMA_SHARED, 31,
                     "model.layers.2.", DS_TRUNK + ("model.layers.0.self_attn.indexer.wk.weight",)),
    # glm5_next (GLM-5.3-Flash): 2 norms + 7 MLA + 7 k-pool indexer (5 + compress ape and gate) + router 2 +
    # 12 experts + 3 shared = 33, under the VL wrapper's model.language_model.; no hyper-connection tensors.
    "glm5_next": Expect("glm5_next", 1, 1, nextn("model.language_model.layers.2.", copies=False),
                        {"head": "lm_head.weight", "embed": "model.language_model.embed_tokens.weight"}, 33,
                        "model.language_model.layers.2.",
                        ("model.language_model.embed_tokens.weight", "lm_head.weight", "model.language_model.norm.weight",
                         "model.language_model.layers.0.hc_attn_fn", "model.language_model.layers.0.self_attn.q_conv1d.weight",
                         "model.language_model.layers.1.self_attn.indexer.index_kpool_compress_gate",
                         "model.visual.patch_embed.proj.weight"), dims={"H": 64, "V": 256, "E": 4}),
    # mimo_v2_flash (mimo_ling): 3 modules, no count key. Block: input_layernorm + q/k/v/o + attention_sink_bias +
    # pre_mlp_layernorm + dense gate/up/down = 10; embedding and head are the trunk's.
    "mimo_v2_flash": Expect("mimo_v2_flash", 3, 3, {
        "embed_norm": ["model.mtp.layers.0.enorm.weight"],
        "hidden_norm": ["model.mtp.layers.0.hnorm.weight"],
        "proj": ["model.mtp.layers.0.eh_proj.weight"],
        "final_norm": ["model.mtp.layers.0.final_layernorm.weight"],
    }, LLAMA_SHARED, 10, "model.mtp.layers.0.",
        ("lm_head.weight", "model.layers.1.self_attn.attention_sink_bias", "model.layers.1.mlp.experts.3.down_proj.weight"),
        dims={"H": 64, "V": 256, "E": 4}),
    # mimo_v2 (MiMo-V2.5 / V2.5-Pro): the same modules with q/k/v fused in one pre-sharded qkv_proj: 10 - 2 = 8
    "mimo_v2": Expect("mimo_v2", 3, 3, {
        "embed_norm": ["model.mtp.layers.0.enorm.weight"],
        "hidden_norm": ["model.mtp.layers.0.hnorm.weight"],
        "proj": ["model.mtp.layers.0.eh_proj.weight"],
        "final_norm": ["model.mtp.layers.0.final_layernorm.weight"],
    }, LLAMA_SHARED, 8, "model.mtp.layers.0.",
        ("lm_head.weight", "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"),
        dims={"H": 64, "V": 256, "E": 4}),
    # bailing_hybrid (Ling, mimo_ling): 2 norms + gated MLA 6 (q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    # dense, g_proj) + router weight and expert_bias + 4 experts x 3 + 3 shared = 25; final_layernorm is the role.
    "bailing_hybrid": Expect("bailing_hybrid", 1, 1, {
        "embed_norm": ["model.layers.2.enorm.weight"],
        "hidden_norm": ["model.layers.2.hnorm.weight"],
        "proj": ["model.layers.2.eh_proj.weight"],
        "final_norm": ["model.layers.2.final_layernorm.weight"],
    }, {"head": "lm_head.weight", "embed": "model.word_embeddings.weight"}, 25, "model.layers.2.",
        ("model.word_embeddings.weight", "model.norm.weight", "model.layers.0.attention.q_conv1d.weight",
         "model.layers.1.mlp.gate.expert_bias"), dims={"H": 64, "V": 256, "E": 4}),
    # step3p7 (step_mellum): Step-3.7-Flash, 3 modules, each with its own head (transformer.shared_head.output); the
    # embedding is the trunk's. Block: 2 norms + q/k/v/o + g_proj + q/k norms + dense gate/up/down = 12.
    "step3p7": Expect("step3p7", 3, 3, {
        "embed_norm": ["model.layers.2.enorm.weight"],
        "hidden_norm": ["model.layers.2.hnorm.weight"],
        "proj": ["model.layers.2.eh_proj.weight"],
        "final_norm": ["model.layers.2.transformer.shared_head.norm.weight"],
        "head": ["model.layers.2.transformer.shared_head.output.weight"],
    }, {"embed": "model.embed_tokens.weight"}, 12, "model.layers.2.",
        ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate_proj.weight",
         "model.layers.1.moe.gate_proj.weight", "model.layers.1.moe.router_bias",
         "model.layers.1.share_expert.down_proj.weight", "model.layers.4.transformer.shared_head.output.weight",
         "vision_model.transformer.resblocks.0.attn.in_proj_weight", "vit_large_projector.weight"),
        norm="1+w", dims={"H": 64, "V": 256, "E": 4}),
    # step3p5 (step_mellum): Step-3.5-Flash, the same layout with a flat text-only config.
    "step3p5": Expect("step3p7", 3, 3, {
        "embed_norm": ["model.layers.2.enorm.weight"],
        "hidden_norm": ["model.layers.2.hnorm.weight"],
        "proj": ["model.layers.2.eh_proj.weight"],
        "final_norm": ["model.layers.2.transformer.shared_head.norm.weight"],
        "head": ["model.layers.2.transformer.shared_head.output.weight"],
    }, {"embed": "model.embed_tokens.weight"}, 12, "model.layers.2.",
        ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.moe.up_proj.weight"),
        norm="1+w", dims={"H": 64, "V": 256, "E": 4}),
    # mellum (step_mellum): Qwen3-Next's mtp.* names with plain norms. Block: 2 norms + q/k/v/o + q/k norms + router +
    # 4 experts x 3 = 21 (no shared expert).
    "mellum": Expect("mellum", 1, 1, QWEN_ROLES, LLAMA_SHARED, 21, "mtp.layers.0.",
                     ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.experts.3.down_proj.weight"),
                     dims={"H": 64, "V": 256, "E": 4}),
    # minimax_m3 (m3_inkling): MiniMax-M3 under `language_model.`; the block is `transformer_layer.`: 2 norms + q/k/v/o
    # + per-head q/k norms + 4 MSA indexer tensors + router weight and bias + 4 experts x 3 (w1/w2/w3) + 3 shared = 29.
    "minimax_m3": Expect("minimax_m3", 1, 1, {
        "embed_norm": ["language_model.model.mtp.layers.0.enorm.weight"],
        "hidden_norm": ["language_model.model.mtp.layers.0.hnorm.weight"],
        "proj": ["language_model.model.mtp.layers.0.eh_proj.weight"],
        "final_norm": ["language_model.model.mtp.layers.0.final_layernorm.weight"],
    }, {"head": "language_model.lm_head.weight", "embed": "language_model.model.embed_tokens.weight"}, 29,
        "language_model.model.mtp.layers.0.transformer_layer.",
        ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
         "language_model.model.layers.0.mlp.gate_proj.weight", "language_model.model.layers.1.self_attn.index_q_proj.weight",
         "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"),
        outer="language_model.", norm="1+w", dims={"H": 64, "V": 256, "E": 4}),
    # inkling (m3_inkling): 2 modules, hidden first, no final norm (no chain norm); the block is `transformer_block.`:
    # 2 norms + wq/wk/wv/wr/wo + q/k norms + k/v sconv + rel_logits_proj + attn/mlp sconv + w13_dn, w2_md, global_scale.
    "inkling": Expect("inkling", 2, 2, {
        "embed_norm": ["model.mtp.layers.0.embed_norm.weight"],
        "hidden_norm": ["model.mtp.layers.0.hidden_norm.weight"],
        "proj": ["model.mtp.layers.0.input_proj.weight"],
    }, {"final_norm": None, "head": "model.llm.unembed.weight", "embed": "model.llm.embed.weight"}, 17,
        "model.mtp.layers.0.transformer_block.",
        ("model.llm.embed_norm.weight", "model.llm.unembed.weight", "model.llm.layers.0.attn.wr_du.weight",
         "model.llm.layers.1.mlp.experts.w13_weight", "model.llm.layers.1.mlp.shared_experts.shared_w2_weight"),
        concat="he", dims={"H": 64, "V": 256, "E": 4}),
}

# Module 1's prefix when two MTP modules are generated.
SECOND_MODULE = {
    "deepseek_v3": "model.layers.3.",
    "deepseek_v3_fp8": "model.layers.3.",
    "glm4_5": "model.layers.3.",
    "glm4_6": "model.layers.3.",
    "qwen3_next": "mtp.layers.1.",
    "qwen3_5": "mtp.layers.1.",
    "qwen3_5_moe": "mtp.layers.1.",
    "mimo": "model.mtp_layers.1.",
    "ernie4_5": "model.mtp_block.1.",
    "longcat_flash": "model.mtp.layers.1.",
    "nemotron_h": "mtp.layers.2.",
    "deepseek_v4": "mtp.1.",
    "bailing_hybrid": "model.layers.3.",  # mimo_ling
    "step3p7": "model.layers.3.",  # step_mellum
    "minimax_m3": "language_model.model.mtp.layers.1.transformer_layer.",  # m3_inkling
    "inkling": "model.mtp.layers.1.transformer_block.",  # m3_inkling
}

FP8 = ["deepseek_v3_fp8", "deepseek_v3_fp8_bad_scale"]


@pytest.fixture(scope="module")
def matched(family_dir):
    cache: dict[str, tuple[Checkpoint, MTPMatch]] = {}

    def get(name: str) -> tuple[Checkpoint, MTPMatch]:
        if name not in cache:
            ckpt = Checkpoint(family_dir(name))
            cache[name] = (ckpt, match(ckpt))
        return cache[name]

    return get


def weights(names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(SCALE_SUFFIX)]


# -- coverage -------------------------------------------------------------------------------------


def test_every_variant_has_expectations():
    assert set(EXPECT) == set(VARIANTS)


def test_every_family_row_has_a_fixture():
    assert {f.name for f in FAMILIES} <= {e.family for e in EXPECT.values()}


# -- matching -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_family_and_module_count(matched, variant):
    ckpt, m = matched(variant)
    e = EXPECT[variant]
    assert (m.family.name, m.outer_prefix, m.config_match) == (e.family, e.outer, True)
    assert (len(m.modules), m.declared) == (e.modules, e.declared)
    assert [mod.index for mod in m.modules] == list(range(e.modules))
    for name in e.trunk:
        assert name in ckpt.tensors


@pytest.mark.parametrize("variant", sorted(v for v, e in EXPECT.items() if e.modules))
def test_roles_and_shared(matched, variant):
    _, m = matched(variant)
    e = EXPECT[variant]
    mod = m.modules[0]
    assert mod.prefix == e.prefix
    assert {r: weights(ns) for r, ns in mod.roles.items() if r != "block"} == e.roles
    assert mod.shared == e.shared
    for role in e.roles:
        assert mod.tensor(role) == e.roles[role][0]
    for role, trunk in e.shared.items():
        assert mod.tensor(role) == trunk


@pytest.mark.parametrize("variant", sorted(v for v, e in EXPECT.items() if e.modules))
def test_block_tensors(matched, variant):
    ckpt, m = matched(variant)
    mod = m.modules[0]
    block = mod.roles["block"]
    assert len(block) == EXPECT[variant].block
    claimed = {n for r, ns in mod.roles.items() if r != "block" for n in ns}
    assert not claimed & set(block)
    assert all(any(n.startswith(p) for p in mod.block_prefixes) for n in block)
    # everything stored under the module's own prefixes belongs to it
    under = {n for n in ckpt.tensors if any(n.startswith(p) for p in mod.block_prefixes)}
    assert under <= set(mod.names)
    assert sorted(mod.block_names().values()) == sorted(block)  # no two block tensors share a key


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_concat_order_norm_and_kind(matched, variant):
    _, m = matched(variant)
    e = EXPECT[variant]
    assert (m.family.run.concat_order, m.family.run.norm, m.family.kind) == (e.concat, e.norm, e.kind)


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if v != "deepseek_v3_bad_shape"))
def test_role_shapes_follow_the_config(matched, variant):
    """The config's dimensions predict every role tensor's shape (the configs are consistent copies)."""
    ckpt, m = matched(variant)
    dims = m.dims()
    assert dims.items() >= EXPECT[variant].dims.items()
    for mod in m.modules:
        for role, spec in m.family.layout.shapes.items():
            name = mod.tensor(role)
            if name is not None:
                assert ckpt.tensors[name].shape == eval_shape(spec, dims), name


def test_bad_shape_is_transposed_eh_proj(matched):
    ckpt, m = matched("deepseek_v3_bad_shape")
    name = FAULTS["deepseek_v3_bad_shape"]
    assert m.modules[0].tensor("proj") == name
    assert ckpt.tensors[name].shape == (128, 64)


# -- shared copies and norm conventions ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v32", "glm4_5"])
def test_stored_copies_equal_the_trunk(matched, variant):
    ckpt, m = matched(variant)
    mod = m.modules[0]
    assert torch.equal(ckpt.get(mod.tensor("embed")), ckpt.get("model.embed_tokens.weight"))
    assert torch.equal(ckpt.get(mod.tensor("head")), ckpt.get("lm_head.weight"))


def _norm_names(mod) -> list[str]:
    roles = [mod.tensor(r) for r in ("embed_norm", "hidden_norm", "final_norm") if r in mod.roles]
    block = [n for n in mod.roles.get("block", []) if re.search(r"(layernorm|_norm|\.layers\.\d+\.norm)\.weight$", n)]
    return roles + block


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "mimo", "nemotron_h"])
def test_norm_weights_follow_the_convention(matched, variant):
    """Zero-centred `(1+w)` norms are stored near 0; plain `w` norms near 1."""
    ckpt, m = matched(variant)
    names = _norm_names(m.modules[0])
    assert len(names) >= 4
    centre = 0.0 if m.family.run.norm == "1+w" else 1.0
    for name in names:
        w = ckpt.get(name).float()
        assert (w - centre).abs().max() < 0.2, name
        assert w.abs().max() > 0, name  # near 0 is not all-zero


# -- sharding and FP8 -----------------------------------------------------------------------------


def test_glm4_6_mtp_file_is_found_despite_the_index(family_dir, matched):
    path = family_dir("glm4_6")
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    assert "mtp.safetensors" not in weight_map.values()
    assert not [n for n in weight_map if n.startswith("model.layers.2.")]
    ckpt, m = matched("glm4_6")
    assert "mtp.safetensors" in ckpt.files
    assert {ckpt.tensors[n].file for n in m.modules[0].names} == {"mtp.safetensors"}


def test_glm4_5_mtp_is_in_the_last_indexed_shard(family_dir, matched):
    ckpt, m = matched("glm4_5")
    assert {ckpt.tensors[n].file for n in m.modules[0].names} == {"model-00002-of-00002.safetensors"}
    assert json.loads((family_dir("glm4_5") / INDEX_FILE).read_text())["weight_map"].keys() == ckpt.tensors.keys()


@pytest.mark.parametrize("variant", FP8)
def test_fp8_release_conventions(matched, variant):
    ckpt, m = matched(variant)
    assert ckpt.block_size() == (128, 128)
    assert all(re.fullmatch(r"model-0000\d-of-000004\.safetensors", f) for f in ckpt.files), ckpt.files
    mod = m.modules[0]
    for role in ("proj", "embed", "head", "embed_norm", "hidden_norm", "final_norm"):
        assert ckpt.tensors[mod.tensor(role)].dtype == "BF16", role
        assert ckpt.scale_for(mod.tensor(role)) is None
    dtypes = {rel: ckpt.tensors[n].dtype for rel, n in mod.block_names().items()}
    assert dtypes["mlp.gate.weight"] == "BF16"
    assert dtypes["mlp.gate.e_score_correction_bias"] == "F32"
    assert dtypes["self_attn.kv_a_layernorm.weight"] == "BF16"
    for rel in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.o_proj.weight",
                "mlp.experts.0.gate_proj.weight", "mlp.shared_experts.down_proj.weight"):
        assert dtypes[rel] == "F8_E4M3", rel
        assert dtypes[rel + SCALE_SUFFIX] == "F32", rel
    # MTP non-expert tensors sit in the last shard, its routed experts in the one before
    last = "model-00004-of-000004.safetensors"
    for name in weights(mod.names):
        want = "model-00003-of-000004.safetensors" if ".mlp.experts." in name else last
        assert ckpt.tensors[name].file == want, name
    assert ckpt.tensors["lm_head.weight"].dtype == "BF16"


@pytest.mark.parametrize("variant", FP8)
def test_fp8_scales_pair_with_their_weights_across_shards(matched, variant):
    ckpt, m = matched(variant)
    mod = m.modules[0]
    fp8 = [n for n in mod.names if ckpt.tensors[n].is_fp8]
    assert len(fp8) == 20
    for name in fp8:
        scale = ckpt.scale_for(name)
        assert scale is not None and scale.name in mod.roles["block"]
        if scale.name != FAULTS["deepseek_v3_fp8_bad_scale"] or variant == "deepseek_v3_fp8":
            assert scale.shape == expected_scale_shape(ckpt.tensors[name].shape, (128, 128)), name
    # 192 is not a multiple of 128: ceil, not floor
    assert ckpt.tensors["model.layers.2.self_attn.o_proj.weight_scale_inv"].shape == (2, 1)
    apart = {n for n, t in ckpt.tensors.items() if t.is_fp8 and ckpt.scale_for(n).file != t.file}
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in apart
    assert "model.layers.1.self_attn.o_proj.weight" in apart


def test_fp8_dequantizes_back_to_the_bf16_weights(matched):
    ckpt, _ = matched("deepseek_v3_fp8")
    reference = make("deepseek_v3_fp8").reference
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in reference
    for name, ref in reference.items():
        got, ref = ckpt.get(name).float(), ref.float()
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=0.07, atol=1e-3 * ref.abs().max().item()), name


def test_fp8_bad_scale_has_one_wrong_scale(matched):
    ckpt, _ = matched("deepseek_v3_fp8_bad_scale")
    scale = ckpt.tensors[FAULTS["deepseek_v3_fp8_bad_scale"]]
    weight = ckpt.tensors[scale.name[: -len(SCALE_SUFFIX)]]
    assert scale.shape != expected_scale_shape(weight.shape, (128, 128))


# -- broken and declared-only variants ------------------------------------------------------------


def test_nan_variant(matched):
    ckpt, m = matched("deepseek_v3_nan")
    name = FAULTS["deepseek_v3_nan"]
    assert name in m.mtp_names and torch.isnan(ckpt.get(name)).sum() == 1


def test_zero_variant(matched):
    ckpt, m = matched("deepseek_v3_zero")
    name = FAULTS["deepseek_v3_zero"]
    assert name in m.mtp_names and not ckpt.get(name).any()
    assert ckpt.get("model.layers.2.self_attn.o_proj.weight").any()


def test_stray_tensor_fits_no_role(matched):
    ckpt, m = matched("deepseek_v3_stray")
    assert FAULTS["deepseek_v3_stray"] in ckpt.tensors
    assert FAULTS["deepseek_v3_stray"] not in m.mtp_names


def test_minimax_declares_mtp_but_stores_none(matched):
    ckpt, m = matched("minimax_m2_declared_missing")
    assert ckpt.config["use_mtp"] is True and ckpt.config["num_mtp_modules"] == 3
    assert m.modules == [] and m.declared == 3
    layers = {int(n.split(".")[2]) for n in ckpt.tensors if n.startswith("model.layers.")}
    assert layers == {0, 1} and not [n for n in ckpt.tensors if "mtp" in n]


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(SECOND_MODULE))
def test_two_mtp_modules(family_dir, variant):
    m = match(Checkpoint(family_dir(variant, mtp=2)))
    assert len(m.modules) == 2
    assert m.modules[1].prefix == SECOND_MODULE[variant]
    assert m.declared == (1 if variant == "qwen3_next" else 2)  # no count key: vLLM assumes 1
    first, second = (set(weights(mod.roles["block"])) for mod in m.modules)
    assert len(first) == len(second) and not first & second


def test_meta_declares_future_tokens_minus_one(family_dir):
    ckpt = Checkpoint(family_dir("meta_mtp"))
    cfg = ckpt.config
    assert (cfg["n_future_tokens"], cfg["n_layers"]) == (4, 5)  # trunk + next-token head + 3 extra heads
    assert {n.split(".")[1] for n in ckpt.tensors if n.startswith("layers.")} == {"0", "1"}


def test_generation_is_deterministic():
    a, b = make("mimo"), make("mimo")
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert not torch.equal(make("mimo", seed=1).tensors["lm_head.weight"], a.tensors["lm_head.weight"])


def test_cli_writes_each_named_variant(tmp_path: Path, capsys):
    assert main([str(tmp_path), "mimo", "ernie4_5"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ernie4_5", "mimo"]
    assert (tmp_path / "mimo" / "config.json").is_file() and (tmp_path / "mimo" / "model.safetensors").is_file()
    assert str(tmp_path / "mimo") in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "no_such_variant"])
    assert exc.value.code == 2


def test_derive_replaces_inside_the_nested_records_only_what_it_names():
    from recycle.families import BY_NAME, Exports, derive

    base = BY_NAME["deepseek_v3"]
    row = derive(base, name="x", run=dict(mask_required=True), exports=dict(gguf=None))
    assert (row.name, row.title, row.layout) == ("x", base.title, base.layout)
    assert row.run.mask_required and not base.run.mask_required
    assert row.run.block_class == base.run.block_class and row.run.zero_embed_at_pos0 == base.run.zero_embed_at_pos0
    assert row.exports.gguf is None and row.exports.nextn_architecture == base.exports.nextn_architecture
    whole = derive(base, exports=Exports())  # a record, not a dict: taken as given
    assert whole.exports == Exports() and whole.run == base.run
