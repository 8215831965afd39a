"""`recycle bench`: the JSON report's schema and consistency, prompt sets, and bad inputs (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from recycle.cli import app
from recycle.prompts import code_prompts, default_prompts, text_prompts

from tests.trained import FIXTURE

runner = CliRunner()


@pytest.fixture(scope="module")
def eagle_dir(converted) -> Path:
    return converted("eagle")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text('{"prompt": "def add(a, b):\\n    return"}\n\n{"prompt": "import os\\nimport sys\\n"}\n')
    return p


def test_default_prompts_are_deterministic_and_held_out():
    from recycle.corpus import documents

    a, b = default_prompts(), default_prompts()
    assert a == b
    assert len(code_prompts()) == 12 and len(text_prompts()) == 6
    held = "\n".join(d.text for d in documents("heldout"))
    assert all(p in held for kind, p in a if kind == "code")  # cut from held-out files only


def test_bench_json_schema(eagle_dir: Path, prompts_file: Path):
    res = runner.invoke(app, ["bench", str(eagle_dir), "--target", str(FIXTURE), "--prompts", str(prompts_file),
                              "--max-new-tokens", "8", "--tree", "chain:2", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    for key in ("target", "drafter", "drafter_kind", "tree", "device", "dtype", "threads", "temperature",
                "max_new_tokens", "prompts", "overall", "bandwidth", "hf"):
        assert key in data
    assert data["drafter_kind"] == "eagle" and data["tree"] == "eagle chain:2" and data["device"] == "cpu"
    assert data["bandwidth"] is None and data["hf"] is None
    o = data["overall"]
    assert o["greedy_match"] == "2/2"
    sp, ar = o["spec"], o["ar"]
    assert ar["tau"] == 1.0 and ar["target_forwards"] == ar["new_tokens"]  # AR: one forward per token
    assert sp["tau"] == pytest.approx((sp["new_tokens"] - len(data["prompts"])) / sp["steps"])
    assert sp["target_forwards"] == sp["steps"] + len(data["prompts"])
    assert len(sp["acceptance"]) <= 2 and all(0 <= a <= 1 for a in sp["acceptance"])
    assert o["speedup"] == pytest.approx(sp["tokens_per_s"] / ar["tokens_per_s"])
    assert set(o["predicted"]) == {"tau", "c_draft", "c_verify", "speedup"}
    for row in data["prompts"]:
        assert row["greedy_match"] is True and row["set"] == "user"
        assert row["spec"]["new_tokens"] <= 8


def test_bench_native_mtp_rich_table(prompts_file: Path):
    """DRAFTER_DIR = the target directory: its own MTP modules draft (the baseline recycling must beat)."""
    res = runner.invoke(app, ["bench", str(FIXTURE), "--target", str(FIXTURE), "--max-new-tokens", "6",
                              "--threads", "1", "--prompts", str(prompts_file)])
    assert res.exit_code == 0, res.output
    assert "native-mtp" in res.stdout and "cost model" in res.stdout


def test_bench_rejects_a_non_jsonl_prompts_file():
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--prompts", str(FIXTURE / "config.json")])
    assert res.exit_code == 2 and res.stderr.startswith("recycle: error:")


@pytest.mark.parametrize(
    "args",
    [
        ["/nonexistent/drafter", "--target", str(FIXTURE)],
        ["--target", str(FIXTURE)],  # neither a drafter nor --native-mtp
        ["--native-mtp", "--target", "/nonexistent/target"],
        ["--native-mtp", "--target", str(FIXTURE), "--tree", "chain:x"],
        ["--native-mtp", "--target", str(FIXTURE), "--tree", "[[0, 0]]"],
        ["--native-mtp", "--target", str(FIXTURE), "--tree", "dynamic:x"],
        ["--native-mtp", "--target", str(FIXTURE), "--temperature", "-1"],
        ["--native-mtp", "--target", str(FIXTURE), "--max-new-tokens", "0"],
        ["--native-mtp", "--target", str(FIXTURE), "--device", "tpu"],
        ["--native-mtp", "--target", str(FIXTURE), "--prompts", "/nonexistent.jsonl"],
    ],
    ids=["missing-drafter", "no-drafter", "missing-target", "chain-syntax", "tree-no-parent", "tree-syntax",
         "temperature", "max-new-tokens", "device", "prompts-file"],
)
def test_bench_bad_inputs_exit_2_with_one_line(args):
    res = runner.invoke(app, ["bench", *args, "--threads", "1"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("recycle: error:"), res.stderr


def test_bench_cuda_without_cuda_is_a_user_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--device", "cuda"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1


# -- spread, notes, --save, and a drafter given as the target -------------------------------------------------


def _stats(tokens: int, steps: int, step_s: float, tau_tokens: int | None = None, draft_s: float = 0.0):
    """A DecodeStats of `steps` target steps of `step_s` each after a 0.1 s prefill."""
    from recycle.decoding import DecodeStats

    new = tau_tokens if tau_tokens is not None else tokens
    return DecodeStats(new_tokens=new, forwards=steps + 1, steps=steps, prefill_s=0.1, draft_s=draft_s,
                       verify_s=steps * step_s, total_s=0.1 + draft_s + steps * step_s)


def test_spread_flags_a_loaded_machine_and_explains_a_losing_good_tau():
    """AR speed 3× apart across prompts: one note that speedups are noise. τ 2 with each round costing more than
    2 AR steps: one note that names the per-round costs from the cost model."""
    from recycle.bench import noise_notes, predicted_speedup, spread, summarize
    from recycle.bench_result import Overall

    ar = [_stats(17, 16, 0.01), _stats(17, 16, 0.03)]  # the second prompt's AR steps took 3× as long
    sp = [_stats(17, 8, 0.012, draft_s=0.1), _stats(17, 8, 0.036, draft_s=0.3)]  # τ = 16/8 = 2
    sp_sum, ar_sum = summarize(sp), summarize(ar)
    overall = Overall(ar=ar_sum, spec=sp_sum, speedup=sp_sum.tokens_per_s / ar_sum.tokens_per_s,
                      predicted=predicted_speedup(sp_sum, ar_sum), greedy_match=None,
                      spread=spread(ar, sp, [[(a, b)] for a, b in zip(ar, sp)]))
    assert overall.spread.loaded and overall.spread.repeats is None
    assert overall.spread.prompts.ar_decode_steps_per_s.ratio == pytest.approx(3.0)
    q = overall.spread.prompts.speedup
    assert q.min <= q.q1 <= q.median <= q.q3 <= q.max
    assert sp_sum.tau == 2.0 and overall.speedup < 1
    notes = noise_notes(overall)
    assert len(notes) == 2 and all("\n" not in n for n in notes)
    assert "noise" in notes[0] and "3.0×" in notes[0]
    assert "τ is 2.00" in notes[1] and "AR steps" in notes[1] and "drafting" in notes[1]


def test_a_quiet_run_has_no_notes():
    from recycle.bench import noise_notes, spread

    ar = [_stats(9, 8, 0.01), _stats(9, 8, 0.011)]
    sp = [_stats(9, 3, 0.012), _stats(9, 3, 0.012)]
    s = spread(ar, sp, [[(ar[0], sp[0]), (ar[0], sp[0])], [(ar[1], sp[1]), (ar[1], sp[1])]])
    assert not s.loaded and s.repeats.n == 2
    overall = _overall(s, tau=2.67, speedup=1.8, predicted=(0.2, 1.2, 1.9))
    assert noise_notes(overall) == []


def test_bench_json_has_spreads_per_prompt_and_over_repeats(eagle_dir: Path, prompts_file: Path):
    res = runner.invoke(app, ["bench", str(eagle_dir), "--target", str(FIXTURE), "--prompts", str(prompts_file),
                              "--max-new-tokens", "6", "--tree", "chain:2", "--threads", "1", "--repeats", "2",
                              "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    spread = data["overall"]["spread"]
    assert set(spread) == {"prompts", "repeats", "loaded"} and isinstance(spread["loaded"], bool)
    assert set(spread["prompts"]["speedup"]) == {"min", "q1", "median", "q3", "max"}
    assert spread["repeats"]["n"] == 2 and set(spread["repeats"]) == {"n", "speedup", "ar_tokens_per_s",
                                                                      "spec_tokens_per_s"}
    for row in data["prompts"]:
        assert len(row["repeats"]["ar_tokens_per_s"]) == 2 and row["speedup"] > 0
        assert row["ar"]["tokens_per_s"] == pytest.approx(max(row["repeats"]["ar_tokens_per_s"]))  # the fastest kept
    assert isinstance(data["notes"], list) and data["saved"] is None


def test_bench_save_writes_bench_json_into_the_drafter(eagle_dir: Path, prompts_file: Path, tmp_path: Path):
    import shutil

    from recycle.hub import validate_drafter

    d = tmp_path / "eagle"
    shutil.copytree(eagle_dir, d)
    res = runner.invoke(app, ["bench", str(d), "--target", str(FIXTURE), "--prompts", str(prompts_file),
                              "--max-new-tokens", "6", "--tree", "chain:2", "--threads", "1", "--save", "--json"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    saved = json.loads((d / "bench.json").read_text())
    assert shown["saved"] == str((d / "bench.json").resolve()) and "saved" not in saved  # no local path goes up
    assert saved == {k: v for k, v in shown.items() if k != "saved"}
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []  # no temp file left
    assert validate_drafter(d).bench.overall.spec.tau == shown["overall"]["spec"]["tau"]  # push reads it
    from recycle.bench_result import BenchResult

    assert BenchResult.from_json(shown).to_json() == shown  # to_json → from_json → to_json: the same report
    assert validate_drafter(d).bench == BenchResult.from_json(shown | {"saved": None})


REPORT = Path(__file__).parent / "data" / "bench_report.json"  # `recycle bench --native-mtp --target FIXTURE
# --max-new-tokens 4 --tree chain:2 --repeats 2 --compare-hf --json` (two prompts), from before bench was typed


def test_a_saved_report_reads_back_byte_for_byte():
    """A report as bench printed it before its result was typed reads into the typed result and writes back the
    same bytes: every key, its order and every float as it was; bench.json is the same less `saved`."""
    from recycle.bench_result import Bandwidth, BenchResult

    text = REPORT.read_text(encoding="utf-8")
    r = BenchResult.from_json(json.loads(text))
    assert json.dumps(r.to_json(), indent=2) + "\n" == text
    assert r.file_json() == {k: v for k, v in json.loads(text).items() if k != "saved"}
    assert r.overall.spec.tau == json.loads(text)["overall"]["spec"]["tau"] and r.drafter is None
    assert r.overall.spread.repeats.n == 2 and [p.method for p in r.hf] == ["hf greedy", "hf use_mtp",
                                                                         "hf prompt lookup"]
    assert r.prompts[0].ar.tau is None and "tau" not in r.to_json()["prompts"][0]["ar"]  # AR rows carry no τ
    on_gpu = json.loads(text) | {"bandwidth": {"peak_gbs": 3350.0, "ar_gbs": 1210.5, "spec_gbs": 960.25}}
    g = BenchResult.from_json(on_gpu)
    assert g.bandwidth == Bandwidth(3350.0, 1210.5, 960.25) and g.to_json() == on_gpu
    assert BenchResult.from_json(g.to_json()) == g


def test_a_report_of_an_earlier_version_reads():
    """bench.json files written before per-prompt speedups, spreads, notes and hybrid rollbacks still read (push's
    check and the card read saved files), with those figures empty; a report without overall.spec.tau does not."""
    from recycle.bench_result import BenchResult

    old = json.loads(REPORT.read_text(encoding="utf-8"))
    for key in ("notes", "saved"):
        del old[key]
    for key in ("spread",):
        del old["overall"][key]
    for side in ("ar", "spec"):
        del old["overall"][side]["rollbacks"]
    for row in old["prompts"]:
        del row["speedup"], row["repeats"], row["ar"]["rollbacks"], row["spec"]["rollbacks"]
    for peer in old["hf"]:
        del peer["speedup_vs_our_ar"]
    r = BenchResult.from_json(old)
    assert r.overall.spread is None and r.notes == () and r.saved is None and r.overall.spec.rollbacks == 0
    assert r.prompts[0].speedup is None and r.prompts[0].repeats is None and r.hf[0].speedup_vs_our_ar is None
    assert r.overall.spec.tau == old["overall"]["spec"]["tau"] and r.overall.spec.acceptance == tuple(
        old["overall"]["spec"]["acceptance"])
    for bad, why in [({"overall": {}}, "no overall.spec.tau"), ([], "no overall.spec.tau"),
                     (old | {"prompts": [{"set": "code"}]}, "prompt has no prompt_tokens")]:
        with pytest.raises(ValueError, match=why):
            BenchResult.from_json(bad)


@pytest.mark.parametrize("args", [[str(FIXTURE), "--target", str(FIXTURE)], ["--native-mtp", "--target", str(FIXTURE)]],
                         ids=["drafter-is-target", "native-mtp"])
def test_bench_save_refuses_native_mtp(args):
    from tests.cli_helpers import assert_bad_input

    before = sorted(p.name for p in FIXTURE.iterdir())
    assert_bad_input(runner.invoke(app, ["bench", *args, "--save", "--threads", "1"]), "--save: native MTP has no "
                     "drafter directory")
    assert sorted(p.name for p in FIXTURE.iterdir()) == before


def test_bench_names_a_drafter_given_as_the_target(eagle_dir: Path):
    from tests.cli_helpers import assert_bad_input

    res = runner.invoke(app, ["bench", str(eagle_dir), "--target", str(eagle_dir)])
    assert_bad_input(res, f"--target {eagle_dir}: this is a drafter (eagle), not a target: pass the model it drafts "
                          "for as --target")
    assistant = FIXTURE.parent / "gemma4_assistant"
    assert_bad_input(runner.invoke(app, ["bench", str(assistant), "--target", str(assistant)]),
                     "this is a drafter (gemma4-assistant), not a target")


def _spread(loaded: bool, ratio: float, low: float):
    """A Spread whose AR decoding ranged `ratio`× from `low` steps/s (one prompt's τ and speedup)."""
    from recycle.bench_result import PromptSpread, Quartiles, Span, Spread

    one = Quartiles(1.0, 1.0, 1.0, 1.0, 1.0)
    return Spread(PromptSpread(speedup=one, tau=one, ar_decode_steps_per_s=Span(low, low * ratio, ratio)),
                  repeats=None, loaded=loaded)


def _overall(spread, tau: float, speedup: float, predicted: tuple[float, float, float]):
    """An Overall of the given spread, τ, speedup and cost model (c_draft, c_verify, speedup); the AR side and the
    rest of the speculative one as a decode that measured nothing."""
    from dataclasses import replace

    from recycle.bench import summarize
    from recycle.bench_result import Overall, Predicted

    return Overall(ar=summarize([]), spec=replace(summarize([]), tau=tau), speedup=speedup,
                   predicted=Predicted(0.0, *predicted), greedy_match=None, spread=spread)


def test_a_costly_verification_is_named_as_the_reason():
    from recycle.bench import noise_notes

    quiet = _spread(loaded=False, ratio=1.1, low=50.0)
    overall = _overall(quiet, tau=2.5, speedup=0.5, predicted=(0.7, 4.6, 0.47))
    (note,) = noise_notes(overall)
    assert "verifying costs 4.60 target steps a round" in note and "--tree" in note


# -- the advice follows the noise verdict; the target's positions bound a run (issue 45) ---------------------------

def test_a_busy_machine_gets_no_tree_advice():
    """The same costly verification as above, measured on a loaded machine: the speedups are noise, so no advice."""
    from recycle.bench import noise_notes

    loaded = _spread(loaded=True, ratio=3.2, low=20.0)
    overall = _overall(loaded, tau=2.5, speedup=0.5, predicted=(0.7, 4.6, 0.47))
    noise, costs = noise_notes(overall)
    assert "noise" in noise and "3.2×" in noise
    assert "busy machine" in costs and "no advice" in costs
    assert "--tree" not in costs and "--tree" not in noise


def _positions() -> int:
    from tests.trained import CONFIG

    return CONFIG["max_position_embeddings"]


def test_bench_refuses_an_absurd_max_new_tokens():
    from tests.cli_helpers import assert_bad_input

    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--max-new-tokens", "1000000"])
    assert_bad_input(res, "--max-new-tokens 1000000: at most 32768 per prompt")


def test_bench_refuses_a_prompt_longer_than_the_target_before_loading_it(tmp_path: Path, monkeypatch):
    from recycle import bench

    from tests.cli_helpers import assert_bad_input

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the prompt was refused")

    monkeypatch.setattr(bench, "load_target", no_load)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "alpha beta gamma " * (_positions() // 2)}) + "\n")
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--prompts", str(long)])
    assert_bad_input(res, f"positions, and the target has {_positions()} (max_position_embeddings)")
    assert "prompt 1 has" in res.stderr
    # a short prompt with a budget beyond the positions: refused alike
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--max-new-tokens", str(_positions())])
    assert_bad_input(res, f"with --max-new-tokens {_positions()} it needs")


def test_bench_counts_the_trees_draft_tokens_against_the_positions(eagle_dir: Path, prompts_file: Path):
    from transformers import AutoTokenizer

    from recycle.prompts import encode_prompts, read_jsonl

    from tests.cli_helpers import assert_bad_input

    encoded = encode_prompts(AutoTokenizer.from_pretrained(FIXTURE), read_jsonl(prompts_file), str(FIXTURE), None)
    longest = max(map(len, encoded))
    new = _positions() - longest - 1  # fits without drafting; a chain of 3 needs 2 positions more than there are
    args = ["bench", str(eagle_dir), "--target", str(FIXTURE), "--prompts", str(prompts_file), "--threads", "1",
            "--max-new-tokens", str(new), "--tree", "chain:3"]
    assert_bad_input(runner.invoke(app, args), f"+ 3 draft tokens (the tree eagle chain:3) it needs {_positions() + 2} "
                                               f"positions, and the target has {_positions()}")
