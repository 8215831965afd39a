"""recycle's GGUF side files in llama.cpp (slow: llama.cpp is built once per machine, `recycle.engines.llama_cpp`).

* The side file equals llama.cpp's own MTP export where llama.cpp has one (GLM-4.5's `--mtp`; DeepSeek-V3's
  converter drops MTP, so a one-module copy relabelled as GLM-4.7-Flash's `Glm4MoeLiteForCausalLM`, the same
  deepseek2 graph, is exported instead): the same tensors, values and header.
* llama.cpp drafts with it next to a trunk GGUF from its own converter, losslessly, and its n_max = 1 acceptance
  is recycle's within 2% (llama.cpp never drafts past a request's last token, recycle's bench does: up to one
  draft per prompt more on recycle's side).
* A distilled drafter converts too, its header and token_embd taken from the trunk GGUF (`--target`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from recycle.distill.train import DistillOptions, distill
from recycle.engines.llama_cpp import convert_trunk

from fixtures.derive import derive
from tests.engines.interop import ar_tokens
from tests.engines.llama_interop import (
    FIXTURES,
    V4,
    llama_runs,
    prompt_ids,
    recycle_run,
    side_file,
    step_for_llama_cpp,
    trunk_gguf,
    v4_for_llama_cpp,
)

pytestmark = pytest.mark.slow
# Keys whose values name the file, not the model
NAMING = {"general.name", "general.size_label", "recycle.source"}
OPTIONAL = {"output.weight"}  # llama.cpp's export carries the trunk's head too; the module's shared_head_head is used


def _contents(path: Path) -> tuple[dict, dict]:
    r = GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in NAMING}
    return kv, {t.name: t for t in r.tensors}


def _assert_same_export(ours: Path, theirs: Path) -> None:
    kv_a, ts_a = _contents(ours)
    kv_b, ts_b = _contents(theirs)
    assert kv_a == kv_b
    missing = set(ts_b) - set(ts_a) - OPTIONAL
    # nextn.embed_tokens: left out where it equals token_embd (llama.cpp falls back to token_embd)
    assert missing <= {n for n in ts_b if n.endswith("nextn.embed_tokens.weight")}, missing
    for n in missing:
        assert np.array_equal(np.asarray(ts_b[n].data), np.asarray(ts_b["token_embd.weight"].data))
    assert set(ts_a) <= set(ts_b)
    for n, t in ts_a.items():
        assert t.tensor_type == ts_b[n].tensor_type and list(t.shape) == list(ts_b[n].shape), n
        assert np.array_equal(np.asarray(t.data), np.asarray(ts_b[n].data)), n


def test_side_files_equal_llama_cpps_own_mtp_export(tmp_path):
    glm = FIXTURES["GLM-4.5"]
    _assert_same_export(side_file(glm, tmp_path, "glm"), convert_trunk(glm, tmp_path / "glm-mtp.gguf", mtp="only"))
    one = Path(derive(FIXTURES["DeepSeek-V3"], tmp_path / "ds1", 1)["out"])
    lite = tmp_path / "ds1-lite"
    lite.mkdir()
    for f in one.iterdir():
        (lite / f.name).symlink_to(f)
    cfg = json.loads((one / "config.json").read_text())
    (lite / "config.json").unlink()
    (lite / "config.json").write_text(json.dumps({**cfg, "architectures": ["Glm4MoeLiteForCausalLM"]}))
    _assert_same_export(side_file(FIXTURES["DeepSeek-V3"], tmp_path, "ds"),
                        convert_trunk(lite, tmp_path / "ds-mtp.gguf", mtp="only"))
    qwen = FIXTURES["Qwen3.5"]  # zero-centred norms stored +1, the head as `output`, the hybrid's header keys
    _assert_same_export(side_file(qwen, tmp_path, "qwen"), convert_trunk(qwen, tmp_path / "qwen-mtp.gguf", mtp="only"))
    from fixtures.build_trained import untrained

    for family in ("qwen3_next", "qwen3_5_moe"):  # no trained fixtures: their recipes at initialisation
        src = untrained(family, tmp_path / family, seed=1)
        _assert_same_export(side_file(src, tmp_path, f"{family}-side"),
                            convert_trunk(src, tmp_path / f"{family}-mtp.gguf", mtp="only"))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_llama_cpp_drafts_losslessly_with_the_side_file_and_counts_as_recycle(name, tmp_path):
    fixture = FIXTURES[name]
    prompts, ids = prompt_ids(fixture, 4)
    trunk = trunk_gguf(fixture, tmp_path)
    assert "nextn" not in " ".join(t.name for t in GGUFReader(str(trunk)).tensors)  # the trunk alone
    side = side_file(fixture, tmp_path, "side")
    plain = llama_runs(trunk, None, ids, 48, 1)
    drafted = llama_runs(trunk, side, ids, 48, 1)
    assert drafted["tokens"] == plain["tokens"] == ar_tokens(fixture, ids, 48)
    ours = recycle_run(fixture, None, prompts, 48, 1)
    assert 0 <= ours["tried"] - drafted["drafted"] <= len(ids)  # recycle also drafts at each prompt's last step
    rate_llama, rate_ours = drafted["accepted"] / drafted["drafted"], ours["accepted"] / ours["tried"]
    assert abs(rate_llama - rate_ours) <= 0.02 * rate_ours, (drafted, ours)


def test_step_side_file_is_llama_cpps_export_and_drafts_with_its_three_modules_as_recycle(tmp_path):
    """Step-3.7 (step35 graph: the three modules in turn, module k at draft step k), on its generator shaped to
    draft (`step_for_llama_cpp`; llama.cpp's converter reading config.json as released, `RAW_CONFIG`):
    * recycle's side file is llama.cpp's own `--mtp` export, all three blocks: the same header, names and bytes;
    * llama.cpp drafts losslessly with it at n_max 1 and 3, and its plain greedy output is recycle's;
    * at n_max 1 its acceptance is recycle's within 2% (recycle also drafts at each prompt's last step);
    * at n_max 3 it accepts more tokens than it has verification steps: the second and third modules accept too;
    * with --target the header is the trunk file's, its per-layer arrays extended by the modules' layers, and it
      drafts the same."""
    src = step_for_llama_cpp(tmp_path)
    _assert_same_export(side_file(src, tmp_path, "all", module=None), convert_trunk(src, tmp_path / "m.gguf", mtp="only"))
    side = tmp_path / "all" / "mtp.gguf"
    prompts, ids = prompt_ids(src, 4)
    trunk = trunk_gguf(src, tmp_path)
    plain = llama_runs(trunk, None, ids, 48, 1)
    assert plain["tokens"] == ar_tokens(src, ids, 48)
    one, three = (llama_runs(trunk, side, ids, 48, n) for n in (1, 3))
    assert one["tokens"] == three["tokens"] == plain["tokens"]
    ours = recycle_run(src, None, prompts, 48, 1)
    assert 0 <= ours["tried"] - one["drafted"] <= len(ids)
    rate_llama, rate_ours = one["accepted"] / one["drafted"], ours["accepted"] / ours["tried"]
    assert abs(rate_llama - rate_ours) <= 0.02 * rate_ours and rate_ours > 0.3, (one, ours)
    assert three["accepted"] > three["steps"], three
    paired = side_file(src, tmp_path, "paired", trunk=trunk, module=None)
    kv = _contents(paired)[0]
    assert kv["step35.attention.head_count"] == [4, 6, 6, 6, 4] and kv["step35.nextn_predict_layers"] == 3
    assert llama_runs(trunk, paired, ids, 48, 3) == three


def test_deepseek_v4_side_file_is_llama_cpps_export_and_drafts_as_recycle(tmp_path):
    """DeepSeek-V4 (deepseek4 graph) on its trained fixture in the release's FP4 expert storage:
    * the widened indexer leaves the model as it was (equal logits past `index_topk` compressed blocks);
    * recycle's side file is llama.cpp's own `--mtp` export: the same header (less the chat template llama.cpp's
      converter adds from its own repository), names and bytes, MXFP4 experts included, except eh_proj, which
      llama.cpp's converter forces to Q8_0 and recycle writes at --dtype (values within Q8_0's rounding);
    * llama.cpp drafts losslessly with it and its n_max = 1 acceptance is recycle's within 2%;
    * llama.cpp's plain greedy output is recycle's where the two engines' arithmetic agrees: it runs FP4 experts
      against Q8_0-quantized activations (ggml-cpu's MXFP4 vec_dot), recycle in float32, so a near-tie may flip;
      at every first divergence recycle's logit for llama.cpp's token is within 0.5 of its own pick's."""
    from gguf.quants import dequantize

    from recycle.decoding.target import load_target

    from fixtures.derive import fp4_experts

    v4 = v4_for_llama_cpp(V4["DeepSeek-V4"], tmp_path)
    narrow = Path(fp4_experts(V4["DeepSeek-V4"], tmp_path / "narrow")["out"])
    ids = torch.randint(5, 4000, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wide_logits, narrow_logits = (load_target(p)(ids).logits for p in (v4, narrow))
    torch.testing.assert_close(wide_logits, narrow_logits, rtol=1e-5, atol=1e-5)

    ours, theirs = side_file(v4, tmp_path, "v4"), convert_trunk(v4, tmp_path / "v4-mtp.gguf", mtp="only")
    kv_a, ts_a = _contents(ours)
    kv_b, ts_b = _contents(theirs)
    kv_b.pop("tokenizer.chat_template")
    assert kv_a == kv_b and set(ts_a) == set(ts_b)
    for n, t in ts_a.items():
        if n.endswith("nextn.eh_proj.weight"):
            assert ts_b[n].tensor_type.name == "Q8_0" and t.tensor_type.name == "F32"
            got, want = np.asarray(t.data), dequantize(np.asarray(ts_b[n].data), ts_b[n].tensor_type)
            assert np.abs(got - want.reshape(got.shape)).max() <= np.abs(got).max() / 127, n
            continue
        assert t.tensor_type == ts_b[n].tensor_type and list(t.shape) == list(ts_b[n].shape), n
        assert np.array_equal(np.asarray(t.data), np.asarray(ts_b[n].data)), n

    prompts, ids = prompt_ids(v4, 4)
    trunk = trunk_gguf(v4, tmp_path)
    plain = llama_runs(trunk, None, ids, 48, 1)
    drafted = llama_runs(trunk, ours, ids, 48, 1)
    assert drafted["tokens"] == plain["tokens"]
    # with --target the header is the trunk file's, its per-block arrays (swiglu clamps) given the MTP block's entry
    paired = side_file(v4, tmp_path, "v4-paired", trunk=trunk)
    assert len(_contents(paired)[0]["deepseek4.swiglu_clamp_exp"]) == 5
    assert llama_runs(trunk, paired, ids, 48, 1) == drafted
    model = load_target(v4)
    for p, got, want in zip(ids, plain["tokens"], ar_tokens(v4, ids, 48)):
        i = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        if i is not None:
            with torch.no_grad():
                logits = model(torch.tensor([p + want[:i]])).logits[0, -1]
            assert logits[want[i]] - logits[got[i]] < 0.5, (i, want[i], got[i])
    rec = recycle_run(v4, None, prompts, 48, 1)
    assert 0 <= rec["tried"] - drafted["drafted"] <= len(ids)
    rate_llama, rate_ours = drafted["accepted"] / drafted["drafted"], rec["accepted"] / rec["tried"]
    assert abs(rate_llama - rate_ours) <= 0.02 * rate_ours, (drafted, rec)


def test_a_distilled_drafter_converts_against_the_trunk_gguf_and_drafts(tmp_path, converted):
    fixture = FIXTURES["DeepSeek-V3"]
    prompts, ids = prompt_ids(fixture, 2)
    trunk = trunk_gguf(fixture, tmp_path)
    eagle = str(converted("eagle", source=fixture))
    trained = distill(DistillOptions(drafter=eagle, target=str(fixture), tokens=2048, seq_len=64, batch=4,
                                     out=str(tmp_path / "eagle-d"), eval_every=10**6))["out"]
    side = side_file(Path(trained), tmp_path, "realigned", trunk=trunk)
    kv, _ = _contents(side)
    assert kv["deepseek2.block_count"] == 11 and kv["tokenizer.ggml.tokens"] == _contents(trunk)[0][
        "tokenizer.ggml.tokens"]
    plain = llama_runs(trunk, None, ids, 32, 1)
    assert llama_runs(trunk, side, ids, 32, 2)["tokens"] == plain["tokens"]


def test_mimo_v2_5_stitched_in_fp8_converts_in_llama_cpp_and_drafts_as_recycle(tmp_path):
    """MiMo-V2.5 (mimo2 graph, which needs the fused `qkv_proj` V2.5 stores) through llama.cpp's own converter, which
    reads MiMoV2ForCausalLM's FP8 chunks itself (`conversion/mimo.py`, `_tp_aware_qkv_dequant`). The target is the
    MiMo drafting copy in V2.5's FP8 layout (`mimo_v25_for_llama_cpp`); into it recycle stitches modules from a BF16
    copy that drafts differently, re-quantized chunk by chunk (scales tiled: 20 rows for four 576-row chunks, where one
    grid would have 18). llama.cpp's plain output is recycle's AR output, its n_max-1 drafting lossless, and on every
    prompt its counts are recycle's on the stitched target but for the draft recycle makes at a prompt's last step
    (llama.cpp stops drafting there): one more tried, at most one more accepted."""
    from recycle.bench import BenchOptions, run_bench
    from recycle.checkpoint import Checkpoint
    from recycle.converters.api import convert_checkpoint
    from recycle.converters.overlay import stitch

    from tests.engines.llama_interop import LlamaServer, mimo_v25_for_llama_cpp

    target = mimo_v25_for_llama_cpp(tmp_path)
    donor = mimo_v25_for_llama_cpp(tmp_path, fp8=False, eh_seed=7)
    overlay = Path(convert_checkpoint(donor, "eagle", tmp_path / "donor")["out"]) / "mtp_overlay"
    stitched = tmp_path / "stitched"
    done = stitch(overlay, target, stitched)
    n = "model.mtp.layers.0.self_attn.qkv_proj.weight"
    assert done["quantization"]["tensors"][n]["how"] == "re-quantized"
    assert Checkpoint(stitched).tensors[n + "_scale_inv"].shape == (20, 1)
    trunk = convert_trunk(stitched, tmp_path / "trunk.gguf", mtp="no")
    side = convert_trunk(stitched, tmp_path / "side.gguf", mtp="only")
    prompts, ids = prompt_ids(stitched, 6)
    with LlamaServer(trunk) as server:
        plain = [server.complete(p, 48)["tokens"] for p in ids]
    assert plain == ar_tokens(stitched, ids, 48)
    with LlamaServer(trunk, side, n_max=1) as server:
        drafted = [server.complete(p, 48) for p in ids]
    assert [d["tokens"] for d in drafted] == plain

    def counts(model: Path) -> list[tuple[int, int]]:
        out = []
        for p in prompts:
            spec = run_bench(BenchOptions(drafter=None, native=True, target=str(model), prompts=[p], max_new_tokens=48,
                                          tree="chain:1", stop_at_eos=False, warmup=False)).overall.spec
            out.append((int(sum(spec.accepted)), int(sum(spec.tried))))
        return out

    ours = counts(stitched)
    for (acc, tried), d in zip(ours, drafted, strict=True):
        assert tried - d["drafted"] == 1 and acc - d["accepted"] in (0, 1), (ours, drafted)
    assert sum(a for a, _ in ours) > 0.2 * sum(t for _, t in ours)  # the copy drafts
    assert ours != counts(target)  # the stitched modules are the ones drafting


def test_mimo_side_files_are_llama_cpps_export_and_draft_v2_flash_as_recycle(tmp_path):
    """MiMo's side file (`--to gguf`, all three modules, q/k/v as the one `attn_qkv` the mimo2 graph asserts):
    * for V2.5's FP8 layout it is llama.cpp's own `--mtp` export: the same header, names and bytes (recycle's reader
      dequantizes into float32, as the converter does, so an fp32 file holds the same values);
    * for V2-Flash, whose own export keeps q/k/v separate and does not draft (llama-server aborts: "MIMO2 MTP requires
      fused attn_qkv"), llama-server drafts with recycle's file beside llama.cpp's trunk, losslessly at n_max 1 and 3,
      and at n_max 1 its counts are recycle's on every prompt but for recycle's draft at a prompt's last step."""
    from recycle.bench import BenchOptions, run_bench

    from tests.engines.llama_interop import LlamaServer, mimo_v25_for_llama_cpp

    v25 = mimo_v25_for_llama_cpp(tmp_path)
    _assert_same_export(side_file(v25, tmp_path, "v25", module=None), convert_trunk(v25, tmp_path / "v25.gguf",
                                                                                      mtp="only"))
    flash = mimo_v25_for_llama_cpp(tmp_path, flash=True)
    trunk, side = trunk_gguf(flash, tmp_path), side_file(flash, tmp_path, "flash", module=None)
    prompts, ids = prompt_ids(flash, 6)
    plain = llama_runs(trunk, None, ids, 48, 1)
    assert plain["tokens"] == ar_tokens(flash, ids, 48)
    assert llama_runs(trunk, side, ids, 48, 3)["tokens"] == plain["tokens"]
    with LlamaServer(trunk, side, n_max=1) as server:
        drafted = [server.complete(p, 48) for p in ids]
    assert [d["tokens"] for d in drafted] == plain["tokens"]
    for p, d in zip(prompts, drafted, strict=True):
        spec = run_bench(BenchOptions(drafter=None, native=True, target=str(flash), prompts=[p], max_new_tokens=48,
                                      tree="chain:1", stop_at_eos=False, warmup=False)).overall.spec
        assert int(sum(spec.tried)) - d["drafted"] == 1 and int(sum(spec.accepted)) - d["accepted"] in (0, 1)


@pytest.mark.parametrize("copy", ["mimo_v2_5", "step3p7"])
def test_beyond_n_max_1_llama_cpp_chains_modules_its_own_way(tmp_path, copy):
    """Past n_max 1 llama.cpp drafts a release's three modules in turn by its own scheme (`chain_heads`: every module's
    cache over the committed positions filled from the trunk's states, the draft region rebuilt per module), not by
    recycle's MTP chain. That scheme re-run with recycle's modules (`llama_interop.chain_heads`) gives llama.cpp's
    counts on every prompt at n_max 2 and 3, where recycle's own chain gives others (BENCHMARKS.md); and the deeper
    modules draft: more is accepted at n_max 2 than at 1."""
    from tests.engines.llama_interop import chain_heads, mimo_v25_for_llama_cpp

    target = mimo_v25_for_llama_cpp(tmp_path) if copy == "mimo_v2_5" else step_for_llama_cpp(tmp_path)
    trunk = convert_trunk(target, tmp_path / "trunk.gguf", mtp="no")
    side = convert_trunk(target, tmp_path / "side.gguf", mtp="only")
    _, ids = prompt_ids(target, 6)
    accepted = {}
    for n in (2, 3):
        ll = [(d["accepted"], d["drafted"]) for d in llama_runs(trunk, side, ids, 48, n)["per_prompt"]]
        sim = chain_heads(target, ids, 48, n)
        assert ll == [(c["accepted"], c["drafted"]) for c in sim], (n, ll, sim)
        accepted[n] = sum(a for a, _ in ll)
    assert accepted[2] > sum(c["accepted"] for c in chain_heads(target, ids, 48, 1)) > 0
