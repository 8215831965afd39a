"""The integer and compressed-tensors storage codecs (`recycle/quant/ctensors.py`, `recycle/quant/intpack.py`).

compressed-tensors: the stored parts are made by the package's own compressors (`compress`), so their bytes are
the real format; recycle's reading (headers → `Packed` → `Checkpoint.get`) must equal the package's `decompress`.
AWQ and GPTQ: packed here, independently of recycle, from the published packers (AutoAWQ's GEMM `from_linear`,
GPTQModel's `pack_original` and its v2→v1 zero-point shift; compressed-tensors' `pack_to_int32` where the GPTQ
layout coincides), and checked against the unpacked integers; AWQ also against compressed-tensors' own
`AutoAWQConverter`.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.quant import CODECS
from recycle.quant.codec import Packed
from recycle.quant.ctensors import NEEDS_PACKAGE, config_group

pytest.importorskip("compressed_tensors")

OUT, IN = 64, 128
ST = {torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
      torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


class Info:
    """A header entry as `Checkpoint.stored` holds it (dtype string, shape)."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = ST[t.dtype], tuple(t.shape)


def headers(tensors: dict[str, torch.Tensor]) -> dict[str, Info]:
    return {k: Info(v) for k, v in tensors.items()}


def weight(seed: int, shape=(OUT, IN)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)


def write(tmp_path, config: dict, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return Checkpoint(tmp_path)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


# -- compressed-tensors ---------------------------------------------------------------------------------------------

FP8_ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
GROUPS = {  # module suffix → (codec, format, weights args, input activations)
    "self_attn.q_proj": ("ct_float", "float-quantized",
                         {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [32, 32]},
                         {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True}),
    "self_attn.o_proj": ("ct_float", "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                         FP8_ACTS),
    "mlp.down_proj": ("ct_pack", "pack-quantized",
                      {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}, None),
    "self_attn.k_proj": ("ct_pack", "pack-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}, None),
    "mlp.up_proj": ("ct_nvfp4", "nvfp4-pack-quantized",
                    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, None),
    "mlp.gate_proj": ("ct_naive", "naive-quantized",
                      {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}, None),
}
SUFFIX = {"codes": "weight", "packed": "weight_packed", "scale": "weight_scale", "global_scale": "weight_global_scale",
          "zero_point": "weight_zero_point", "shape": "weight_shape", "g_idx": "weight_g_idx"}


def ct_config() -> dict:
    """A mixed-precision llm-compressor config: one group per module by regex, the last by the "Linear" class."""
    groups = {}
    for i, (suffix, (_, fmt, w, acts)) in enumerate(GROUPS.items()):
        target = "Linear" if suffix == "mlp.gate_proj" else "re:.*" + suffix.replace(".", r"\.") + "$"
        groups[f"group_{i}"] = {"targets": [target], "weights": w, "input_activations": acts, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": groups,
            "ignore": ["lm_head", "re:^mtp\\."]}


def package_decompress(fmt: str, group: dict, state: dict[str, torch.Tensor]) -> torch.Tensor:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(group)
    return BaseCompressor.get_value_from_registry(fmt).decompress(state, scheme)["weight"]


def test_compressed_tensors_formats_read_as_the_package_decompresses(tmp_path):
    config = ct_config()
    originals, tensors = {}, {}
    for i, suffix in enumerate(GROUPS):
        name = f"model.layers.0.{suffix}.weight"
        originals[name] = weight(i)
        tensors.update(CODECS.get(GROUPS[suffix][0]).quantize(originals[name], name, config))
    tensors["lm_head.weight"] = weight(10)
    tensors["mtp.fc.weight"] = weight(11)
    tensors["model.norm.weight"] = torch.ones(IN, dtype=torch.bfloat16)
    ck = write(tmp_path, config, tensors)

    for i, (suffix, (codec, fmt, _, _)) in enumerate(GROUPS.items()):
        name = f"model.layers.0.{suffix}.weight"
        p = ck.packed[name]
        assert (p.codec, tuple(ck.tensors[name].shape)) == (codec, (OUT, IN))
        assert ck.tensors[name].dtype == {"ct_float": "FP8", "ct_nvfp4": "NVFP4", "ct_naive": "INT8"}.get(
            codec, "INT4" if suffix == "mlp.down_proj" else "INT8")
        assert all(part not in ck.tensors for part in p.parts.values() if part != name)
        got = ck.get(name, torch.float32)
        state = {SUFFIX[role]: ck.raw(part) for role, part in p.parts.items()}
        want = package_decompress(fmt, config["config_groups"][f"group_{i}"], state).float()
        assert got.shape == (OUT, IN) and torch.equal(got, want), suffix
        step = (originals[name].float() - got).abs().max()
        assert 0 < step < 0.05, (suffix, step)  # quantized, and close: the bytes decode to this weight
    # ignored and untargeted weights stay as stored
    for name in ("lm_head.weight", "mtp.fc.weight", "model.norm.weight"):
        assert name not in ck.packed and ck.tensors[name].dtype == "BF16"


def test_writer_bytes_are_the_package_compressors(tmp_path):
    """quantize: the format's own `compress` over min-max qparams; names and dtypes as llm-compressor stores them."""
    config = ct_config()
    w = weight(3)
    parts = CODECS.get("ct_pack").quantize(w, "model.layers.0.mlp.down_proj.weight", config)
    m = "model.layers.0.mlp.down_proj."
    assert {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()} == {
        m + "weight_packed": (torch.int32, (OUT, IN // 8)), m + "weight_scale": (torch.bfloat16, (OUT, IN // 32)),
        m + "weight_zero_point": (torch.int32, (OUT // 8, IN // 32)), m + "weight_shape": (torch.int64, (2,))}
    # asymmetric min-max: each group's min and max land on the code range's ends
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    codes = unpack_from_int32(parts[m + "weight_packed"], 4, torch.Size((OUT, IN))).view(OUT, IN // 32, 32)
    assert int(codes.amin()) == -8 and int(codes.amax()) == 7
    fp8 = CODECS.get("ct_float").quantize(w, "model.layers.0.self_attn.o_proj.weight", config)
    q = fp8["model.layers.0.self_attn.o_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn
    assert torch.allclose(q.float().abs().amax(1), torch.full((OUT,), 448.0))  # per-channel absmax → e4m3 max
    with pytest.raises(RecycleError) as e:
        CODECS.get("ct_pack").quantize(w, "lm_head.weight", config)
    assert "no pack-quantized group" in one_line(e)


def test_pure_fp8_build_dequantizes_through_its_codec():
    """An FP8-only build has no int part; the codec reads it from headers all the same."""
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "strategy": "tensor"}, "input_activations": FP8_ACTS}}}
    w = weight(4)
    parts = CODECS.get("ct_float").quantize(w, "a.weight", config)
    assert tuple(parts["a.weight_scale"].shape) == (1,)
    found = CODECS.get("ct_float").group(headers(parts), config)
    assert set(found) == {"a.weight"} and CODECS.get("ct_naive").group(headers(parts), config) == {}
    p = found["a.weight"]
    got = CODECS.get("ct_float").dequantize({r: parts[n] for r, n in p.parts.items()}, p, config, torch.float32)
    want = parts["a.weight"].float() * parts["a.weight_scale"].float()
    assert torch.allclose(got, want, rtol=2 ** -8, atol=0)  # the package multiplies in the scale's dtype (bf16)


def test_config_group_follows_vllms_lookup():
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*mtp.*", "lm_head"],
              "config_groups": {
                  "a": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}},
                  "b": {"targets": ["re:.*down_proj$"], "weights": {"num_bits": 8, "strategy": "channel"},
                        "format": "naive-quantized"},
                  "c": {"targets": ["re:.*down_proj$", "model.layers.1.mlp.gate_proj"],
                        "weights": {"num_bits": 8, "type": "float"}, "format": "float-quantized"}}}
    down = config_group("model.layers.0.mlp.down_proj", config)
    assert (down.key, down.format, down.num_bits, down.strategy) == ("c", "float-quantized", 8, "tensor")  # last wins
    gate = config_group("model.layers.1.mlp.gate_proj", config)
    assert gate.key == "c"  # a name beats the "Linear" class
    up = config_group("model.layers.1.mlp.up_proj", config)
    assert (up.key, up.format, up.strategy, up.group_size) == ("a", "pack-quantized", "group", 128)  # top format
    assert config_group("model.layers.1.mlp.up_proj", config, two_d=False) is None  # not a Linear
    assert config_group("mtp.layers.0.mlp.up_proj", config) is None  # ignored
    assert config_group("lm_head", config) is None
    with pytest.raises(RecycleError) as e:
        config_group("x", {"config_groups": {"W4A16": ["Linear"]}})
    assert "preset" in one_line(e)


def test_compressed_tensors_corrupt_parts_are_one_line(tmp_path, monkeypatch):
    config = ct_config()
    name = "model.layers.0.mlp.down_proj.weight"
    parts = CODECS.get("ct_pack").quantize(weight(1), name, config)
    m = name[: -len("weight")]
    # scales that do not divide the weight's groups: refused from the headers
    bad = dict(parts, **{m + "weight_scale": parts[m + "weight_scale"][:, :3]})
    with pytest.raises(RecycleError) as e:
        CODECS.get("ct_pack").group(headers(bad), config)
    assert "weight_scale" in one_line(e) and "[64, 3]" in str(e.value)
    # packed words of the wrong width (wrong byte length) against a consistent scale: refused
    bad = dict(parts, **{m + "weight_packed": parts[m + "weight_packed"][:, :12]})
    with pytest.raises(RecycleError) as e:
        CODECS.get("ct_pack").group(headers(bad), config)
    one_line(e)
    # a weight_shape that disagrees with the headers: refused when read
    bad = dict(parts, **{m + "weight_shape": torch.tensor([OUT, IN - 8])})
    ck = write(tmp_path, config, bad)
    with pytest.raises(RecycleError) as e:
        ck.get(name)
    assert "weight_shape" in one_line(e)
    # without the package: one line naming the extra
    monkeypatch.setitem(sys.modules, "compressed_tensors.compressors", None)
    with pytest.raises(RecycleError) as e:
        ck.get(name)
    assert one_line(e) == NEEDS_PACKAGE
    with pytest.raises(RecycleError) as e:
        CODECS.get("ct_pack").quantize(weight(1), name, config)
    assert one_line(e) == NEEDS_PACKAGE


# -- AWQ --------------------------------------------------------------------------------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ awq/modules/linear/gemm.py:222


def autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing (gemm.py:214-228, the same loop for qzeros at 235-249): [rows, cols] ints → [rows,
    cols/8] int32, word c's nibble i holding column 8c + AWQ_ORDER[i]."""
    packed = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]].to(torch.int32) << (i * 4)
    return packed


def int4_groups(seed: int, rows: int, cols: int, group: int):
    """Codes [rows=in, cols=out] in 0..15, zero points and fp16 scales per group of input rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (rows // group, cols), generator=g, dtype=torch.int32)
    s = (torch.rand((rows // group, cols), generator=g) * 0.01 + 0.001).half()
    return q, z, s


def test_awq_gemm_reads_autoawq_packing(tmp_path):
    group = 32
    q, z, s = int4_groups(0, IN, OUT, group)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["mtp"]}
    m = "model.layers.0.mlp.down_proj."
    tensors = {m + "qweight": autoawq_pack(q), m + "qzeros": autoawq_pack(z), m + "scales": s,
               "mtp.fc.weight": weight(1)}
    ck = write(tmp_path, config, tensors)
    assert ck.tensors[m + "weight"].dtype == "INT4" and tuple(ck.tensors[m + "weight"].shape) == (OUT, IN)
    got = ck.get(m + "weight", torch.float32)
    rows = torch.arange(IN) // group
    want = ((q - z[rows]).float() * s.float()[rows]).T  # W[o, i] = (q[i, o] − z[g(i), o]) · s[g(i), o]
    assert torch.equal(got, want)
    # compressed-tensors' own AutoAWQ converter decodes the same parts to the same weight
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converted = AutoAWQConverter(bits=4, group_size=group).process({k: v.clone() for k, v in tensors.items()})
    args = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}
    ref = package_decompress("pack-quantized", {"targets": ["Linear"], "weights": args},
                             {k.removeprefix(m): v for k, v in converted.items() if k.startswith(m)})
    assert torch.allclose(got, ref.float(), atol=0, rtol=1e-3)  # the package decodes in fp16


def test_awq_refusals_are_one_line():
    m = "l."
    q, z, s = int4_groups(1, IN, OUT, 32)
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    good = {m + "qweight": autoawq_pack(q), m + "qzeros": autoawq_pack(z), m + "scales": s}
    assert set(CODECS.get("awq").group(headers(good), config)) == {"l.weight"}
    assert CODECS.get("awq").group(headers(good), dict(config, quant_method="gptq")) == {}
    with pytest.raises(RecycleError) as e:  # zero points of other groups than the scales
        CODECS.get("awq").group(headers(dict(good, **{m + "qzeros": good[m + "qzeros"][:3]})), config)
    assert "qzeros" in one_line(e)
    with pytest.raises(RecycleError) as e:  # scales whose groups do not divide the input rows
        CODECS.get("awq").group(headers(dict(good, **{m + "scales": s[:3]})), config)
    assert "scales" in one_line(e)
    with pytest.raises(RecycleError) as e:
        CODECS.get("awq").group(headers(good), dict(config, version="gemv"))
    assert "GEMM" in one_line(e)
    p = CODECS.get("awq").group(headers(good), config)["l.weight"]
    parts = {"codes": good[m + "qweight"][:, :4], "zeros": good[m + "qzeros"], "scale": s}
    with pytest.raises(RecycleError) as e:  # tensors that are not what the headers said
        CODECS.get("awq").dequantize(parts, p, config, torch.float32)
    assert "qweight" in one_line(e)


# -- GPTQ -------------------------------------------------------------------------------------------------------------

def gptqmodel_pack_rows(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQModel `pack_original` (nn_modules/qlinear/__init__.py:1537-1539): [in, out] → [in·bits/32, out]."""
    per = 32 // bits
    packed = torch.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=torch.int64)
    for row in range(packed.shape[0]):
        for j in range(per):
            packed[row] |= intweight[row * per + j].long() << (bits * j)
    return packed.to(torch.int32)  # wraps to the signed words the checkpoint holds


def v1(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQModel's v2→v1 conversion (utils/model.py:928-931): the whole word minus one per field, wrapping."""
    words = (qzeros.long() - sum(1 << (bits * j) for j in range(32 // bits))) & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@pytest.mark.parametrize(("bits", "fmt", "sym", "desc_act"), [
    (4, "gptq", False, True), (4, "gptq_v2", False, False), (8, "gptq", True, False)])
def test_gptq_reads_gptqmodel_packing(tmp_path, bits, fmt, sym, desc_act):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    group, top = 32, 1 << bits
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, top, (IN, OUT), generator=g, dtype=torch.int32)
    n_groups = IN // group
    z = torch.full((n_groups, OUT), top // 2, dtype=torch.int32) if sym else \
        torch.randint(0, top, (n_groups, OUT), generator=g, dtype=torch.int32)
    z[0, 0] = top // 2 if sym else 0  # a zero point of 0: v1's word-wide subtraction borrows from its neighbour
    s = (torch.rand((n_groups, OUT), generator=g) * 0.01 + 0.001).half()
    g_idx = (torch.randperm(IN, generator=g) if desc_act else torch.arange(IN)) // group
    offset = top // 2  # compressed-tensors packs signed codes, offset by 2^(bits-1): the same words as GPTQ's
    qweight = pack_to_int32((q - offset).to(torch.int8), bits, packed_dim=0)
    assert torch.equal(qweight, gptqmodel_pack_rows(q, bits))
    qzeros = pack_to_int32((z - offset).to(torch.int8), bits, packed_dim=1)
    if fmt == "gptq":
        qzeros = v1(qzeros, bits)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": fmt, "dynamic": {"-:.*mtp.*": {}}}
    m = "model.layers.0.mlp.down_proj."
    ck = write(tmp_path, config, {m + "qweight": qweight, m + "qzeros": qzeros, m + "scales": s,
                                  m + "g_idx": g_idx.to(torch.int32), "mtp.fc.weight": weight(2)})
    assert ck.tensors[m + "weight"].dtype == f"INT{bits}" and tuple(ck.tensors[m + "weight"].shape) == (OUT, IN)
    got = ck.get(m + "weight", torch.float32)
    want = ((q - z[g_idx]).float() * s.float()[g_idx]).T  # GPTQModel _dequantize_from_codes (v2 zero points)
    assert torch.equal(got, want)
    assert "mtp.fc.weight" not in ck.packed


def test_gptq_refusals_are_one_line():
    m, bits, group = "l.", 4, 32
    q = torch.randint(0, 16, (IN, OUT), dtype=torch.int32)
    z = torch.randint(0, 16, (IN // group, OUT), dtype=torch.int32)
    parts = {m + "qweight": gptqmodel_pack_rows(q, bits), m + "scales": torch.ones(IN // group, OUT).half(),
             m + "qzeros": gptqmodel_pack_rows(z.T.contiguous(), bits).T.contiguous()}
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True, "checkpoint_format": "gptq_v2"}
    p: Packed = CODECS.get("gptq").group(headers(parts), config)["l.weight"]
    tensors = {r: parts[n] for r, n in p.parts.items()}
    with pytest.raises(RecycleError) as e:  # random zero points under sym: true: vLLM would serve other weights
        CODECS.get("gptq").dequantize(tensors, p, config, torch.float32)
    assert "sym" in one_line(e)
    with pytest.raises(RecycleError) as e:
        CODECS.get("gptq").group(headers(dict(parts, **{m + "g_idx": torch.zeros(IN - 1, dtype=torch.int32)})),
                                 config)
    assert "g_idx" in one_line(e)
    p = CODECS.get("gptq").group(headers(dict(parts, **{m + "g_idx": torch.zeros(IN, dtype=torch.int32)})),
                                 dict(config, sym=False))["l.weight"]
    bad = dict(tensors, g_idx=torch.full((IN,), 9, dtype=torch.int32))
    with pytest.raises(RecycleError) as e:
        CODECS.get("gptq").dequantize(bad, p, dict(config, sym=False), torch.float32)
    assert "g_idx" in one_line(e)
    with pytest.raises(RecycleError) as e:
        CODECS.get("gptq").group(headers(parts), dict(config, checkpoint_format="marlin"))
    one_line(e)
