"""bench at several temperatures and draft-sampling rules (issue 50): --temperature T[,T...] and --draft-sample parsed
and refused in one line, both rules lossless (χ² against the exact law), the sweep's rows in --json, bench.json,
recycle.json and the card."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from typer.testing import CliRunner

from recycle.cli import app
from recycle.decoding import MaskCache, MTPStack, StaticTree, Target
from recycle.decoding.tree import Expander
from recycle.errors import RecycleError
from recycle.options import BenchOptions

from tests.helpers import assert_target_law, chi2_sf, exact_marginals, sampled_counts, tiny_mtp_pair
from tests.trained import FIXTURE

runner = CliRunner()
V = 8


# -- options ---------------------------------------------------------------------------------------------------------


def test_temperature_list_and_rules_parse():
    from recycle.flags import _flags

    spec = dict(_flags(BenchOptions))
    assert spec["temperatures"][0].parse("0,0.7,1.0") == (0.0, 0.7, 1.0)
    assert spec["draft_samples"][0].parse("greedy, probabilistic") == ("greedy", "probabilistic")
    assert spec["draft_samples"][0].parse(None) == ()  # not given: the shape's default
    opts = BenchOptions(drafter=None, target=str(FIXTURE), native=True)
    assert opts.temperatures == (0.0,) and opts.temperature == 0.0 and opts.draft_samples == ()


@pytest.mark.parametrize("args, says", [
    (["--temperature", "-1"], "--temperature -1: must be a finite number ≥ 0"),
    (["--temperature", "0,inf"], "--temperature inf"),
    (["--temperature", "0,x"], "'x' is not a number"),
    (["--temperature", "0.7,0.7"], "0.7 is named twice"),
    (["--draft-sample", "greedi"], "did you mean 'greedy'"),
    (["--draft-sample", "greedy,greedy"], "greedy is named twice"),
    (["--draft-sample", "probabilistic", "--tree", "dynamic:2,2,3"], "a dynamic tree keeps only"),
], ids=["negative", "infinite", "not-a-number", "twice", "unknown-rule", "rule-twice", "dynamic-probabilistic"])
def test_bad_sweep_exits_2_in_one_line_before_loading(args, says, monkeypatch):
    import recycle.bench

    monkeypatch.setattr(recycle.bench, "load_target", lambda *a, **k: pytest.fail("a model loaded"))
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), *args, "--threads", "1"])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("recycle: error:"), res.output
    assert says in lines[0], lines[0]


def test_plan_takes_one_temperature(monkeypatch):
    import recycle.bench

    monkeypatch.setattr(recycle.bench, "load_target", lambda *a, **k: pytest.fail("a model loaded"))
    res = runner.invoke(app, ["plan", str(FIXTURE), "--native-mtp", "--target", str(FIXTURE), "--temperature", "0,1"])
    assert res.exit_code == 2 and "plan measures at one temperature" in res.stderr, res.output


def test_probabilistic_on_a_default_dynamic_tree_is_refused():
    from recycle.bench import draft_rules
    from recycle.decoding import Drafter, DynamicTreeSpec

    engine = Drafter()
    engine.shape = DynamicTreeSpec()
    assert draft_rules((), engine) == ("greedy",)  # the default where the shape forbids sampling
    with pytest.raises(RecycleError, match="dynamic tree"):
        draft_rules(("greedy", "probabilistic"), engine)
    engine.shape = StaticTree.from_choices([[0], [1]])
    assert draft_rules((), engine) == ("probabilistic",)


# -- the rule in the Expander ------------------------------------------------------------------------------------------


def test_static_tree_siblings_are_drawn_without_replacement():
    """Each sibling is a distinct token, recorded with q less the earlier siblings, renormalised; greedy records δ."""
    logits = torch.tensor([[0.5, 0.1, 0.0, -0.2, 0.3]])
    shape = StaticTree.from_choices([[0], [1], [2], [0, 0]])
    q = torch.softmax(logits[0], -1)
    for seed in range(20):
        ex = Expander(0, shape, 1.0, torch.Generator().manual_seed(seed), "probabilistic")
        ex.expand(logits)
        kids = [c for c in range(1, len(ex.tok)) if ex.par[c] == 0]
        toks = [ex.tok[c] for c in kids]
        assert len(set(toks)) == 3
        for j, c in enumerate(kids):
            want = q.clone()
            want[toks[:j]] = 0.0
            assert torch.allclose(ex.q[c], want / want.sum())
    ex = Expander(0, shape, 1.0, torch.Generator().manual_seed(0), "greedy")
    ex.expand(logits)
    assert ex.tok[1:] == [0, 4, 1] and ex.q[1:] == [None] * 3  # the top-3, deterministic


# -- losslessness: the sampled tokens' law against the exact law ----------------------------------------------------


@pytest.mark.parametrize("rule", ["probabilistic", "greedy"])
def test_one_node_with_three_sampled_siblings_emits_the_target_law(rule):
    """A root with three children drafted from a sharp q far from p: the first emitted token (an accepted child, else
    the residual's draw) is distributed as p. A sibling recorded with the wrong q (not renormalised after its earlier
    siblings) fails this."""
    from recycle.decoding.verify import verify

    p_logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    q_logits = torch.tensor([[-1.0, 0.0, 2.5, 1.0, 0.0]])
    logits = torch.stack([p_logits] + [torch.zeros(5)] * 3)
    shape = StaticTree.from_choices([[0], [1], [2]])
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    counts, n = torch.zeros(5), 3000
    for _ in range(n):
        ex = Expander(0, shape, 1.0, gen, rule)
        ex.expand(q_logits)
        tree = ex.tree()[0]
        path, tok = verify(tree, logits, 1.0, rng, gen)
        counts[tree.tokens[path[1]] if len(path) > 1 else tok] += 1
    expected = torch.softmax(p_logits, -1) * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert chi2_sf(stat, 4) > 1e-3, (counts.tolist(), expected.tolist())


@pytest.fixture(scope="module")
def tiny():
    return tiny_mtp_pair(V)


def _chi2_law(model, mtp, shape, rule: str, runs: int) -> None:
    target = Target(model)
    masks = MaskCache(torch.float32, "cpu")
    engine = MTPStack(mtp, shape, masks)
    engine.draft_sample = rule
    target.set_taps(engine.taps)
    prompt, temperature = [1, 5, 2, 7, 3], 1.0
    exact = exact_marginals(model, prompt, temperature)
    sampled = 0
    propose = engine.propose

    def watched(root, t=0.0, gen=None):
        nonlocal sampled
        tree = propose(root, t, gen)
        sampled += sum(q is not None for q in tree.q[1:])
        return tree

    engine.propose = watched
    counts, accepted = sampled_counts(target, engine, prompt, runs, V, masks, temperature)
    assert accepted > runs // 10  # the drafts are exercised, not all rejected
    assert (sampled > 0) == (rule == "probabilistic")  # the rule took effect
    assert_target_law(counts, exact, runs)


@pytest.mark.slow
def test_greedy_drafts_on_a_chain_are_lossless_at_t1(tiny):
    _chi2_law(*tiny, 2, "greedy", 1200)


@pytest.mark.slow
def test_probabilistic_drafts_on_a_static_tree_are_lossless(tiny):
    _chi2_law(*tiny, StaticTree.from_choices([[0], [1], [2], [0, 0], [1, 0], [0, 1]]), "probabilistic", 1200)


# -- the sweep end to end ------------------------------------------------------------------------------------------


def test_bootstrap_resamples_prompts():
    from recycle.bench import bootstrap
    from recycle.decoding import DecodeStats

    same = [DecodeStats(new_tokens=9, steps=4, tried=[4, 3], accepted=[3, 2]) for _ in range(3)]
    (a1, a2), tau = bootstrap(same, 0)
    assert (a1.low, a1.high, a2.low, a2.high, tau.low, tau.high) == pytest.approx((0.75, 0.75, 2 / 3, 2 / 3, 2, 2))
    mixed = [DecodeStats(new_tokens=5, steps=4, tried=[4], accepted=[0]),
             DecodeStats(new_tokens=9, steps=4, tried=[4], accepted=[4])]
    (a1,), tau = bootstrap(mixed, 0)
    assert a1.low == 0.0 and a1.high == 1.0 and tau.low == 1.0 and tau.high == 2.0


@pytest.fixture(scope="module")
def swept(converted, tmp_path_factory):
    """An EAGLE drafter (a copy: --save writes into it) benched at T = 0 and 1 with both rules, 2 prompts × 8 tokens."""
    d = tmp_path_factory.mktemp("sweep") / "eagle"
    shutil.copytree(converted("eagle"), d)
    prompts = d.parent / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return"}\n{"prompt": "import os\\nimport sys\\n"}\n')
    res = runner.invoke(app, ["bench", str(d), "--target", str(FIXTURE), "--prompts", str(prompts),
                              "--max-new-tokens", "8", "--tree", "chain:2", "--temperature", "0,1.0",
                              "--draft-sample", "greedy,probabilistic", "--threads", "1", "--save", "--json"])
    assert res.exit_code == 0, res.output
    return d, json.loads(res.stdout)


@pytest.mark.slow
def test_sweep_rows_and_json(swept):
    from recycle.bench_result import BenchResult

    _, data = swept
    rows = data["sweep"]
    assert [(r["temperature"], r["draft_sample"]) for r in rows] == [(0.0, "greedy"), (1.0, "greedy"),
                                                                     (1.0, "probabilistic")]
    for r in rows:
        assert list(r) == ["temperature", "draft_sample", "prompts", "acceptance", "accepted", "tried",
                           "acceptance_quartiles", "acceptance_interval", "tau", "tau_quartiles", "tau_interval",
                           "tokens_per_s", "ar_tokens_per_s", "speedup", "speedup_quartiles", "greedy_match"]
        assert r["prompts"] == 2 and len(r["acceptance"]) == len(r["acceptance_interval"]) <= 2
        for a, acc, tried, iv, q in zip(r["acceptance"], r["accepted"], r["tried"], r["acceptance_interval"],
                                        r["acceptance_quartiles"]):
            assert a == pytest.approx(acc / tried) and iv["low"] - 1e-9 <= a <= iv["high"] + 1e-9
            assert q["min"] <= q["max"]
        assert r["tau_interval"]["low"] - 1e-9 <= r["tau"] <= r["tau_interval"]["high"] + 1e-9
    assert rows[0]["greedy_match"] == "2/2" and rows[1]["greedy_match"] is None
    o = data["overall"]  # the first row, measured in full
    assert data["temperature"] == 0.0 and o["greedy_match"] == "2/2"
    assert o["spec"]["tau"] == rows[0]["tau"] and o["spec"]["acceptance"] == rows[0]["acceptance"]
    assert BenchResult.from_json(data).to_json() == data


@pytest.mark.slow
def test_saved_sweep_reaches_recycle_json_push_and_the_card(swept):
    from recycle.hub import validate_drafter
    from recycle.hub.card import build_card

    d, data = swept
    record = json.loads((d / "recycle.json").read_text())["bench"]
    assert record["file"] == "bench.json" and record["tree"] == data["tree"] and record["prompts"] == 2
    assert record["temperatures"] == [0.0, 1.0] and record["draft_samples"] == ["greedy", "probabilistic"]
    assert record["rows"] == [{k: r[k] for k in ("temperature", "draft_sample", "acceptance", "tau")}
                              for r in data["sweep"]]
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]  # no temp file left
    drafter = validate_drafter(d)
    assert drafter.bench.sweep[2].draft_sample == "probabilistic"
    card = str(build_card(drafter, "someone/eagle"))
    row = data["sweep"][2]
    a1, iv = row["acceptance"][0], row["acceptance_interval"][0]
    assert f"| 1 | probabilistic | {a1:.2f} [{iv['low']:.2f}–{iv['high']:.2f}]" in card
    assert "| temperature | rule | α pos 1" in card


def test_save_into_a_drafter_another_run_is_writing_refuses_before_loading(converted, tmp_path, monkeypatch):
    """bench --save holds the drafter directory's output lock from before anything loads: with another run holding it
    (a second bench --save, a distill into that directory), one line, exit 2, and nothing written."""
    import recycle.bench
    from recycle.preflight import OutputLock

    d = tmp_path / "eagle"
    shutil.copytree(converted("eagle"), d)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    monkeypatch.setattr(recycle.bench, "load_target", lambda *a, **k: pytest.fail("a model loaded"))
    other = OutputLock(d).acquire()
    try:
        res = runner.invoke(app, ["bench", str(d), "--target", str(FIXTURE), "--save", "--threads", "1"])
    finally:
        other.release()
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "another recycle run" in lines[0], res.output
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
