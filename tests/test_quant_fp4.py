"""FP4 storage codecs (recycle/quant/fp4.py) and e8m0 block scales (recycle/quant/fp8.py).

Referees: transformers 5.23's own MXFP4 routine (`convert_moe_packed_tensors`, gpt-oss) and its FP4 expert
dequantizer (`Fp8Dequantize`, DeepSeek-V4), compressed-tensors 0.20's NVFP4 decompressor with its reciprocal global
scale (through its own ModelOpt converter), and torch's float8_e8m0fnu.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from recycle.checkpoint import Checkpoint
from recycle.decoding.target import load_target
from recycle.errors import RecycleError
from recycle.quant import CODECS, dequantize_fp8, quantize_fp8
from recycle.quant.fp4 import MX_BLOCK, NV_BLOCK, MXFP4Native

from fixtures.fp8 import make_fp8
from tests.helpers import ROOT

Info = namedtuple("Info", "dtype shape")
ST = {torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
      torch.float8_e8m0fnu: "F8_E8M0", torch.bfloat16: "BF16", torch.float4_e2m1fn_x2: "F4"}


def headers(tensors: dict[str, torch.Tensor]) -> dict[str, Info]:
    """What a reader sees of these tensors: safetensors' dtype names and header shapes (F4 counts its values)."""
    return {n: Info(ST[t.dtype], (*t.shape[:-1], 2 * t.shape[-1]) if t.dtype == torch.float4_e2m1fn_x2
                    else tuple(t.shape)) for n, t in tensors.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def parts_of(packed, tensors):
    return {role: tensors[name] for role, name in packed.parts.items()}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- bit-exact against the references -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_equals_transformers(dtype):
    """gpt-oss `P_blocks`/`P_scales` → `P` [E, G*32, rows], bit for bit what transformers loads (scales span the
    e8m0 range: 2^-127 (subnormal) .. 2^100)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen())
    scales = torch.randint(0, 228, (3, 40, 4), dtype=torch.uint8, generator=gen(1))
    stored = {"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
              "model.layers.0.mlp.experts.gate_up_proj_scales": scales}
    (packed,) = CODECS.get("mxfp4").group(headers(stored), {}).values()
    assert packed.name == "model.layers.0.mlp.experts.gate_up_proj" and packed.shape == (3, 128, 40)
    ours = CODECS.get("mxfp4").dequantize(parts_of(packed, stored), packed, {}, dtype)
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert ours.dtype == dtype and torch.equal(bits(ours), bits(ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_native_equals_transformers_and_f4(dtype):
    """DeepSeek-V4's `w1.weight` I8 + `w1.scale` e8m0: bit for bit transformers' `Fp8Dequantize` (its FP4 path, the
    block read from the scale grid); the same bytes stored as F4 (float4_e2m1fn_x2) read the same."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    codes = torch.randint(-128, 128, (48, 96), dtype=torch.int8, generator=gen())
    scale = torch.randint(90, 160, (48, 6), dtype=torch.uint8, generator=gen(1)).view(torch.float8_e8m0fnu)
    codec = CODECS.get("mxfp4_native")
    for stored_codes in (codes, codes.view(torch.uint8), codes.view(torch.float4_e2m1fn_x2)):
        stored = {"mtp.0.ffn.experts.3.w1.weight": stored_codes, "mtp.0.ffn.experts.3.w1.scale": scale}
        (packed,) = codec.group(headers(stored), {}).values()
        assert packed.shape == (48, 192) and packed.parts["scale"] == "mtp.0.ffn.experts.3.w1.scale"
        ours = codec.dequantize(parts_of(packed, stored), packed, {}, dtype)
        ref = Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=dtype)
        assert torch.equal(bits(ours), bits(ref))


def test_fp8_with_e8m0_scales_equals_float_scales():
    """An e8m0 block scale (float8_e8m0fnu, or its bytes as uint8) multiplies as its float32 value, 2^(s-127)."""
    w = (torch.randn(200, 300, generator=gen()) * 4).to(torch.float8_e4m3fn)
    s = torch.randint(100, 150, (2, 3), dtype=torch.uint8, generator=gen(1))
    as_float = s.view(torch.float8_e8m0fnu).float()
    ref = dequantize_fp8(w, as_float, (128, 128), torch.bfloat16)
    for scale in (s.view(torch.float8_e8m0fnu), s):
        assert torch.equal(bits(dequantize_fp8(w, scale, (128, 128), torch.bfloat16)), bits(ref))
    with pytest.raises(RecycleError, match="NaN code 255") as e:
        dequantize_fp8(w, torch.full((2, 3), 255, dtype=torch.uint8), (128, 128))
    assert "\n" not in str(e.value)


def _nvfp4_stored(w: torch.Tensor, name: str = "model.layers.0.mlp.down_proj.weight") -> dict[str, torch.Tensor]:
    out = CODECS.get("nvfp4").quantize(w, name, {})
    out[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
    return out


@pytest.mark.parametrize("power_of_two", [True, False])
def test_nvfp4_equals_compressed_tensors(power_of_two):
    """ModelOpt's layout, converted by compressed-tensors' own ModelOpt converter (weight_global_scale = 1 /
    weight_scale_2) and decompressed by its NVFP4 compressor, reads as ours: bit for bit where weight_scale_2 is a
    power of two (the reciprocal is exact), else within one bf16 step. Its quantizer, given our scales, packs our
    codes."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4 as CT_NVFP4

    w = torch.randn(64, 256, generator=gen()) * 0.05
    if power_of_two:
        w = w.clamp(-10.0, 10.0)
        w[3, 7] = 2688 / 256  # amax / (6 * 448) = 2^-8: weight_scale_2 exact, and so is its reciprocal
    stored = _nvfp4_stored(w)
    (packed,) = CODECS.get("nvfp4").group(headers(stored), {}).values()
    assert set(packed.parts) == {"codes", "scale", "global_scale", "input_scale"}
    ours = CODECS.get("nvfp4").dequantize(parts_of(packed, stored), packed, {}, torch.bfloat16)
    g = stored["model.layers.0.mlp.down_proj.weight_scale_2"]
    assert (float(g) == 2.0 ** -8) == power_of_two

    ct = ModelOptNvfp4Converter(targets=["re:.*down_proj$"]).process(dict(stored))
    assert torch.equal(ct["model.layers.0.mlp.down_proj.weight_global_scale"], 1 / g)
    state = {k.rpartition(".")[2]: v for k, v in ct.items()}
    scheme = QuantizationScheme(targets=["Linear"], **CT_NVFP4)
    theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16
    if power_of_two:
        assert torch.equal(bits(ours), bits(theirs))
    else:
        step = ours.float().abs() * 2.0 ** -7
        assert ((ours.float() - theirs.float()).abs() <= step).all()
        codes = quantize_and_pack_fp4(w, stored["model.layers.0.mlp.down_proj.weight_scale"].float(),
                                      global_scale=(1 / g).reshape(1), group_size=NV_BLOCK)
        assert (codes == stored["model.layers.0.mlp.down_proj.weight"]).float().mean() > 0.99
    if power_of_two:
        codes = quantize_and_pack_fp4(w, stored["model.layers.0.mlp.down_proj.weight_scale"].float(),
                                      global_scale=(1 / g).reshape(1), group_size=NV_BLOCK)
        assert torch.equal(codes, stored["model.layers.0.mlp.down_proj.weight"])


# -- round trips ------------------------------------------------------------------------------------------------------

def test_mx_round_trip_is_exact_on_the_grid_and_bounded_off_it():
    """quantize(dequantize(codes)) reproduces the values exactly (the scale rule never clips); a float weight lands
    within one scale step of itself, for gpt-oss's transposed layout and DeepSeek's."""
    for name, codec, logical in (("m.experts.down_proj", "mxfp4", (2, 64, 24)),
                                 ("mtp.0.ffn.experts.0.w2.weight", "mxfp4_native", (24, 64))):
        c = CODECS.get(codec)
        w = torch.randn(logical, generator=gen()) * 0.1
        w[..., 5] = 0.0
        stored = c.quantize(w, name, {})
        (packed,) = c.group(headers(stored), {}).values()
        assert packed.shape == logical
        back = c.dequantize(parts_of(packed, stored), packed, {}, torch.float32)
        along_in = back.transpose(1, 2) if codec == "mxfp4" else back  # blocks run along the inputs
        w_in = w.transpose(1, 2) if codec == "mxfp4" else w
        step = w_in.reshape(*w_in.shape[:-1], -1, MX_BLOCK).abs().amax(-1, keepdim=True) / 6 * 2
        err = (along_in - w_in).reshape(step.shape[:-1] + (MX_BLOCK,)).abs()
        assert (err <= step).all() and (err.mean() < step.mean() / 4)
        again = c.quantize(back, name, {})
        assert torch.equal(c.dequantize(parts_of(packed, again), packed, {}, torch.float32), back)


def test_nvfp4_round_trip_within_one_block_step():
    w = torch.randn(32, 128, generator=gen()) * 0.3
    w[0, :16] = 0.0  # an all-zero block: scale 1, codes 0
    stored = _nvfp4_stored(w, "lin.weight")
    (packed,) = CODECS.get("nvfp4").group(headers(stored), {}).values()
    back = CODECS.get("nvfp4").dequantize(parts_of(packed, stored), packed, {}, torch.float32)
    step = stored["lin.weight_scale"].float() * stored["lin.weight_scale_2"]
    err = (back - w).reshape(32, -1, NV_BLOCK).abs()
    assert (err <= step[..., None] * 1.0001).all() and torch.equal(back[0, :16], torch.zeros(16))
    assert stored["lin.weight_scale_2"].shape == () and stored["lin.weight_scale"].dtype == torch.float8_e4m3fn
    with pytest.raises(RecycleError, match="NaN or infinite"):
        CODECS.get("nvfp4").quantize(torch.full((2, 16), float("nan")), "x.weight", {})


def test_nvfp4_fused_experts_with_a_global_scale_each():
    """[E, out, in/2] codes with weight_scale_2 [E] read as each expert's own 2-D weight."""
    c = CODECS.get("nvfp4")
    ws = [torch.randn(8, 32, generator=gen(k)) * (k + 1) for k in range(3)]
    each = [c.quantize(w, "e.weight", {}) for w in ws]
    fused = {k: torch.stack([e[k] for e in each]) for k in each[0]}
    (packed,) = c.group(headers(fused), {}).values()
    assert packed.shape == (3, 8, 32) and len(set(fused["e.weight_scale_2"].tolist())) == 3
    got = c.dequantize(parts_of(packed, fused), packed, {}, torch.float32)
    (one,) = c.group(headers(each[0]), {}).values()
    assert torch.equal(got, torch.stack([c.dequantize(parts_of(one, e), one, {}, torch.float32) for e in each]))


# -- group(): headers only ----------------------------------------------------------------------------------------

def test_group_finds_each_storage_and_nothing_else():
    h = {
        # gpt-oss
        "model.layers.0.mlp.experts.gate_up_proj_blocks": Info("U8", (4, 64, 3, 16)),
        "model.layers.0.mlp.experts.gate_up_proj_scales": Info("U8", (4, 64, 3)),
        "model.layers.0.mlp.experts.gate_up_proj_bias": Info("BF16", (4, 64)),
        "model.layers.0.mlp.router.weight": Info("BF16", (4, 96)),
        # DeepSeek-V4: FP4 expert, FP8 with e8m0 (fp8's, not ours), an unscaled I8 tensor
        "layers.1.ffn.experts.7.w3.weight": Info("I8", (64, 48)),
        "layers.1.ffn.experts.7.w3.scale": Info("F8_E8M0", (64, 3)),
        "layers.1.attn.wq_a.weight": Info("F8_E4M3", (256, 128)),
        "layers.1.attn.wq_a.scale": Info("F8_E8M0", (2, 1)),
        "layers.1.ffn.gate.tid2eid": Info("I64", (100, 6)),
        "layers.1.other.weight": Info("I8", (8, 8)),
        # ModelOpt NVFP4, one without input_scale
        "model.layers.2.self_attn.q_proj.weight": Info("U8", (32, 64)),
        "model.layers.2.self_attn.q_proj.weight_scale": Info("F8_E4M3", (32, 8)),
        "model.layers.2.self_attn.q_proj.weight_scale_2": Info("F32", ()),
        "model.layers.2.self_attn.q_proj.input_scale": Info("F32", ()),
        "model.layers.2.self_attn.o_proj.weight": Info("U8", (64, 32)),
        "model.layers.2.self_attn.o_proj.weight_scale": Info("F8_E4M3", (64, 4)),
        "model.layers.2.self_attn.o_proj.weight_scale_2": Info("F32", (1,)),
        # compressed-tensors' NVFP4 names (another codec's), an embedding in U8 with nothing beside it
        "model.layers.3.mlp.up_proj.weight_packed": Info("U8", (32, 64)),
        "model.layers.3.mlp.up_proj.weight_scale": Info("F8_E4M3", (32, 8)),
        "model.layers.3.mlp.up_proj.weight_global_scale": Info("F32", (1,)),
        "model.embed.weight": Info("U8", (10, 10)),
    }
    found = {c: CODECS.get(c).group(h, {}) for c in ("mxfp4", "mxfp4_native", "nvfp4")}
    assert {c: {k: v.shape for k, v in f.items()} for c, f in found.items()} == {
        "mxfp4": {"model.layers.0.mlp.experts.gate_up_proj": (4, 96, 64)},
        "mxfp4_native": {"layers.1.ffn.experts.7.w3.weight": (64, 96)},
        "nvfp4": {"model.layers.2.self_attn.q_proj.weight": (32, 128),
                  "model.layers.2.self_attn.o_proj.weight": (64, 64)}}
    assert "input_scale" not in found["nvfp4"]["model.layers.2.self_attn.o_proj.weight"].parts
    assert {f.tag for g in found.values() for f in g.values()} == {"MXFP4", "NVFP4"}


@pytest.mark.parametrize("codec,h,what", [
    ("mxfp4", {"a.down_proj_blocks": Info("U8", (2, 8, 3, 16)), "a.down_proj_scales": Info("U8", (2, 8, 4))},
     "a.down_proj_blocks"),
    ("mxfp4_native", {"e.w1.weight": Info("I8", (64, 48)), "e.w1.scale": Info("F8_E8M0", (64, 4))}, "e.w1.weight"),
    ("mxfp4_native", {"e.w1.weight": Info("I8", (64, 40)), "e.w1.scale": Info("F8_E8M0", (64, 2))}, "e.w1.weight"),
    ("nvfp4", {"q.weight": Info("U8", (32, 64)), "q.weight_scale": Info("F8_E4M3", (32, 7)),
               "q.weight_scale_2": Info("F32", ())}, "q.weight"),
    ("nvfp4", {"q.weight": Info("U8", (32, 64)), "q.weight_scale": Info("F8_E4M3", (32, 8))}, "weight_scale_2"),
])
def test_group_refuses_parts_that_do_not_fit(codec, h, what):
    with pytest.raises(RecycleError, match="corrupt") as e:
        CODECS.get(codec).group(h, {})
    assert what in str(e.value) and "\n" not in str(e.value)


def test_group_needs_no_torch():
    code = ("import sys, collections; from recycle.quant import CODECS; I = collections.namedtuple('I', 'dtype shape');"
            "h = {'x.weight': I('I8', (4, 16)), 'x.scale': I('F8_E8M0', (4, 1)), 'p_blocks': I('U8', (1, 2, 1, 16)),"
            " 'p_scales': I('U8', (1, 2, 1)), 'q.weight': I('U8', (2, 8)), 'q.weight_scale': I('F8_E4M3', (2, 1)),"
            " 'q.weight_scale_2': I('F32', ())};"
            "assert all(len(CODECS.get(c).group(h, {})) == 1 for c in ('mxfp4', 'mxfp4_native', 'nvfp4'));"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- dequantize(): bad bytes --------------------------------------------------------------------------------------

def test_dequantize_refuses_bad_parts_in_one_line():
    c = MXFP4Native()
    good = {"e.w1.weight": torch.zeros(4, 32, dtype=torch.int8),
            "e.w1.scale": torch.full((4, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
    (packed,) = c.group(headers(good), {}).values()
    bad = [({"codes": torch.zeros(4, 31, dtype=torch.int8)}, "shape"),  # a byte short per row
           ({"codes": torch.zeros(4, 32, dtype=torch.float32)}, "one byte"),
           ({"scale": torch.ones(4, 2)}, "e8m0"),
           ({"scale": torch.full((4, 2), 255, dtype=torch.uint8)}, "NaN code")]
    for change, msg in bad:
        parts = {**parts_of(packed, good), **change}
        with pytest.raises(RecycleError, match=msg) as e:
            c.dequantize(parts, packed, {}, torch.bfloat16)
        assert "\n" not in str(e.value)
    nv = _nvfp4_stored(torch.randn(4, 32, generator=gen()), "q.weight")
    (p,) = CODECS.get("nvfp4").group(headers(nv), {}).values()
    for change, msg in (({"global_scale": torch.tensor(-1.0)}, "non-positive"),
                        ({"global_scale": torch.ones(2)}, "one float32"),
                        ({"scale": torch.full((4, 2), float("nan")).to(torch.float8_e4m3fn)}, "NaN"),
                        ({"scale": torch.full((4, 2), -1.0).to(torch.float8_e4m3fn)}, "non-positive")):
        with pytest.raises(RecycleError, match=msg) as e:
            CODECS.get("nvfp4").dequantize({**parts_of(p, nv), **change}, p, {}, torch.bfloat16)
        assert "\n" not in str(e.value)


# -- through the reader -------------------------------------------------------------------------------------------

def test_checkpoint_folds_and_reads_each_layout(tmp_path):
    """A safetensors file in each layout: `Checkpoint.tensors` holds the logical weights (tag as dtype), `stored`
    the parts, and `get` gives what the codec makes of them."""
    w_oss = torch.randn(2, 64, 40, generator=gen()) * 0.1
    w_v4 = torch.randn(40, 64, generator=gen(1)) * 0.1
    w_nv = torch.randn(40, 64, generator=gen(2)) * 0.1
    w_fp8 = torch.randn(40, 64, generator=gen(3))
    tensors = {**CODECS.get("mxfp4").quantize(w_oss, "model.layers.0.mlp.experts.down_proj", {}),
               **CODECS.get("mxfp4_native").quantize(w_v4, "mtp.0.ffn.experts.1.w2.weight", {}),
               **_nvfp4_stored(w_nv, "model.layers.1.mlp.gate_proj.weight"),
               "mtp.0.attn.wq_a.weight": w_fp8.to(torch.float8_e4m3fn),
               "mtp.0.attn.wq_a.scale": torch.full((1, 1), 126, dtype=torch.uint8).view(torch.float8_e8m0fnu),
               "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "test"}))
    ckpt = Checkpoint(tmp_path)
    assert {n: (i.dtype, i.shape) for n, i in ckpt.tensors.items() if i.dtype in ("MXFP4", "NVFP4")} == {
        "model.layers.0.mlp.experts.down_proj": ("MXFP4", (2, 64, 40)),
        "mtp.0.ffn.experts.1.w2.weight": ("MXFP4", (40, 64)),
        "model.layers.1.mlp.gate_proj.weight": ("NVFP4", (40, 64))}
    assert "mtp.0.ffn.experts.1.w2.scale" in ckpt.stored and "mtp.0.ffn.experts.1.w2.scale" not in ckpt.tensors
    for name, w, tol in (("model.layers.0.mlp.experts.down_proj", w_oss, 0.34),
                         ("mtp.0.ffn.experts.1.w2.weight", w_v4, 0.34),
                         ("model.layers.1.mlp.gate_proj.weight", w_nv, 0.2)):
        got = ckpt.get(name, torch.float32)
        packed = ckpt.packed[name]
        assert torch.equal(got, CODECS.get(packed.codec).dequantize(parts_of(packed, tensors), packed, {},
                                                                       torch.float32))
        assert got.shape == w.shape and (got - w).abs().max() <= tol * w.abs().max()
    fp8 = ckpt.get("mtp.0.attn.wq_a.weight", torch.float32)
    assert torch.equal(fp8, w_fp8.to(torch.float8_e4m3fn).float() * 0.5)


def test_deepseek_v4_mtp_runs_from_fp4_experts(family_dir, tmp_path):
    """The release's layout (FP8 e_proj with an e8m0 `.scale`, routed experts as I8 pairs with e8m0 scales per 32)
    builds the same MTP as a BF16 copy holding the dequantized values; FP4 codes with no scale are refused."""
    from recycle.mtp import MTP

    src = family_dir("deepseek_v4")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["mtp.0.e_proj.weight"] = tensors["mtp.0.e_proj.weight"].float().to(torch.float8_e4m3fn)
    tensors["mtp.0.e_proj.scale"] = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    codec = CODECS.get("mxfp4_native")
    plain = dict(tensors)
    experts = [n for n in tensors if ".experts." in n and n.endswith(".weight")]
    for name in experts:
        stored = codec.quantize(tensors[name], name, {})
        tensors.update(stored)
        (packed,) = codec.group(headers(stored), {}).values()
        # what `Checkpoint.get` gives by default (bfloat16), held in the fixture's own dtype
        plain[name] = codec.dequantize(parts_of(packed, stored), packed, {}, torch.bfloat16).to(plain[name].dtype)
    plain["mtp.0.e_proj.weight"] = tensors["mtp.0.e_proj.weight"].to(plain["mtp.0.e_proj.weight"].dtype)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    cfg["expert_dtype"] = "fp4"
    for d, t, c in (("fp4", tensors, cfg), ("bf16", plain, json.loads((src / "config.json").read_text()))):
        (tmp_path / d).mkdir()
        save_file(t, str(tmp_path / d / "model.safetensors"))
        (tmp_path / d / "config.json").write_text(json.dumps(c))
    assert {Checkpoint(tmp_path / "fp4").tensors[n].dtype for n in experts} == {"MXFP4"}
    ours, ref = MTP.from_checkpoint(tmp_path / "fp4"), MTP.from_checkpoint(tmp_path / "bf16")
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    bare = next(n for n in experts if n.startswith("mtp."))
    del tensors[bare.removesuffix("weight") + "scale"]
    (tmp_path / "bare").mkdir()
    save_file(tensors, str(tmp_path / "bare" / "model.safetensors"))
    (tmp_path / "bare" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RecycleError, match="no e8m0 scale") as e:
        MTP.from_checkpoint(tmp_path / "bare")
    assert bare in str(e.value) and "\n" not in str(e.value)


def test_a_target_with_native_e8m0_fp8_scales_loads_as_its_float32_twin(tmp_path):
    """DeepSeek-V4's FP8 linears keep a power-of-two e8m0 `.scale` beside `.weight`: the target loader (bench's and
    distill's teacher) reads it as the same weights as float32 `weight_scale_inv` holding those values."""
    twin = make_fp8(ROOT / "fixtures" / "deepseek_v3_mtp", tmp_path / "f32")
    src = Checkpoint(twin)
    state, native = {}, {}
    for name in src.stored:
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in src.stored:  # re-quantized with power-of-two scales, which e8m0 holds exactly
            q, scale = quantize_fp8(src.get(name, torch.float32), (128, 128), pow2=True)
            state[name] = native[name] = q
            state[name + "_scale_inv"] = scale
            native[name.removesuffix(".weight") + ".scale"] = scale.to(torch.float8_e8m0fnu)
        else:
            state[name] = native[name] = src.raw(name)
    save_file(state, str(twin / "model.safetensors"), metadata={"format": "pt"})
    e8 = tmp_path / "e8m0"
    e8.mkdir()
    for f in twin.iterdir():
        if f.suffix != ".safetensors":
            (e8 / f.name).write_bytes(f.read_bytes())
    save_file(native, str(e8 / "model.safetensors"), metadata={"format": "pt"})
    assert Checkpoint(e8).stored["model.layers.3.self_attn.o_proj.scale"].dtype == "F8_E8M0"
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        a, b = load_target(twin)(ids).logits, load_target(e8)(ids).logits
    assert torch.equal(a, b)
