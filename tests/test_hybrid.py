"""Hybrid targets (Qwen3.5: Gated DeltaNet + gated attention) in recycle's decoder.

A DeltaNet layer keeps one recurrent state that has absorbed every verified token, so rejected drafts must be
taken back out: the loop snapshots the linear-attention states before verification and, on rejection, restores
them and runs the accepted tokens again (`recycle.decoding.cache.snapshot/restore`). These tests check that
drafting stays lossless exactly where that matters: chains rejected in the middle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from recycle.checkpoint import Checkpoint
from recycle.decoding.drafting import Drafter, load_engine
from recycle.decoding.drafting.native_mtp import MTPStack
from recycle.decoding.loop import generate
from recycle.decoding.target import Target, load_target
from recycle.decoding.tree import MaskCache
from recycle.encode import quiet_transformers
from recycle.errors import RecycleError
from recycle.families import BY_NAME, match
from recycle.mtp import MTP

from tests.helpers import chi2_sf, exact_marginals, oracle


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """An untrained Qwen3.5 checkpoint in the trained fixture's layout (`fixtures/build_trained.py`'s recipe):
    text-only `Qwen3_5ForCausalLM`, 6 DeltaNet + 2 attention layers, one MTP layer under `mtp.*`."""
    from fixtures.build_trained import untrained

    return untrained("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), seed=3)


TRAINED = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_5_mtp"


@pytest.mark.parametrize("which", ["recipe", "trained"])
def test_layout_is_the_family_row_s_and_transformers_ignores_the_mtp(qwen_dir: Path, which: str) -> None:
    qwen_dir = TRAINED if which == "trained" else qwen_dir
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    assert cfg["mtp_num_hidden_layers"] == 1 and "num_nextn_predict_layers" not in cfg
    m = match(Checkpoint(qwen_dir))
    assert m.family is BY_NAME["qwen3_5"] and m.declared == len(m.modules) == 1 and m.config_match
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mtp_names = {n for n in names if n.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate_proj.weight"} <= mtp_names
    with quiet_transformers():
        model = load_target(qwen_dir)
    assert not any(n.startswith("mtp.") for n in model.state_dict())  # `_keys_to_ignore_on_load_unexpected`
    mtp = MTP.from_checkpoint(qwen_dir)
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(mtp.layers[0].proj.weight, f.get_tensor("mtp.fc.weight").float())
    assert Target(model).rolls_back


@pytest.mark.parametrize("length,wrong", [(3, 1), (4, 2), (2, 2)], ids=["reject-last", "reject-middle", "reject-all"])
def test_rejections_mid_chain_roll_the_recurrent_state_back(qwen_dir: Path, length: int, wrong: int) -> None:
    with quiet_transformers():
        target = Target(load_target(qwen_dir))
    prompt = list(range(200, 230))
    plain = generate(target, Drafter(), prompt, 20).tokens
    spec = generate(target, oracle(plain, length, wrong, target.config.vocab_size), prompt, 20)
    assert spec.tokens == plain
    assert spec.stats.rollbacks == spec.stats.steps > 0
    assert sum(spec.stats.accepted) >= (length - wrong) * (spec.stats.steps - 1)


def test_without_the_rollback_drafts_would_corrupt_the_output(qwen_dir: Path, monkeypatch) -> None:
    """The test above can fail: with the states not restored, the same rejections change the output."""
    from recycle.decoding import cache as kv

    with quiet_transformers():
        target = Target(load_target(qwen_dir))
    prompt = list(range(200, 230))
    plain = generate(target, Drafter(), prompt, 20).tokens
    monkeypatch.setattr(kv, "restore", lambda snap: None)
    spec = generate(target, oracle(plain, 3, 1, target.config.vocab_size), prompt, 20)
    assert spec.tokens != plain


def test_native_mtp_chain_is_lossless_and_a_tree_is_refused(qwen_dir: Path) -> None:
    with quiet_transformers():
        target = Target(load_target(qwen_dir))
        masks = MaskCache(target.dtype, target.device)
        engine = load_engine(None, target, masks, tree="chain:3", native=True, target_dir=str(qwen_dir))
        with pytest.raises(RecycleError, match="chains only"):
            load_engine(None, target, masks, tree="dynamic", native=True, target_dir=str(qwen_dir))
    assert isinstance(engine, MTPStack) and engine.shape == 3
    target.set_taps(engine.taps)
    prompt = list(range(300, 340))
    assert generate(target, engine, prompt, 16).tokens == generate(target, Drafter(), prompt, 16).tokens


V = 8


@pytest.mark.slow  # ~40 s of sampling; the rollbacks' exactness stays in the default run (greedy, through rejections)
def test_speculative_sampling_on_a_hybrid_follows_the_target_law() -> None:
    """The sampling rule with rollbacks: tokens 1–3 distributed as the target's own law (χ² against the exact
    marginals), on a tiny hybrid whose weak MTP module is accepted often and rejected often."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from recycle.mtp import block_config

    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=2, max_position_embeddings=64,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 1, 1]})
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a target law far from uniform
    mtp = MTP(block_config(dict(cfg, model_type="qwen3_5_text")), BY_NAME["qwen3_5"], 1).eval()
    with torch.no_grad():
        for t in mtp.parameters():
            t.normal_(0, 0.1) if t.dim() > 1 else t.zero_()  # zero-centred norms: scale 1
        mtp.layers[0].head.weight.copy_(model.lm_head.weight * 0.05)
        mtp.layers[0].embed.weight.copy_(model.model.embed_tokens.weight)
    target = Target(model)
    assert target.rolls_back
    masks = MaskCache(torch.float32, "cpu")
    engine = MTPStack(mtp, 2, masks, reuse="cycle")
    target.set_taps(engine.taps)
    prompt, runs = [1, 5, 2, 7, 3], 600
    exact = exact_marginals(model, prompt, 1.0)
    counts = torch.zeros(3, V, dtype=torch.float64)
    accepted = rollbacks = 0
    for seed in range(runs):
        g = generate(target, engine, prompt, 3, temperature=1.0, seed=seed, masks=masks)
        for i, t in enumerate(g.tokens[:3]):
            counts[i, t] += 1
        accepted += sum(g.stats.accepted)
        rollbacks += g.stats.rollbacks
    assert accepted > runs // 10 and rollbacks > runs // 10  # both branches exercised
    for i in range(3):
        expected = exact[i] * runs
        keep = expected >= 5
        stat = float((((counts[i] - expected) ** 2) / expected.clamp(min=1e-12))[keep].sum())
        assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (i, counts[i].tolist(), expected.tolist())


def test_a_distilled_qwen_drafter_writes_its_overlay_back_and_stitches(qwen_dir: Path, tmp_path: Path,
                                                                     converted) -> None:
    """Zero-centred norms: the EAGLE drafter trains them as plain `w`, the overlay stores them as the family does
    (w − 1), so `recycle stitch` puts the trained module back and the target's own MTP runtime runs it."""
    from safetensors.torch import load_file

    from recycle.converters.overlay import stitch
    from recycle.distill.train import DistillOptions, distill
    from recycle.drafters import load_drafter

    eagle = str(converted("eagle", source=qwen_dir))
    rec = distill(DistillOptions(drafter=eagle, target=str(qwen_dir), tokens=6 * 4 * 64, seq_len=64, batch=4,
                                 lr=3e-3, eval_every=10**6, out=str(tmp_path / "d"), init="scratch"))
    out = Path(rec["out"])
    drafter = load_drafter(out)
    overlay = load_file(str(out / "mtp_overlay" / "mtp.safetensors"))
    assert set(overlay) == set(load_file(str(Path(eagle) / "mtp_overlay" / "mtp.safetensors")))
    trained = drafter.layers[0].embed_norm.weight.detach().float()
    # the drafter file holds 1 + w in bf16 (steps of 2^-7 near 1); the overlay w itself, from the fp32 weights
    assert (overlay["mtp.pre_fc_norm_embedding.weight"].float() - (trained - 1)).abs().max() <= 2 ** -8
    assert not torch.equal(overlay["mtp.pre_fc_norm_embedding.weight"],  # it trained (scratch init moved it)
                           load_file(str(qwen_dir / "model.safetensors"))["mtp.pre_fc_norm_embedding.weight"])
    stitched = tmp_path / "stitched"
    stitch(out / "mtp_overlay", qwen_dir, stitched)
    native = MTP.from_checkpoint(stitched)
    assert torch.allclose(1 + native.layers[0].embed_norm.weight, trained, atol=1e-2)


def test_the_trained_module_drafts_losslessly_through_rejections() -> None:
    """The trained fixture's own module, reused for 3 draft steps (as vLLM and llama.cpp reuse it): accepted and
    rejected mid-chain on real text, and the output is plain decoding's."""
    from transformers import AutoTokenizer

    from recycle.prompts import default_prompts, encode_prompts

    with quiet_transformers():
        target = Target(load_target(TRAINED))
        masks = MaskCache(target.dtype, target.device)
        engine = load_engine(None, target, masks, tree="chain:3", native=True, target_dir=str(TRAINED))
    target.set_taps(engine.taps)
    ids = encode_prompts(AutoTokenizer.from_pretrained(TRAINED), default_prompts()[:2], str(TRAINED), None)
    accepted = rollbacks = 0
    for prompt in ids:
        spec = generate(target, engine, prompt, 24)
        assert spec.tokens == generate(target, Drafter(), prompt, 24).tokens
        accepted, rollbacks = accepted + sum(spec.stats.accepted), rollbacks + spec.stats.rollbacks
    assert accepted > 0 and rollbacks > 0
