"""`recycle bench --context-buckets`: the buckets, the long prompts cut from held-out text, the decay's slope and its
bootstrap interval, bad input (exit 2, one line, before any model loads) and an end-to-end bench (slow)."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from recycle.bench_result import BenchResult
from recycle.cli import app
from recycle.contexts import (
    MIN_PROMPT,
    check_buckets,
    context_streams,
    decay,
    encode_streams,
    label,
    lengths,
    parse_buckets,
    slope,
)
from recycle.encode import load_tokenizer
from recycle.errors import RecycleError
from recycle.preflight import max_positions

from tests.helpers import ROOT, run
from tests.trained import FIXTURE

runner = CliRunner()
NATIVE = ["bench", str(FIXTURE), "--native-mtp", "--target", str(FIXTURE), "--threads", "1"]


# -- the buckets ------------------------------------------------------------------------------------------------
def test_buckets_parse_with_k_and_m_suffixes():
    assert parse_buckets("0-512,512-2k,2k-8k") == ((0, 512), (512, 2048), (2048, 8192))
    assert parse_buckets("1M-2M") == ((1 << 20, 2 << 20),)
    assert parse_buckets(" 0 - 1K , 4k-5000") == ((0, 1024), (4096, 5000))  # a gap between buckets is allowed
    assert parse_buckets(None) == parse_buckets("") == ()
    assert parse_buckets([(0, 256), (256, 1024)]) == ((0, 256), (256, 1024))
    assert [label(b) for b in parse_buckets("0-512,512-2k,2560-1M")] == ["0-512", "512-2k", "2560-1M"]


@pytest.mark.parametrize("value, words", [
    ("512-0", "start must be below its end"),
    ("256-256", "start must be below its end"),
    ("0-512,256-1k", "ascend without overlapping"),
    ("512-1k,0-256", "ascend without overlapping"),
    ("0-x", "expected LO-HI"),
    ("0-2G", "expected LO-HI"),
    ("512", "expected LO-HI"),
])
def test_bad_buckets_are_refused(value, words):
    with pytest.raises(RecycleError, match=words):
        parse_buckets(value)


def test_room_in_a_bucket_and_the_context():
    check_buckets([(0, 256), (1024, 2048)], 2048, 32, 2)  # fits
    with pytest.raises(RecycleError, match=r"1k-4k: ends at position 4096, past the target's context of 2048"):
        check_buckets([(0, 256), (1024, 4096)], 2048, 32, 2)
    with pytest.raises(RecycleError, match=r"0-48: too narrow .* --max-new-tokens 32 \+ 2 draft tokens"):
        check_buckets([(0, 48)], 2048, 32, 2, "chain:2")
    assert max_positions({"text_config": {"max_position_embeddings": 4096}}) == 4096
    assert max_positions({"max_position_embeddings": True}) is None


def test_prompt_lengths_spread_across_the_bucket_leaving_room():
    for bucket, n in (((0, 256), 4), ((256, 1024), 3), ((1000, 1100), 1)):
        got = lengths(bucket, n, 32, 2)
        assert got == sorted(got) and len(set(got)) == n
        assert all(max(bucket[0], MIN_PROMPT) <= x and x + 32 + 2 <= bucket[1] for x in got), got
    assert lengths((1000, 1100), 1, 32, 2) == [1033]  # the middle of 1000 … 1066


# -- bad input: one line, exit 2, before any model loads --------------------------------------------------------
def test_bucket_past_the_context_exits_2_from_the_command_line():
    res = run([sys.executable, "-m", "recycle.cli", *NATIVE, "--context-buckets", "0-4k"], timeout=60,
              capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and "0-4k" in lines[0] and "2048" in lines[0], res.stderr


@pytest.mark.parametrize("args, words", [
    (["--context-buckets", "0-256,128-1k"], "overlapping"),
    (["--context-buckets", "0-40", "--max-new-tokens", "32"], "too narrow"),
    (["--context-buckets", "0-256", "--context-prompts", "0"], "--context-prompts must be at least 1"),
    (["--data", "stdlib"], "only with --context-buckets"),
    (["--context-buckets", "0-256", "--data", "/nonexistent/text"], "no such file"),
])
def test_bad_context_options_exit_2_with_one_line(args, words):
    res = runner.invoke(app, [*NATIVE, *args])  # refused by BenchOptions.validate, which loads nothing
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("recycle: error:") and words in lines[0], res.stderr


@pytest.mark.slow  # imports torch and loads the tokenizer: the tree's draft tokens are known only there
def test_a_bucket_too_narrow_for_the_tree_exits_2_before_any_model_loads(monkeypatch):
    import recycle.bench

    def no_model(*a, **k):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr(recycle.bench, "load_target", no_model)
    res = runner.invoke(app, [*NATIVE, "--context-buckets", "0-64", "--max-new-tokens", "16", "--tree", "chain:40"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "0-64: too narrow" in lines[0] and "40 draft tokens" in lines[0], res.stderr


# -- the long prompts -------------------------------------------------------------------------------------------
class FixtureTokenizer:
    """The fixture target's own tokenizer.json through the `tokenizers` library, called as transformers' tokenizers
    are (recycle.encode's calls): the same ids as `load_tokenizer`, without importing transformers (seconds)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
        eos = json.loads((FIXTURE / "tokenizer_config.json").read_text())["eos_token"]
        self.eos_token_id = self.tok.token_to_id(eos)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict:
        return {"input_ids": [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer():
    return FixtureTokenizer()


@pytest.mark.slow
def test_the_stand_in_tokenizer_is_the_targets():
    text = "def add(a, b):\n    return a + b  # the sum"
    assert FixtureTokenizer()([text], add_special_tokens=False)["input_ids"][0] == \
        load_tokenizer(FIXTURE)(text, add_special_tokens=False)["input_ids"]


def _rows(n: int) -> list[str]:
    """n distinct documents of ~2,000 characters each, numbered."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    return [f"row {i}: " + " ".join(rng.choice(words) for _ in range(300)) for i in range(n)]


def test_long_prompts_fall_inside_their_buckets_and_pair_across_them(tokenizer, tmp_path):
    data = tmp_path / "rows.jsonl"
    rows = _rows(200)
    data.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    opts = SimpleNamespace(data=str(data), context_buckets=((0, 256), (256, 1024)), context_prompts=3,
                           max_new_tokens=8, tree=None, target=str(FIXTURE), chat_template=None)
    streams = context_streams(opts, tokenizer, [("code", "def f(): pass")])
    assert streams.source == str(data)
    prompts = streams.prompts(opts.context_buckets, 3, 8, 2)
    assert [p.bucket for p in prompts] == [(0, 256)] * 3 + [(256, 1024)] * 3
    stream = [t for d in streams.docs for t in d]
    for p in prompts:
        lo, hi = p.bucket
        assert lo <= len(p.ids) and len(p.ids) + 8 + 2 <= hi
        assert p.ids == stream[p.end - len(p.ids):p.end]
    short, long = prompts[:3], prompts[3:]
    # paired: prompt k of each bucket ends at the same place, so the longer one holds the shorter one as its tail
    assert [p.end for p in short] == [p.end for p in long] and len({p.end for p in short}) == 3
    assert all(b.ids[-len(a.ids):] == a.ids for a, b in zip(short, long))
    assert len({tokenizer.decode(p.ids) for p in prompts}) == 6
    text = tokenizer.decode(stream)
    assert min(int(x.split(":")[0]) for x in text.split("row ")[1:]) >= 190  # the held-out tail (5%) only
    assert any(tokenizer.eos_token_id in p.ids for p in long)  # the longer ones span documents, EOS between


def test_too_little_held_out_text_is_one_line(tokenizer):
    with pytest.raises(RecycleError, match="too few for the long prompts"):
        encode_streams("tiny", ["alpha beta", "gamma delta"], tokenizer, str(FIXTURE), None, 400)
    streams = encode_streams("tiny", ["alpha beta", "gamma delta"], tokenizer, str(FIXTURE), None, 4)
    with pytest.raises(RecycleError, match="fewer than the"):
        streams.prompts([(0, 900)], 2, 8, 0)


# -- the decay --------------------------------------------------------------------------------------------------
def test_slope_recovers_a_known_decay_and_excludes_zero():
    rng = random.Random(7)
    xs = [rng.uniform(0, 8192) for _ in range(40)]
    ys = [0.8 - 0.05 * x / 1024 + rng.gauss(0, 0.02) for x in xs]
    d = decay(xs, ys, seed=0)
    assert d.slope_per_1k == pytest.approx(-0.05, abs=0.005)
    assert d.low < -0.05 < d.high and d.includes_zero is False
    assert d.prompts == 40 and d.resamples == 1000
    assert decay(xs, ys, seed=0) == d  # a fixed seed: the same interval


def test_a_flat_noisy_series_interval_includes_zero():
    rng = random.Random(3)
    xs = [rng.uniform(0, 2048) for _ in range(24)]
    ys = [min(1.0, max(0.0, 0.6 + rng.gauss(0, 0.15))) for _ in xs]
    d = decay(xs, ys, seed=0)
    assert d.includes_zero is True and d.low < 0 < d.high
    assert abs(d.slope_per_1k) < d.high - d.low


def test_no_slope_without_spread_in_positions():
    assert slope([1.0, 1.0], [0.2, 0.4]) is None
    d = decay([100, 100, 100], [0.2, 0.4, 0.5])
    assert d.slope_per_1k is None and d.low is None and d.includes_zero is None
    two = decay([100, 900], [0.5, 0.3])
    assert two.slope_per_1k == pytest.approx(-0.2 / 0.78125) and two.low is None  # no interval from two prompts


# -- end to end -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_reports_acceptance_by_context_bucket(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return"}\n')
    res = run([sys.executable, "-m", "recycle.cli", *NATIVE, "--prompts", str(prompts), "--json",
               "--context-buckets", "0-256,256-1k", "--context-prompts", "2", "--max-new-tokens", "8",
               "--temperature", "0,1"],
              timeout=600, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    c = data["contexts"]
    assert set(c) == {"source", "prompts_per_bucket", "seconds", "runs"} and c["source"] == "stdlib"
    r, hot = c["runs"]  # one run per temperature, in the order given
    assert set(r) == {"temperature", "draft_sample", "buckets", "decay", "prompts"}
    assert (r["temperature"], r["draft_sample"]) == (0, "greedy")  # T = 0: the drafts are the top-k
    assert (hot["temperature"], hot["draft_sample"]) == (1, "probabilistic")  # a chain's default rule
    assert [p["prompt_tokens"] for p in hot["prompts"]] == [p["prompt_tokens"] for p in r["prompts"]]
    assert [b["bucket"] for b in r["buckets"]] == ["0-256", "256-1k"]
    for b in r["buckets"]:
        assert b["prompts"] == 2 and b["new_tokens"] == 16 and 0 <= b["acceptance"][0] <= 1
        assert b["acceptance"][0] == pytest.approx(b["accepted"][0] / b["tried"][0]) and b["tau"] >= 1
    for p in r["prompts"]:
        lo, hi = parse_buckets(p["bucket"])[0]
        assert lo <= p["prompt_tokens"] and p["prompt_tokens"] + p["new_tokens"] <= hi
        assert p["position"] == p["prompt_tokens"] + p["new_tokens"] / 2
    d = r["decay"]
    assert d["prompts"] == 4 and d["resamples"] == 1000 and d["low"] <= d["slope_per_1k"] <= d["high"]
    assert d["includes_zero"] == (d["low"] <= 0 <= d["high"])
    back = BenchResult.from_json(data)
    assert back.to_json() == data and back.contexts.runs[0].decay.slope_per_1k == d["slope_per_1k"]
    old = {k: v for k, v in data.items() if k != "contexts"}  # a report of an earlier version
    assert BenchResult.from_json(old).contexts is None
    from recycle.report import out, render_contexts

    with out.capture() as shown:
        render_contexts(back.contexts)
    text = shown.get()
    assert "0-256" in text and "256-1k" in text and "α1 slope" in text and "T=1" in text
