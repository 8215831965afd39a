"""GLM-5 / 5.1 / 5.2 (`glm_moe_dsa`) and GLM-5.3-Flash (`glm5_next`), and DeepSeek-V3.2's sparse-attention MTP.

The referee is transformers' own decoder layer: the causal LM loaded with `num_hidden_layers` widened, so the MTP
layer loads as an ordinary layer, and the NextN wrapper around it assembled by hand from the raw tensors, run in
eager attention with an explicit float mask while recycle runs its default (sdpa). Sequences go past `index_topk`,
where the indexer starts dropping tokens. GLM-5.3-Flash's MTP layer has no transformers class (its decoder layer
always has hyper-connections): recycle composes it of that model's parts, and the referee is transformers' layer
with its hyper-connections made the identity.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from recycle.checkpoint import Checkpoint
from recycle.families import derive
from recycle.mtp import MTP

from tests.cli_helpers import run_cli

V32_LAYER = "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32DecoderLayer"
# what the MTP layer (index L) is in each per-layer list, written from the releases: a DSA layer, MoE, full indexer
MTP_LAYER = {"layer_types": "indexed_attention", "mlp_layer_types": "sparse", "indexer_types": "full"}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_logits(path, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Depth 1 from raw tensors around transformers' own decoder layer L (eager, explicit causal float mask)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    L = cfg.num_hidden_layers
    cfg.num_hidden_layers = L + 1
    for key, value in MTP_LAYER.items():
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, list(getattr(cfg, key))[:L] + [value])
    cfg._attn_implementation = "eager"
    wide = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    ck = Checkpoint(path)
    raw = lambda n: ck.get(n, torch.float32)
    p, eps = f"model.layers.{L}.", cfg.rms_norm_eps
    own = lambda name, trunk: raw(p + name) if p + name in ck.tensors else raw(trunk)
    b, t = h.shape[:2]
    pos = torch.arange(t).unsqueeze(0).expand(b, t)
    e = F.embedding(ids[:, 1 : t + 1], own("embed_tokens.weight", "model.embed_tokens.weight"))
    e[:, 0] = 0.0  # position 0 (vLLM's DeepSeekMTP)
    x = F.linear(torch.cat([_rms(e, raw(p + "enorm.weight"), eps), _rms(h, raw(p + "hnorm.weight"), eps)], -1),
                 raw(p + "eh_proj.weight"))
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
    y = wide.model.layers[L](x, attention_mask=mask, position_ids=pos, position_embeddings=wide.model.rotary_emb(x, pos))
    y = y[0] if isinstance(y, tuple) else y
    return F.linear(_rms(y, raw(p + "shared_head.norm.weight"), eps),
                    own("shared_head.head.weight", "lm_head.weight"))


@pytest.mark.parametrize(("variant", "tokens"), [("deepseek_v32", 72), ("glm5", 12), ("glm5_2", 12)])
def test_sparse_attention_mtp_matches_transformers_layer(family_dir, variant, tokens):
    """Past index_topk (64 for the V3.2 fixture, 4 for GLM's), under recycle's default attention (sdpa)."""
    path = family_dir(variant)
    topk = json.loads((path / "config.json").read_text())["index_topk"]
    assert tokens > topk
    mtp = MTP.from_checkpoint(path)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, tokens, mtp.config.hidden_size, generator=g)
    ids = torch.randint(0, mtp.config.vocab_size, (2, tokens + 1), generator=g)
    with torch.no_grad():
        got = mtp(h, ids).logits[0]
        want = _reference_logits(path, h, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_glm5_runs_its_own_block_and_the_v32_block_differs_past_index_topk(family_dir):
    """On the same weights, DeepSeek-V3.2's layer equals GLM's while the indexer keeps every token (T ≤ index_topk)
    and not past it: GLM's indexer rotates interleaved pairs, V3.2's half-split ones."""
    glm = MTP.from_checkpoint(family_dir("glm5"))
    assert (glm.family.name, type(glm.layers[0].block).__name__) == ("glm_moe_dsa", "GlmMoeDsaDecoderLayer")
    v32 = MTP(glm.config, derive(glm.family, run=dict(block_class=V32_LAYER)), 1).eval()
    v32.load_state_dict(glm.state_dict())
    assert type(v32.layers[0].block).__name__ == "DeepseekV32DecoderLayer"
    topk = glm.config.index_topk
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3 * topk, glm.config.hidden_size, generator=g)
    ids = torch.randint(0, glm.config.vocab_size, (2, 3 * topk + 1), generator=g)
    with torch.no_grad():
        a, b = glm(h, ids).logits[0], v32(h, ids).logits[0]
    torch.testing.assert_close(a[:, :topk], b[:, :topk], rtol=1e-5, atol=1e-5)  # ≤ topk visible: all kept
    assert (a[:, topk:] - b[:, topk:]).abs().amax(-1).max() > 0.1  # here about 1-3 (logits)


def test_glm5_2_mtp_layer_runs_a_full_indexer(family_dir):
    """GLM-5.2's indexer_types covers the trunk only ("shared" layers store no indexer); the MTP layer's is full."""
    path = family_dir("glm5_2")
    ck = Checkpoint(path)
    assert ck.config["indexer_types"] == ["full", "shared"]
    assert not [n for n in ck.tensors if n.startswith("model.layers.1.self_attn.indexer.")]
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in ck.tensors
    mtp = MTP.from_checkpoint(path)
    assert mtp.config.indexer_types == ["full", "shared", "full"]
    assert mtp.layers[0].block.self_attn.indexer is not None


def test_glm5_next_detected(family_dir):
    """GLM-5.3-Flash as released: its row, one module under the VL wrapper's prefix, no error-level finding."""
    res = run_cli("inspect", str(family_dir("glm5_next")), "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert (rep["family"], rep["mtp"]["declared"], rep["mtp"]["found"]) == ("glm5_next", 1, 1)
    assert rep["mtp"]["modules"][0]["prefix"] == "model.language_model.layers.2."
    assert not [f for f in rep["findings"] if f["severity"] == "error"], rep["findings"]


def _glm5_next_reference(path, h: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Depth 1 around transformers' own `Glm5NextTextDecoderLayer`, its hyper-connections made the identity (one
    stream; pre and post weights exactly 1, no epsilon): then it is the plain pre-norm residual layer the MTP layer
    is. Weights from the raw tensors, experts fused by hand; eager attention, the padding mask as the model gives it."""
    from transformers import AutoConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

    cfg = AutoConfig.from_pretrained(path).text_config
    L = cfg.num_hidden_layers
    for key, value in MTP_LAYER.items():
        setattr(cfg, key, list(getattr(cfg, key))[:L] + [value])
    cfg.hc_mult, cfg.hc_eps = 1, 0.0
    cfg._attn_implementation, cfg._experts_implementation = "eager", "eager"
    layer = Glm5NextTextDecoderLayer(cfg, L).eval()
    ck = Checkpoint(path)
    raw = lambda n: ck.get(n, torch.float32)
    p, eps, H = f"model.language_model.layers.{L}.", cfg.rms_norm_eps, cfg.hidden_size
    state = {n[len(p):]: raw(n) for n in ck.tensors if n.startswith(p) and ".experts." not in n}
    experts = range(cfg.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([raw(f"{p}mlp.experts.{j}.gate_proj.weight"), raw(f"{p}mlp.experts.{j}.up_proj.weight")]) for j in experts])
    state["mlp.experts.down_proj"] = torch.stack([raw(f"{p}mlp.experts.{j}.down_proj.weight") for j in experts])
    for hc in ("attn_hc.", "ffn_hc."):  # sigmoid(40) == 1.0 in float32 (pre); 2·sigmoid(0) = 1 (post); comb = [[1]]
        state |= {hc + "fn": torch.zeros(3, H), hc + "base": torch.tensor([40.0, 0.0, 0.0]), hc + "scale": torch.ones(3)}
    wrapper = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    layer.load_state_dict({k: v for k, v in state.items() if k not in wrapper}, strict=True)
    t = h.shape[1]
    e = F.embedding(ids[:, 1 : t + 1], raw("model.language_model.embed_tokens.weight"))
    e[:, 0] = 0.0
    x = F.linear(torch.cat([_rms(e, raw(p + "enorm.weight"), eps), _rms(h, raw(p + "hnorm.weight"), eps)], -1),
                 raw(p + "eh_proj.weight"))
    y, _ = layer(x.unsqueeze(2), attention_mask=keep, position_embeddings=None)
    return F.linear(_rms(y.squeeze(2), raw(p + "shared_head.norm.weight"), eps), raw("lm_head.weight"))


def test_glm5_next_mtp_matches_transformers_layer(family_dir):
    """The composed plain-residual block (recycle/mtp/blocks.py) against transformers' layer with identity
    hyper-connections, past index_topk, with a left-padded row (compared at its real tokens)."""
    path = family_dir("glm5_next")
    mtp = MTP.from_checkpoint(path)
    assert type(mtp.layers[0].block).__name__ == "Glm5NextPlainDecoderLayer"
    tokens = 3 * mtp.config.index_topk
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, tokens, mtp.config.hidden_size, generator=g)
    ids = torch.randint(0, mtp.config.vocab_size, (2, tokens + 1), generator=g)
    keep = torch.ones(2, tokens, dtype=torch.bool)
    keep[1, :3] = False
    with torch.no_grad():
        got = mtp(h, ids).logits[0]
        torch.testing.assert_close(got, _glm5_next_reference(path, h, ids, torch.ones_like(keep)), rtol=1e-4, atol=1e-4)
        got = mtp(h, ids, attention_mask=keep.long()).logits[0]
        want = _glm5_next_reference(path, h, ids, keep)
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
