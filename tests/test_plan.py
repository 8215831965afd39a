"""`recycle plan` and its roofline: counts against transformers' own models, the model's limits, the
report's consistency on the trained fixture, and bad input (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recycle import roofline
from recycle.hardware import GPUS, gpu
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE, TRAINED

# DeepSeek-V3's published config (the numbers that set its size), FP8 weights.
DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, vocab_size=129280,
                   num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
                   moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                   first_k_dense_replace=3, n_group=8, quantization_config={"quant_method": "fp8"})


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_roofline_counts_every_parameter_transformers_builds(family):
    """The config-derived count equals the parameters (and router-bias buffers) of the loaded target."""
    from recycle.decoding import load_target

    path = TRAINED[family]
    cost = roofline.target_cost(json.loads((path / "config.json").read_text()))
    model = load_target(path)
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert cost.stored_params == n
    assert cost.moe_layers == model.config.num_hidden_layers - model.config.first_k_dense_replace


def test_roofline_deepseek_v3_size_and_regimes():
    cost = roofline.target_cost(DEEPSEEK_V3)
    assert 670e9 < cost.stored_params < 672e9  # "671B total"
    assert 37e9 < cost.active_params + 129280 * 7168 < 38e9  # "37B activated" (the embedding row included)
    assert cost.weight_bytes == 1.0 and cost.kv_bytes == (512 + 64) * 2
    h200 = gpu("H200")
    box = roofline.node(h200, roofline.gpus_needed(cost, h200))
    assert box.bandwidth_gbs == 6 * h200.bandwidth_gbs  # 671 GB of FP8 weights need six 141 GB cards
    # One token touches 8 of 256 experts; a batch of 128 tokens touches almost all of them.
    assert cost.experts_touched(1) == pytest.approx(8)
    assert cost.experts_touched(128) > 250
    assert cost.bound(box, 1, 1, 2048) == "memory"
    assert cost.bound(box, 512, 4, 2048) == "compute"
    mtp = roofline.target_cost(dict(DEEPSEEK_V3, num_hidden_layers=1, first_k_dense_replace=0))
    kw = dict(verify_tokens=3, passes=2, pass_tokens=1, context=2048)
    at = {b: roofline.speedup(2.5, cost, mtp, box, b, **kw) for b in roofline.BATCH_GRID}
    # MoE at batch 1: verifying 3 tokens reads ~3× the routed experts one token reads, so τ 2.5 buys
    # little; by batch 128 a single token already touches nearly every expert and the gain is τ-like.
    assert 1.0 < at[1] < 1.4 and at[128] > 2.0
    cross = roofline.crossover(2.5, cost, mtp, box, **kw)
    assert cross is not None and all(at[b] < 1.0 for b in at if b >= cross)
    assert at[roofline.BATCH_GRID[roofline.BATCH_GRID.index(cross) - 1]] >= 1.0
    # A longer chain stops paying at a smaller batch: it verifies more tokens per accepted one.
    deep = roofline.crossover(3.6, cost, mtp, box, verify_tokens=6, passes=5, pass_tokens=1, context=2048)
    assert deep is not None and deep < cross


def test_roofline_dense_target_keeps_tau_at_small_batches():
    llama70b = dict(hidden_size=8192, num_hidden_layers=80, vocab_size=128256, num_attention_heads=64,
                    num_key_value_heads=8, intermediate_size=28672)
    cost = roofline.target_cost(llama70b)
    layer = roofline.target_cost(dict(llama70b, num_hidden_layers=1))
    h100 = gpu("H100")
    assert roofline.gpus_needed(cost, h100) == 2  # 141 GB of bf16 weights
    box = roofline.node(h100, 2)
    kw = dict(verify_tokens=3, passes=2, pass_tokens=1, context=2048)
    assert 2.3 < roofline.speedup(2.5, cost, layer, box, 1, **kw) < 2.5  # memory-bound: close to τ
    # Compute-bound: rejected drafts cost their FLOPs. A chain of 5 (τ 3.6) verifies 6 tokens per step.
    deep = dict(verify_tokens=6, passes=5, pass_tokens=1, context=2048)
    assert roofline.speedup(3.6, cost, layer, box, 1, **deep) > 3.0
    assert roofline.speedup(3.6, cost, layer, box, 1024, **deep) < 1.0


def test_gpu_table_lookup_and_bench_bandwidth():
    assert {"H100", "H200", "A100", "L40S", "RTX4090"} <= {g.key for g in GPUS}
    assert gpu("h100").bandwidth_gbs == 3350.0 and all(g.source for g in GPUS)
    from recycle.errors import RecycleError

    with pytest.raises(RecycleError, match="known: H200"):
        gpu("TPUv5")


@pytest.fixture(scope="module")
def plan_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from recycle.converters.api import convert_checkpoint

    tmp = tmp_path_factory.mktemp("plan")
    convert_checkpoint(FIXTURE, "eagle", tmp / "eagle")
    prompts = tmp / "p.jsonl"
    prompts.write_text('{"set": "code", "prompt": "def add(a, b):\\n    return"}\n'
                       '{"set": "prose", "prompt": "The module reads configuration files and"}\n')
    png = tmp / "plan.png"
    res = run_cli("plan", str(tmp / "eagle"), "--target", str(FIXTURE), "--prompts", str(prompts), "--max-chain", "3",
                  "--max-new-tokens", "12", "--gpu", "H100,L40S", "--batch", "1,16", "--plot", str(png), "--json",
                  "--threads", "1")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), png


def test_plan_report_is_consistent(plan_report):
    data, png = plan_report
    assert set(data["sets"]) == {"code", "prose"}
    assert len(data["verify_s"]) == 32 and all(t > 0 for t in data["verify_s"])
    for st in data["sets"].values():
        rows = {r["shape"]: r for r in st["candidates"]}
        assert {"chain:1", "chain:2", "chain:3", "dynamic:3,2,6"} <= set(rows)
        taus = [rows[f"chain:{k}"]["tau"] for k in (1, 2, 3)]
        assert taus == sorted(taus) and 1.0 <= taus[0] <= 2.0
        # τ(chain:3) is derived from chain:3's own steps: it equals their mean accepted length
        assert rows["chain:3"]["measured_tau"] is not None
        for r in rows.values():
            assert r["predicted"] > 0 and r["cost"] == pytest.approx(r["c_draft"] + r["c_verify"])
        assert st["recommended"]["shape"] in rows and st["recommended"]["reason"]
        acc = st["acceptance_by_depth"]
        assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
    assert [g["gpu"] for g in data["roofline"]["gpus"]] == ["H100", "L40S"]
    for g in data["roofline"]["gpus"]:
        for st in g["sets"].values():
            assert set(st["best"]) == {"1", "16"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_rich_output_names_the_recommendation(tmp_path: Path):
    res = run_cli("plan", str(FIXTURE), "--target", str(FIXTURE), "--prompts", _one_prompt(tmp_path), "--max-chain", "2",
                  "--max-new-tokens", "6", "--gpu", "RTX4090", "--batch", "1", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert "recommended for user" in res.stdout and "RTX 4090" in res.stdout


def _one_prompt(tmp_path: Path) -> str:
    p = tmp_path / "one.jsonl"
    p.write_text('{"prompt": "import os\\nimport sys\\n"}\n')
    return str(p)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--gpu", "TPUv5"], "known: H200, H100-PCIe, H100"),
        (["--batch", "1,x"], "--batch"),
        (["--batch", "0"], "--batch"),
        (["--batch", ""], "--batch"),
        (["--model-config", "/nonexistent/config.json"], "--model-config"),
    ],
    ids=["unknown-gpu", "batch-syntax", "batch-zero", "batch-empty", "model-config"],
)
def test_plan_bad_options_exit_2(extra, needle, tmp_path: Path):
    res = run_cli("plan", "--native-mtp", "--target", str(FIXTURE), "--prompts", _one_prompt(tmp_path), *extra)
    assert_bad_input(res, needle)


def test_plan_drafter_that_does_not_fit_exits_2(tmp_path: Path):
    from recycle.converters.api import convert_checkpoint

    convert_checkpoint(FIXTURE, "eagle", tmp_path / "eagle")
    other = FIXTURE.parent / "meta_mtp_parallel"  # hidden 256 against the drafter's 128
    res = run_cli("plan", str(tmp_path / "eagle"), "--target", str(other), "--prompts", _one_prompt(tmp_path))
    assert_bad_input(res, "does not fit the target")


def test_jsonl_prompt_sets(tmp_path: Path):
    from recycle.prompts import read_jsonl

    p = tmp_path / "p.jsonl"
    p.write_text('{"set": "json", "prompt": "{"}\n{"prompt": "x"}\n')
    assert read_jsonl(p) == [("json", "{"), ("user", "x")]
    p.write_text('{"set": 3, "prompt": "x"}\n')
    from recycle.errors import RecycleError

    with pytest.raises(RecycleError, match='"set"'):
        read_jsonl(p)


@pytest.mark.parametrize("kind", ["native-mtp", "medusa", "parallel-heads"])
def test_plan_runs_for_every_drafter_kind(kind: str, tmp_path: Path):
    """Heads that draft in one pass and to a fixed depth (Medusa, Meta's parallel heads) and the native
    modules; a Meta-layout target's roofline reads the config transformers built it from."""
    target = FIXTURE.parent / "meta_mtp_parallel" if kind == "parallel-heads" else FIXTURE
    drafter = target
    if kind == "medusa":
        from recycle.converters.api import convert_checkpoint

        drafter = Path(convert_checkpoint(FIXTURE, "medusa", tmp_path / "medusa")["out"])
    res = run_cli("plan", str(drafter), "--target", str(target), "--prompts", _one_prompt(tmp_path), "--max-chain", "2",
                  "--max-new-tokens", "6", "--gpu", "H100", "--batch", "1", "--json", "--threads", "1")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["shape"]: r for r in data["sets"]["user"]["candidates"]}
    assert "chain:1" in rows and data["roofline"]["drafter"]["active_params"] > 0
    single = kind != "native-mtp"
    assert all(r["passes"] == 1 for r in rows.values()) == single
