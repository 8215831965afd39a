"""Issue 50, windows that reach the contexts served: --seq-len checked against the target's context before any model
loads, whole-document packing (no short document straddles two windows, padding masked, deterministic, resumable),
the long-context curriculum (stage boundaries, rows per step, resume inside a stage) and its per-stage plan."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recycle.distill.data import PackedStream, Position, Staged
from recycle.distill.memory import for_options
from recycle.distill.schedule import Schedule, eval_prompt_len
from recycle.distill.train import DistillOptions, distill
from recycle.errors import RecycleError
from recycle.options import parse_curriculum, target_context

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
EOS = 0


class _Tok:
    """One id per character (its code point): a document of one repeated character is recognisable in any window."""

    eos_token_id = EOS

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def _documents(n: int = 80, seed: int = 1) -> list[str]:
    """n documents, each one character (its own) repeated 1 to 70 times: some longer than a 32-token window."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 71, (n,), generator=g).tolist()
    return [chr(0x100 + i) * k for i, k in enumerate(lengths)]


def _epoch(stream: PackedStream) -> tuple[torch.Tensor, torch.Tensor]:
    """Every window of the stream's first epoch, with their masks."""
    rows = list(stream._epoch(0))
    return (torch.tensor([r for r, _ in rows]), torch.tensor([m for _, m in rows]))


# -- the target's context -------------------------------------------------------------------------------------------


def test_seq_len_past_the_context_exits_2_before_any_model_loads(tmp_path: Path, monkeypatch) -> None:
    import recycle.distill.setup as setup

    def no_load(*a, **k):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(setup, "load_drafter", no_load)
    monkeypatch.setattr(setup, "Teacher", no_load)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    out = tmp_path / "out"
    res = run_cli("distill", str(drafter), "--target", str(FIXTURE), "--tokens", "64k", "--seq-len", "4096",
                  "-o", str(out))
    assert_bad_input(res, "--seq-len 4096")
    assert "2048" in res.stderr  # both numbers named
    assert not out.exists() and not (tmp_path / "out.distill").exists()
    res = run_cli("harvest", "--target", str(FIXTURE), "--tokens", "64k", "--seq-len", "2049", "-o", str(out))
    assert_bad_input(res, "2048 positions")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"seq_len": 256}))
    res = run_cli("distill", str(drafter), "--target", str(FIXTURE), "--tokens", "64k", "--seq-len", "2048",
                  "--cache-hidden", str(cache), "-o", str(out))
    assert_bad_input(res, "harvested for other options: seq_len 256 (distill: 2048)")


def test_target_context_reads_a_multimodal_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert target_context(str(tmp_path)) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    assert target_context(str(tmp_path)) is None
    assert target_context(str(FIXTURE)) == 2048


# -- whole-document packing -----------------------------------------------------------------------------------------


def test_whole_packing_keeps_short_documents_in_one_window_and_masks_the_padding() -> None:
    docs, n = _documents(), 32
    ids, mask = _epoch(PackedStream(lambda: docs, _Tok(), n, seed=2, packing="whole"))
    assert ids.shape[1] == n and mask.dtype == torch.bool
    for i, d in enumerate(docs):
        code = 0x100 + i
        where = (ids == code).nonzero().tolist()
        rows = sorted({r for r, _ in where})
        assert len(where) == len(d)  # every token read once
        if len(d) + 1 <= n:  # with its EOS it fits a window: it sits in one, whole, followed by its EOS
            assert len(rows) == 1, (i, len(d), rows)
            cols = [c for _, c in where]
            assert cols == list(range(cols[0], cols[0] + len(d)))
            assert ids[rows[0], cols[-1] + 1] == EOS and mask[rows[0], cols[0]:cols[-1] + 2].all()
        else:  # cut into window-length pieces: every whole piece fills a window of its own
            full = [r for r in rows if (ids[r] == code).sum() >= n - 1 and mask[r].all()]  # its EOS may end one
            assert len(full) == (len(d) + 1) // n
    padding = ~mask
    assert padding.any()  # the fixture's lengths leave gaps: padding, masked, EOS ids, at each window's end
    assert (ids[padding] == EOS).all()
    for row in padding:
        first = int(row.float().argmax()) if row.any() else n
        assert row[first:].all() and not row[:first].any()
    assert int(mask.sum()) == sum(len(d) + 1 for d in docs)  # real tokens: the documents and their EOS
    stream = PackedStream(lambda: docs, _Tok(), n, seed=2, packing="whole")
    _epoch(stream)
    assert stream.padding_share == pytest.approx(float(padding.float().mean()))


def test_stream_packing_is_todays() -> None:
    docs = _documents()
    s = PackedStream(lambda: docs, _Tok(), 32, seed=2, packing="stream")
    ids, mask = s.take_masked(10)
    assert mask is None and s.padding_share == 0
    flat = [t for d in (docs[i] for i in s.order(0)) for t in [ord(c) for c in d] + [EOS]]
    assert ids.flatten().tolist() == flat[:320]  # concatenated and cut, nothing dropped or padded
    with pytest.raises(RecycleError, match="--packing"):
        PackedStream(lambda: docs, _Tok(), 32, packing="tight")


def test_whole_packing_is_deterministic_and_resumes_at_a_position() -> None:
    docs = _documents()
    a = PackedStream(lambda: docs, _Tok(), 32, seed=5, packing="whole")
    first_ids, first_mask = a.take_masked(7)
    rest_ids, rest_mask = a.take_masked(200)  # rolls over into later epochs
    assert a.pos.epoch >= 2
    b = PackedStream(lambda: docs, _Tok(), 32, seed=5, packing="whole")
    b.seek(Position(0, 7))
    again_ids, again_mask = b.take_masked(200)
    assert torch.equal(again_ids, rest_ids) and torch.equal(again_mask, rest_mask)
    c_ids, _ = PackedStream(lambda: docs, _Tok(), 32, seed=5, packing="whole").take_masked(7)
    assert torch.equal(c_ids, first_ids)
    other, _ = PackedStream(lambda: docs, _Tok(), 32, seed=6, packing="whole").take_masked(7)
    assert not torch.equal(other, first_ids)


def test_long_held_out_rows_keep_a_long_context_and_the_target_writes_their_end() -> None:
    assert [eval_prompt_len(n, 64, 3) for n in (48, 128, 256, 512, 2048)] == [12, 32, 64, 320, 1856]


# -- the curriculum ------------------------------------------------------------------------------------------------


def test_curriculum_stages_and_rows_per_step() -> None:
    stages = parse_curriculum("256,1024", 2048, 8)
    assert stages == ((256, pytest.approx(1 / 3)), (1024, pytest.approx(1 / 3)))
    s = Schedule(30 * 8 * 2048, 8, 2048, 1, stages)
    got = [(st.length, st.first, st.end, st.rows) for st in s.stages()]
    assert got == [(256, 0, 10, 64), (1024, 10, 20, 16), (2048, 20, 30, 8)]
    assert s.total_steps == Schedule(30 * 8 * 2048, 8, 2048).total_steps == 30
    for i in range(30):  # every step reads the same tokens: the steps and the schedule are a plain run's
        step = s.step(i)
        assert step.tokens == 8 * 2048 and set(step.lengths) == {step.seq_len}
    assert [s.step(i).seq_len for i in (9, 10, 19, 20)] == [256, 1024, 1024, 2048]
    shared = Schedule(20 * 8 * 2048 + 300, 8, 2048, 2, parse_curriculum("256:0.25,1024:0.5", 2048, 8))
    got = [(st.length, st.first, st.end, st.per_rank, st.rows) for st in shared.stages()]
    assert got == [(256, 0, 3, 64, 128), (1024, 3, 8, 16, 32), (2048, 8, 11, 8, 16)]
    assert shared.step(9).lengths == (2048,) * 16 and shared.step(10).lengths == (300,)  # the budget's rest
    cut = Schedule(2 * 8 * 2048 + 100, 8, 2048, 1, ((256, 0.9),))  # the budget's last step cut in a stage
    assert cut.step(2).seq_len == 256 and cut.step(2).lengths == (100,)


@pytest.mark.parametrize("text,needle", [
    ("1024,256", "short to long"), ("256,2048", "shorter than --seq-len"), ("4", "at least 8"),
    ("300", "do not divide"), ("256:0.5,1024:0.5", "sum to 1"), ("256:0.2,1024", "a share or none"),
    ("256:x", "LEN or LEN:SHARE"), ("256:1.5", "in (0, 1)"),
])
def test_curriculum_refusals(text: str, needle: str) -> None:
    with pytest.raises(RecycleError, match=None) as e:
        parse_curriculum(text, 2048, 8)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_curriculum_with_a_harvested_cache_is_refused_in_one_line(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (tmp_path / "cache").mkdir()
    res = run_cli("distill", str(drafter), "--target", str(FIXTURE), "--tokens", "64k", "--seq-len", "1024",
                  "--curriculum", "256", "--cache-hidden", str(tmp_path / "cache"), "-o", str(tmp_path / "o"))
    assert_bad_input(res, "--curriculum: not with --cache-hidden")


def test_staged_stream_continues_in_the_stage_its_position_names() -> None:
    docs = _documents()

    def make(length: int) -> PackedStream:
        return PackedStream(lambda: docs, _Tok(), length, f"7/{length}" if length != 32 else 7, packing="whole")

    a = Staged(make, 32)
    a.take_masked(4, 16)
    a.take_masked(3, 16)
    pos = a.pos
    assert (pos.length, pos.taken) == (16, 7)
    nxt = a.take_masked(5, 16)[0]
    b = Staged(make, 32)
    b.seek(pos)
    assert torch.equal(b.take_masked(5, 16)[0], nxt)
    final = b.take_masked(2)[0]  # the next stage starts at its own beginning
    assert final.shape == (2, 32) and b.pos == Position(0, 2, None)
    assert torch.equal(final, make(32).take_masked(2)[0])


def test_plan_lists_each_stage_and_takes_the_peak(converted) -> None:
    opts = DistillOptions(drafter=str(converted("eagle")), target=str(FIXTURE), tokens=10**6, seq_len=2048, batch=8,
                          curriculum="256,1024")
    plan = for_options(opts)
    stages = plan.options["curriculum"]
    assert [(s["seq_len"], s["rows_per_rank"]) for s in stages] == [(256, 64), (1024, 16), (2048, 8)]
    assert [s["peak"] for s in stages].count(True) == 1
    assert plan.per_rank_bytes == max(s["per_rank_bytes"] for s in stages)
    assert plan.as_dict()["options"]["curriculum"] == stages
    assert "curriculum" not in for_options(DistillOptions(drafter=str(converted("eagle")), target=str(FIXTURE),
                                                         tokens=10**6, seq_len=2048, batch=8)).options


# -- resume inside a stage (a tiny real run) -------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_inside_stage_two_matches_an_uninterrupted_run(converted, tmp_path: Path) -> None:
    """seq-len 48, batch 2, --curriculum 16,24 over 30 steps: stages at steps 0-10 (6 rows of 16), 10-20 (4 of 24),
    20-30 (2 of 48); killed at its first checkpoint, step 14 (stage 2), resumed, bit for bit the uninterrupted run."""
    src = str(converted("medusa"))
    tokens = 30 * 2 * 48
    common = ["--target", str(FIXTURE), "--tokens", str(tokens), "--seq-len", "48", "--batch", "2",
              "--curriculum", "16,24", "--checkpoint-every", "14", "--eval-every", "1000", "--threads", "1", "--json"]
    out, state = tmp_path / "killed", tmp_path / "killed.distill"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    helpers.kill_at_first_checkpoint([sys.executable, "-m", "recycle.cli", "distill", src, "-o", str(out), *common],
                                     state, ROOT, env)
    ck = torch.load(state / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 14 and ck["data"] == {"epoch": 0, "taken": 4 * 4, "length": 24}
    opts = dict(drafter=src, target=str(FIXTURE), tokens=tokens, seq_len=48, batch=2, curriculum="16,24",
                checkpoint_every=14, eval_every=1000, threads=1)
    rec = distill(DistillOptions(out=str(out), resume=True, **opts))
    assert rec["resumed"] and rec["steps"] == 30 and rec["tokens"] == tokens
    assert [(s["seq_len"], s["steps"], s["rows_per_step"]) for s in rec["data"]["curriculum"]] == \
        [(16, 10, 6), (24, 10, 4), (48, 10, 2)]
    assert rec["data"]["packing"] == "whole" and 0 <= rec["data"]["padding_share"] < 1
    distill(DistillOptions(out=str(tmp_path / "ref"), **opts))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_vllm_jobs_allow_only_the_slack_past_the_context(tmp_path, monkeypatch):
    """A job whose rows reach the context exactly (a window of 2,048 positions) needs max_model_len past it for the
    slack alone: the override is set then, and never for rows that compute a position past the context, nor for
    rows that leave room."""
    from recycle.engines import vllm_job

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    job = {"target": str(tmp_path)}
    for computed, allowed in ((2048, True), (2049, False), (2000, False), (2040, False), (2041, True)):
        monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
        assert vllm_job.model_len(job, computed) == computed + vllm_job.SLACK
        assert (os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1") is allowed, computed
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert vllm_job.model_len({**job, "max_model_len": 4096}, 100) == 4096  # a job's own, larger: kept
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 512}}))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert vllm_job.model_len(job, 512) == 520 and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1"
