"""The MTP runtime against independent computations on the committed trained fixture.

Two referees: transformers' own MTP drafter (`MtpModel`, what `generate(use_mtp=True)` runs) for
depth 1, and a forward hand-assembled from raw tensors, with the blocks loaded by transformers'
DeepseekV3 loader, for both depths (it also pins vLLM's pre-norm chaining and position-0 zeroing,
where transformers differs from the engines).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import BY_NAME, derive
from recycle.mtp import MTP, Norm, block_config

from fixtures.fp8 import QUANTIZATION_CONFIG, is_fp8_weight, make_fp8
from tests.trained import FIXTURE, H, L


@pytest.fixture(scope="module")
def trunk():
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mtp():
    return MTP.from_checkpoint(FIXTURE)


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 4096, (2, 26), generator=g)


def test_loads_from_fixture(mtp):
    assert mtp.depth == 2
    assert mtp.family.name == "deepseek_v3"
    layer = mtp.layers[0]
    assert layer.head is not None and layer.embed is not None and layer.final_norm is not None
    assert type(layer.block).__name__ == "DeepseekV3DecoderLayer"
    assert type(layer.block.mlp).__name__ == "DeepseekV3MoE"  # MoE, like layers ≥ first_k_dense_replace
    assert MTP.from_checkpoint(FIXTURE, depth=1).depth == 1


def test_depth1_matches_transformers_mtp_model(trunk, mtp, ids):
    """transformers' MtpModel differs only in not zeroing position 0, so start positions at 1."""
    from transformers.modeling_layers import MtpModel

    trunk._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*", rf"model\.layers\.{L + 1}\..*"]
    ref_model = MtpModel.from_pretrained(trunk).float().eval()
    t = ids.shape[1] - 2
    pos = torch.arange(1, t + 1).unsqueeze(0).expand(2, t)
    with torch.no_grad():
        h = trunk.model(input_ids=ids[:, :t], position_ids=pos).last_hidden_state
        ours = mtp(h, ids, position_ids=pos, depth=1).logits[0]
        state = ref_model.forward_layer(0, h, pos, None, input_ids=ids[:, 1 : t + 1])
        ref = ref_model._project_to_logits(state)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_matches_hand_assembled_forward(trunk, mtp, ids):
    """Both depths from raw tensors: [e;h] concat, zeroed e at position 0, pre-norm chaining."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    # Load the MTP blocks as ordinary decoder layers L, L+1 through transformers' own loader.
    cfg = AutoConfig.from_pretrained(FIXTURE)
    cfg.num_hidden_layers = L + 2
    wide = DeepseekV3ForCausalLM.from_pretrained(FIXTURE, config=cfg, dtype=torch.float32).eval()
    ck = Checkpoint(FIXTURE)
    raw = lambda n: ck.get(n, torch.float32)
    t = ids.shape[1] - 2
    pos = torch.arange(t).unsqueeze(0).expand(2, t)
    with torch.no_grad():
        h = trunk.model(input_ids=ids[:, :t]).last_hidden_state
        rope = wide.model.rotary_emb(h, pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(2, 1, t, t)
        state, want = h, []
        for k in range(2):
            p = f"model.layers.{L + k}."
            e = F.embedding(ids[:, k + 1 : k + 1 + t], raw(p + "embed_tokens.weight"))
            e[:, 0] = 0.0
            x = torch.cat([_rms(e, raw(p + "enorm.weight")), _rms(state, raw(p + "hnorm.weight"))], -1)
            x = F.linear(x, raw(p + "eh_proj.weight"))
            y = wide.model.layers[L + k](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            want.append(F.linear(_rms(y, raw(p + "shared_head.norm.weight")), raw(p + "shared_head.head.weight")))
            state = y
        got = mtp(h, ids).logits
    for k in range(2):
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_checkpoint_tensors_round_trip(mtp):
    """Runtime → DeepSeek names → bytes identical to what the fixture stores (per-expert layout)."""
    ck = Checkpoint(FIXTURE)
    out = mtp.checkpoint_tensors()
    stored = {n for n in ck.tensors if n.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}."))}
    assert set(out) == stored
    assert f"model.layers.{L}.mlp.experts.7.down_proj.weight" in out
    for name, t in out.items():
        assert torch.equal(t.to(ck.raw(name).dtype), ck.raw(name)), name


def test_concat_order_and_zero_centred_norm():
    """'he' with swapped projection halves equals 'eh'; a '1+w' norm with w=0 is a plain RMSNorm."""
    cfg = block_config(Checkpoint(FIXTURE).config)
    fam = BY_NAME["deepseek_v3"]
    torch.manual_seed(0)
    a = MTP(cfg, fam, 1).eval()
    b = MTP(cfg, derive(fam, run=dict(concat_order="he", norm="1+w")), 1).eval()
    state = a.state_dict()
    hsz = cfg.hidden_size
    w = state["layers.0.proj.weight"]
    state["layers.0.proj.weight"] = torch.cat([w[:, hsz:], w[:, :hsz]], 1)
    for n in ("embed_norm", "hidden_norm", "final_norm"):
        state[f"layers.0.{n}.weight"] = torch.zeros(hsz)  # ones in "w" (the init) ≡ zeros in "1+w"
    b.load_state_dict(state)
    h = torch.randn(1, 6, hsz)
    ids = torch.randint(0, 4096, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(a(h, ids).logits[0], b(h, ids).logits[0])
    x = torch.randn(3, hsz)
    torch.testing.assert_close(Norm(hsz, 1e-6, "1+w")(x), Norm(hsz, 1e-6, "w")(x))


def test_input_too_short_and_no_mtp(tmp_path, mtp):
    with pytest.raises(ValueError):
        mtp(torch.zeros(1, 4, H), torch.zeros(1, 4, dtype=torch.long))
    ck = Checkpoint(FIXTURE)
    from safetensors.torch import save_file

    trunk_only = {n: ck.raw(n) for n in ck.tensors if not n.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}."))}
    save_file(trunk_only, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((FIXTURE / "config.json").read_text())
    with pytest.raises(RecycleError, match="stores no MTP module"):
        MTP.from_checkpoint(tmp_path)


def test_fp8_variant_matches_bf16(tmp_path, mtp, trunk, ids):
    out = make_fp8(FIXTURE, tmp_path / "fp8")
    ck = Checkpoint(out)
    assert ck.config["quantization_config"] == QUANTIZATION_CONFIG
    p = f"model.layers.{L}."
    assert ck.tensors[p + "self_attn.kv_b_proj.weight"].dtype == "F8_E4M3"
    assert ck.tensors[p + "self_attn.kv_b_proj.weight_scale_inv"].shape == (2, 4)  # [256, 512] in 128² blocks
    assert ck.tensors[p + "mlp.experts.0.gate_proj.weight"].dtype == "F8_E4M3"
    assert ck.tensors[p + "mlp.shared_experts.down_proj.weight"].dtype == "F8_E4M3"
    for bf16 in ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight", "mlp.gate.weight", "enorm.weight"):
        assert ck.tensors[p + bf16].dtype == "BF16", bf16
    assert ck.tensors[p + "mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert ck.tensors["lm_head.weight"].dtype == "BF16"
    assert not is_fp8_weight("model.layers.0.mlp.gate.weight", (8, H))

    fp8 = MTP.from_checkpoint(out)
    t = ids.shape[1] - 2
    with torch.no_grad():
        h = trunk.model(input_ids=ids[:, :t]).last_hidden_state
        want, got = mtp(h, ids).logits, fp8(h, ids).logits
    for k in range(2):
        rel = (got[k] - want[k]).norm() / want[k].norm()
        assert 0 < rel < 0.1, (k, rel)  # e4m3 has 3 mantissa bits: a few % error, never exact
        agree = (got[k].argmax(-1) == want[k].argmax(-1)).float().mean()
        assert agree > 0.8, (k, agree)


@pytest.mark.parametrize("variant", ["deepseek_v3_fp8", "glm4_5", "glm4_6", "qwen3_next", "qwen3_5", "qwen3_5_moe", "mimo",
                                     "ernie4_5"])
def test_runtime_runs_other_families(family_dir, variant):
    """Every family with a block class builds from its exact layout and runs both concat orders/norm styles."""
    model = MTP.from_checkpoint(family_dir(variant))
    h = torch.randn(1, 5, model.config.hidden_size)
    ids = torch.randint(0, model.config.vocab_size, (1, 5 + model.depth))
    out = model(h, ids)
    assert len(out.logits) == model.depth
    assert out.logits[0].shape == (1, 5, model.config.vocab_size)
    assert all(torch.isfinite(lg).all() for lg in out.logits)


def test_runtime_refuses_family_without_block_class(family_dir):
    with pytest.raises(RecycleError, match="no sequential MTP runtime"):
        MTP.from_checkpoint(family_dir("nemotron_h"))
