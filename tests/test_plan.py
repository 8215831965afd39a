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
def plan_report(tmp_path_factory: pytest.TempPathFactory, converted) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("plan")
    prompts = tmp / "p.jsonl"
    prompts.write_text('{"set": "code", "prompt": "def add(a, b):\\n    return"}\n'
                       '{"set": "prose", "prompt": "The module reads configuration files and"}\n')
    png = tmp / "plan.png"
    res = run_cli("plan", str(converted("eagle")), "--target", str(FIXTURE), "--prompts", str(prompts), "--max-chain", "3",
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
        if st["verdict"] == "recommended":  # real timings: on a busy machine the plan may refuse to recommend
            assert st["recommended"]["shape"] in rows and st["recommended"]["reason"] and not st["noise"]
        else:
            assert st["verdict"] == "too noisy to recommend" and st["recommended"] is None and st["noise"]
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
    assert ("recommended for user" in res.stdout or "too noisy to recommend" in res.stdout) and "RTX 4090" in res.stdout


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


def test_plan_drafter_that_does_not_fit_exits_2(tmp_path: Path, converted):
    other = FIXTURE.parent / "meta_mtp_parallel"  # hidden 256 against the drafter's 128
    res = run_cli("plan", str(converted("eagle")), "--target", str(other), "--prompts", _one_prompt(tmp_path))
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
def test_plan_runs_for_every_drafter_kind(kind: str, tmp_path: Path, converted):
    """Heads that draft in one pass and to a fixed depth (Medusa, Meta's parallel heads) and the native
    modules; a Meta-layout target's roofline reads the config transformers built it from."""
    target = FIXTURE.parent / "meta_mtp_parallel" if kind == "parallel-heads" else FIXTURE
    drafter = target
    if kind == "medusa":
        drafter = converted("medusa")
    res = run_cli("plan", str(drafter), "--target", str(target), "--prompts", _one_prompt(tmp_path), "--max-chain", "2",
                  "--max-new-tokens", "6", "--gpu", "H100", "--batch", "1", "--json", "--threads", "1")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["shape"]: r for r in data["sets"]["user"]["candidates"]}
    assert "chain:1" in rows and data["roofline"]["drafter"]["active_params"] > 0
    single = kind != "native-mtp"
    assert all(r["passes"] == 1 for r in rows.values()) == single


# -- the plan checks its own timings (issue 45): repeated, medians, "too noisy to recommend" -----------------------

def _verify_cost(n: int) -> float:
    """A clean verification cost: 10 ms plus 0.5 ms a token."""
    return 0.010 + 0.0005 * n


def _fake_timings(monkeypatch, verify_noise: bool, decode_noise: bool) -> None:
    """Keep plan's real decoding (τ, accepted lengths, steps) but replace its two cost measurements: the
    verification curve and each decode run's timings, from a clean cost model (a drafter pass 1 ms, a step's
    verification `_verify_cost(nodes + 1)`, a 20 ms prefill per prompt) or from noise."""
    from recycle import plan

    def curve(ses, context, max_n, reps=plan.VERIFY_REPS):
        out = [[_verify_cost(n)] * reps for n in range(1, max_n + 1)]
        if verify_noise:  # the run: 16 tokens 3.66 s, 32 tokens 0.19 s
            out[15], out[31] = [3.66, 3.5, 3.8, 3.6, 3.7][:reps], [0.19] * reps
        return out

    real = plan._decode
    calls: dict[int, int] = {}

    def decode(ses, engine, prompts, opts):
        s = real(ses, engine, prompts, opts)
        info = plan._shape_info(engine)
        calls[id(engine)] = calls.get(id(engine), -1) + 1
        k = (1.0, 3.0, 0.4)[calls[id(engine)] % 3] if decode_noise else 1.0  # each candidate's repeats: 1×, 3×, 0.4×
        s["draft_s"] = k * s["steps"] * info["passes"] * 0.001
        s["verify_s"] = k * s["steps"] * _verify_cost(round(s["tree_nodes_per_step"]) + 1)
        s["prefill_s"] = k * s["prompts"] * 0.020
        s["seconds"] = s["draft_s"] + s["verify_s"] + s["prefill_s"]
        s["tokens_per_s"] = s["new_tokens"] / s["seconds"]
        s["round_s"] = (s["draft_s"] + s["verify_s"]) / s["steps"]
        s["draft_step_s"] = s["draft_s"] / s["steps"]
        return s

    monkeypatch.setattr(plan, "verify_curve", curve)
    monkeypatch.setattr(plan, "_decode", decode)


@pytest.mark.parametrize("noise", [None, "verify", "decode"], ids=["clean", "non-monotone-verify", "decode-spread"])
def test_plan_recommends_only_from_timings_that_hold(noise, monkeypatch, tmp_path: Path):
    _fake_timings(monkeypatch, noise == "verify", noise == "decode")
    args = ("plan", str(FIXTURE), "--target", str(FIXTURE), "--prompts", _one_prompt(tmp_path), "--max-chain", "2",
            "--max-new-tokens", "6", "--gpu", "H100", "--batch", "1", "--threads", "1")
    res = run_cli(*args, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    st = data["sets"]["user"]
    assert data["noise"]["repeats"] >= 3 and data["noise"]["verify_reps"] >= 3
    if noise is None:
        assert st["verdict"] == "recommended" and st["noise"] == [] and data["noise"]["findings"] == []
        best = max(st["candidates"], key=lambda r: r["predicted"])
        assert st["recommended"]["shape"] == best["shape"]
        for r in st["candidates"]:  # the clean costs in AR steps: verifying a chain of K over one token
            if r["shape"].startswith("chain:"):
                assert r["c_verify"] == pytest.approx(_verify_cost(r["verify_tokens"]) / _verify_cost(1))
    else:
        assert st["verdict"] == "too noisy to recommend" and st["recommended"] is None
        assert data["noise"]["verdict"] == "too noisy to recommend"
        why = " ".join(st["noise"])
        if noise == "verify":
            assert "verifying 17 tokens measured 18.5 ms, less than 16 tokens' 3660.0 ms" in why
        else:
            assert "spread" in why and "IQR" in why
    rich = run_cli(*args)
    assert rich.exit_code == 0, rich.output
    text = " ".join(rich.stdout.split())
    assert ("user: too noisy to recommend" in text) == (noise is not None)
    assert ("recommended for user:" in text) == (noise is None)


def test_noise_checks_on_their_own():
    from recycle import plan

    clean = [[_verify_cost(n)] * 5 for n in range(1, 33)]
    assert plan.curve_findings(clean, {2, 3, 7}) == []
    wobbly = [list(s) for s in clean]
    wobbly[2] = [0.01, 0.03, 0.012, 0.05, 0.011]  # n = 3: IQR 0.019 s around a 0.012 s median
    assert plan.curve_findings(wobbly, {2}) == []  # a size no candidate uses does not count
    (line,) = plan.curve_findings(wobbly, {3})
    assert line.startswith("verifying 3 tokens: its 5 timings spread")
    assert plan.spread([1.0, 1.0, 1.0]) == 0.0 and plan.spread([1.0]) == 0.0
    assert plan.spread([1.0, 2.0, 3.0]) == pytest.approx(0.5)


# -- the ETA of progress lines (issue 45: "about 0 s left" after the first item) -------------------------------

def test_eta_waits_for_a_finished_item_then_counts_the_mean():
    from recycle.report import eta_note

    assert eta_note(1, 13, (1, 100.0), 100.0) == ", estimating time left"  # the first count seen: no duration yet
    assert eta_note(3, 13, (1, 100.0), 118.0) == ", about 2 min left"  # 9 s an item since, 10 items left: 90 s
    assert eta_note(3, 13, (1, 100.0), 160.0) == ", about 5 min left"
    assert eta_note(2, 4, (0, 0.0), 30.0) == ", about 30 s left"  # counted from 0: the first item's time is known
    assert eta_note(13, 13, (1, 100.0), 500.0) == "" and eta_note(3, None, (0, 0.0), 9.0) == ""
    assert eta_note(2, 1000, (1, 0.0), 600.0) == ", about 6.9 days left"


def test_progress_lines_keep_one_count_across_labels(monkeypatch, capsys):
    """plan labels every step differently ("code: ar", "code: chain:1", …): one count, so the ETA after the
    second step is the first step's pace, not "0 s"."""
    import time

    from recycle.report import Reporter

    clock = iter([0.0, 10.0, 40.0, 70.0, 100.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    with Reporter("measuring") as bar:
        for i, label in enumerate(["verification cost", "code: ar", "code: chain:1", "code: chain:2"], 1):
            bar.update(i, 4, description=label, force=True, line=f"plan: {label} ({i}/4)")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["recycle: plan: verification cost (1/4) (10 s, estimating time left)",
                     "recycle: plan: code: ar (2/4) (40 s, about 60 s left)",
                     "recycle: plan: code: chain:1 (3/4) (70 s, about 30 s left)",
                     "recycle: plan: code: chain:2 (4/4) (100 s)"]
