"""A Gemma 4 assistant into portable formats (converters/assistant.py, the calibrated Medusa): what the fold keeps
exactly is checked as such, the outputs load and decode losslessly, and bad input is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recycle.converters.api import convert_checkpoint
from recycle.decoding import Drafter, MaskCache, Target, generate, load_target
from recycle.decoding.drafting import load_engine
from recycle.distill.calibrate import convert_calibrated
from recycle.drafters import load_drafter
from recycle.drafters.eagle3 import Eagle3Drafter
from recycle.drafters.medusa import MedusaDrafter

from tests.cli_helpers import assert_bad_input, run_cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TARGET, ASSISTANT = FIXTURES / "gemma4_target", FIXTURES / "gemma4_assistant"


@pytest.fixture(scope="module")
def folded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fold") / "eagle3"
    convert_checkpoint(ASSISTANT, "eagle3", out, target=TARGET, dtype="fp32")
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def test_fold_writes_a_norm_before_residual_eagle3_at_the_target_width(folded):
    cfg = json.loads((folded / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["norm_before_residual"] is True
    assert cfg["hidden_size"] == cfg["target_hidden_size"] == 128
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0  # transformers' LlamaConfig refuses anything else
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]  # the target's depth, not the assistant's
    state = load_file(str(folded / "model.safetensors"))
    assert "embed_tokens.weight" not in state and "d2t" not in state  # the target's embedding, full vocabulary
    rec = json.loads((folded / "recycle.json").read_text())
    assert rec["source"]["family"] == "gemma4_assistant" and rec["summary"]["approx"] == rec["summary"]["tensors"]
    assert any("layer 1 (full_attention)" in n for n in rec["notes"])
    assert isinstance(load_drafter(folded), Eagle3Drafter)


def test_fold_keeps_the_head_and_recovers_the_aux_state_for_keys(folded):
    """lm_head is the assistant's tied head (zero columns past its width); the K/V heads read the whole aux
    state back through M⁻¹: their keys are the target's own projections of it (k_norm's weight applied), up to a
    per-head scale."""
    d = load_drafter(folded)
    a_state = load_file(str(ASSISTANT / "model.safetensors"))
    t_state = load_file(str(TARGET / "model.safetensors"))
    e_a = a_state["model.embed_tokens.weight"].float()
    assert torch.equal(d.lm_head.weight[:, :96], e_a) and not d.lm_head.weight[:, 96:].any()
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 3.0
    with torch.no_grad():
        r = d.midlayer.hidden_norm(d.fc(torch.cat([torch.zeros(64, 256), x], dim=-1)))
        keys = r @ d.midlayer.self_attn.k_proj.weight[:64, 128:].T  # the assistant's 2 K/V heads of 32
    ln = t_state["model.layers.5.input_layernorm.weight"].float()
    k_norm = t_state["model.layers.5.self_attn.k_norm.weight"].float().repeat(2)  # per head dimension, as k_norm
    want = x @ (k_norm[:, None] * t_state["model.layers.5.self_attn.k_proj.weight"].float() * ln[None, :]).T
    for head in range(2):
        cols = slice(32 * head, 32 * head + 32)
        assert _cos(keys[:, cols], want[:, cols]).min() > 0.999
    # r's first 96 coordinates are P_h·diag(target norm)·x̂, at the expected scale
    p_h = a_state["pre_projection.weight"].float()[:, 128:] * t_state["model.norm.weight"].float()[None, :]
    x_hat = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    assert _cos(r[:, :96], x_hat @ p_h.T).min() > 0.99


def test_embedding_heads_return_the_embedding_term(folded):
    """The extra heads attend each position itself and return c·P_e·ê: the embedding share of the assistant's
    x0, which an EAGLE-3 residual cannot carry."""
    d = load_drafter(folded)
    model = load_target(TARGET)
    ids = torch.randint(0, 4096, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
        p_e = load_file(str(ASSISTANT / "model.safetensors"))["pre_projection.weight"].float()[:, :128]
        want = emb @ p_e.T
        x = torch.cat([d.midlayer.input_layernorm(emb), torch.zeros(1, 200, 128)], dim=-1)
        att = d.midlayer.self_attn
        seen = {}
        hook = att.o_proj.register_forward_hook(lambda _m, inp, _o: seen.setdefault("in", inp[0]))
        mask = torch.full((200, 200), float("-inf")).triu(1)[None, None]
        att(x, position_embeddings=d.rotary(x, torch.arange(200)[None]), attention_mask=mask)
        hook.remove()
        extra = seen["in"][..., 4 * 32:] @ att.o_proj.weight[:, 4 * 32:].T
    assert _cos(extra[0, :, :96], want[0]).mean() > 0.99
    assert not extra[..., 96:].abs().max() > 0


def test_folded_eagle3_decodes_losslessly_and_distils(folded, tmp_path):
    model = load_target(TARGET)
    target, masks = Target(model), MaskCache(torch.float32, "cpu")
    engine = load_engine(str(folded), target, masks, tree="chain:3", target_dir=str(TARGET))
    target.set_taps(engine.taps)
    prompt = list(range(5, 40))
    assert generate(target, engine, prompt, 24, masks=masks).tokens == generate(target, Drafter(), prompt, 24,
                                                                                    masks=masks).tokens
    res = run_cli("distill", str(folded), "--target", str(TARGET), "--tokens", "4096", "--seq-len", "128",
                  "--batch", "4", "--eval-every", "4", "-o", str(tmp_path / "d"), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokens"] == 4096
    assert isinstance(load_drafter(tmp_path / "d"), Eagle3Drafter)


def test_medusa_from_the_assistant_is_calibrated_at_the_target_width(tmp_path):
    out = tmp_path / "medusa"
    convert_calibrated(ASSISTANT, "medusa", out, heads=2, calibrate=4096, target=TARGET, dtype="fp32",
                       calibrate_steps=100)
    d = load_drafter(out)
    assert isinstance(d, MedusaDrafter) and d.num_heads == 2
    head = load_file(str(TARGET / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert all(torch.equal(h.weight, head) for h in d.lm_heads)  # the target's (tied) head
    rec = json.loads((out / "recycle.json").read_text())
    for h in rec["calibration"]["heads"]:  # fitted toward the assistant's chain, from the identity
        assert h["calibrated"]["kl"] < h["identity"]["kl"]
        assert h["calibrated"]["top1_agreement"] > h["identity"]["top1_agreement"]
    assert not math.isnan(rec["calibration"]["heads"][0]["calibrated"]["kl"])


@pytest.mark.parametrize("args,needle", [
    (("--to", "eagle3"), "pass --target"),
    (("--to", "eagle"), "use --to eagle3 or --to medusa"),
    (("--to", "medusa"), "--calibrate TOKENS --target"),
    (("--to", "eagle3", "--target", str(TARGET), "--eagle3-attention", "mla"), "MLA source"),
    (("--to", "eagle3", "--target", str(FIXTURES / "deepseek_v3_mtp")), "drafts for a Gemma 4 model"),
])
def test_assistant_conversions_refuse_bad_input(tmp_path, args, needle):
    assert_bad_input(run_cli("convert", str(ASSISTANT), *args, "-o", str(tmp_path / "out")), needle)
    assert not (tmp_path / "out").exists()


def test_target_with_eagle3_is_for_assistants_only(tmp_path):
    res = run_cli("convert", str(FIXTURES / "deepseek_v3_mtp"), "--to", "eagle3", "--target", str(TARGET),
                  "-o", str(tmp_path / "out"))
    assert_bad_input(res, "Gemma 4 assistant source")


def test_a_draft_vocabulary_is_counted_with_the_target_s_tokenizer(tmp_path):
    """An assistant ships no tokenizer; --draft-vocab counts with its target's."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main():\n    return sorted(items, key=len)\n" * 50)
    out = tmp_path / "e3"
    convert_checkpoint(ASSISTANT, "eagle3", out, target=TARGET, draft_vocab=256, vocab_corpus=corpus)
    d = load_drafter(out)
    assert d.draft_vocab_size == 256 and d.lm_head.weight.shape == (256, 128)
    head = load_file(str(ASSISTANT / "model.safetensors"))["model.embed_tokens.weight"]
    ids = d.target_ids()
    assert torch.equal(d.lm_head.weight[:, :96].to(head.dtype), head[ids])
