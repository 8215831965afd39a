"""Layouts for engines that cannot run here (SGLang needs CUDA; llama.cpp is not installed), checked
against what their loaders' source reads. Each test cites the file (repository @ commit, read through
the code index) whose rule it encodes; the rules are quoted in the docstrings, not imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from recycle.converters.api import convert_checkpoint, stitch_overlay
from fixtures.derive import derive
from recycle.checkpoint import Checkpoint
from tests.trained import TRAINED

NEXTN_ARCH = {"deepseek_v3": "DeepseekV3ForCausalLMNextN", "glm4_moe": "Glm4MoeForCausalLMNextN"}


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-layouts")
    return {f: Path(convert_checkpoint(d, "eagle", root / f)["out"]) for f, d in TRAINED.items()}


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
def test_eagle3_is_what_sglang_loads(tmp_path, draft_vocab):
    """SGLang `llama_eagle3.py` @03d5a777: every tensor must land on a parameter (`midlayer.*` natively, with
    no `layers.0.` remap), `d2t` becomes `hot_token_id` (optional: `eagle_worker_v2.py` @69834611 checks it
    for None), `t2d` is skipped; `EntryClass = [LlamaForCausalLMEagle3]`; one layer."""
    out = convert_checkpoint(TRAINED["glm4_moe"], "eagle3", tmp_path / "e3", draft_vocab=draft_vocab)["out"]
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
