"""MiMo-V2-Flash (`mimo_v2_flash`) and Ling (`bailing_hybrid`): detection on their own layouts, and recycle's MTP
forward against transformers' own decoder layers, every depth chained.

The referees load the MTP blocks as ordinary decoder layers of a widened model through transformers' `from_pretrained`
(its own conversion: MiMo's `attention_sink_bias` → `sinks`; Ling's `attention.*`, `dense`, `gate.expert_bias`, the
per-expert tensors fused), and assemble the rest by hand from raw tensors: the [e; h] concat, the post-norm chaining
and the trunk's head that vLLM's MiMoV2MTP and BailingMoeV3MTP compute, with hand-built masks (a 4-token sliding window
for MiMo's MTP layers, which are sliding-window attention with a dense MLP).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import match
from recycle.mtp import MTP

from tests.helpers import native_chain_past_the_window

T = 10  # positions: longer than MiMo's 4-token window


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mask(b: int, window: int | None = None) -> torch.Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(T, T).masked_fill(~ok, float("-inf"))[None, None].expand(b, 1, T, T)


def _inputs(depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, T, 64, generator=g)
    ids = torch.randint(0, 256, (2, T + depth), generator=g)
    return h, ids, torch.arange(T).unsqueeze(0).expand(2, T)


def _reference(wide, ck: Checkpoint, names, h, ids, pos, mask, rope, embed: str, eps: float) -> list[torch.Tensor]:
    """Depths 1..n: e = Embed(t_{i+k}) (not zeroed), x = eh_proj(cat[enorm(e), hnorm(state)]), y = the widened model's
    layer L+k, logits = lm_head(final_layernorm(y)), and the next depth reads final_layernorm(y)."""
    raw = lambda n: ck.get(n, torch.float32)
    L = ck.config["num_hidden_layers"]
    state, want = h, []
    for k, p in enumerate(names):
        e = F.embedding(ids[:, k + 1 : k + 1 + T], raw(embed))
        x = torch.cat([_rms(e, raw(p + "enorm.weight"), eps), _rms(state, raw(p + "hnorm.weight"), eps)], -1)
        x = F.linear(x, raw(p + "eh_proj.weight"))
        y = wide.model.layers[L + k](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        state = _rms(y, raw(p + "final_layernorm.weight"), eps)
        want.append(F.linear(state, raw("lm_head.weight")))
    return want


# -- detection ------------------------------------------------------------------------------------------------


def test_detected_on_their_own_layouts(family_dir):
    mimo, ling = Checkpoint(family_dir("mimo_v2_flash")), Checkpoint(family_dir("bailing_hybrid"))
    m = match(mimo)
    assert (m.family.name, m.declared, len(m.modules), m.conflict) == ("mimo_v2_flash", 3, 3, None)
    assert m.modules[2].tensor("final_norm") == "model.mtp.layers.2.final_layernorm.weight"
    m = match(ling)
    assert (m.family.name, m.declared, len(m.modules), m.conflict) == ("bailing_hybrid", 1, 1, None)
    assert m.modules[0].shared == {"head": "lm_head.weight", "embed": "model.word_embeddings.weight"}
    # by tensors alone, neither row claims the layout it used to be mistaken for, nor the other way round
    for ckpt, other in ((mimo, "longcat_flash"), (Checkpoint(family_dir("longcat_flash")), "mimo_v2_flash"),
                        (Checkpoint(family_dir("deepseek_v3")), "bailing_hybrid")):
        with pytest.raises(RecycleError, match="unknown layout"):
            match(ckpt, other)
    assert match(Checkpoint(family_dir("longcat_flash"))).family.name == "longcat_flash"


# -- MiMo-V2-Flash --------------------------------------------------------------------------------------------


def _mimo_wide(src: Path, out: Path, depth: int):
    """The fixture with MTP block k renamed into decoder layer L+k (its `pre_mlp_layernorm` is the layer's
    `post_attention_layernorm`), loaded by MiMoV2FlashForCausalLM.from_pretrained."""
    from transformers import MiMoV2FlashForCausalLM

    ck = Checkpoint(src)
    cfg = dict(ck.config)
    L = cfg["num_hidden_layers"]
    cfg.update(num_hidden_layers=L + depth, layer_types=cfg["layer_types"] + ["sliding_attention"] * depth,
               mlp_layer_types=cfg["mlp_layer_types"] + ["dense"] * depth)
    tensors = {}
    for name in ck.tensors:
        if not name.startswith("model.mtp.layers."):
            tensors[name] = ck.raw(name)
            continue
        k, rel = name.removeprefix("model.mtp.layers.").split(".", 1)
        if not rel.startswith(("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")):
            tensors[f"model.layers.{L + int(k)}.{rel.replace('pre_mlp_layernorm.', 'post_attention_layernorm.')}"] = ck.raw(name)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    wide, info = MiMoV2FlashForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return wide.eval()


def test_mimo_v2_flash_matches_transformers_layers(family_dir, tmp_path):
    src = family_dir("mimo_v2_flash")
    ck = Checkpoint(src)
    mtp = MTP.from_checkpoint(src)
    assert mtp.depth == 3 and [layer.layer_type for layer in mtp.layers] == ["sliding_attention"] * 3
    assert all(type(layer.block.mlp).__name__ == "MiMoV2FlashMLP" for layer in mtp.layers)  # dense, not the MoE
    assert mtp.layers[0].block.self_attn.sinks is not None
    wide = _mimo_wide(src, tmp_path / "wide", 3)
    h, ids, pos = _inputs(3)
    with torch.no_grad():
        rope = wide.model.rotary_emb(h, pos, "sliding_attention")
        names = [f"model.mtp.layers.{k}." for k in range(3)]
        window = ck.config["sliding_window"]
        want = _reference(wide, ck, names, h, ids, pos, _mask(2, window), rope, "model.embed_tokens.weight", 1e-5)
        got = mtp(h, ids).logits
    assert len(got) == 3
    for k in range(3):
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_mimo_side_file_fuses_q_k_v_as_llama_cpps_graph_asserts(family_dir, tmp_path):
    """`--to gguf` writes llama.cpp's mimo2 side file: every module as blk.{L+k}, its q/k/v as the one `attn_qkv`
    the MTP graph asserts (mimo2.cpp:285), unsharded [Q; K; V], `final_layernorm` as `layer_output_norm`. V2-Flash's
    separate q/k/v and V2.5's pre-sharded chunks of the same values give the same tensors (that V2.5's file is
    llama.cpp's own export byte for byte, and that llama-server drafts with V2-Flash's, is the slow suite's)."""
    from gguf import GGUFReader

    from recycle.converters.api import convert_checkpoint

    from fixtures.families import write_tokenizer

    files = {}
    for name, opts in (("mimo_v2", {}), ("mimo_v2_flash", {"kv": 2})):
        src = tmp_path / name
        shutil.copytree(family_dir(name, **opts), src)
        write_tokenizer(src)
        out = Path(convert_checkpoint(src, "gguf", tmp_path / f"{name}-gguf", dtype="fp32")["out"]) / "mtp.gguf"
        files[name] = {t.name: t for t in GGUFReader(str(out)).tensors}
    v25, flash = files["mimo_v2"], files["mimo_v2_flash"]
    assert set(v25) == set(flash) and all(np.array_equal(np.asarray(v25[n].data), np.asarray(flash[n].data))
                                         for n in v25)
    ck = Checkpoint(family_dir("mimo_v2_flash", kv=2))
    p = "model.mtp.layers.1.self_attn."
    qkv = torch.cat([ck.get(p + f"{x}_proj.weight", torch.float32) for x in "qkv"])
    assert np.array_equal(np.asarray(flash["blk.3.attn_qkv.weight"].data), qkv.numpy())
    assert {"blk.2.layer_output_norm.weight", "blk.4.nextn.eh_proj.weight", "output.weight"} <= set(flash)
    assert not any(n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")) for n in flash)


# -- Ling (bailing_hybrid) ------------------------------------------------------------------------------------


def test_bailing_hybrid_matches_transformers_layers(family_dir):
    """Two modules (the releases store one) so that the chaining is exercised; the MTP layers are MLA + MoE."""
    from transformers import AutoConfig, BailingHybridForCausalLM

    src = family_dir("bailing_hybrid", mtp=2)
    ck = Checkpoint(src)
    L = ck.config["num_hidden_layers"]
    mtp = MTP.from_checkpoint(src)
    assert mtp.depth == 2 and [layer.layer_type for layer in mtp.layers] == ["full_attention"] * 2
    assert all(type(layer.block.mlp).__name__ == "BailingHybridMoE" for layer in mtp.layers)
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_hidden_layers = L + 2
    cfg.layer_types = cfg.layer_types[:L] + ["full_attention"] * 2
    cfg.mlp_layer_types = cfg.mlp_layer_types[:L] + ["sparse"] * 2
    wide, info = BailingHybridForCausalLM.from_pretrained(src, config=cfg, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info  # the MTP blocks sit in ordinary layer slots L, L+1
    wide.eval()
    h, ids, pos = _inputs(2)
    with torch.no_grad():
        rope = wide.model.rotary_emb(h, pos)
        names = [f"model.layers.{L + k}." for k in range(2)]
        want = _reference(wide, ck, names, h, ids, pos, _mask(2), rope, "model.word_embeddings.weight", 1e-6)
        got = mtp(h, ids).logits
    for k in range(2):
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_bailing_hybrid_round_trips_to_ling_names(family_dir):
    """Runtime → Ling's names (`attention.dense`, `gate.expert_bias`, per-expert) → the bytes the fixture stores."""
    src = family_dir("bailing_hybrid")
    ck = Checkpoint(src)
    out = MTP.from_checkpoint(src).checkpoint_tensors()
    assert set(out) == {n for n in ck.tensors if n.startswith("model.layers.2.")}
    assert "model.layers.2.attention.dense.weight" in out and "model.layers.2.mlp.gate.expert_bias" in out
    for name, t in out.items():
        assert torch.equal(t.to(ck.raw(name).dtype), ck.raw(name)), name


def _copy(src: Path, out: Path, config: dict, drop: str = "") -> Path:
    """The fixture with config.json keys replaced and one tensor left out (one shard file, no index)."""
    ck = Checkpoint(src)
    out.mkdir()
    save_file({n: ck.raw(n) for n in ck.tensors if n != drop}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(ck.config) | config))
    return out


def test_releases_transformers_cannot_run_are_refused_in_one_line(family_dir, tmp_path):
    """Ling-2.6's MLA has no output gate, which transformers' BailingHybridAttention (Ling-3.0's) applies; a MiMo-V2.5
    config whose sliding-window heads differ from its full-attention ones is one transformers' MiMo-V2 layer cannot
    express (it gives them the same heads, twice the KV heads). Both are detected, neither is run."""
    ling26 = _copy(family_dir("bailing_hybrid"), tmp_path / "ling26", {"architectures": ["BailingMoeV2_5ForCausalLM"]},
                   drop="model.layers.2.attention.g_proj.weight")
    v25 = _copy(family_dir("mimo_v2"), tmp_path / "v25", {"swa_num_attention_heads": 8})
    assert match(Checkpoint(ling26)).family.name == "bailing_hybrid"
    assert match(Checkpoint(v25)).family.name == "mimo_v2"
    for path, why in ((ling26, "missing: block.self_attn.g_proj.weight"),
                      (v25, "swa_num_attention_heads is 8, and transformers' MiMo-V2 sliding-window layer")):
        with pytest.raises(RecycleError, match=why) as e:
            MTP.from_checkpoint(path)
        assert "\n" not in str(e.value)


# -- MiMo-V2.5 / V2.5-Pro (mimo_v2): q/k/v fused and pre-sharded, the release's own config keys -------------------


def test_mimo_v2_5_runs_the_flash_layers_exactly(family_dir):
    """MiMo-V2.5's generator is MiMo-V2-Flash's values with q/k/v stored as one `qkv_proj` in 2 pre-sharded chunks
    (num_key_value_heads) and only the release's config keys. recycle cuts the chunks into transformers' q/k/v and
    reads the keys into MiMoV2FlashConfig: every module's logits, and the target's, are the Flash copy's exactly (a
    wrong cut or a mis-read key, rotary theta, window, epsilon or value scale, would change them); written back, the
    modules are the stored tensors, fused as stored."""
    from recycle.decoding.target import load_target

    v25, flash = family_dir("mimo_v2"), family_dir("mimo_v2_flash", kv=2)
    assert "layer_types" not in Checkpoint(v25).config and "model.layers.0.self_attn.q_proj.weight" not in \
        Checkpoint(v25).tensors
    g = torch.Generator().manual_seed(0)
    h, ids = torch.randn(2, T, 64, generator=g), torch.randint(0, 256, (2, T + 3), generator=g)
    mine, theirs = MTP.from_checkpoint(v25), MTP.from_checkpoint(flash)
    with torch.no_grad():
        for a, b in zip(mine(h, ids).logits, theirs(h, ids).logits, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(load_target(v25)(ids).logits, load_target(flash)(ids).logits)
    ck = Checkpoint(v25)
    written = mine.checkpoint_tensors()
    stored = {n for n in ck.tensors if n.startswith("model.mtp.")}
    assert set(written) == stored
    assert all(torch.equal(written[n].to(torch.bfloat16), ck.raw(n)) for n in stored)


@pytest.mark.parametrize("fmt", ["eagle", "eagle3", "medusa"])
def test_mimo_v2_5_converts_to_what_the_flash_copy_converts_to(family_dir, converted, fmt):
    """Every drafter format from MiMo-V2.5's layout is, tensor for tensor, the one from the V2-Flash copy of the same
    values (the EAGLE-3 fold and the Medusa heads read the block through the cut, lazily)."""
    from safetensors.torch import load_file

    a, b = (load_file(str(converted(fmt, source=family_dir(v, **o)) / "model.safetensors"))
            for v, o in (("mimo_v2", {}), ("mimo_v2_flash", {"kv": 2})))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_mimo_v2_5_fp8_scales_are_tiled_per_chunk(family_dir, tmp_path):
    """The releases quantize each pre-sharded chunk in blocks of its own, so a `qkv_proj`'s scales come in tiles
    (vLLM's `_shard_fp8_qkv_proj` and llama.cpp's converter read them so). Here the chunks are 160 and 224 rows:
    4 scale rows either way, where one grid over the whole would have 3 and 4, so the second is read right only by
    its chunks. inspect finds nothing wrong; read by chunk every value is within e4m3's rounding of the bf16 one,
    read as one grid it is not; stitch re-quantizes a bf16 module into such a target chunk by chunk."""
    from tests.cli_helpers import run_cli

    v25 = family_dir("mimo_v2", fp8=True)
    from fixtures.families import make

    reference = make("mimo_v2", fp8=True).reference
    ck = Checkpoint(v25)
    res = run_cli("inspect", str(v25), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["worst"] != "error", res.output

    def within(got: torch.Tensor, want: torch.Tensor) -> bool:  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16
        return bool(((got - want).abs() <= want.abs() / 16 + 1e-6).all())

    for n in ("model.layers.1.self_attn.qkv_proj.weight", "model.mtp.layers.2.self_attn.qkv_proj.weight"):
        want = reference[n].float()
        assert ck.tensors[n + "_scale_inv"].shape == (4, 1)
        assert within(ck.get(n, torch.float32, row_chunks=2), want)
        assert not within(ck.get(n, torch.float32), want)
    # a bf16 module (the same values, converted from the bf16 generator) stitched into the FP8 target
    from fixtures.families import write_tokenizer

    bf16 = tmp_path / "bf16"
    shutil.copytree(family_dir("mimo_v2"), bf16)
    write_tokenizer(bf16)
    target = tmp_path / "fp8"
    shutil.copytree(v25, target)
    write_tokenizer(target)
    assert run_cli("convert", str(bf16), "--to", "eagle", "-o", str(tmp_path / "e")).exit_code == 0
    notes = json.loads((tmp_path / "e" / "recycle.json").read_text())["notes"]  # and so the card
    assert any("reads right only at --tensor-parallel-size = num_key_value_heads" in n for n in notes), notes
    res = run_cli("stitch", str(tmp_path / "e" / "mtp_overlay"), "--target", str(target), "-o", str(tmp_path / "st"),
                  "--json")
    assert res.exit_code == 0, res.output
    n = "model.mtp.layers.0.self_attn.qkv_proj.weight"
    assert json.loads(res.stdout)["quantization"]["tensors"][n]["how"] == "re-quantized"
    assert json.loads(res.stdout)["notes"] == []
    # in BF16 the release's layout is one vLLM reads right only at its chunk count: stitch says so
    res = run_cli("stitch", str(tmp_path / "e" / "mtp_overlay"), "--target", str(target), "-o", str(tmp_path / "b"),
                  "--mtp-dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert f"note: {n}: written BF16 in its 2 pre-sharded chunks, which vLLM 0.32 reads right only at" in \
        " ".join(res.stdout.split())
    st = Checkpoint(tmp_path / "st")
    want = Checkpoint(bf16).get(n, torch.float32)
    assert within(st.get(n, torch.float32, row_chunks=2), want) and not within(st.get(n, torch.float32), want)


def test_mimo_v2_5_qkv_that_does_not_cut_is_refused(family_dir, tmp_path):
    """A `qkv_proj` whose rows are not the chunks of the layer's q/k/v (here 8 rows short): one line naming it from
    convert (exit 2, nothing written) and from the target's loader."""
    from recycle.decoding.target import load_target

    from tests.cli_helpers import assert_bad_input, run_cli

    src = Checkpoint(family_dir("mimo_v2"))
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = {n: src.raw(n) for n in src.tensors}
    for n in ("model.mtp.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"):
        tensors[n] = tensors[n][:-8].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(src.config))
    assert_bad_input(run_cli("convert", str(bad), "--to", "eagle", "-o", str(tmp_path / "o")),
                     "model.mtp.layers.1.self_attn.qkv_proj.weight: 440 rows are not 2 chunks of 96 + 96 + 32 rows")
    assert not (tmp_path / "o").exists()
    with pytest.raises(RecycleError, match=r"layers.1.self_attn.qkv_proj.weight: 440 rows are not 2 chunks") as e:
        load_target(bad)
    assert "\n" not in str(e.value)


# -- EAGLE-3 ----------------------------------------------------------------------------------------------------


def _mapping(d: Path) -> dict[str, dict]:
    return {m["tensor"]: m for m in json.loads((d / "recycle.json").read_text())["mapping"]}


def test_eagle3_folds_both_under_their_layers_names(family_dir, converted):
    """The fold reads the blocks through the rows' renames (MiMo's pre_mlp_layernorm, Ling's attention.*), pads
    MiMo's narrower value heads to the query/key head size (values rescaled by attention_value_scale), and the
    MLA variant leaves out Ling's output gate, which vLLM's DeepseekV2 attention has no place for."""
    from safetensors.torch import load_file

    from recycle.drafters import load_drafter

    src = family_dir("mimo_v2_flash")
    ck = Checkpoint(src)
    d = converted("eagle3", source=src)
    cfg, got, how = json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors")), _mapping(d)
    heads, kv, hd, vd, h = 4, 2, 48, 16, 64
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (heads, kv, hd)
    p = "model.mtp.layers.0."
    assert how["midlayer.post_attention_layernorm.weight"]["from"] == [p + "pre_mlp_layernorm.weight"]
    assert torch.equal(got["midlayer.post_attention_layernorm.weight"], ck.raw(p + "pre_mlp_layernorm.weight"))
    v = got["midlayer.self_attn.v_proj.weight"].float().view(kv, hd, 2 * h)
    assert not v[:, vd:].any()
    want = 0.707 * ck.get(p + "self_attn.v_proj.weight", torch.float32).view(kv, vd, h)
    torch.testing.assert_close(v[:, :vd, h:], want, rtol=1e-2, atol=1e-3)  # bf16 storage
    o = got["midlayer.self_attn.o_proj.weight"].view(h, heads, hd)
    assert not o[:, :, vd:].any() and torch.equal(o[:, :, :vd].reshape(h, -1), ck.raw(p + "self_attn.o_proj.weight"))
    assert "attention sinks" in how["midlayer.self_attn.q_proj.weight"]["note"]
    assert type(load_drafter(d)).__name__ == "Eagle3Drafter"  # every shape fits the config it wrote

    src = family_dir("bailing_hybrid")
    how = _mapping(converted("eagle3", source=src))
    q = how["midlayer.self_attn.q_proj.weight"]
    assert q["kind"] == "approx" and "model.layers.2.attention.kv_b_proj.weight" in q["from"]  # MLA folded, not fresh
    assert how["midlayer.self_attn.o_proj.weight"]["from"] == ["model.layers.2.attention.dense.weight"]
    d = converted("eagle3", source=src, eagle3_attention="mla")
    names = set(load_file(str(d / "model.safetensors")))
    assert "midlayer.self_attn.kv_b_proj.weight" in names and "midlayer.self_attn.g_proj.weight" not in names
    assert any("g_proj" in n for n in json.loads((d / "recycle.json").read_text())["notes"])


def test_a_card_says_vllm_runs_only_mimos_first_module(family_dir, converted):
    """Issue 47: MiMo-V2 stores 3 modules; vLLM's MiMoV2MTP runs module 0 only (mimo_v2_mtp.py: num_mtp_layers = 1).
    The conversion's notes say so, and push's card carries them; a one-module checkpoint gets no such note."""
    from typer.testing import CliRunner

    from recycle.cli import app

    three = converted("eagle", source=family_dir("mimo_v2_flash"))
    notes = json.loads((three / "recycle.json").read_text())["notes"]
    assert any("vLLM's MTP model for 'mimo_v2_flash' runs module 0 only" in n for n in notes), notes
    res = CliRunner().invoke(app, ["push", str(three), "--repo", "me/x", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    assert "runs module 0 only" in json.loads(res.stdout)["card"]
    one = converted("eagle", source=family_dir("mimo_v2_flash", mtp=1))
    assert not any("module 0 only" in n for n in json.loads((one / "recycle.json").read_text())["notes"])
    # what vLLM does with the module's window (docs/engines.md): every MiMo conversion says it
    assert any("`sliding_window_size` keys" in n for n in json.loads((one / "recycle.json").read_text())["notes"])


def test_native_chain_is_lossless_past_the_targets_sliding_window(family_dir):
    """Issue 47: MiMo-V2's trunk alternates full and sliding-window layers. Its cache keeps every token (a layer that
    evicted cannot be cut back to the accepted ones) and each layer type gets its own mask."""
    native_chain_past_the_window(family_dir("mimo_v2_flash"), 3)


def test_plans_read_a_release_transformers_has_no_class_for(family_dir, tmp_path):
    """`distill --plan` and `harvest --plan` size the target from its config the way the target loads: MiMo-V2.5's
    keys read by its row (before: transformers' "does not recognize this architecture" as a traceback); a model type
    no row reads is one line, exit 2."""
    from tests.cli_helpers import assert_bad_input, run_cli

    v25 = family_dir("mimo_v2")
    eagle = tmp_path / "eagle"
    assert run_cli("convert", str(v25), "--to", "eagle", "-o", str(eagle)).exit_code == 0
    res = run_cli("distill", str(eagle), "--target", str(v25), "--tokens", "4k", "--plan")
    assert res.exit_code == 0 and "total per rank" in res.stdout, res.output
    res = run_cli("harvest", "--target", str(v25), "--plan", "--tokens", "1M")
    assert res.exit_code == 0 and "harvest plan" in res.stdout, res.output
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "not_a_model", "architectures": ["NotAModel"]}))
    assert_bad_input(run_cli("harvest", "--target", str(odd), "--plan", "--tokens", "1M"),
                     "transformers cannot read its config.json (ValueError: Unrecognized model identifier: not_a_model")


def test_mimo_v2_5_as_released_with_its_towers_runs_its_text_model(family_dir):
    """MiMo-V2.5 as released is omni (MiMoV2OmniForCausalLM, `vision_config`, `audio_config`; vLLM's MiMoV2Omni maps
    `model.visual.` and `speech_embeddings.` beside the text model's `model.`): inspect names the row with no error,
    and its modules and target (towers left unread) compute what the text-only layout computes."""
    from recycle.decoding.target import load_target

    from tests.cli_helpers import run_cli

    omni, text = family_dir("mimo_v2", omni=True), family_dir("mimo_v2")
    res = run_cli("inspect", str(omni), "--json")
    data = json.loads(res.stdout)
    assert res.exit_code == 0 and data["family"] == "mimo_v2" and data["worst"] != "error", res.output
    g = torch.Generator().manual_seed(0)
    h, ids = torch.randn(1, T, 64, generator=g), torch.randint(0, 256, (1, T + 3), generator=g)
    with torch.no_grad():
        assert torch.equal(load_target(omni)(ids).logits, load_target(text)(ids).logits)
        for a, b in zip(MTP.from_checkpoint(omni)(h, ids).logits, MTP.from_checkpoint(text)(h, ids).logits,
                        strict=True):
            assert torch.equal(a, b)
