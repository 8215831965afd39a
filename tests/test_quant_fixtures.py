"""The quantized builds made by the real tools (`fixtures/quant/*`, `fixtures/build_quantized.py`) and their broken
copies (`fixtures/quant_broken.py`): what each stores, as the tool wrote it, read from the headers only. recycle's
codecs are tested elsewhere; here the fixtures must be what they claim to be."""

from __future__ import annotations

import fnmatch
import json
import math
import re

import pytest

from recycle.checkpoint import INDEX_FILE, Checkpoint
from recycle.errors import RecycleError

from fixtures import quant_broken as qb
from tests.helpers import ROOT

MIB = 1 << 20
# name → (tool's own config file, trunk scheme, MTP stored by the tool)
BUILDS = {
    "ds_v3_nvfp4a16_llmc": ("recipe.yaml", "NVFP4", False),
    "ds_v3_nvfp4_modelopt": ("hf_quant_config.json", "NVFP4", False),
    "qwen3_5_fp8_dynamic_llmc": ("recipe.yaml", "FP8", True),
    "ds_v3_w4a16_llmc": ("recipe.yaml", "INT4", False),
}
SOURCES = {"ds_v3_nvfp4a16_llmc": "fixtures/deepseek_v3_mtp_posttrained",
           "ds_v3_nvfp4_modelopt": "fixtures/deepseek_v3_mtp_posttrained",
           "qwen3_5_fp8_dynamic_llmc": "fixtures/qwen3_5_mtp_posttrained",
           "ds_v3_w4a16_llmc": "fixtures/deepseek_v3_mtp_posttrained"}
# The parts each storage writes per quantized Linear weight [out, in]: suffix → (dtype, shape from (out, in)).
PARTS = {
    "nvfp4-pack-quantized": {"weight_packed": ("U8", lambda o, i: [o, i // 2]),
                             "weight_scale": ("F8_E4M3", lambda o, i: [o, i // 16]),
                             "weight_global_scale": ("F32", lambda o, i: [1])},
    "modelopt-nvfp4": {"weight": ("U8", lambda o, i: [o, i // 2]),
                       "weight_scale": ("F8_E4M3", lambda o, i: [o, i // 16]),
                       "weight_scale_2": ("F32", lambda o, i: []),
                       "input_scale": ("F32", lambda o, i: [])},
    "pack-quantized": {"weight_packed": ("I32", lambda o, i: [o, i // 8]),
                       "weight_scale": ("BF16", lambda o, i: [o, i // 64]),
                       "weight_shape": ("I64", lambda o, i: [2])},
    "float-quantized": {"weight": ("F8_E4M3", lambda o, i: [o, i]),
                        "weight_scale": ("BF16", lambda o, i: [o, 1])},
}
PROBE = "model.layers.3.self_attn.o_proj"  # a trunk Linear both families quantize
PROBE_SHAPE = {"ds": (128, 128), "qwen3_5": (128, 256)}


def build_dir(name: str):
    return ROOT / "fixtures" / "quant" / name


def config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def mtp_names(path) -> list[str]:
    prefixes = qb.mtp_prefixes(config(path))
    return sorted(n for n in Checkpoint(path).stored if qb.is_mtp(n, prefixes))


def ignored(module: str, entries: list[str], modelopt: bool) -> bool:
    """Whether an engine's ignore-list match skips `module`: compressed-tensors takes exact names and `re:` regexes
    (matched from the start), ModelOpt's exclude_modules are shell wildcards."""
    if modelopt:
        return any(fnmatch.fnmatch(module, e) for e in entries)
    return any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in entries)


def test_builds_are_committed_small_and_complete():
    total = 0
    for name, (tool_file, _, _) in BUILDS.items():
        d = build_dir(name)
        files = {p.name for p in d.iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "build.json", tool_file} <= files, name
        size = sum(p.stat().st_size for p in d.iterdir())
        assert size <= 6 * MIB, (name, size)
        total += size
        rec = json.loads((d / "build.json").read_text())
        assert rec["source"] == SOURCES[name] and rec["command"].endswith(f"build_quantized.py {name} --overwrite")
        src = ROOT / rec["source"]
        assert (d / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert total <= 20 * MIB, total
    assert sorted(BUILDS) == qb.builds()


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_config_names_the_scheme_and_the_weights_are_stored_so(name):
    d = build_dir(name)
    q = config(d)["quantization_config"]
    stored = Checkpoint(d).stored
    family = "ds" if name.startswith("ds_") else "qwen3_5"
    o, i = PROBE_SHAPE[family]
    if name.endswith("_modelopt"):
        hf = json.loads((d / "hf_quant_config.json").read_text())
        assert hf["producer"]["name"] == "modelopt" and hf["quantization"]["quant_algo"] == "NVFP4"
        assert hf["quantization"]["group_size"] == 16 and q["quant_algo"] == "NVFP4"
        storage = "modelopt-nvfp4"
    else:
        assert q["quant_method"] == "compressed-tensors"
        storage = q["format"]
        weights = q["config_groups"]["group_0"]["weights"]
        assert (storage, weights["num_bits"], weights["type"]) == {
            "ds_v3_nvfp4a16_llmc": ("nvfp4-pack-quantized", 4, "float"),
            "qwen3_5_fp8_dynamic_llmc": ("float-quantized", 8, "float"),
            "ds_v3_w4a16_llmc": ("pack-quantized", 4, "int")}[name]
    assert qb.scheme_of(config(d)) == BUILDS[name][1]
    for suffix, (dtype, shape) in PARTS[storage].items():
        info = stored[f"{PROBE}.{suffix}"]
        assert (info.dtype, list(info.shape)) == (dtype, shape(o, i)), (name, suffix)
    assert stored["lm_head.weight"].dtype == "BF16"


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_tool_dropped_or_kept_the_mtp_as_observed(name):
    d = build_dir(name)
    cfg, kept = config(d), BUILDS[name][2]
    declared = qb.mtp_prefixes(cfg)
    assert declared, "the config still declares its MTP modules"
    names = mtp_names(d)
    assert json.loads((d / "build.json").read_text())["stored_mtp_tensors"] == len(names)
    if not kept:  # DeepSeek-V3: transformers dropped model.layers.10/11 on load; nothing carried them over
        assert names == [] and cfg["num_nextn_predict_layers"] == 2
        assert not any(ignored(p + "self_attn.o_proj", cfg["quantization_config"]["ignore"], name.endswith("modelopt"))
                       for p in declared)
        return
    # Qwen3.5: compressed-tensors' save_mtp_tensors_to_checkpoint copied mtp.* BF16 into a shard and ignored it
    source = Checkpoint(ROOT / SOURCES[name])
    stored = Checkpoint(d).stored
    assert names == sorted(n for n in source.tensors if n.startswith("mtp."))
    assert {stored[n].dtype for n in names} == {"BF16"} and {stored[n].file for n in names} == {qb.MTP_SHARD}
    assert "re:^mtp.*" in cfg["quantization_config"]["ignore"]
    index = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == set(stored)


CASES = [("ds_v3_nvfp4a16_llmc", v) for v in qb.VARIANTS] + [
    ("ds_v3_nvfp4_modelopt", "mtp_bf16_ignored"), ("ds_v3_nvfp4_modelopt", "mtp_wrong_scheme"),
    ("qwen3_5_fp8_dynamic_llmc", "mtp_dropped"), ("qwen3_5_fp8_dynamic_llmc", "mtp_bf16_no_ignore"),
    ("qwen3_5_fp8_dynamic_llmc", "mtp_bf16_ignored")]


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_broken_copy_has_what_it_claims(tmp_path, name, variant):
    out = qb.make(name, variant, tmp_path / variant)
    cfg, modelopt = config(out), name.endswith("_modelopt")
    prefixes = qb.mtp_prefixes(cfg)
    assert prefixes == qb.mtp_prefixes(config(build_dir(name)))  # still declared
    assert qb.scheme_of(cfg) == BUILDS[name][1]  # the trunk's config unchanged in scheme
    ckpt = Checkpoint(out)
    stored = ckpt.stored
    names = mtp_names(out)
    entries = cfg["quantization_config"].get("ignore", [])
    if modelopt:
        assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == entries
    mtp_ignored = [ignored(p + "self_attn.o_proj", entries, modelopt) for p in prefixes]
    assert not ignored(PROBE, entries, modelopt)  # the trunk stays quantized
    if variant == "mtp_dropped":
        assert names == [] and not any(mtp_ignored)
        return
    source = Checkpoint(ROOT / SOURCES[name])
    src_names = sorted(n for n in source.tensors if qb.is_mtp(n, prefixes))
    assert all(stored[n].file == qb.MTP_SHARD for n in names)
    assert set(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == set(stored)
    if variant in ("mtp_bf16_no_ignore", "mtp_bf16_ignored"):
        assert names == src_names
        assert all(stored[n].dtype == source.tensors[n].dtype for n in names)
        assert all(mtp_ignored) if variant == "mtp_bf16_ignored" else not any(mtp_ignored)
        return
    # mtp_wrong_scheme: DeepSeek block FP8 under the NVFP4 config, nothing ignored
    assert not any(mtp_ignored) and "fp8" not in json.dumps(cfg["quantization_config"]).lower()
    fp8 = [n for n in src_names if stored[n].dtype == "F8_E4M3"]
    assert f"{prefixes[0]}self_attn.o_proj.weight" in fp8 and f"{prefixes[0]}mlp.experts.0.down_proj.weight" in fp8
    assert stored[f"{prefixes[0]}eh_proj.weight"].dtype == "BF16"  # not attention/MLP: BF16, as DeepSeek ships it
    for n in fp8:
        m, k = source.tensors[n].shape
        scale = stored[n + "_scale_inv"]
        assert (scale.dtype, scale.shape) == ("F32", (math.ceil(m / 128), math.ceil(k / 128))), n
    assert sorted(set(names) - {n + "_scale_inv" for n in fp8}) == src_names


def test_wrong_scheme_needs_an_nvfp4_build_and_variants_are_known(tmp_path):
    with pytest.raises(RecycleError, match="from an NVFP4 build, not FP8"):
        qb.make("qwen3_5_fp8_dynamic_llmc", "mtp_wrong_scheme", tmp_path / "w")
    with pytest.raises(RecycleError, match="unknown broken variant"):
        qb.make("ds_v3_nvfp4a16_llmc", "mtp_fp2", tmp_path / "x")
    assert not (tmp_path / "w").exists() and not (tmp_path / "x").exists()
