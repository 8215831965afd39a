"""Issue 48 part 3: `stitch --mtp-dtype auto|bf16` writes re-aligned MTP modules back into every quantized build in
the form its engine loads: the target's own MTP storage where it has one (NVFP4 re-quantized through the codec,
FP8 blocks where the config declares them), else the scheme record's `writes` (BF16 named in the scheme's own ignore
key: compressed-tensors `ignore`, ModelOpt `exclude_modules` + config.json `ignore`, AWQ `modules_to_not_convert`,
GPTQ `dynamic`); everything checked with the scheme's own ignore rule, read back with `recycle.checkpoint` and
audited by `recycle inspect`. Refusals leave nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recycle.checkpoint import Checkpoint
from recycle.quant import CODECS, dequantize_fp8, engine_fp8, module_of, quantize_fp8
from recycle.quant.schemes import detect, engine_ignores, quant_config

from fixtures.quant_broken import QUANT, builds, make, record
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

ROOT = FIXTURE.parents[1]
POST = FIXTURE.parent / "deepseek_v3_mtp_posttrained"
NAME_KEYS = ("ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")
BOUND = {"NVFP4": 0.25, "MXFP4": 0.25, "F8_E4M3": 0.065, "FP8": 0.065, "INT4": 0.075}  # max |ŵ − w| / max|w| of its row (its block for FP8)
MTP_LAYERS = (10, 11)  # the DeepSeek fixture's MTP modules (num_hidden_layers 10, 2 modules)


@pytest.fixture(scope="module")
def overlays(converted) -> dict[str, Path]:
    """The stale base modules as overlays, per source family (each build's source without `_posttrained`)."""
    return {src: converted("eagle", source=ROOT / src, layouts="overlay") / "mtp_overlay"
            for src in ("fixtures/deepseek_v3_mtp", "fixtures/qwen3_5_mtp")}


def _overlay(overlays: dict, target: Path) -> Path:
    build = target if (target / "build.json").is_file() else QUANT / json.loads(
        (target / "broken.json").read_text())["build"]
    return overlays[record(build)["source"].removesuffix("_posttrained")]


def _stitch(overlay: Path, target: Path, out: Path, mode: str) -> dict:
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in target.iterdir())
    res = run_cli("stitch", str(overlay), "--target", str(target), "-o", str(out), "--mtp-dtype", mode, "--json")
    assert res.exit_code == 0, res.output
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in target.iterdir()) == before
    return json.loads(res.stdout)


def _views(d: Path) -> list[dict]:
    """Every quantization config an engine may read from `d`: config.json's, and ModelOpt's file."""
    hf = d / "hf_quant_config.json"
    out = [quant_config(json.loads((d / "config.json").read_text()))]
    return [v for v in out if v] + ([json.loads(hf.read_text())] if hf.is_file() else [])


def _lists(views: list[dict]) -> dict[str, list]:
    out = {}
    for i, v in enumerate(views):
        sec = v.get("quantization") if isinstance(v.get("quantization"), dict) else v
        out.update({f"{i}:{k}": sec[k] for k in NAME_KEYS if isinstance(sec.get(k), list)})
    return out


def _audit_errors(out: Path) -> list[dict]:
    res = run_cli("inspect", str(out), "--json")
    assert res.exit_code in (0, 1), res.output
    return [f for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"]


def _check(target: Path, overlay: Path, out: Path, summary: dict, audit: bool = True) -> Checkpoint:
    """The stitched output, read back: inspect finds no error (`audit`); every MTP Linear written BF16 is ignored
    by the scheme's own rule under every config an engine reads, every one written quantized is not; ignore lists
    are sorted, without duplicates, with the target's entries kept; values are the overlay's (exact where BF16,
    within the storage's error where quantized, and the recorded error is the one read back)."""
    if audit:
        assert not (errors := _audit_errors(out)), errors
    st, ov = Checkpoint(out), Checkpoint(overlay)
    rec = detect(st.config, out)
    views = _views(out)
    old, new = _lists(_views(target)), _lists(views)
    for key, entries in new.items():  # a list stitch wrote to is sorted and whole; one it did not is as it was
        assert entries in (old.get(key), sorted(set(entries))), key
        assert set(old.get(key, [])) <= set(entries), key
    tensors = summary["quantization"]["tensors"]
    for n, r in tensors.items():
        if r["how"].startswith("the target's"):
            continue
        info = st.tensors[n]
        want = ov.get(n, torch.float32)
        blocks = info.is_fp8 or (n in st.packed and st.packed[n].codec == "modelopt_fp8")  # ModelOpt's, folded
        scale = next((f"{module_of(n)}.{s}" for s in ("weight_scale_inv", "scale", "weight_scale")
                      if blocks and f"{module_of(n)}.{s}" in st.stored), None)
        if scale is not None:  # block FP8 by either name (ModelOpt's FP8_PB_WO `weight_scale` is [ob, 1, ib, 1] or 2-D)
            s_ = st.raw(scale)
            got = dequantize_fp8(st.raw(n), s_.reshape(s_.shape[0], -1), (128, 128), torch.float32)
        else:
            got = st.get(n, torch.float32)
        if engine_fp8(n, tuple(info.shape)):  # a Linear of attention or MLP: the engine builds it per the rule
            ignored = [engine_ignores(rec, module_of(n), v) for v in views]
            assert ignored == [not info.quantized] * len(views), (n, info.dtype, ignored)
        if not info.quantized:
            assert torch.equal(got, want.to(st.get(n).dtype).float()), n
            continue
        if scale is None:  # a codec's record: relative to the largest |w| of the row
            amax = want.abs().amax(-1, keepdim=True)
        else:  # block FP8's: of the 128×128 block
            m, k = want.shape
            pad = torch.zeros(-(-m // 128) * 128, -(-k // 128) * 128)
            pad[:m, :k] = want.abs()
            blocks = pad.view(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128).amax(dim=(1, 3))
            amax = blocks.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :k]
        err = float(((got - want).abs() / amax.clamp(min=1e-12)).max())
        assert err < BOUND[info.dtype] and abs(err - r["max_rel_error"]) < 1e-4, (n, err, r)
    return st


@pytest.mark.parametrize("mode", ["auto", "bf16"])
@pytest.mark.parametrize("build", builds())
def test_stitch_into_each_tool_made_build(build: str, mode: str, overlays, tmp_path: Path) -> None:
    """llm-compressor's and ModelOpt's builds (their MTP dropped, or kept BF16 under `re:^mtp.*`): the stale base
    modules go back BF16, named in the scheme's own ignore key where the engine would quantize them."""
    target = QUANT / build
    overlay = _overlay(overlays, target)
    summary = _stitch(overlay, target, tmp_path / "st", mode)
    st = _check(target, overlay, tmp_path / "st", summary)
    q = summary["quantization"]
    assert q["scheme"] == detect(st.config, target).name and q["requantized"] == 0
    mtp = [n for n in st.tensors if n.startswith(("mtp.", "model.layers.10.", "model.layers.11."))]
    assert mtp and not any(st.tensors[n].quantized for n in mtp)
    if (target / "hf_quant_config.json").is_file():  # ModelOpt: both files carry the same entries
        assert set(q["ignore_keys"]) == {"config.json: ignore", "hf_quant_config.json: exclude_modules"}
        assert "model.layers.10.self_attn.q_a_proj" in q["ignored_added"]
    elif build.startswith("ds_v3"):
        assert set(q["ignore_keys"]) == {"config.json: ignore"}
        assert "model.layers.11.mlp.experts.0.gate_proj" in q["ignored_added"]  # CT decides experts by expert 0
    else:  # Qwen3.5 through llm-compressor: `re:^mtp.*` already keeps the whole MTP out, nothing to add
        assert q["ignored_added"] == []


@pytest.mark.parametrize("variant", ["mtp_bf16_no_ignore", "mtp_bf16_ignored", "mtp_wrong_scheme"])
def test_stitch_into_the_broken_copies(variant: str, overlays, tmp_path: Path) -> None:
    """The trackers' broken layouts of the NVFP4 build come out loadable: BF16 without an entry gets one; the
    scheme's own `re:` entry is kept and nothing added; FP8-block MTP the config does not declare (vllm#54126)
    is not copied in that form but written BF16 with an entry, since the engine would build it NVFP4."""
    target = make("ds_v3_nvfp4a16_llmc", variant, tmp_path / "t")
    summary = _stitch(_overlay(overlays, target), target, tmp_path / "st", "auto")
    _check(target, _overlay(overlays, target), tmp_path / "st", summary)
    q = summary["quantization"]
    assert (q["ignored_added"] == []) == (variant == "mtp_bf16_ignored")
    how = q["tensors"]["model.layers.10.self_attn.q_a_proj.weight"]["how"]
    assert ("does not declare" in how) == (variant == "mtp_wrong_scheme"), how


def _modelopt(tmp_path: Path, stale: str) -> Path:
    """ModelOpt's NVFP4 build with a stale MTP layer 10 put back: `nvfp4` (its attention through
    the codec, with the trunk's input_scale, as ModelOpt stores W4A4) or `fp8` (attention as ModelOpt FP8_PB_WO:
    e4m3 + a 128×128 `weight_scale`, declared per layer under MIXED_PRECISION, the Qwen3.8 NVFP4 release's form);
    its MLP and layer 11 stay BF16 with no entry (the broken part)."""
    d = tmp_path / f"modelopt-{stale}"
    shutil.copytree(QUANT / "ds_v3_nvfp4_modelopt", d)
    state = load_file(str(d / "model.safetensors"))
    source = load_file(str(POST / "model.safetensors"))
    layers = {}
    for n, t in source.items():
        if not n.startswith(("model.layers.10.", "model.layers.11.")):
            continue
        module = module_of(n)
        ours = n.startswith("model.layers.10.self_attn.") and engine_fp8(n, tuple(t.shape))
        if ours and stale == "nvfp4":
            state.update(CODECS.get("nvfp4").quantize(t.float(), n, {}))
            state[module + ".input_scale"] = state[module.replace("layers.10", "layers.9") + ".input_scale"].clone()
        elif ours and ".self_attn." in n and t.shape[1] % 128 == 0:
            state[n], scale = quantize_fp8(t, (128, 128))
            state[module + ".weight_scale"] = scale
            layers[module] = {"quant_algo": "FP8_PB_WO", "group_size": 128}
        else:
            state[n] = t
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    if layers:  # every NVFP4 trunk module per layer, the FP8 ones beside them
        nv = {module_of(n): {"quant_algo": "NVFP4", "group_size": 16} for n in state if n.endswith(".weight_scale_2")}
        for path, key in ((d / "hf_quant_config.json", "quantization"), (d / "config.json", "quantization_config")):
            cfg = json.loads(path.read_text())
            cfg[key].update(quant_algo="MIXED_PRECISION", quantized_layers={**nv, **layers})
            path.write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def stale_modelopt(overlays, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """stale → (target, overlay, its auto stitch's summary), made once for the tests that read them."""
    out = {}
    for stale in ("nvfp4", "fp8"):
        root = tmp_path_factory.mktemp(f"modelopt-{stale}")
        target, overlay = _modelopt(root, stale), _overlay(overlays, QUANT / "ds_v3_nvfp4_modelopt")
        out[stale] = (target, overlay, _stitch(overlay, target, root / "st", "auto"))
    return out


@pytest.mark.parametrize("stale", ["nvfp4", "fp8"])
def test_auto_keeps_the_storage_the_target_used_for_its_mtp(stale: str, stale_modelopt, tmp_path: Path) -> None:
    target, overlay, summary = stale_modelopt[stale]
    st = _check(target, overlay, Path(summary["out"]), summary, audit=stale == "nvfp4")  # fp8: see the test below
    q_a = "model.layers.10.self_attn.q_a_proj"
    want = {"nvfp4": "NVFP4", "fp8": "FP8"}[stale]  # ModelOpt's FP8 is read through its codec (modelopt_fp8)
    assert st.tensors[q_a + ".weight"].dtype == want and summary["quantization"]["requantized"] > 0
    if stale == "nvfp4":  # the activations' calibration is the target's: a weight gives none
        assert torch.equal(st.raw(q_a + ".input_scale"), Checkpoint(target).raw(q_a + ".input_scale"))
    else:
        assert st.stored[q_a + ".weight_scale"].shape == (1, 1) and q_a + ".weight_scale_inv" not in st.stored
    assert st.tensors["model.layers.10.mlp.experts.0.up_proj.weight"].dtype == "BF16"
    # NVFP4: the BF16 experts get entries; MIXED_PRECISION builds a Linear it has no entry for unquantized
    assert ("model.layers.10.mlp.experts.0.up_proj" in summary["quantization"]["ignored_added"]) == (stale == "nvfp4")
    assert q_a not in summary["quantization"]["ignored_added"]
    bf16 = _stitch(overlay, target, tmp_path / "bf16", "bf16")
    assert bf16["quantization"]["requantized"] == 0 and q_a in bf16["quantization"]["ignored_added"]
    _check(target, overlay, tmp_path / "bf16", bf16)


def test_inspect_reads_the_modelopt_block_fp8_mtp_stitch_writes(stale_modelopt) -> None:
    assert not (errors := _audit_errors(Path(stale_modelopt["fp8"][2]["out"]))), errors


@pytest.mark.slow  # compressed-tensors' import alone takes ~4 s here
def test_auto_requantizes_a_compressed_tensors_mtp_through_its_compressor(overlays, tmp_path: Path) -> None:
    """llm-compressor's W4A16 build with a stale MTP attention kept quantized (pack-quantized, made by
    compressed-tensors' own compressor through the `ct_pack` codec): auto writes the re-aligned attention the same
    way, error recorded; the rest of the MTP goes BF16 with `ignore` entries."""
    target = tmp_path / "t"
    shutil.copytree(QUANT / "ds_v3_w4a16_llmc", target)
    q = json.loads((target / "config.json").read_text())["quantization_config"]
    state = load_file(str(target / "model.safetensors"))
    for n, t in load_file(str(POST / "model.safetensors")).items():
        if n.startswith("model.layers.10.self_attn.") and engine_fp8(n, tuple(t.shape)):
            state.update(CODECS.get("ct_pack").quantize(t, n, q))
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    overlay = _overlay(overlays, QUANT / "ds_v3_w4a16_llmc")
    summary = _stitch(overlay, target, tmp_path / "st", "auto")
    st = _check(target, overlay, tmp_path / "st", summary)
    q_a = "model.layers.10.self_attn.q_a_proj.weight"
    assert st.packed[q_a].codec == "ct_pack" and summary["quantization"]["requantized"] == 5
    assert "model.layers.10.self_attn.q_a_proj" not in summary["quantization"]["ignored_added"]
    assert "model.layers.10.mlp.experts.0.gate_proj" in summary["quantization"]["ignored_added"]


@pytest.mark.slow  # ~60 FP4/FP8 quantizations: 0.2-1 s, kept out of the default suite's budget
def test_deepseek_v4_layout_gets_mxfp4_experts_and_power_of_two_fp8(overlays, tmp_path: Path) -> None:
    """DeepSeek-V4's storage (routed experts MXFP4 through `mxfp4_native`, I8 pairs + e8m0 `.scale`; the other
    Linears block FP8 with `scale_fmt: ue8m0`), here on the post-trained fixture's last trunk layer: auto writes
    the MTP the same way, its FP8 scales powers of two (vLLM builds them e8m0: fp8.py `is_scale_e8m0`)."""
    target = tmp_path / "v4"
    target.mkdir()
    for p in POST.iterdir():
        if p.suffix != ".safetensors" and p.is_file():
            shutil.copy(p, target / p.name)
    state = {}
    for n, t in load_file(str(POST / "model.safetensors")).items():
        if n.startswith(("model.layers.10.", "model.layers.11.")):
            continue
        if n.startswith("model.layers.9.") and ".experts." in n and engine_fp8(n, tuple(t.shape)):
            state.update(CODECS.get("mxfp4_native").quantize(t.float(), n, {}))
        elif n.startswith("model.layers.9.") and engine_fp8(n, tuple(t.shape)):
            state[n], state[n + "_scale_inv"] = quantize_fp8(t, (128, 128))
        else:
            state[n] = t
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "deepseek_v4_fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(cfg))
    overlay = overlays["fixtures/deepseek_v3_mtp"]
    summary = _stitch(overlay, target, tmp_path / "st", "auto")
    st = _check(target, overlay, tmp_path / "st", summary, audit=False)  # inspect reads no V4 config yet
    assert st.packed["model.layers.11.mlp.experts.5.down_proj.weight"].codec == "mxfp4_native"
    scale = st.raw("model.layers.11.self_attn.kv_b_proj.weight_scale_inv")
    assert st.tensors["model.layers.11.self_attn.kv_b_proj.weight"].dtype == "F8_E4M3"
    assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale)))) and summary["quantization"]["ignored_added"] == []


def _int_target(tmp_path: Path, method: str) -> Path:
    """The post-trained fixture with every trunk attention Linear stored as AWQ (GEMM) or GPTQ parts (codes
    random: only the layout matters to stitch), its MTP dropped, as AutoAWQ/GPTQModel save it."""
    d = tmp_path / method
    d.mkdir()
    for p in POST.iterdir():
        if p.suffix != ".safetensors" and p.is_file():
            shutil.copy(p, d / p.name)
    gen = torch.Generator().manual_seed(0)
    state, group = {}, 64
    for n, t in load_file(str(POST / "model.safetensors")).items():
        layer = int(n.split(".")[2]) if n.startswith("model.layers.") else -1
        if layer in MTP_LAYERS:
            continue
        if not (layer >= 1 and ".self_attn." in n and engine_fp8(n, tuple(t.shape))):
            state[n] = t
            continue
        out, inp = t.shape
        base = module_of(n)

        def words(*shape):
            return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, generator=gen)

        state[base + ".scales"] = torch.rand(inp // group, out, generator=gen).half() / 64
        if method == "awq":
            state[base + ".qweight"], state[base + ".qzeros"] = words(inp, out // 8), words(inp // group, out // 8)
        else:
            state[base + ".qweight"] = words(inp // 8, out)
            state[base + ".qzeros"] = torch.full((inp // group, out // 8), 0x77777777, dtype=torch.int32)
            state[base + ".g_idx"] = torch.arange(inp, dtype=torch.int32) // group
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                   "version": "gemm", "modules_to_not_convert": None} if method == "awq" else
                                  {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                   "desc_act": False, "checkpoint_format": "gptq"})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_name_the_mtp_in_their_own_keys(method: str, overlays, tmp_path: Path) -> None:
    """AWQ matches `modules_to_not_convert` by substring, so routed experts need their container (vLLM decides
    them by `...mlp.experts`); an empty list, which vLLM fills from the stored dtypes, gets the trunk's own BF16
    Linears so they stay BF16. GPTQ gets anchored `-:` regexes first in `dynamic`, per vLLM layer (fused names)."""
    target = _int_target(tmp_path, method)
    overlay = overlays["fixtures/deepseek_v3_mtp"]
    summary = _stitch(overlay, target, tmp_path / "st", "auto")
    rec = detect(json.loads((target / "config.json").read_text()))
    q = json.loads((tmp_path / "st" / "config.json").read_text())["quantization_config"]
    trunk_awq = [module_of(n) for n in Checkpoint(target).packed]
    assert trunk_awq and not any(engine_ignores(rec, m, q) for m in trunk_awq)  # the trunk stays quantized
    assert all(engine_ignores(rec, f"model.layers.{i}.{m}", q) for i in MTP_LAYERS
               for m in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "mlp.experts.3.down_proj",
                         "mlp.shared_experts.up_proj"))
    if method == "awq":
        assert "model.layers.10.mlp.experts" in q["modules_to_not_convert"]
        assert "model.layers.1.mlp.shared_experts.gate_proj" in q["modules_to_not_convert"]  # BF16 in the trunk
    else:
        keys = list(q["dynamic"])
        assert all(k.startswith("-:") and k.endswith("$") for k in keys)
        assert r"-:model\.layers\.10\.self_attn\.fused_qkv_a_proj$" in keys
    _check(target, overlay, tmp_path / "st", summary)


@pytest.mark.parametrize(("method", "mode", "needle"), [
    ("foo", "auto", "'foo'"), ("bitsandbytes", "bf16", "'bitsandbytes'"), ("fp8", "auto", "--mtp-dtype bf16")])
def test_refuses_what_no_engine_would_load(method: str, mode: str, needle: str, overlays, tmp_path: Path) -> None:
    """An unknown scheme, one recycle names but reads nothing of, and (auto) one whose record writes nothing
    (per-tensor FP8): one line, exit 2, nothing written; the last names the option that works."""
    d = tmp_path / "t"
    shutil.copytree(POST, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "st"
    res = run_cli("stitch", str(overlays["fixtures/deepseek_v3_mtp"]), "--target", str(d), "-o", str(out),
                  "--mtp-dtype", mode)
    assert_bad_input(res, needle)
    assert not out.exists()
    if method == "fp8":  # bf16 works: both FP8 keys name the MTP, exactly
        summary = _stitch(overlays["fixtures/deepseek_v3_mtp"], d, out, "bf16")
        q = json.loads((out / "config.json").read_text())["quantization_config"]
        assert q["ignored_layers"] == q["modules_to_not_convert"] == summary["quantization"]["ignored_added"]
        assert "model.layers.11.self_attn.q_b_proj" in q["ignored_layers"]


def test_refuses_a_corrupt_packed_target_and_bf16_experts_under_mxfp4(overlays, tmp_path: Path) -> None:
    """A packed target tensor whose scale does not fit its codes is one line before anything is written; and
    gpt-oss's MXFP4 has no key vLLM reads to keep routed experts BF16 (mxfp4.py), so --mtp-dtype bf16 is refused
    by the scheme's own rule rather than written."""
    overlay = overlays["fixtures/deepseek_v3_mtp"]
    d = tmp_path / "corrupt"
    shutil.copytree(QUANT / "ds_v3_nvfp4_modelopt", d)
    state = load_file(str(d / "model.safetensors"))
    name = "model.layers.9.self_attn.q_a_proj.weight_scale"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    res = run_cli("stitch", str(overlay), "--target", str(d), "-o", str(tmp_path / "a"))
    assert_bad_input(res, "model.layers.9.self_attn.q_a_proj")
    assert not (tmp_path / "a").exists()

    d = tmp_path / "mx"
    shutil.copytree(POST, d)
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.1.mlp.experts.gate_up_proj_blocks"] = torch.full((8, 128, 4, 16), 0x22, dtype=torch.uint8)
    state["model.layers.1.mlp.experts.gate_up_proj_scales"] = torch.full((8, 128, 4), 120, dtype=torch.uint8)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (d / "config.json").write_text(json.dumps(cfg))
    res = run_cli("stitch", str(overlay), "--target", str(d), "-o", str(tmp_path / "b"), "--mtp-dtype", "bf16")
    assert_bad_input(res, "mlp.experts")
    assert not (tmp_path / "b").exists()
