"""NVIDIA ModelOpt's FP8 storages (`modelopt_fp8`, recycle/quant/fp8.py): `X.weight` e4m3 with a float
`X.weight_scale` per tensor (quant_algo FP8), per output channel (FP8_PER_CHANNEL_PER_TOKEN) or per 128×128 block
(FP8_PB_WO, [ob, 1, ib, 1] as ModelOpt exports it, or 2-D), read through `Checkpoint.get`; and vllm#54126's layout,
FP8-block MTP experts under an NVFP4 trunk, audited as vLLM 0.32 would load it (modelopt.py:1813-1883): an error
under the plain NVFP4 config, clean where MIXED_PRECISION's `quantized_layers` declares those layers FP8_PB_WO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recycle.audit import inspect_checkpoint
from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.quant import CODECS

from fixtures.quant_broken import MTP_SHARD, make

MODELOPT = "ds_v3_nvfp4_modelopt"
M, N = 200, 300  # ragged against 128: the last row and column blocks are partial
MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "FP8"}
# scale form -> its stored shape for an [M, N] weight
FORMS = {"tensor0": (), "tensor1": (1,), "channel1": (M,), "channel2": (M, 1), "block2": (2, 3), "block4": (2, 1, 3, 1)}


def _expand(scale: torch.Tensor) -> torch.Tensor:
    """The [M, N] multiplier of each form, by broadcasting alone (no recycle code)."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(M, N)
    if s.numel() == M:
        return s.reshape(M, 1).expand(M, N)
    s = s.reshape(2, 3)
    return s.repeat_interleave(128, 0)[:M].repeat_interleave(128, 1)[:, :N]


def _write(d: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama",
                                               "quantization_config": config or MODELOPT_CONFIG}))
    save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """One weight per scale form (random e4m3 codes, positive scales of mixed magnitude), one with an input_scale."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for form, shape in FORMS.items():
        codes = (torch.randn(M, N, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(shape, generator=g) * 0.01 + 1e-4
        tensors[f"m.{form}.weight"], tensors[f"m.{form}.weight_scale"] = codes, scale.float()
    tensors["m.block2.weight_scale"] = tensors["m.block2.weight_scale"].bfloat16()  # a BF16 scale reads too
    tensors["m.tensor1.input_scale"] = torch.tensor([0.5])
    return _write(tmp_path_factory.mktemp("forms"), tensors), tensors


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_scale_form_reads_as_codes_times_scale(form: str, forms) -> None:
    d, tensors = forms
    ckpt = Checkpoint(d)
    name = f"m.{form}.weight"
    assert ckpt.tensors[name].dtype == "FP8" and ckpt.packed[name].codec == "modelopt_fp8"
    assert name + "_scale" in ckpt.stored and name + "_scale" not in ckpt.tensors  # folded into its weight
    want = tensors[name].float() * _expand(tensors[name + "_scale"])
    assert torch.equal(ckpt.get(name, torch.float32), want)
    assert torch.equal(ckpt.get(name), want.bfloat16())  # float32 product, rounded once


def test_the_input_scale_is_a_part_and_no_other_storage_is_claimed(forms, tmp_path: Path) -> None:
    d, tensors = forms
    assert Checkpoint(d).packed["m.tensor1.weight"].parts["input_scale"] == "m.tensor1.input_scale"
    codes, scale = tensors["m.block2.weight"], tensors["m.block4.weight_scale"]
    # compressed-tensors' FP8 is ct_float's; DeepSeek's weight_scale_inv beside it is fp8_block's (not folded)
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}
    ct_ckpt = Checkpoint(_write(tmp_path / "ct", {"m.w.weight": codes, "m.w.weight_scale": torch.tensor([0.5])}, ct))
    assert ct_ckpt.packed["m.w.weight"].codec == "ct_float"
    inv = Checkpoint(_write(tmp_path / "inv", {"m.w.weight": codes, "m.w.weight_scale": scale,
                                               "m.w.weight_scale_inv": scale.reshape(2, 3).clone()}))
    assert inv.tensors["m.w.weight"].dtype == "F8_E4M3" and "m.w.weight" not in inv.packed


@pytest.mark.parametrize(("shape", "value"), [((3, 2), 0.5), ((M + 1,), 0.5), ((2,), 0.5), ((1,), float("nan")),
                                              ((1,), -1.0)])
def test_a_corrupt_scale_is_one_line(shape: tuple[int, ...], value: float, forms, tmp_path: Path) -> None:
    codes = forms[1]["m.block2.weight"]
    ckpt = Checkpoint(_write(tmp_path / "bad", {"m.w.weight": codes, "m.w.weight_scale": torch.full(shape, value)}))
    with pytest.raises(RecycleError) as e:
        ckpt.get("m.w.weight")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("m.w.weight_scale: ") and "corrupt scale" in msg, msg


def test_quantize_writes_fp8_pb_wo_as_modelopt_exports_it() -> None:
    codec = CODECS.get("modelopt_fp8")
    w = torch.randn(M, 256, generator=torch.Generator().manual_seed(1))
    parts = codec.quantize(w, "m.w.weight", {})
    assert parts["m.w.weight"].dtype == torch.float8_e4m3fn and parts["m.w.weight_scale"].shape == (2, 1, 2, 1)
    packed = codec.group({n: _Info(t) for n, t in parts.items()}, MODELOPT_CONFIG)["m.w.weight"]
    back = codec.dequantize({r: parts[p] for r, p in packed.parts.items()}, packed, MODELOPT_CONFIG, torch.float32)
    assert float(((back - w).abs() / w.abs().amax()).max()) < 0.07
    with pytest.raises(RecycleError, match="multiple of 128"):  # vLLM's FP8_PB_WO needs `in` % 128 (modelopt.py:2232)
        codec.quantize(torch.ones(M, N), "m.w.weight", {})


class _Info:
    """Header facts of a tensor made here (the codec's `group` reads `.dtype` and `.shape`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}[t.dtype]
        self.shape = tuple(t.shape)


# -- vllm#54126: FP8-block MTP under a ModelOpt NVFP4 trunk ----------------------------------------------------------


def _errors(d: Path) -> list[tuple[str, str, str]]:
    return [(f.code, f.tensor, f.message) for f in inspect_checkpoint(d).findings if f.severity == "error"]


def test_fp8_block_mtp_under_plain_nvfp4_is_vllm_54126(tmp_path: Path) -> None:
    """vLLM creates the MTP's Linears NVFP4 (ModelOptNvFp4Config) and the FP8 parts do not fit: the same error as
    for DeepSeek's `weight_scale_inv` names, whichever names the FP8 blocks go by."""
    for variant in ("mtp_fp8_modelopt_names", "mtp_wrong_scheme"):
        d = make(MODELOPT, variant, tmp_path / variant)
        errors = _errors(d)
        assert {c for c, _, _ in errors} == {"mtp_quant_differs"}, errors
        assert all("vllm#54126" in m and "creates as nvfp4" in m for _, _, m in errors), errors
    ckpt = Checkpoint(tmp_path / "mtp_fp8_modelopt_names")
    o_proj = "model.layers.10.self_attn.o_proj.weight"
    assert ckpt.packed[o_proj].codec == "modelopt_fp8" and ckpt.stored[o_proj + "_scale"].shape == (1, 1, 1, 1)


def test_fp8_block_mtp_declared_fp8_pb_wo_under_mixed_precision_is_clean(tmp_path: Path) -> None:
    """`quantized_layers` naming the MTP modules FP8_PB_WO: vLLM builds them block FP8 (Fp8MoEMethod for the experts,
    KFp8Block128 for the Linears), as stored; the trunk stays NVFP4. A scale of the wrong shape is then one finding."""
    d = make(MODELOPT, "mtp_fp8_modelopt_mixed", tmp_path / "mixed")
    assert not (errors := _errors(d)), errors
    hf = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    expert = "model.layers.11.mlp.experts.0.down_proj"
    assert hf["quant_algo"] == "MIXED_PRECISION" and hf["quantized_layers"][expert]["quant_algo"] == "FP8_PB_WO"
    assert Checkpoint(d).tensors[expert + ".weight"].dtype == "FP8"
    state = load_file(str(d / MTP_SHARD))
    scale = "model.layers.10.self_attn.o_proj.weight_scale"
    state[scale] = torch.ones(1, 2)
    save_file(state, str(d / MTP_SHARD), metadata={"format": "pt"})
    errors = _errors(d)
    assert [(c, t) for c, t, _ in errors] == [("quant_scale_shape", scale[: -len("_scale")])], errors
    assert "shape [1, 2]" in errors[0][2], errors


def test_a_mixed_precision_layer_declared_nvfp4_but_stored_fp8_is_an_error(tmp_path: Path) -> None:
    """MIXED_PRECISION is per layer: where `quantized_layers` says NVFP4 for an MTP module, vLLM builds that layer
    NVFP4 (modelopt.py:1813-1883), so FP8 blocks stored for it do not fit, whatever the other layers say."""
    d = make(MODELOPT, "mtp_fp8_modelopt_mixed", tmp_path / "mixed")
    relabelled = "model.layers.10.self_attn.o_proj"
    for file in ("hf_quant_config.json", "config.json"):
        cfg = json.loads((d / file).read_text())
        section = cfg["quantization"] if file == "hf_quant_config.json" else cfg.get("quantization_config", {})
        if relabelled in section.get("quantized_layers", {}):
            section["quantized_layers"][relabelled] = {"quant_algo": "NVFP4", "group_size": 16}
            (d / file).write_text(json.dumps(cfg))
    errors = _errors(d)
    assert [c for c, _, _ in errors] == ["mtp_quant_differs"], errors
    assert relabelled in errors[0][2] and "nvfp4" in errors[0][2], errors
