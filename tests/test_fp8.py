"""FP8 in, FP8 out (issue 30): MTP modules stitched into a block-FP8 release in its own scheme, or kept BF16 with an
ignore entry; a distilled drafter from an FP8 source keeps its FP8 overlay; inspect finds the layouts that load
silently wrong; schemes recycle cannot write are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recycle.checkpoint import Checkpoint
from recycle.converters.api import convert_checkpoint
from recycle.quant import dequantize_fp8, engine_fp8, ignore_entries, quantize_fp8

from fixtures.fp8 import make_fp8
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

POST = FIXTURE.parent / "deepseek_v3_mtp_posttrained"


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory, converted) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    base = make_fp8(FIXTURE, root / "base-fp8")
    post = make_fp8(POST, root / "post-fp8")
    eagle = converted("eagle", layouts="overlay")
    eagle8 = converted("eagle", source=base, layouts="recycle,overlay")
    return {"root": root, "base": base, "post": post, "overlay": eagle / "mtp_overlay", "eagle8": eagle8}


def _stitch(fp8: dict, out: Path, *extra: str, overlay: Path | None = None) -> dict:
    res = run_cli("stitch", str(overlay or fp8["overlay"]), "--target", str(fp8["post"]), "-o", str(out), *extra,
                  "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_stitching_into_fp8_requantizes_in_the_targets_blocks(fp8, tmp_path: Path) -> None:
    rec = _stitch(fp8, tmp_path / "st")
    st, ov = Checkpoint(tmp_path / "st"), Checkpoint(fp8["overlay"])
    q = rec["quantization"]
    assert q["target"] == "fp8 block 128x128" and q["requantized"] > 0 and q["max_rel_error"] < 1 / 16
    for name, info in ov.tensors.items():
        if engine_fp8(name, info.shape):  # FP8 with a fresh scale: the overlay's values to FP8 rounding
            assert st.tensors[name].dtype == "F8_E4M3" and st.scale_for(name) is not None
            w = ov.get(name)
            ref = dequantize_fp8(*quantize_fp8(w, (128, 128)))
            assert torch.equal(st.get(name, torch.float32), ref)
            assert float((st.get(name, torch.float32) - w.float()).abs().max()) <= float(w.abs().max()) / 16
        elif not info.is_scale:
            assert st.tensors[name].dtype != "F8_E4M3"  # norms, router, eh_proj, copies: the target's float dtypes
    stale = [n for n, i in st.tensors.items() if i.is_scale and not st.tensors[n[: -len("_scale_inv")]].is_fp8]
    assert not stale and json.loads((tmp_path / "st" / "recycle-stitch.json").read_text())["quantization"]
    res = run_cli("inspect", str(tmp_path / "st"), "--strict", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.stdout[-800:]


def test_bf16_stitch_names_the_mtp_modules_in_the_ignore_list(fp8, tmp_path: Path) -> None:
    rec = _stitch(fp8, tmp_path / "st", "--mtp-dtype", "bf16")
    cfg = json.loads((tmp_path / "st" / "config.json").read_text())["quantization_config"]
    st = Checkpoint(tmp_path / "st")
    linears = [n for n, i in st.tensors.items() if n.startswith("model.layers.1") and engine_fp8(n, i.shape)
               and int(n.split(".")[2]) >= 10]
    assert linears and all(st.tensors[n].dtype == "BF16" for n in linears)
    assert cfg["ignored_layers"] == cfg["modules_to_not_convert"] == rec["quantization"]["ignored_added"]
    assert set(ignore_entries(linears)) <= set(cfg["ignored_layers"])
    assert "model.layers.10.mlp.experts" in cfg["ignored_layers"]
    findings = json.loads(run_cli("inspect", str(tmp_path / "st"), "--json").stdout)["findings"]
    assert [(f["severity"], f["code"]) for f in findings] == [("info", "mtp_quant_differs")]


def test_transformers_keeps_the_ignored_mtp_layer_bf16(fp8, tmp_path: Path) -> None:
    """transformers' own FP8 replacement, on a model whose layers include the MTP layer's index."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    _stitch(fp8, tmp_path / "st", "--mtp-dtype", "bf16")
    cfg = json.loads((tmp_path / "st" / "config.json").read_text())
    q = FineGrainedFP8Config.from_dict(cfg.pop("quantization_config"))
    config = AutoConfig.for_model(**{**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = replace_with_fp8_linear(model, modules_to_not_convert=q.modules_to_not_convert, quantization_config=q)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert kinds["model.layers.10.self_attn.q_a_proj"] == "Linear"
    assert kinds["model.layers.9.self_attn.q_a_proj"] != "Linear"  # the trunk stays FP8
    assert "FP8" not in kinds["model.layers.10.mlp.experts"] and "FP8" in kinds["model.layers.9.mlp.experts"]


def test_distill_keeps_an_fp8_overlay_and_stitch_takes_it_back(fp8, tmp_path: Path) -> None:
    out = tmp_path / "d"
    res = run_cli("distill", str(fp8["eagle8"]), "--target", str(fp8["post"]), "--tokens", "1k", "--seq-len", "48",
                  "--batch", "2", "--eval-every", "1000", "--threads", "1", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    before, after = Checkpoint(fp8["eagle8"] / "mtp_overlay"), Checkpoint(out / "mtp_overlay")
    assert {n: (i.dtype, i.shape) for n, i in before.tensors.items()} == \
        {n: (i.dtype, i.shape) for n, i in after.tensors.items()}
    rec = _stitch(fp8, tmp_path / "st", overlay=out / "mtp_overlay")
    assert rec["quantization"]["requantized"] == 0  # already in the target's blocks: stored bytes
    a, b = load_file(str(out / "mtp_overlay" / "mtp.safetensors")), Checkpoint(tmp_path / "st")
    name = "model.layers.10.self_attn.q_a_proj.weight"
    assert torch.equal(a[name].view(torch.uint8), b.raw(name).view(torch.uint8))


def test_convert_reexports_a_distilled_drafter_from_its_overlay(fp8, tmp_path: Path) -> None:
    """convert takes a distilled EAGLE drafter as its source (its FP8 mtp_overlay/, dequantized): the same modules
    come out, and other formats can be made from them."""
    from recycle.drafters import load_drafter

    out = tmp_path / "d"
    res = run_cli("distill", str(fp8["eagle8"]), "--target", str(fp8["post"]), "--tokens", "1k", "--seq-len", "48",
                  "--batch", "2", "--eval-every", "1", "--lr", "1e-2", "--threads", "1", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    again = convert_checkpoint(out, "eagle", tmp_path / "re", layouts="recycle")
    assert json.loads((tmp_path / "re" / "recycle.json").read_text())["source"]["path"] == str(out.resolve())
    trained, reexported = load_drafter(out).state_dict(), load_drafter(again["out"]).state_dict()
    overlay = Checkpoint(out / "mtp_overlay")
    for k, v in trained.items():  # block weights went through FP8 once more; the rest is exact
        tol = float(v.abs().max()) / 16 if ".block." in k and v.dim() == 2 and "gate.weight" not in k else 0.0
        assert float((v.float() - reexported[k].float()).abs().max()) <= tol + 1e-6, k
    assert overlay.tensors and convert_checkpoint(out, "medusa", tmp_path / "m")["format"] == "medusa"


def test_inspect_finds_the_broken_fp8_layouts(fp8, tmp_path: Path) -> None:
    def broken(name: str, edit) -> list[str]:
        d = tmp_path / name
        shutil.copytree(fp8["post"], d)
        state = load_file(str(d / "model.safetensors"))
        cfg = json.loads((d / "config.json").read_text())
        edit(state, cfg)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        res = run_cli("inspect", str(d), "--json", "--strict")
        assert res.exit_code == 1, res.output
        return [f["code"] for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"]

    w = "model.layers.10.self_attn.q_a_proj.weight"

    def unscaled(s, c):  # the old stitch: BF16 bytes where the engine builds FP8, the stale scale left behind
        s[w] = dequantize_fp8(s[w], s[w + "_scale_inv"]).to(torch.bfloat16)

    def orphan(s, c):
        unscaled(s, c)
        s.pop(w + "_scale_inv")
        s["model.layers.10.self_attn.o_proj.weight_scale_inv_x"] = torch.ones(1)
        s["model.layers.10.ghost.weight_scale_inv"] = torch.ones(1, 1)

    def bad_shape(s, c):
        s[w + "_scale_inv"] = torch.ones(3, 3)

    def no_config(s, c):
        c.pop("quantization_config")

    assert set(broken("unscaled", unscaled)) == {"fp8_unscaled_weight", "fp8_orphan_scale"}
    assert "fp8_orphan_scale" in broken("orphan", orphan)
    assert "fp8_scale_shape" in broken("shape", bad_shape)
    assert "mtp_quant_differs" in broken("noconfig", no_config)


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors", "modelopt_fp4", "mxfp4"])
def test_stitch_refuses_schemes_it_cannot_write(fp8, tmp_path: Path, method: str) -> None:
    d = tmp_path / "t"
    shutil.copytree(fp8["post"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "st"
    assert_bad_input(run_cli("stitch", str(fp8["overlay"]), "--target", str(d), "-o", str(out)), f"'{method}'")
    assert not out.exists()


def test_stitch_refuses_scales_out_of_the_declared_blocks(fp8, tmp_path: Path) -> None:
    d = tmp_path / "t"
    shutil.copytree(fp8["post"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]  # the stored scales are in 128×128 blocks
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "st"
    assert_bad_input(run_cli("stitch", str(fp8["overlay"]), "--target", str(d), "-o", str(out)), "blocks")
    assert not out.exists()
