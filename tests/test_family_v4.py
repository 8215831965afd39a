"""DeepSeek-V4 (`deepseek_v4` row, recycle.mtp.deepseek_v4): detection under DeepSeek's own names and scales, inspect, and the
stream-state MTP runtime against an independent computation.

The referee: transformers' DeepseekV4ForCausalLM for the trunk (its last layer's hyper-connection streams), the MTP
modules' blocks loaded by transformers' own loader as ordinary layers L, L+1 of a wider model, and vLLM's
DeepSeekV4MTP formula (e/h projections per stream, zeroed position-0 embedding, the module's hc_head, its norm, the
trunk's head) written out here with raw tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from recycle.audit import inspect_checkpoint
from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import match
from recycle.mtp import MTP
from recycle.mtp.deepseek_v4 import DeepseekV4MTP

L = 2  # trunk layers of the generator


@pytest.fixture(scope="module")
def two(family_dir):
    return family_dir("deepseek_v4", mtp=2)


@pytest.fixture(scope="module")
def loaded(two):
    """transformers' own V4 model of the generator's trunk, and its loading report."""
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(two, dtype=torch.float32, attn_implementation="eager",
                                                        output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def ours(two):
    return MTP.from_checkpoint(two)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hc_head(s: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6):
    """vLLM's hc_head: a sigmoid mix of the streams, from the RMS-normalised flattened streams."""
    flat = s.flatten(2)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + eps
    return (pre.unsqueeze(-1) * s).sum(2)


def test_inspect_is_clean(family_dir):
    rep = inspect_checkpoint(family_dir("deepseek_v4"))
    assert (rep.family, rep.declared, len(rep.modules)) == ("deepseek_v4", 1, 1)
    assert rep.worst != "error", [f.message for f in rep.findings]


def _release_storage(src, out, codes=None):
    """The generator's checkpoint in the release's storage: FP8 e_proj with an e8m0 `.scale`, FP4 experts packed in
    I8 with an e8m0 `.scale` per 32 (codes: zeros, or drawn from `codes`, a generator)."""
    tensors = load_file(str(src / "model.safetensors"))
    w = tensors["mtp.0.e_proj.weight"]
    tensors["mtp.0.e_proj.weight"] = w.float().to(torch.float8_e4m3fn)
    tensors["mtp.0.e_proj.scale"] = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    for name in [n for n in tensors if ".experts." in n]:
        rows, cols = tensors[name].shape
        tensors[name] = torch.zeros(rows, cols // 2, dtype=torch.int8) if codes is None else \
            torch.randint(-128, 128, (rows, cols // 2), dtype=torch.int8, generator=codes)
        scale = 1.0 if codes is None else 2.0 ** -7
        tensors[name.removesuffix(".weight") + ".scale"] = torch.full((rows, cols // 32), scale).to(torch.float8_e8m0fnu)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    cfg["expert_dtype"] = "fp4"
    (out / "config.json").write_text(json.dumps(cfg))
    return out, tensors


def test_native_scales_pair_and_fp4_experts_refuse(family_dir, tmp_path):
    """The release's layout: FP8 e_proj with an e8m0 `.scale`, FP4 experts packed in I8 with `.scale` per 32.
    Scales join their weight's role (not the block), inspect finds no error, and the runtime refuses in one line."""
    out, tensors = _release_storage(family_dir("deepseek_v4"), tmp_path / "v4_fp")
    ckpt = Checkpoint(out)
    m = match(ckpt)
    mod = m.modules[0]
    assert mod.roles["e_proj"] == ["mtp.0.e_proj.weight", "mtp.0.e_proj.scale"]
    assert mod.tensor("e_proj") == "mtp.0.e_proj.weight"
    assert ckpt.scale_for("mtp.0.e_proj.weight").dtype == "F8_E8M0"
    # the FP4 experts are folded with their e8m0 scales into one weight each (recycle/quant/fp4.py's
    # mxfp4_native), read through the codec; the runtime from them: tests/test_quant_fp4.py
    expert = "mtp.0.ffn.experts.3.w2.weight"
    assert "mtp.0.ffn.experts.3.w2.scale" not in mod.roles["block"] and expert in mod.roles["block"]
    assert ckpt.packed[expert].parts["scale"] == "mtp.0.ffn.experts.3.w2.scale"
    assert ckpt.tensors[expert].shape == tensors[expert].shape[:1] + (tensors[expert].shape[1] * 2,)
    rep = inspect_checkpoint(out)
    assert rep.worst != "error", [f.message for f in rep.findings]


def test_matches_trunk_streams_and_vllm_formula(two, loaded, ours, tmp_path):
    """Both depths: recycle's runtime on the trunk's streams equals the formula with transformers' own layers."""
    from transformers import DeepseekV4ForCausalLM

    # The MTP blocks as ordinary trunk layers L, L+1: renamed to layers.{L+k}. and loaded by transformers, whose config
    # reads the release's compress_ratios (0: sliding window) for them.
    wide_dir = tmp_path / "wide"
    wide_dir.mkdir()
    raw = load_file(str(two / "model.safetensors"))
    leaves = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "hc_head_", "norm.weight")
    renamed = {}
    for name, t in raw.items():
        if name.startswith("mtp."):
            k, rel = name.split(".", 2)[1:]
            if rel.startswith(leaves):
                continue
            name = f"layers.{L + int(k)}.{rel}"
        renamed[name] = t
    save_file(renamed, str(wide_dir / "model.safetensors"))
    cfg = json.loads((two / "config.json").read_text())
    cfg["num_hidden_layers"] = L + 2
    (wide_dir / "config.json").write_text(json.dumps(cfg))
    wide = DeepseekV4ForCausalLM.from_pretrained(wide_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert wide.config.layer_types[L:] == ["sliding_attention"] * 2
    assert wide.config.mlp_layer_types[L:] == ["moe"] * 2

    trunk = loaded[0]
    assert isinstance(ours, DeepseekV4MTP) and ours.depth == 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (2, 14), generator=g)
    t = ids.shape[1] - 2  # 12 > the sliding window (8): the window and both compressors are exercised
    r = {n: v.float() for n, v in raw.items()}
    captured = {}
    hook = trunk.model.layers[-1].register_forward_hook(lambda mod, args, out: captured.update(s=out))
    with torch.no_grad():
        final = trunk.model(input_ids=ids[:, :t]).last_hidden_state
        hook.remove()
        streams = captured["s"]
        assert streams.shape == (2, t, 4, 64)
        # the hook holds what the trunk's own hc_head and norm read
        torch.testing.assert_close(_rms(_hc_head(streams, r["hc_head_fn"], r["hc_head_base"], r["hc_head_scale"]),
                                        r["norm.weight"]), final, rtol=1e-5, atol=1e-5)
        pos = torch.arange(t).unsqueeze(0).expand(2, t)
        rope = {kind: wide.model.rotary_emb(final, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        mask = torch.zeros(t, t).masked_fill((j > i) | (i - j >= cfg["sliding_window"]), float("-inf"))
        mask = mask[None, None].expand(2, 1, t, t)
        state, want = streams, []
        for k in range(2):
            p = f"mtp.{k}."
            e = F.embedding(ids[:, k + 1 : k + 1 + t], r["embed.weight"])
            e[:, 0] = 0.0  # vLLM: inputs_embeds zeroed where positions == 0
            x = F.linear(_rms(state, r[p + "hnorm.weight"]), r[p + "h_proj.weight"]) + F.linear(
                _rms(e, r[p + "enorm.weight"]), r[p + "e_proj.weight"]).unsqueeze(-2)
            y = wide.model.layers[L + k](x, input_ids=None, position_embeddings=rope, position_ids=pos,
                                         attention_mask=mask)
            h = _hc_head(y, r[p + "hc_head_fn"], r[p + "hc_head_base"], r[p + "hc_head_scale"])
            want.append(F.linear(_rms(h, r[p + "norm.weight"]), r["head.weight"]))
            state = y  # chained: the streams, before the module's hc_head
        got = ours(streams, ids)
    assert len(got.logits) == 2 and got.states[0].shape == (2, t, 4, 64)
    for k in range(2):
        torch.testing.assert_close(got.logits[k], want[k], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want[0], want[1], atol=1e-2)  # the depths differ: the test sees a wrong chain


def test_refuses_a_final_normed_state(ours):
    with pytest.raises(RecycleError, match="hyper-connection streams"):
        ours(torch.zeros(1, 4, 64), torch.zeros(1, 5, dtype=torch.long))


def test_checkpoint_tensors_round_trip(two, ours):
    """Runtime → DeepSeek's names → bytes identical to what the fixture stores (per-expert w1/w2/w3, kv_norm)."""
    ck = Checkpoint(two)
    out = ours.checkpoint_tensors()
    assert set(out) == {n for n in ck.tensors if n.startswith("mtp.")}
    assert "mtp.1.attn.kv_norm.weight" in out and "mtp.0.ffn.experts.3.w2.weight" in out
    for name, t in out.items():
        assert torch.equal(t.to(ck.raw(name).dtype), ck.raw(name)), name


def test_fixture_loads_in_transformers_without_missing_tensors(loaded):
    """The generator's trunk names are exactly what transformers' V4 conversion reads: nothing missing."""
    info = loaded[1]
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"]


# -- decoding: a V4 target and its own modules in recycle's decoder --------------------------------------------------
# The generator's trunk: layer 0 compressed sparse attention (ratio 4, with the indexer), layer 1 heavily compressed
# (ratio 128); sliding window 8. Prompts of 126 tokens make the ratio-128 compressor close its first window mid-decode.


@pytest.fixture(scope="module", autouse=True)
def stable_ties():
    """The generator's compressed sparse attention (4 indexer heads, index_topk 4) ties many entries at a score of 0;
    with ties broken by index, greedy decoding is a function of the prompt alone (`tests.helpers.stable_topk`)."""
    from tests.helpers import stable_topk

    with stable_topk():
        yield


@pytest.fixture(scope="module")
def target(two):
    from recycle.decoding import Target, load_target

    return Target(load_target(two))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cached_decoding_equals_full_forwards(target):
    """The target's cache as transformers builds it (compressor layers kept, not flattened to plain layers) decodes
    what forwards over the whole sequence give, past the window and both compress ratios."""
    from recycle.decoding import generate
    from recycle.decoding.drafting import Drafter

    prompt = _prompt(120)
    got = generate(target, Drafter(), prompt, 16).tokens
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]


@pytest.mark.parametrize("length,wrong", [(3, 1), (4, 2), (2, 2)], ids=["reject-last", "reject-middle", "reject-all"])
def test_rejections_roll_the_compressors_back(target, length, wrong):
    from recycle.decoding import generate
    from recycle.decoding.drafting import Drafter

    from tests.helpers import oracle

    assert target.rolls_back
    prompt = _prompt(126)
    plain = generate(target, Drafter(), prompt, 16).tokens
    spec = generate(target, oracle(plain, length, wrong, 256), prompt, 16)
    assert spec.tokens == plain
    assert spec.stats.rollbacks == spec.stats.steps > 0
    assert sum(spec.stats.accepted) >= (length - wrong) * (spec.stats.steps - 1)


def test_without_the_rollback_rejections_are_refused_not_decoded(target, monkeypatch):
    """The test above can fail: with the compressor caches not put back, the evicted window cannot be cut to the
    accepted tokens, and the decoder says so in one line instead of decoding from rejected drafts' state."""
    from recycle.decoding import cache as kv
    from recycle.decoding import generate
    from recycle.decoding.drafting import Drafter

    from tests.helpers import oracle

    prompt = _prompt(126)
    plain = generate(target, Drafter(), prompt, 16).tokens
    monkeypatch.setattr(kv, "restore", lambda snap: None)
    with pytest.raises(RecycleError, match="already evicted"):
        generate(target, oracle(plain, 3, 1, 256), prompt, 16)


def test_native_chain_is_lossless_and_a_tree_is_refused(two, target):
    from recycle.decoding import MaskCache, generate
    from recycle.decoding.drafting import Drafter, load_engine
    from recycle.decoding.drafting.hyper_mtp import StreamChain

    masks = MaskCache(torch.float32, "cpu")
    with pytest.raises(RecycleError, match="chains only"):
        load_engine(None, target, masks, tree="dynamic", native=True, target_dir=str(two))
    engine = load_engine(None, target, masks, tree="chain:3", native=True, target_dir=str(two))
    assert isinstance(engine, StreamChain) and engine.shape == 3 and engine.tail == 3 * 7 + 1
    target.set_taps(engine.taps)
    prompt = _prompt(40, seed=1)
    run = generate(target, engine, prompt, 24)
    assert run.tokens == generate(target, Drafter(), prompt, 24).tokens
    assert run.stats.tree_nodes == 3 * run.stats.steps  # every module drafts (the third is module 0 again), every step


def test_drafts_are_the_runtime_over_the_whole_sequence(two, target):
    """A chain drafted from the tail of the streams (n·(W−1)+1 rows) is what `DeepseekV4MTP.forward` computes over
    every position; with a tail too short for the window (the control) the second draft changes."""
    from recycle.decoding import MaskCache
    from recycle.decoding.drafting import load_engine

    engine = load_engine(None, target, MaskCache(torch.float32, "cpu"), tree="chain:2", native=True,
                         target_dir=str(two))
    target.set_taps(engine.taps)

    def drafts(prompt: list[int], tail: int) -> tuple[int, list[int], torch.Tensor]:
        engine.tail = tail
        logits, feats = target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], None,
                                       target.new_cache(), logits_for=slice(-1, None))
        root = int(logits[0].argmax())
        engine.start(prompt, feats)
        return root, engine.propose(root).tokens[1:], feats["streams"]

    short = []
    for seed in range(4):
        prompt = _prompt(60, seed)
        root, got, streams = drafts(prompt, 2 * 7 + 1)
        with torch.no_grad():
            out = engine.mtp(streams[None], torch.tensor([prompt + [root] + got[:1]]))
        assert got == [int(lg[0, -1].argmax()) for lg in out.logits]
        short.append(drafts(prompt, 3)[1] != got)
    assert any(short)


# -- the --to eagle drafter in the decoder and in distill --------------------------------------------------------------


@pytest.fixture(scope="module")
def v4_eagle(two, tmp_path_factory):
    from recycle.converters.api import convert_checkpoint

    out = tmp_path_factory.mktemp("v4eagle") / "eagle"
    convert_checkpoint(two, "eagle", out, dtype="fp32")
    return out


def test_eagle_drafter_decodes_losslessly_in_chains(two, target, v4_eagle):
    from recycle.decoding import MaskCache, generate
    from recycle.decoding.drafting import Drafter, load_engine
    from recycle.decoding.drafting.hyper_mtp import StreamChain

    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(str(v4_eagle), target, masks, target_dir=str(two))
    assert isinstance(engine, StreamChain) and engine.shape == 3 and engine.kind == "eagle"
    assert [lyr is engine.mtp.layers[min(k, 1)] for k, lyr in enumerate(engine.layers)] == [True] * 3  # last repeats
    with pytest.raises(RecycleError, match="chains only"):
        load_engine(str(v4_eagle), target, masks, tree="dynamic", target_dir=str(two))
    target.set_taps(engine.taps)
    prompt = _prompt(40, seed=2)
    assert generate(target, engine, prompt, 24).tokens == generate(target, Drafter(), prompt, 24).tokens


def test_distill_unrolls_the_drafter_over_the_teachers_streams(two, v4_eagle, tmp_path):
    """The teacher hands the target's last-layer streams to the unroller (as aux), and step k of the unroll is the
    source modules' depth k on them; a vLLM teacher (a server, an online harvest), which captures no streams, is
    refused (a cache holds them: tests/test_harvest_streams.py)."""
    from recycle.distill.teacher import Teacher
    from recycle.distill.unroll import unroller_for
    from recycle.drafters import load_drafter
    from recycle.formats import get

    drafter = load_drafter(v4_eagle)
    teacher = Teacher(two, torch.device("cpu"), precision="fp32", streams=True)
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(3))
    te = teacher(ids)
    assert te.aux.shape == (2, 20, 4, 64) and te.last.shape == (2, 20, 64)
    steps = unroller_for(get("eagle")).make(drafter, 2).unroll(ids, te.last, te.aux, te.logits)
    t = 20 - 2 - 1
    with torch.no_grad():
        want = MTP.from_checkpoint(two)(te.aux[:, :t], ids[:, :t + 2]).normed
    for k in range(2):
        torch.testing.assert_close(steps[k].draft, want[k].reshape(-1, 64), rtol=1e-4, atol=1e-4)
    with pytest.raises(RecycleError, match="vLLM 0.32 captures neither"):
        Teacher(two, torch.device("cpu"), precision="fp32", streams=True, remote=object())


def test_the_release_storage_round_trips_through_convert_and_distills_rewrite(family_dir, tmp_path):
    """From the FP8 + FP4 release layout: `mtp_overlay/` holds every stored part (each FP4 expert's codes and its
    e8m0 scale: stitch needs both), and after training distill's rewriter writes it back in that storage, the same
    tensors and dtypes: each FP4 expert as the codec encodes its trained values, the FP8 `e_proj` with power-of-two
    e8m0 scales. The stale overlay is far from the trained values; the rewritten one is within the storage's error."""
    from recycle.converters.api import convert_checkpoint
    from recycle.converters.registry import REWRITERS
    from recycle.drafters import load_drafter
    from recycle.quant import CODECS

    src, _ = _release_storage(family_dir("deepseek_v4"), tmp_path / "v4_fp", codes=torch.Generator().manual_seed(5))
    eagle = tmp_path / "eagle"
    convert_checkpoint(src, "eagle", eagle, dtype="fp32")
    stored = Checkpoint(eagle / "mtp_overlay")
    expert = "mtp.0.ffn.experts.3.w2.weight"
    assert stored.packed[expert].parts == {"codes": expert, "scale": "mtp.0.ffn.experts.3.w2.scale"}
    assert set(stored.stored) == set(Checkpoint(src).stored) - {n for n in Checkpoint(src).stored
                                                               if not n.startswith("mtp.")}
    drafter = load_drafter(eagle)
    with torch.no_grad():  # training, in miniature: every weight moves
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    files, dropped, notes = REWRITERS.get("eagle")(eagle, {}, drafter)
    assert not dropped and not notes
    new = files["mtp_overlay/mtp.safetensors"]
    assert {k: tuple(v.shape) for k, v in new.items()} == {k: tuple(i.shape) for k, i in stored.stored.items()}
    codes = {"I8": torch.int8, "F8_E8M0": torch.float8_e8m0fnu, "F8_E4M3": torch.float8_e4m3fn}  # made final here
    assert {k: new[k].dtype for k, i in stored.stored.items() if i.dtype in codes} == \
        {k: codes[i.dtype] for k, i in stored.stored.items() if i.dtype in codes}  # (floats: the writer casts)
    trained = drafter.checkpoint_tensors()
    codec = CODECS.get("mxfp4_native")
    packed = stored.packed[expert]
    back = codec.dequantize({"codes": new[expert], "scale": new["mtp.0.ffn.experts.3.w2.scale"]}, packed, {},
                            torch.float32)
    want = trained[expert].float()
    err, stale = (back - want).abs().max(), (stored.get(expert, torch.float32) - want).abs().max()
    assert err <= want.abs().max() / 4 and err < stale  # FP4: within a quarter of the range; the stale one is not
    assert new["mtp.0.e_proj.scale"].float().log2().frac().abs().max() == 0  # power-of-two scales, as V4 stores
    e = new["mtp.0.e_proj.weight"].float() * new["mtp.0.e_proj.scale"].float()
    torch.testing.assert_close(e, trained["mtp.0.e_proj.weight"].float(), rtol=0.07, atol=1e-3)


def test_medusa_heads_from_v4_decode_in_chains(two, target, tmp_path):
    """Medusa heads read the target's final-normed state, which V4 has like any model: `--to medusa` writes them,
    and on a V4 target (chains only) their default tree becomes a chain, lossless."""
    from recycle.converters.api import convert_checkpoint
    from recycle.decoding import MaskCache, generate
    from recycle.decoding.drafting import Drafter, load_engine

    out = tmp_path / "medusa"
    convert_checkpoint(two, "medusa", out, dtype="fp32")
    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(str(out), target, masks, target_dir=str(two))
    assert engine.shape == 3  # the chain a target that verifies chains only gets (HYBRID_CHAIN)
    target.set_taps(engine.taps)
    prompt = _prompt(40, seed=4)
    assert generate(target, engine, prompt, 16).tokens == generate(target, Drafter(), prompt, 16).tokens


def test_the_release_storage_loads_as_a_target_with_its_stored_values(tmp_path):
    """A V4 target as released (FP4 routed experts, an I64 hash-routing table, DeepSeek's names without transformers'
    `model.` prefix, a declared quantization) loads through recycle's dequantizing reader, and computes exactly what
    the same values stored as float32 compute through transformers' own from_pretrained."""
    from pathlib import Path

    from recycle.decoding.target import load_target

    from fixtures.derive import fp4_experts

    root = Path(__file__).resolve().parents[1]
    fp4 = Path(fp4_experts(root / "fixtures" / "deepseek_v4_mtp", tmp_path / "fp4")["out"])
    ckpt = Checkpoint(fp4)
    plain = tmp_path / "plain"
    plain.mkdir()
    state = {n: ckpt.raw(n) if i.dtype == "I64" else ckpt.get(n, torch.float32) for n, i in ckpt.tensors.items()}
    save_file(state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in ckpt.config.items() if k not in ("quantization_config", "expert_dtype")}
    (plain / "config.json").write_text(json.dumps(cfg))
    assert ckpt.tensors["layers.0.ffn.gate.tid2eid"].dtype == "I64" and "quantization_config" in ckpt.config
    ids = torch.randint(5, 4000, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = (load_target(p)(ids).logits for p in (fp4, plain))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow  # two spawned gloo ranks and a one-process run, about 60 s here
def test_two_gloo_ranks_distill_v4_as_one_process_and_write_its_release_storage(tmp_path):
    """Under torchrun (2 gloo ranks, the routed experts split between them, the rest FSDP2-sharded) a V4 drafter
    reads its blocks under DeepSeek's names per rank (`HyperEagleDrafter.block_to_stored`), trains on the teacher's
    streams with the one-process loss curve (2 ranks × batch 4 against batch 8: within 2e-3), and writes
    model.safetensors from the shards; its `mtp_overlay/` (FP8 e8m0-scaled linears and FP4 experts, as released)
    is rebuilt on rank 0 by the one-process rewriter from the weights the ranks wrote: byte for byte what that
    rewriter makes of the written drafter, in the one-process run's names, dtypes and shapes. Before, the ranks
    stopped mid-set-up on `self_attn.sinks`, and then dropped the overlay."""
    from pathlib import Path

    import torch.multiprocessing as mp

    from recycle.converters.registry import REWRITERS
    from recycle.converters.rewrite import stored_layout
    from recycle.distill.train import DistillOptions, distill
    from recycle.drafters import load_drafter

    from tests import helpers
    from tests.cli_helpers import run_cli

    root = Path(__file__).resolve().parents[1]
    target = root / "fixtures" / "deepseek_v4_mtp"
    fp = tmp_path / "fp"  # the release's storage in the overlay: FP8 e_proj, FP4 experts
    _release_storage(target, fp, codes=torch.Generator().manual_seed(0))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (fp / f).write_bytes((target / f).read_bytes())
    drafter = tmp_path / "v4e"
    assert run_cli("convert", str(fp), "--to", "eagle", "-o", str(drafter)).exit_code == 0
    run = dict(drafter=str(drafter), target=str(target), tokens=4096, seq_len=64)
    one = distill(DistillOptions(**run, batch=8, out=str(tmp_path / "one")))
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(helpers.distill_rank, args=(2, helpers.free_port(), dict(run, batch=4, out=str(tmp_path / "two")), queue), nprocs=2,
             join=True)
    two = next(rec for _, rec in (queue.get() for _ in range(2)) if rec is not None)

    def losses(rec: dict) -> list[float]:
        return [json.loads(x)["loss"] for x in (Path(rec["state_dir"]) / "metrics.jsonl").read_text().splitlines()]

    la, lb = losses(one), losses(two)
    assert len(la) == len(lb) >= 8 and max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 2e-3
    out = Path(two["out"])
    overlay = out / "mtp_overlay" / "mtp.safetensors"
    assert stored_layout(overlay) == stored_layout(Path(one["out"]) / "mtp_overlay" / "mtp.safetensors")
    rebuilt, dropped, _ = REWRITERS.get("eagle")(drafter, {}, load_drafter(str(out), dtype=torch.float32))
    assert not dropped
    written = load_file(str(overlay))
    assert set(written) == set(rebuilt["mtp_overlay/mtp.safetensors"])
    for name, t in rebuilt["mtp_overlay/mtp.safetensors"].items():
        want = t.to(written[name].dtype)
        assert torch.equal(written[name].view(torch.uint8), want.contiguous().view(torch.uint8)), name
