"""Step-3.5/3.7-Flash (`step3p7`) and Mellum2 (`mellum`): detection on their own layouts, and recycle's MTP forward
against transformers' own computation.

Step: the referee loads the three MTP blocks as ordinary decoder layers L..L+2 of a widened Step3p7 model through
transformers' `from_pretrained` (the config class lays out each MTP layer from the release's padded per-layer lists:
sliding window, 6 query heads on sliding layers, dense MLP), and assembles the rest by hand from raw tensors as vLLM's
Step3p5MTP computes it: (1+w) norms, the [e; h] concat, the module's own `transformer.shared_head.{norm,output}`, the
block's output (before that norm) chained to the next module, no position-0 zeroing. transformers' MtpModel cannot be
the referee here: it chains the normed state, reads the trunk's lm_head, and its renames miss `transformer.`.

Mellum: the referee is transformers' MtpModel itself (what `generate(use_mtp=True)` runs), loaded from the checkpoint
through `MtpModel.from_pretrained`; its one MTP layer is sliding-window attention (4 tokens here, T = 10).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import BY_NAME, derive, match
from recycle.mtp import MTP

from fixtures.families import make
from tests.helpers import native_chain_past_the_window

T = 10  # positions: longer than both fixtures' 4-token sliding windows


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    """from_pretrained lists the MTP tensors a widened or trunk-only model leaves unused: expected here."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    yield
    logging.set_verbosity(level)


def _inputs(depth: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T, 64, generator=g)
    ids = torch.randint(0, 256, (2, T + depth), generator=g)
    return h, ids, torch.arange(T).unsqueeze(0).expand(2, T)


def _rms1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm, (1 + w)·x̂ (GemmaRMSNorm, as vLLM's Step3p5MTP runs enorm/hnorm/shared_head.norm)."""
    return (1.0 + w) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mask(b: int, window: int | None) -> torch.Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(T, T).masked_fill(~ok, float("-inf"))[None, None].expand(b, 1, T, T)


# -- Step-3.7-Flash ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step(family_dir):
    return family_dir("step3p7")


@pytest.fixture(scope="module")
def step_mtp(step):
    return MTP.from_checkpoint(step)


def test_step_detected_with_its_own_head(step):
    ck = Checkpoint(step)
    m = match(ck)
    assert (m.family.name, m.declared, len(m.modules), m.conflict) == ("step3p7", 3, 3, None)
    assert (ck.config["model_type"], m.config["model_type"]) == ("step3p7", "step3p5")  # the text model is step3p5
    for k, mod in enumerate(m.modules):
        p = f"model.layers.{2 + k}."
        assert mod.tensor("head") == p + "transformer.shared_head.output.weight"
        assert mod.tensor("final_norm") == p + "transformer.shared_head.norm.weight"
        assert not [n for n in mod.roles["block"] if "shared_head" in n or n.endswith(("enorm.weight", "eh_proj.weight"))]
    # forced through DeepSeek's row (what tensor names alone used to pick): the trunk's head, the module's own head in
    # the block, and a DeepSeek block the config cannot build: a one-line refusal, never a drafter
    forced = match(ck, "deepseek_v3")
    assert forced.modules[0].shared["head"] == "lm_head.weight"
    assert "model.layers.2.transformer.shared_head.output.weight" in forced.modules[0].roles["block"]
    with pytest.raises(RecycleError, match="cannot build"):
        MTP.from_checkpoint(step, family="deepseek_v3")


def test_step_blocks_as_the_release_lays_them_out(step, step_mtp):
    """Per MTP layer, from the padded lists by hand: sliding, sliding, full (the 4-cycle at indices 2-4), 6 query heads
    on sliding layers and 4 on full ones (attention_other_setting), a dense MLP (moe_layers_enum lists layer 1 only),
    each module's own head and (1+w) norms, and the embedding borrowed from the trunk."""
    ck = Checkpoint(step)
    assert step_mtp.depth == 3 and step_mtp.config.num_hidden_layers == 2
    assert [layer.layer_type for layer in step_mtp.layers] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert [layer.block.self_attn.q_proj.weight.shape[0] for layer in step_mtp.layers] == [96, 96, 64]
    assert [layer.block.self_attn.sliding_window for layer in step_mtp.layers] == [4, 4, None]
    assert {type(layer.block.mlp).__name__ for layer in step_mtp.layers} == {"Step3p7MLP"}
    for k, layer in enumerate(step_mtp.layers):
        assert torch.equal(layer.head.weight, ck.get(f"model.layers.{2 + k}.transformer.shared_head.output.weight",
                                                     torch.float32))
        assert torch.equal(layer.embed.weight, ck.get("model.embed_tokens.weight", torch.float32))  # the trunk's
        assert layer.embed_norm.style == "1+w"
        assert layer.embed_norm.weight.abs().max() < 0.2  # stored zero-centred: near 0, not near 1


def test_step_matches_transformers_layers_every_depth(step, step_mtp):
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    raw_config = json.loads((step / "config.json").read_text())
    text = raw_config["text_config"]
    L, eps, window = text["num_hidden_layers"], text["rms_norm_eps"], text["sliding_window"]
    # the MTP layers as ordinary layers L..L+2: the config class reads their entries off the padded lists
    wide = Step3p7Config.from_dict({**raw_config, "text_config": {**text, "num_hidden_layers": L + 3,
                                                                   "num_nextn_predict_layers": 0}})
    model, info = Step3p7ForConditionalGeneration.from_pretrained(
        step, config=wide, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # every weight came from the file, as stored
    lm = model.model.language_model.eval()
    ck = Checkpoint(step)
    raw = lambda n: ck.get(n, torch.float32)
    h, ids, pos = _inputs(3)
    with torch.no_grad():
        state, want = h, []
        for k in range(3):
            p, layer_type = f"model.layers.{L + k}.", wide.text_config.layer_types[L + k]
            e = F.embedding(ids[:, k + 1 : k + 1 + T], raw("model.embed_tokens.weight"))
            x = torch.cat([_rms1p(e, raw(p + "enorm.weight"), eps), _rms1p(state, raw(p + "hnorm.weight"), eps)], -1)
            y = lm.layers[L + k](F.linear(x, raw(p + "eh_proj.weight")),
                                 attention_mask=_mask(2, window if layer_type == "sliding_attention" else None),
                                 position_ids=pos, position_embeddings=lm.rotary_emb(h, pos, layer_type))
            normed = _rms1p(y, raw(p + "transformer.shared_head.norm.weight"), eps)
            want.append(F.linear(normed, raw(p + "transformer.shared_head.output.weight")))
            state = y  # the next module reads the block's output before shared_head.norm
        got = step_mtp(h, ids).logits
    assert len(got) == 3
    for k in range(3):
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
    # the chaining matters from depth 2 on: chaining the normed state would give other logits
    post = MTP.from_checkpoint(step)
    post.family = derive(post.family, run=dict(chained_state="post_norm"))
    with torch.no_grad():
        other = post(h, ids).logits
    torch.testing.assert_close(other[0], got[0])
    assert (other[1] - got[1]).abs().max() > 1e-2


def test_step_drafts_with_each_modules_own_head(tmp_path):
    """The released heads are copies of lm_head; after the trunk moves they differ, and the engine (vLLM's
    Step3p5MTP) drafts with each module's own: so does recycle, and it writes each module's own back."""
    fx = make("step3p7")
    name = "model.layers.3.transformer.shared_head.output.weight"
    g = torch.Generator().manual_seed(1)
    fx.tensors[name] = (fx.tensors[name].float() + 0.05 * torch.randn(fx.tensors[name].shape, generator=g)).bfloat16()
    path = fx.write(tmp_path / "stale_head")
    ck = Checkpoint(path)
    mtp = MTP.from_checkpoint(path)
    assert torch.equal(mtp.layers[1].head.weight, ck.get(name, torch.float32))
    assert not torch.equal(mtp.layers[1].head.weight, ck.get("lm_head.weight", torch.float32))
    assert torch.equal(mtp.layers[0].head.weight, ck.get("lm_head.weight", torch.float32))
    assert torch.equal(mtp.checkpoint_tensors()[name], ck.raw(name).float())


def test_step_target_decodes_past_its_window_with_its_three_modules(step):
    """Issue 47: Step-3.7 is a multimodal release with no causal-LM class in transformers: the decoder loads its
    image-text-to-text class and runs it on token ids; its trunk's sliding layers (window 4) and its 3 modules chain
    past the window as plain decoding does."""
    native_chain_past_the_window(step, 3)


def test_step_checkpoint_tensors_round_trip(step, step_mtp):
    ck = Checkpoint(step)
    out = step_mtp.checkpoint_tensors()
    assert set(out) == {n for n in ck.tensors if n.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4."))}
    for name, t in out.items():
        assert torch.equal(t.to(ck.raw(name).dtype), ck.raw(name)), name


def test_step_converts_to_eagle3_and_to_gguf_only_with_a_vocabulary(step, tmp_path):
    """EAGLE-3 folds module 0 into a Llama midlayer; its 6 sliding-window heads do not divide hidden 64 (nor the
    release's 96 its 4096), which transformers' LlamaConfig refuses: that attention starts fresh, the rest is copied.
    --to gguf (llama.cpp's step35 graph: tests/test_gguf.py) needs the vocabulary for the side file's header: the
    generator ships no tokenizer, so it is refused in one line naming --target."""
    from recycle.converters.api import convert_checkpoint
    from recycle.drafters import load_drafter

    out = tmp_path / "eagle3"
    convert_checkpoint(step, "eagle3", out)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["head_dim"], config["rope_theta"]) == (4, 16, 10000.0)  # module 0's
    mapping = {m["tensor"]: m for m in json.loads((out / "recycle.json").read_text())["mapping"]}
    assert mapping["midlayer.self_attn.o_proj.weight"]["kind"] == "fresh"
    assert "6 attention heads do not divide" in mapping["midlayer.self_attn.o_proj.weight"]["note"]
    assert mapping["midlayer.mlp.down_proj.weight"]["kind"] == "exact"
    assert type(load_drafter(out)).__name__ == "Eagle3Drafter"
    with pytest.raises(RecycleError, match="no tokenizer.json for the side file's vocabulary; pass --target"):
        convert_checkpoint(step, "gguf", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


# -- Mellum2 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mellum(family_dir):
    return family_dir("mellum")


def test_mellum_is_matched_as_mellum_not_qwen3_next(mellum):
    ck = Checkpoint(mellum)
    m = match(ck)
    assert (m.family.name, m.declared, len(m.modules), m.conflict) == ("mellum", 1, 1, None)
    assert (m.family.run.norm, BY_NAME["qwen3_next"].run.norm) == ("w", "1+w")
    # the names are Qwen3-Next's: forced through that row the same tensors fill the same roles
    forced = match(ck, "qwen3_next")
    assert forced.modules[0].roles == m.modules[0].roles and forced.modules[0].shared == m.modules[0].shared
    assert ck.get("mtp.norm.weight").float().mean() > 0.9  # w-style: stored near 1


def test_mellum_matches_transformers_mtp_model(mellum):
    """Depth 1 against MtpModel: MellumDecoderLayer as the block (sliding window), w norms, post_norm = mtp.norm."""
    from transformers import MellumForCausalLM
    from transformers.modeling_layers import MtpModel

    trunk = MellumForCausalLM.from_pretrained(mellum, dtype=torch.float32).eval()
    ref = MtpModel.from_pretrained(trunk).float().eval()
    assert type(ref.layers[0].mtp_block).__name__ == "MellumDecoderLayer"
    assert ref.config.layer_types == ["sliding_attention"]
    ours = MTP.from_checkpoint(mellum)
    assert ours.layers[0].layer_type == "sliding_attention"
    _, ids, pos = _inputs(1)
    with torch.no_grad():
        h = trunk.model(input_ids=ids[:, :T]).last_hidden_state
        got = ours(h, ids).logits[0]
        state = ref.forward_layer(0, h, pos, None, input_ids=ids[:, 1 : T + 1])
        want = ref._project_to_logits(state)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # Qwen3-Next's reading of the same weights, (1+w) norms: every norm about 2x, other logits
        as_qwen = MTP.from_checkpoint(mellum)
        as_qwen.family = derive(as_qwen.family, run=dict(norm=BY_NAME["qwen3_next"].run.norm))
        for layer in as_qwen.layers:
            for norm in (layer.embed_norm, layer.hidden_norm, layer.final_norm):
                norm.style = "1+w"
        wrong = as_qwen(h, ids).logits[0]
    assert (wrong - want).abs().max() > 0.1
    assert (wrong.argmax(-1) != want.argmax(-1)).float().mean() > 0.05


def test_mellum_forced_through_qwen3_next_row_is_refused(mellum):
    """The qwen3_next row's block class cannot hold Mellum's layer: forcing it fails loudly, never silently."""
    with pytest.raises(RecycleError):
        MTP.from_checkpoint(mellum, family="qwen3_next")


def test_a_step_conversion_says_vllm_cannot_serve_its_modules(family_dir, tmp_path):
    """vLLM 0.32's Step MTP path fails on every device (vllm#49642, measured on its CPU build: docs/engines.md): the
    conversion's notes say so, and name what does run them, llama.cpp's step35 graph; push's card carries the note."""
    import json

    from tests.cli_helpers import run_cli

    out = tmp_path / "eagle"
    res = run_cli("convert", str(family_dir("step3p7")), "--to", "eagle", "-o", str(out))
    assert res.exit_code == 0, res.output
    notes = json.loads((out / "recycle.json").read_text())["notes"]
    assert any("vllm#49642" in n and "step35" in n for n in notes), notes
    card = run_cli("push", str(out), "--repo", "me/x", "--dry-run", "--json")
    assert card.exit_code == 0 and "vllm#49642" in json.loads(card.stdout)["card"]
