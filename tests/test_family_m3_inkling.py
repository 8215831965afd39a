"""MiniMax-M3 and Inkling: recycle's MTP forward against transformers' own layers, and the releases that store no MTP.

MiniMax-M3's MTP block (sparse MSA-indexer attention + MoE, vLLM's force_sparse_attn/force_moe) is loaded by
transformers' own loader as an extra trunk layer; Inkling's modules run through transformers' `MtpModel` (what
`generate(use_mtp=True)` drafts with), fed the embedding the engines feed (the trunk's `embed_norm` applied, which
vLLM and SGLang do and `MtpModel` does not).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from recycle.checkpoint import Checkpoint
from recycle.families import NO_MTP
from recycle.mtp import MTP

from fixtures.families import NO_MTP_RELEASES
from tests.cli_helpers import assert_bad_input, run_cli

T = 20  # > index_block_size (4) x index_topk_blocks (2): MiniMax-M3's indexer drops key blocks


def _rms_1p(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 250, (2, T + 2), generator=torch.Generator().manual_seed(0))


def test_minimax_m3_matches_transformers_layer(family_dir, tmp_path, ids):
    """The MTP module by hand from raw tensors ([e;h], zeroed e at position 0, 1+w norms), its block run as layer L of
    MiniMaxM3SparseForConditionalGeneration loaded from the same tensors with one more sparse MoE layer."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    src = family_dir("minimax_m3")
    ck = Checkpoint(src)
    cfg = copy.deepcopy(ck.config)
    text = cfg["text_config"]
    n = text["num_hidden_layers"]
    text["num_hidden_layers"] = n + 1
    text["moe_layer_freq"] = text["moe_layer_freq"] + [1]
    sparse = text["sparse_attention_config"]
    for key in ("sparse_attention_freq", "sparse_disable_index_value"):
        sparse[key] = sparse[key] + [1]
    block, mtp_prefix = "language_model.model.mtp.layers.0.transformer_layer.", "language_model.model.mtp."
    tensors = {f"language_model.model.layers.{n}." + name[len(block):] if name.startswith(block) else name: ck.raw(name)
               for name in ck.tensors if name.startswith(block) or not name.startswith(mtp_prefix)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    wide = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    lm = wide.model.language_model
    layer = lm.layers[n]
    assert layer.self_attn.indexer is not None and type(layer.mlp).__name__ == "MiniMaxM3VLSparseMoeBlock"

    mtp = MTP.from_checkpoint(src)
    assert mtp.family.name == "minimax_m3" and mtp.depth == 1
    raw = lambda name: ck.get(name, torch.float32)
    p = "language_model.model.mtp.layers.0."
    pos = torch.arange(T).unsqueeze(0).expand(2, T)
    with torch.no_grad():
        h = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(1))
        e = F.embedding(ids[:, 1 : T + 1], raw("language_model.model.embed_tokens.weight"))
        e[:, 0] = 0.0
        x = F.linear(torch.cat([_rms_1p(e, raw(p + "enorm.weight")), _rms_1p(h, raw(p + "hnorm.weight"))], -1),
                     raw(p + "eh_proj.weight"))
        rope = lm.rotary_emb(x, pos)
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
        want = F.linear(_rms_1p(y, raw(p + "final_layernorm.weight")), raw("language_model.lm_head.weight"))
        got = mtp(h, ids[:, : T + 1])
        torch.testing.assert_close(got.states[0], y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.logits[0], want, rtol=1e-5, atol=1e-5)
        indexer, layer.self_attn.indexer = layer.self_attn.indexer, None  # the same layer with dense attention
        dense = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
        layer.self_attn.indexer = indexer
    assert (dense - y).abs().max() > 1e-2  # the sparse selection is in play at this length


def test_minimax_m3_round_trips_its_names(family_dir):
    """Runtime → MiniMax-M3's names (block_sparse_moe, w1/w2/w3, index_*) → the bytes the fixture stores."""
    ck = Checkpoint(family_dir("minimax_m3"))
    # checkpoint_tensors names modules as the row's templates do: without the outer `language_model.` prefix
    out = {"language_model." + n: t for n, t in MTP.from_checkpoint(ck).checkpoint_tensors().items()}
    mtp = "language_model.model.mtp.layers.0."
    assert {n for n in out if n.startswith(mtp + "transformer_layer.")} == {
        n for n in ck.tensors if n.startswith(mtp + "transformer_layer.")}
    for name, t in out.items():
        if name.startswith(mtp + "transformer_layer."):
            assert torch.equal(t.to(ck.raw(name).dtype), ck.raw(name)), name


@pytest.mark.parametrize(("chain_norm", "local"), [(False, ()), (True, (1,))])
def test_inkling_matches_transformers_mtp_model(family_dir, ids, chain_norm, local):
    """Both depths through transformers' MtpModel: [h;e], the head on h / logits_mup_width_multiplier sliced to
    unpadded_vocab_size, the chain norm (when configured) as the chained and projected state, a depth listed in
    mtp_config.local_layer_ids as a sliding-window layer."""
    from transformers import InklingForConditionalGeneration
    from transformers.modeling_layers import MtpModel

    src = family_dir("inkling", chain_norm=chain_norm, local=local)
    main = InklingForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    ref = MtpModel.from_pretrained(main).float().eval()
    assert ref.use_shared_post_norm == chain_norm
    mtp = MTP.from_checkpoint(src)
    assert mtp.family.name == "inkling" and mtp.depth == 2
    assert (mtp.layers[0].final_norm is not None) == chain_norm
    assert [lyr.block.self_attn.is_sliding for lyr in mtp.layers] == [k in local for k in range(2)]
    pos = torch.arange(T).unsqueeze(0).expand(2, T)
    with torch.no_grad():
        h = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(1))  # a final-normed state's scale
        got = mtp(h, ids).logits
        state = h
        for k in range(2):
            # the engines' embedding: the trunk's own (embed_norm included), as main.get_input_embeddings() gives it
            e = main.get_input_embeddings()(ids[:, k + 1 : k + 1 + T])
            state = ref.forward_layer(k, state, pos, None, inputs_embeds=e)
            want = ref._project_to_logits(state)
            assert got[k].shape == want.shape == (2, T, 250)
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6)
        # MtpModel's own embedding drops the trunk's embed_norm: a different drafter, which recycle does not build
        plain = ref._project_to_logits(ref.forward_layer(0, h, pos, None, input_ids=ids[:, 1 : T + 1]))
    assert (plain - got[0]).abs().max() > 100 * 1e-6


@pytest.mark.parametrize("release", sorted(NO_MTP_RELEASES))
def test_release_without_mtp_says_so(tmp_path, release):
    out = NO_MTP_RELEASES[release]().write(tmp_path / release)
    model_type = json.loads((out / "config.json").read_text())["model_type"]
    assert model_type in NO_MTP
    assert_bad_input(run_cli("inspect", str(out)), "stores no MTP")


def test_gemma4_unified_points_to_its_assistant(tmp_path):
    """Gemma 4 unified (the target) ships its drafter as a separate model; its assistant is the gemma4_assistant row."""
    from recycle.families import BY_NAME

    row = BY_NAME["gemma4_assistant"]
    assert "gemma4_unified_assistant" in row.model_types and "Gemma4UnifiedAssistantForCausalLM" in row.architectures
    out = NO_MTP_RELEASES["kimi_k25"]().write(tmp_path / "unified")  # a trunk's tensors, a gemma4_unified config
    (out / "config.json").write_text(json.dumps({"model_type": "gemma4_unified",
                                                 "architectures": ["Gemma4UnifiedForConditionalGeneration"]}))
    assert_bad_input(run_cli("inspect", str(out)), "gemma4_unified_assistant")


@pytest.mark.parametrize(("variant", "opts"), [("minimax_m3", {}), ("inkling", {"padded": False})])
def test_eagle_drafter_equals_the_mtp(family_dir, converted, variant, opts):
    """`convert --to eagle` carries the row's semantics (1+w norms, [h;e], the trunk's embedding norm, the muP
    divisor) into the drafter: both depths give the MTP runtime's logits."""
    from recycle.drafters import EagleDrafter, load_drafter

    src = family_dir(variant, **opts)
    mtp = MTP.from_checkpoint(src)
    drafter = load_drafter(converted("eagle", src, dtype="fp32"))
    assert isinstance(drafter, EagleDrafter) and drafter.depth == mtp.depth
    g = torch.Generator().manual_seed(2)
    h, ids = torch.randn(2, 8, 64, generator=g), torch.randint(0, 250, (2, 8 + mtp.depth), generator=g)
    with torch.no_grad():
        want, got = mtp(h, ids).logits, drafter(h, ids).logits
    for k in range(mtp.depth):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_padded_head_is_refused_by_convert(family_dir, tmp_path):
    res = run_cli("convert", str(family_dir("inkling")), "--to", "eagle", "-o", str(tmp_path / "d"))
    assert_bad_input(res, "padded to vocab_size")


@pytest.mark.parametrize("variant", ["minimax_m3", "inkling"])
def test_tree_drafting_refuses_blocks_with_more_than_kv_state(family_dir, variant):
    """MiniMax-M3's sparse layers cache indexer keys, Inkling's its short convolutions: the native-mtp / eagle tree
    drafter keeps plain KV caches, so it says so in one line instead of drafting from stale state."""
    from recycle.decoding.drafting.native_mtp import MTPStack
    from recycle.errors import RecycleError

    with pytest.raises(RecycleError, match="cannot draft with this block"):
        MTPStack(MTP.from_checkpoint(family_dir(variant)), 2, None)
