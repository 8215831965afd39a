"""`recycle convert --to gguf` and `recycle inspect FILE.gguf`: llama.cpp's names, shapes and values for both MLA and
GQA fixtures, the header from config or from a trunk GGUF, and bad input. (llama.cpp itself runs the side files in
the slow suite: tests/engines/test_llama_cpp.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from recycle.checkpoint import Checkpoint

from tests.cli_helpers import assert_bad_input, run_cli

ROOT = Path(__file__).resolve().parents[1]
DS, GLM = ROOT / "fixtures" / "deepseek_v3_mtp", ROOT / "fixtures" / "glm4_moe_mtp"

GLM_NAMES = {  # what llama.cpp's own converter exports for this fixture's NextN layer (--mtp), less its optional
    # nextn.embed_tokens (equal to token_embd here) and output (shared_head_head is there)
    "token_embd.weight", "output_norm.weight", "blk.10.nextn.eh_proj.weight", "blk.10.nextn.enorm.weight",
    "blk.10.nextn.hnorm.weight", "blk.10.nextn.shared_head_head.weight", "blk.10.nextn.shared_head_norm.weight",
    "blk.10.attn_norm.weight", "blk.10.ffn_down_exps.weight", "blk.10.ffn_gate_exps.weight",
    "blk.10.ffn_up_exps.weight", "blk.10.exp_probs_b.bias", "blk.10.ffn_gate_inp.weight",
    "blk.10.ffn_down_shexp.weight", "blk.10.ffn_gate_shexp.weight", "blk.10.ffn_up_shexp.weight",
    "blk.10.post_attention_norm.weight", "blk.10.attn_k_norm.weight", "blk.10.attn_k.bias", "blk.10.attn_k.weight",
    "blk.10.attn_output.weight", "blk.10.attn_q_norm.weight", "blk.10.attn_q.bias", "blk.10.attn_q.weight",
    "blk.10.attn_v.bias", "blk.10.attn_v.weight"}


def read(path: Path) -> tuple[dict, dict]:
    r = GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


def values(t) -> torch.Tensor:
    """A reader tensor as float32 in torch's row-major shape (GGUF stores dims innermost first)."""
    data = np.asarray(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:  # the reader hands BF16 over as raw bytes
        data = (np.ascontiguousarray(data).reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape([int(d) for d in reversed(t.shape)])


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    made = {}
    for name, src, extra in (("glm", GLM, ()), ("ds", DS, ("--module", "0"))):
        res = run_cli("convert", str(src), "--to", "gguf", "-o", str(out / name), *extra)
        assert res.exit_code == 0, res.output
        made[name] = out / name / "mtp.gguf"
    return made


def test_glm_side_file_has_llama_cpps_names_header_and_values(sides):
    kv, ts = read(sides["glm"])
    assert set(ts) == GLM_NAMES
    cfg = json.loads((GLM / "config.json").read_text())
    assert kv["general.architecture"] == "glm4moe" and kv["glm4moe.block_count"] == cfg["num_hidden_layers"] + 1
    assert kv["glm4moe.nextn_predict_layers"] == 1 and kv["glm4moe.expert_gating_func"] == 2
    assert kv["glm4moe.rope.dimension_count"] == cfg["head_dim"] // 2  # GLM's half-rotary heads
    assert kv["glm4moe.expert_count"] == cfg["n_routed_experts"] and kv["glm4moe.attention.head_count_kv"] == 2
    ck = Checkpoint(GLM)
    # bf16 by default; norms, biases and the router in f32, as llama.cpp's converter keeps them
    assert ts["blk.10.attn_q.weight"].tensor_type == GGMLQuantizationType.BF16
    for n in ("blk.10.attn_norm.weight", "blk.10.attn_q.bias", "blk.10.ffn_gate_inp.weight", "blk.10.exp_probs_b.bias"):
        assert ts[n].tensor_type == GGMLQuantizationType.F32, n
    assert torch.equal(values(ts["blk.10.ffn_gate_inp.weight"]), ck.get("model.layers.10.mlp.gate.weight").float())
    gate = values(ts["blk.10.ffn_gate_exps.weight"])  # [experts, ff, hidden], expert-major
    for e in (0, 5):
        want = ck.get(f"model.layers.10.mlp.experts.{e}.gate_proj.weight").to(torch.bfloat16).float()
        assert torch.equal(gate[e], want)
    assert torch.equal(values(ts["blk.10.nextn.eh_proj.weight"]),
                       ck.get("model.layers.10.eh_proj.weight").to(torch.bfloat16).float())
    assert torch.equal(values(ts["token_embd.weight"]), ck.get("model.embed_tokens.weight").to(torch.bfloat16).float())
    tok = json.loads((GLM / "tokenizer.json").read_text())
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.tokens"][:3] == [t["content"] for t in tok["added_tokens"][:3]]
    assert len(kv["tokenizer.ggml.merges"]) == len(tok["model"]["merges"])
    record = json.loads((sides["glm"].parent / "recycle.json").read_text())
    assert record["target"]["format"] == "gguf" and record["summary"]["exact"] == len(GLM_NAMES)


def test_deepseek_side_file_splits_mla_kv_b_as_llama_cpp_reads_it(sides):
    kv, ts = read(sides["ds"])
    cfg = json.loads((DS / "config.json").read_text())
    heads, nope, v, rank = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    assert kv["general.architecture"] == "deepseek2" and kv["deepseek2.block_count"] == 11
    assert kv["deepseek2.attention.key_length"] == rank + cfg["qk_rope_head_dim"]
    assert kv["deepseek2.attention.key_length_mla"] == nope + cfg["qk_rope_head_dim"]
    assert kv["deepseek2.attention.head_count_kv"] == 1 and kv["deepseek2.vocab_size"] == cfg["vocab_size"]
    assert "blk.11.attn_q_a.weight" not in ts and "blk.10.ffn_norm.weight" in ts  # module 0 only, DeepSeek's names
    kv_b = Checkpoint(DS).get("model.layers.10.self_attn.kv_b_proj.weight").to(torch.bfloat16).float()
    k_b, v_b = values(ts["blk.10.attn_k_b.weight"]), values(ts["blk.10.attn_v_b.weight"])
    assert k_b.shape == (heads, rank, nope) and v_b.shape == (heads, v, rank)
    rebuilt = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * (nope + v), rank)
    assert torch.equal(rebuilt, kv_b)
    # DeepSeek stores a physical copy of the embedding in its module: equal to the trunk's, so left out
    assert "blk.10.nextn.embed_tokens.weight" not in ts and "blk.10.nextn.shared_head_head.weight" in ts


def _trunk_gguf(path: Path, arch: str, layers: int, hidden: int, vocab: int) -> np.ndarray:
    """A small trunk GGUF as llama.cpp's converter lays one out (no blocks needed here), its token_embd Q8_0."""
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", layers)
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    embed = quantize(np.random.default_rng(0).standard_normal((vocab, hidden)).astype(np.float32),
                     GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", embed, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return embed


def test_a_trunk_gguf_gives_the_header_and_its_quantized_token_embd(tmp_path):
    cfg = json.loads((GLM / "config.json").read_text())
    trunk = tmp_path / "trunk-q8.gguf"
    embed = _trunk_gguf(trunk, "glm4moe", cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"])
    res = run_cli("convert", str(GLM), "--to", "gguf", "--target", str(trunk), "-o", str(tmp_path / "side"), "--json")
    assert res.exit_code == 0, res.output
    kv, ts = read(tmp_path / "side" / "mtp.gguf")
    assert kv["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]  # the trunk's vocabulary, not the source's
    assert kv["glm4moe.block_count"] == cfg["num_hidden_layers"] + 1 and kv["glm4moe.nextn_predict_layers"] == 1
    assert ts["token_embd.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert np.array_equal(np.asarray(ts["token_embd.weight"].data), embed)  # byte for byte
    for bad, (arch, layers, hidden, vocab), why in (
            ("arch", ("deepseek2", 10, 128, 4096), "a deepseek2 GGUF"),
            ("layers", ("glm4moe", 12, 128, 4096), "layers 12"),
            ("width", ("glm4moe", 10, 64, 4096), "hidden size 64"),
            ("vocab", ("glm4moe", 10, 128, 1000), "vocabulary of 1000 tokens")):
        path = tmp_path / f"{bad}.gguf"
        _trunk_gguf(path, arch, layers, hidden, vocab)
        res = run_cli("convert", str(GLM), "--to", "gguf", "--target", str(path), "-o", str(tmp_path / bad))
        assert_bad_input(res, why)
        assert not (tmp_path / bad).exists()


def test_what_llama_cpp_cannot_draft_with_is_refused_in_one_line(tmp_path):
    res = run_cli("convert", str(DS), "--to", "gguf", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "llama.cpp drafts with one")
    res = run_cli("convert", str(ROOT / "fixtures" / "meta_mtp_parallel"), "--to", "gguf", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "sequential MTP modules")
    res = run_cli("convert", str(DS), "--to", "gguf", "--module", "2", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "has modules 0..1")
    res = run_cli("convert", str(DS), "--to", "gguf", "--module", "0", "--target", str(DS), "-o", str(tmp_path / "o"))
    assert_bad_input(res, "takes the trunk's .gguf file")
    res = run_cli("convert", str(DS), "--to", "eagle", "--module", "0", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "--module applies to --to gguf only")
    from fixtures.families import make

    v32 = make("deepseek_v32").write(tmp_path / "v32")  # llama.cpp has the graph (with the indexer); not written
    res = run_cli("convert", str(v32), "--to", "gguf", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "llama.cpp has no MTP graph recycle writes for DeepSeek-V3.2")
    assert not (tmp_path / "o").exists()


def test_inspect_reads_gguf_headers_and_reports_missing_mtp(tmp_path, sides):
    res = run_cli("inspect", str(sides["glm"]), "--json")
    data = json.loads(res.stdout)
    assert data["holds"] == "MTP side file" and data["mtp"] == {
        "declared": 1, "stored": [10], "blocks": [10], "params": data["mtp"]["params"],
        "tensor_types": {"10": {"F32": 12, "BF16": 12}}} and data["worst"] == "ok"
    declared = tmp_path / "declared.gguf"  # a trunk that declares its NextN layer but stores none of it
    w = GGUFWriter(str(declared), "glm4moe")
    w.add_uint32("glm4moe.block_count", 2)
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = run_cli("inspect", str(declared), "--json", "--strict")
    data = json.loads(res.stdout)
    assert [f["code"] for f in data["findings"]] == ["mtp_declared_missing"] and data["holds"] == "trunk only"
    assert res.exit_code != 0
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(sides["glm"].read_bytes()[:5000])
    assert_bad_input(run_cli("inspect", str(cut)), "truncated")
    text = tmp_path / "text.gguf"
    text.write_text("not a gguf")
    assert_bad_input(run_cli("inspect", str(text)), "not a GGUF file")
    # a side file is for llama.cpp, not a drafter directory push publishes
    assert_bad_input(run_cli("push", str(sides["glm"].parent), "--repo", "me/x", "--dry-run"),
                     "recycle push publishes drafter directories")


# llama.cpp's own `--mtp` export of the Qwen layouts (fixtures/build_trained.py's recipes at initialisation),
# block 8 after the 8 trunk layers; the slow suite compares whole files against it.
QWEN_BLOCK = {"attn_norm", "post_attention_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
              "attn_k_norm"}
QWEN_NAMES = {
    "qwen3_5": {"token_embd.weight", "output_norm.weight", "output.weight"}
    | {f"blk.8.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    | {f"blk.8.{n}.weight" for n in QWEN_BLOCK | {"ffn_gate", "ffn_up", "ffn_down"}},
    "qwen3_next": {"token_embd.weight", "output_norm.weight", "output.weight"}
    | {f"blk.8.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    | {f"blk.8.{n}.weight" for n in QWEN_BLOCK | {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp",
                                                   "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
                                                   "ffn_gate_inp_shexp"}},
}


QWEN_NAMES["qwen3_5_moe"] = QWEN_NAMES["qwen3_next"]


@pytest.mark.parametrize("family,arch", [("qwen3_5", "qwen35"), ("qwen3_next", "qwen3next"),
                                         ("qwen3_5_moe", "qwen35moe")])
def test_qwen_side_files_have_llama_cpps_names_header_and_plus_one_norms(family, arch, tmp_path):
    from safetensors.torch import load_file

    from fixtures.build_trained import untrained

    src = untrained(family, tmp_path / "src", seed=5)
    with torch.no_grad():  # trained-looking norms: zero-centred weights away from 0
        state = load_file(str(src / "model.safetensors"))
        for k in state:
            if k.endswith("norm.weight") and "linear_attn" not in k:
                state[k] = (torch.randn_like(state[k].float()) * 0.1).to(state[k].dtype)
        from safetensors.torch import save_file
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    res = run_cli("convert", str(src), "--to", "gguf", "--dtype", "fp32", "-o", str(tmp_path / "side"))
    assert res.exit_code == 0, res.output
    kv, ts = read(tmp_path / "side" / "mtp.gguf")
    assert set(ts) == QWEN_NAMES[family]
    assert kv["general.architecture"] == arch and kv[f"{arch}.block_count"] == 9
    assert kv[f"{arch}.nextn_predict_layers"] == 1 and kv[f"{arch}.full_attention_interval"] == 4
    assert kv[f"{arch}.attention.recurrent_layers"] == [True, True, True, False] * 2 + [False]
    assert kv[f"{arch}.rope.dimension_count"] == 16 and kv[f"{arch}.ssm.inner_size"] == 128
    assert (kv.get(f"{arch}.rope.dimension_sections") == [3, 3, 2, 0]) == arch.startswith("qwen35")
    for gguf_name, name in (("blk.8.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
                            ("blk.8.attn_q_norm.weight", "mtp.layers.0.self_attn.q_norm.weight"),
                            ("blk.8.post_attention_norm.weight", "mtp.layers.0.post_attention_layernorm.weight"),
                            ("output_norm.weight", "model.norm.weight")):
        assert torch.equal(values(ts[gguf_name]), state[name].float() + 1), gguf_name  # stored w + 1
    assert torch.equal(values(ts["output.weight"]), state["lm_head.weight"].float())
    assert torch.equal(values(ts["blk.8.nextn.eh_proj.weight"]), state["mtp.fc.weight"].float())


def test_q8_0_side_file_quantizes_the_block_and_keeps_head_and_norms_precise(tmp_path):
    from gguf.quants import dequantize

    qwen = ROOT / "fixtures" / "qwen3_5_mtp"
    for dt in ("fp32", "q8_0"):
        res = run_cli("convert", str(qwen), "--to", "gguf", "--dtype", dt, "-o", str(tmp_path / dt))
        assert res.exit_code == 0, res.output
    kv, q8 = read(tmp_path / "q8_0" / "mtp.gguf")
    _, f32 = read(tmp_path / "fp32" / "mtp.gguf")
    assert kv["general.file_type"] == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    types = {n: t.tensor_type.name for n, t in q8.items()}
    assert types["blk.8.attn_q.weight"] == types["blk.8.ffn_up.weight"] == types["blk.8.nextn.eh_proj.weight"] == "Q8_0"
    assert types["output.weight"] == types["token_embd.weight"] == "F16"  # the head and embeddings stay precise
    assert types["blk.8.ffn_down.weight"] == "F16"  # 344-wide rows: not whole 32-blocks
    assert types["blk.8.nextn.enorm.weight"] == types["output_norm.weight"] == "F32"
    w = values(f32["blk.8.attn_q.weight"])
    got = torch.from_numpy(dequantize(np.asarray(q8["blk.8.attn_q.weight"].data), GGMLQuantizationType.Q8_0))
    assert got.shape == w.shape and (got - w).abs().max() <= w.abs().max() / 127  # one 8-bit step at most
    assert (tmp_path / "q8_0" / "mtp.gguf").stat().st_size < 0.6 * (tmp_path / "fp32" / "mtp.gguf").stat().st_size
    res = run_cli("convert", str(qwen), "--to", "eagle", "--dtype", "q8_0", "-o", str(tmp_path / "e"))
    assert_bad_input(res, "unknown dtype 'q8_0' (choose from bf16, fp16, fp32)")


V4_NAMES = {  # llama.cpp's own `--mtp` export of the FP4 V4 fixture (conversion/deepseek.py DeepseekV4Model)
    "token_embd.weight", "output.weight", "output_norm.weight", "output_hc_fn.weight", "output_hc_base.weight",
    "output_hc_scale.weight", "blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
    "blk.4.nextn.shared_head_norm.weight", "blk.4.attn_sinks.weight", "blk.4.attn_q_a.weight",
    "blk.4.attn_q_a_norm.weight", "blk.4.attn_q_b.weight", "blk.4.attn_kv.weight", "blk.4.attn_kv_a_norm.weight",
    "blk.4.attn_output_a.weight", "blk.4.attn_output_b.weight", "blk.4.attn_norm.weight", "blk.4.ffn_norm.weight",
    "blk.4.hc_attn_fn.weight", "blk.4.hc_attn_base.weight", "blk.4.hc_attn_scale.weight", "blk.4.hc_ffn_fn.weight",
    "blk.4.hc_ffn_base.weight", "blk.4.hc_ffn_scale.weight", "blk.4.ffn_gate_inp.weight", "blk.4.exp_probs_b.bias",
    "blk.4.ffn_gate_shexp.weight", "blk.4.ffn_down_shexp.weight", "blk.4.ffn_up_shexp.weight",
    "blk.4.ffn_gate_exps.weight", "blk.4.ffn_down_exps.weight", "blk.4.ffn_up_exps.weight"}


def test_deepseek_v4_side_file_fuses_e_h_and_repacks_fp4_experts_bit_for_bit(tmp_path):
    """V4's module as llama.cpp's deepseek4 graph reads it: e_proj and h_proj side by side as eh_proj, the module's
    hc_head at the root, the trunk's head as `output`, its V4 header; FP4 experts as MXFP4 blocks whose values are
    the stored ones (GGML's own dequantizer agrees with recycle's codec), whatever --dtype; float32 kept where the
    release stores float32 under --dtype bf16."""
    from gguf.quants import dequantize

    from fixtures.derive import fp4_experts

    src = Path(fp4_experts(ROOT / "fixtures" / "deepseek_v4_mtp", tmp_path / "fp4")["out"])
    ckpt = Checkpoint(src)
    for dt in ("fp32", "bf16"):
        res = run_cli("convert", str(src), "--to", "gguf", "--dtype", dt, "-o", str(tmp_path / dt))
        assert res.exit_code == 0, res.output
    kv, ts = read(tmp_path / "fp32" / "mtp.gguf")
    assert set(ts) == V4_NAMES
    assert kv["general.architecture"] == "deepseek4" and kv["general.file_type"] == 38  # MOSTLY_MXFP4_MOE
    assert (kv["deepseek4.block_count"], kv["deepseek4.nextn_predict_layers"]) == (5, 1)
    assert kv["deepseek4.attention.compress_ratios"] == [4, 128, 4, 128, 0]
    assert kv["deepseek4.swiglu_clamp_exp"] == [10.0] * 5 and kv["deepseek4.expert_gating_func"] == 4
    assert kv["deepseek4.embedding_length_out"] == 512 and kv["deepseek4.hyper_connection.count"] == 4
    eh = values(ts["blk.4.nextn.eh_proj.weight"])
    assert torch.equal(eh, torch.cat([ckpt.get("mtp.0.e_proj.weight"), ckpt.get("mtp.0.h_proj.weight")], 1).float())
    assert torch.equal(values(ts["output_hc_fn.weight"]), ckpt.get("mtp.0.hc_head_fn").float())
    assert torch.equal(values(ts["output.weight"]), ckpt.get("head.weight").float())
    for proj, w in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
        t = ts[f"blk.4.ffn_{proj}_exps.weight"]
        assert t.tensor_type == GGMLQuantizationType.MXFP4
        got = torch.from_numpy(dequantize(np.asarray(t.data), GGMLQuantizationType.MXFP4).copy())
        want = torch.stack([ckpt.get(f"mtp.0.ffn.experts.{e}.{w}.weight", torch.float32) for e in range(8)])
        assert torch.equal(got.reshape(want.shape), want), proj
    _, bf = read(tmp_path / "bf16" / "mtp.gguf")
    types = {n: t.tensor_type.name for n, t in bf.items()}
    assert types["blk.4.attn_q_a.weight"] == types["blk.4.nextn.eh_proj.weight"] == "BF16"
    assert types["blk.4.hc_attn_fn.weight"] == types["output_hc_fn.weight"] == types["blk.4.attn_sinks.weight"] == "F32"
    assert types["blk.4.ffn_up_exps.weight"] == "MXFP4"


def test_deepseek_v4_fp8_block_weights_go_in_dequantized_without_their_scales(tmp_path):
    """The release stores the attention in FP8 with DeepSeek's native e8m0 `.scale` beside each weight: the side
    file holds the dequantized weight under llama.cpp's name and no tensor for the scale."""
    from safetensors.torch import load_file, save_file

    from fixtures.derive import fp4_experts

    src = Path(fp4_experts(ROOT / "fixtures" / "deepseek_v4_mtp", tmp_path / "fp4")["out"])
    state = load_file(str(src / "model.safetensors"))
    w = state["mtp.0.attn.wkv.weight"]
    state["mtp.0.attn.wkv.weight"] = (w / 2).to(torch.float8_e4m3fn)
    state["mtp.0.attn.wkv.scale"] = torch.full((1, 1), 2.0).to(torch.float8_e8m0fnu)  # one 128×128 block
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    res = run_cli("convert", str(src), "--to", "gguf", "--dtype", "fp32", "-o", str(tmp_path / "side"))
    assert res.exit_code == 0, res.output
    _, ts = read(tmp_path / "side" / "mtp.gguf")
    assert set(ts) == V4_NAMES
    want = state["mtp.0.attn.wkv.weight"].float() * 2
    assert torch.equal(values(ts["blk.4.attn_kv.weight"]), want)


STEP_BLOCK = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
              "attn_gate", "ffn_gate", "ffn_up", "ffn_down")
STEP_NEXTN = ("eh_proj", "enorm", "hnorm", "shared_head_norm", "shared_head_head")


def _step_names(blocks) -> set[str]:
    return {"token_embd.weight", "output_norm.weight", "rope_freqs.weight"} \
        | {f"blk.{b}.nextn.{n}.weight" for b in blocks for n in STEP_NEXTN} \
        | {f"blk.{b}.{n}.weight" for b in blocks for n in STEP_BLOCK}


def test_step_side_file_holds_every_module_as_llama_cpps_step35_chain_reads_them(tmp_path):
    """Step-3.5's three modules as llama.cpp's step35 graph drafts with them (module k at blk.{n+k}, draft step k):
    each with its own nextn leaves and head, every norm stored +1, per-layer head counts, sliding pattern and clamps
    over the trunk's and the modules' layers, the llama3 rope factors the full-attention module reads (transformers'
    own llama3 frequencies against the default ones); `--module K` writes one, with its own layer's entries."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fixtures.families import make, write_tokenizer

    src = write_tokenizer(make("step3p5").write(tmp_path / "s35"))
    ckpt, cfg = Checkpoint(src), json.loads((src / "config.json").read_text())
    res = run_cli("convert", str(src), "--to", "gguf", "--dtype", "fp32", "-o", str(tmp_path / "all"))
    assert res.exit_code == 0, res.output
    kv, ts = read(tmp_path / "all" / "mtp.gguf")
    assert set(ts) == _step_names((2, 3, 4))
    assert (kv["step35.block_count"], kv["step35.nextn_predict_layers"]) == (5, 3)
    assert kv["step35.attention.head_count"] == [4, 6, 6, 6, 4] and kv["step35.attention.head_count_kv"] == [2] * 5
    assert kv["step35.attention.sliding_window_pattern"] == [False, True, True, True, False]
    assert kv["step35.swiglu_clamp_exp"] == [0.0, 7.0, 0.0, 0.0, 0.0]
    assert (kv["step35.rope.freq_base"], kv["step35.rope.freq_base_swa"]) == (5e6, 1e4)
    assert kv["step35.leading_dense_block_count"] == 1 and kv["step35.expert_gating_func"] == 2
    for b in (2, 3, 4):
        p = f"model.layers.{b}."
        assert torch.equal(values(ts[f"blk.{b}.attn_norm.weight"]), ckpt.get(p + "input_layernorm.weight").float() + 1)
        assert torch.equal(values(ts[f"blk.{b}.attn_q_norm.weight"]), ckpt.get(p + "self_attn.q_norm.weight").float() + 1)
        assert torch.equal(values(ts[f"blk.{b}.nextn.enorm.weight"]), ckpt.get(p + "enorm.weight").float() + 1)
        assert torch.equal(values(ts[f"blk.{b}.nextn.shared_head_norm.weight"]),
                           ckpt.get(p + "transformer.shared_head.norm.weight").float() + 1)
        assert torch.equal(values(ts[f"blk.{b}.nextn.shared_head_head.weight"]),
                           ckpt.get(p + "transformer.shared_head.output.weight").float())
        assert torch.equal(values(ts[f"blk.{b}.attn_gate.weight"]), ckpt.get(p + "self_attn.g_proj.weight").float())
    assert torch.equal(values(ts["output_norm.weight"]), ckpt.get("model.norm.weight").float() + 1)

    rope = {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"][0]}
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5,
                        rope_parameters=rope, max_position_embeddings=cfg["max_position_embeddings"])
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](llama)
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = values(ts["rope_freqs.weight"])
    assert freqs.shape == (8,) and torch.equal(freqs[4:], torch.ones(4))  # padded to head_dim / 2
    torch.testing.assert_close(freqs[:4], plain / scaled, rtol=1e-5, atol=0)
    assert freqs[:4].max() > 1  # the scaling bites at these widths
    data = json.loads(run_cli("inspect", str(tmp_path / "all" / "mtp.gguf"), "--json").stdout)
    assert data["mtp"]["declared"] == 3 and data["mtp"]["stored"] == [2, 3, 4] and data["findings"] == []

    two = tmp_path / "two.gguf"  # the same depth in an architecture whose graph drafts with one module: a warning
    w = GGUFWriter(str(two), "glm4moe")
    w.add_uint32("glm4moe.block_count", 3)
    w.add_uint32("glm4moe.nextn_predict_layers", 2)
    for b in (1, 2):
        w.add_tensor(f"blk.{b}.nextn.eh_proj.weight", np.ones((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = json.loads(run_cli("inspect", str(two), "--json").stdout)
    assert [f["code"] for f in data["findings"]] == ["mtp_depth_unsupported"]
    assert "glm4moe MTP graph takes one" in data["findings"][0]["message"]

    res = run_cli("convert", str(src), "--to", "gguf", "--module", "1", "--dtype", "fp32", "-o", str(tmp_path / "one"))
    assert res.exit_code == 0, res.output
    kv, ts = read(tmp_path / "one" / "mtp.gguf")
    assert set(ts) == _step_names((2,))
    assert (kv["step35.block_count"], kv["step35.nextn_predict_layers"]) == (3, 1)
    assert kv["step35.attention.head_count"] == [4, 6, 6]  # trunk layers 0-1, then MTP layer 3's (sliding)
    assert kv["step35.attention.sliding_window_pattern"] == [False, True, True]
    assert torch.equal(values(ts["blk.2.nextn.eh_proj.weight"]), ckpt.get("model.layers.3.eh_proj.weight").float())
