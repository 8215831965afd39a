"""Throughput at scale (issue 49, part 4): the loss's chunk cap, the teacher's logits shared by the draft steps that
score the same position, checkpoints and evaluations spaced by tokens (resume exact), and the experts' all-to-all
exchange against the all-gather (2 gloo ranks, slow)."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recycle.distill.losses import LOSS_CHUNK_ROWS, TargetLogits, distill_loss, distill_terms
from recycle.errors import RecycleError
from recycle.options import Every, LossConfig

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
CFG = LossConfig(ce_weight=0.1, kl_weight=1.0, decay=0.8)


@pytest.fixture(scope="module")
def fixture_teacher():
    """The fixture target's final-normed states and head (its 10 layers at width 128, vocabulary 4,096)."""
    from recycle.distill.teacher import Teacher

    torch.manual_seed(0)
    teacher = Teacher(FIXTURE, torch.device("cpu"), precision="fp32")
    ids = torch.randint(0, teacher.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    return teacher, ids, teacher(ids)


@pytest.fixture(scope="module")
def small_teacher():
    """A stand-in teacher at width 32 over 512 words (the default suite's: the fixture's is in the slow tests): final-
    normed states for 2 sequences of 24 tokens and its head, as `Teacher.logits` gives them."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 512, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(512, 32, generator=g))
    ids = torch.randint(0, 512, (2, 24), generator=g)
    last = torch.randn(2, 24, 32, generator=g)

    def logits(rows, vocab=None):
        with torch.no_grad():
            return head(rows).float()

    return SimpleNamespace(config=SimpleNamespace(hidden_size=32, vocab_size=512)), ids, SimpleNamespace(
        last=last, aux=None, logits=logits)


def _medusa(teacher, steps: int = 3):
    from recycle.distill.unroll import make_unroller
    from recycle.drafters.medusa import MedusaDrafter

    torch.manual_seed(2)
    model = MedusaDrafter(teacher.config.hidden_size, teacher.config.vocab_size, steps)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return make_unroller("medusa", model, steps)


def _counted(fn, calls: list[int]):
    """`fn` (a head), recording the rows of each call."""
    def head(rows):
        calls.append(rows.shape[0])
        return fn(rows)
    return head


def _loss_and_grads(unroller, steps, chunk: int) -> tuple[float, list[torch.Tensor], dict]:
    unroller.model.zero_grad()
    loss, info = distill_loss(steps, CFG, chunk)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in unroller.model.parameters() if p.grad is not None], info


def test_the_cap_is_the_memory_plans_constant() -> None:
    assert LOSS_CHUNK_ROWS == 2048
    assert distill_loss.__defaults__[-1] == LOSS_CHUNK_ROWS and distill_terms.__defaults__[0] == LOSS_CHUNK_ROWS


@pytest.mark.parametrize("chunk", [7, 10**6])
def test_shared_teacher_logits_equal_each_steps_own(small_teacher, chunk: int) -> None:
    """The loss, its gradients and the logged terms with the teacher's logits shared equal the previous loss (each
    step scoring its own rows against its own teacher logits) to 1e-6, at any chunk size; no head sees more rows
    than the chunk. (On the fixture, with the EAGLE and EAGLE-3 drafters: the slow test below.)"""
    teacher, ids, te = small_teacher
    unroller = _medusa(teacher)
    drafted, scored = [], []
    steps = unroller.unroll(ids, te.last, te.aux, _counted(te.logits, scored))
    for s in steps:
        s.head = _counted(s.head, drafted)
    loss, grads, info = _loss_and_grads(unroller, steps, chunk)
    own = [dataclasses.replace(s, shared=None, positions=None)  # each step its own target rows, as before
           for s in unroller.unroll(ids, te.last, te.aux, te.logits)]
    ref, ref_grads, ref_info = _loss_and_grads(unroller, own, 10**6)
    assert loss == pytest.approx(ref, rel=1e-6, abs=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert info["agree"] == ref_info["agree"]
    assert info["kl"] == pytest.approx(ref_info["kl"], rel=1e-6)
    assert max(drafted + scored) <= chunk  # rows per chunk never exceed the cap


def test_each_position_goes_through_the_head_once_per_pass(small_teacher) -> None:
    """K = 3 steps over 2 × 21 anchors score 2 × 22 distinct positions: the teacher's head runs on those once in
    forward, and once more in backward when the pieces are recomputed (previously K·T rows each time)."""
    teacher, ids, te = small_teacher
    unroller = _medusa(teacher)
    positions = ids.shape[0] * (ids.shape[1] - 2)
    steps = unroller.unroll(ids, te.last, te.aux, te.logits)
    _loss_and_grads(unroller, steps, 10**6)  # one chunk, nothing recomputed
    assert steps[0].shared.rows_computed == positions < sum(s.rows for s in steps)
    steps = unroller.unroll(ids, te.last, te.aux, te.logits)
    _loss_and_grads(unroller, steps, 16)
    assert steps[0].shared.rows_computed == 2 * positions  # forward, and the chunks' one recompute in backward
    assert steps[0].shared._kept is None  # the backward's last chunk dropped once every step had its gradient
    steps = unroller.unroll(ids, te.last, te.aux, te.logits)
    with torch.no_grad():
        distill_terms(steps, 16, grad=False)
    assert steps[0].shared.rows_computed == positions


def _saved_vocab_rows(rows_per_step: int, batch: int, vocab: int, chunk: int) -> int:
    """Rows of [rows, vocab] tensors autograd keeps for backward (outside recomputed pieces) for a micro-batch of
    `batch` sequences of `rows_per_step` anchors, 3 steps."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, vocab, bias=False)
    t = rows_per_step
    last = torch.randn(batch, t + 4, 8, generator=g)
    shared = TargetLogits(last.reshape(-1, 8), head)
    base = (torch.arange(batch)[:, None] * (t + 4) + torch.arange(t)[None]).reshape(-1)
    from recycle.distill.losses import StepOutput

    steps = [StepOutput(torch.randn(batch * t, 8, generator=g, requires_grad=True), last[:, k + 1:k + 1 + t].reshape(-1, 8),
                        torch.randint(0, vocab, (batch * t,), generator=g), head=head, target_head=head, shared=shared,
                        positions=base + k + 1) for k in range(3)]
    kept = []

    def pack(x):
        if x.dim() == 2 and x.shape[-1] == vocab:
            kept.append(x.shape[0])
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        distill_loss(steps, CFG, chunk)
    return sum(kept)


def test_micro_batch_one_keeps_no_more_than_two() -> None:
    """One sequence's rows just under the cap (DeepSeek-V3 at micro-batch 1: 2,044 anchors per step against 2,048)
    were one unchunked piece per step, all kept for backward: K times a chunk. Capped, the vocabulary-wide tensors
    kept are never more than at micro-batch 2, and never more than one chunk's worth."""
    chunk, vocab = 16, 64
    one, two = (_saved_vocab_rows(15, b, vocab, chunk) for b in (1, 2))
    assert one <= two and one <= 6 * chunk
    assert _saved_vocab_rows(4, 1, vocab, chunk) > 0  # small enough: kept, nothing recomputed


# -- cadence ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,every", [(50, Every(50)), ("50", Every(50)), ("50M", Every(50_000_000, True)),
                                        ("1.5k", Every(1500, True)), ("2000 tokens", Every(2000, True))])
def test_every_reads_steps_or_tokens(text, every: Every) -> None:
    assert Every.parse(text, "--checkpoint-every") == every
    assert Every.parse(every.value, "--checkpoint-every") == every  # the normalised value reads back


@pytest.mark.parametrize("text", [0, "0", "-3", "tokens", "5q", "0k"])
def test_every_refuses(text) -> None:
    with pytest.raises(RecycleError, match="--checkpoint-every"):
        Every.parse(text, "--checkpoint-every")


def test_tokens_cadence_fires_once_per_multiple_passed() -> None:
    every = Every(250, tokens=True)
    sizes = [96] * 9 + [40]  # the last step short, as a budget cuts it
    done, fired = 0, []
    for step, n in enumerate(sizes, 1):
        if every.due(step, done, done + n):
            fired.append(step)
        done += n
    assert fired == [3, 6, 8]  # 288, 576, 768 tokens: the first step past 250, 500, 750
    assert [s for s in range(1, 11) if Every(3).due(s, 0, 0)] == [3, 6, 9]


def test_a_bad_cadence_is_one_line(tmp_path: Path) -> None:
    res = run_cli("distill", str(tmp_path), "--target", str(FIXTURE), "--tokens", "1k", "--checkpoint-every", "0k")
    assert_bad_input(res, "--checkpoint-every")


@pytest.mark.slow
def test_resume_with_a_token_cadence_is_bit_exact(converted, tmp_path: Path) -> None:
    """`--checkpoint-every 500 tokens` (1k suffix form on the command line): killed after the first checkpoint,
    resumed, the drafter equals an uninterrupted run's bit for bit, and the checkpoint sits on a token multiple."""
    from safetensors.torch import load_file

    from recycle.distill.train import DistillOptions, distill

    src = str(converted("medusa"))
    budget = 30 * 2 * 48
    common = ["--target", str(FIXTURE), "--tokens", str(budget), "--seq-len", "48", "--batch", "2",
              "--checkpoint-every", "0.5k", "--eval-every", "1k", "--threads", "1", "--json"]
    out, state = tmp_path / "killed", tmp_path / "killed.distill"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "recycle.cli", "distill", src, "-o", str(out), *common]
    helpers.kill_at_first_checkpoint(cmd, state, ROOT, env)
    ck = torch.load(state / "checkpoint.pt", weights_only=False)
    assert 0 < ck["tokens"] < budget and ck["tokens"] // 500 > (ck["tokens"] - 96) // 500
    opts = dict(drafter=src, target=str(FIXTURE), tokens=budget, seq_len=48, batch=2, checkpoint_every="0.5k",
                eval_every="1k", threads=1)
    rec = distill(DistillOptions(out=str(out), resume=True, **opts))
    assert rec["resumed"] and rec["tokens"] == budget
    distill(DistillOptions(out=str(tmp_path / "ref"), **opts))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_shared_logits_equal_each_steps_own_for_the_converted_drafters(converted, fixture_teacher, fmt: str) -> None:
    """The EAGLE drafter (chained steps) and EAGLE-3 (the teacher's logits over its draft vocabulary)."""
    from recycle.distill.teacher import Teacher
    from recycle.distill.unroll import make_unroller
    from recycle.drafters import load_drafter

    model = load_drafter(converted(fmt), dtype=torch.float32)
    _, ids, _ = fixture_teacher
    aux = [2, 5, 9] if fmt == "eagle3" else None
    teacher = Teacher(FIXTURE, torch.device("cpu"), aux_layers=aux, precision="fp32")
    te = teacher(ids)
    unroller = make_unroller(fmt, model, 3, teacher.embed, aux)
    steps = unroller.unroll(ids, te.last, te.aux, te.logits)
    loss, grads, _ = _loss_and_grads(unroller, steps, 16)
    own = [dataclasses.replace(s, shared=None, positions=None) for s in unroller.unroll(ids, te.last, te.aux, te.logits)]
    ref, ref_grads, _ = _loss_and_grads(unroller, own, 10**6)
    assert loss == pytest.approx(ref, rel=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- experts: all-to-all against all-gather (2 gloo ranks) ---------------------------------------------------------


def _exchange_worker(rank: int, world: int, init: str, lopsided: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from recycle.distill import experts

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        ref = helpers.moe_block()
        if lopsided:  # every row routed to rank 0's experts: rank 1 receives no rows at all
            ref.gate.e_score_correction_bias.data[4:] = -100.0
        g = torch.Generator().manual_seed(1)
        rows = (5, 3)
        x = torch.randn(sum(rows), 32, generator=g)
        c = torch.randn(sum(rows), 32, generator=g)
        mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))
        whole = x.clone().requires_grad_()
        (ref(whole[:, None, :]).squeeze(1) * c).sum().backward()
        mesh = init_device_mesh("cpu", (world,))
        got = {}
        for exchange in experts.EXCHANGES:
            os.environ[experts.EXCHANGE_ENV] = exchange
            moe = copy.deepcopy(ref)
            moe.zero_grad()
            experts.shard_experts(moe, mesh)
            assert moe.experts.forward.exchange == exchange
            part = x[mine].clone().requires_grad_()
            out = moe(part[:, None, :]).squeeze(1)
            ((out * c[mine]).sum() * world).backward()
            got[exchange] = (out.detach(), part.grad / world, moe.experts.gate_up_proj.grad.to_local(),
                             moe.experts.down_proj.grad.to_local())
        a, b = got["all_to_all"], got["all_gather"]
        torch.testing.assert_close(a[0], ref(x[mine][:, None, :]).squeeze(1).detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a[1], whole.grad[mine], rtol=1e-5, atol=1e-6)
        first = rank * 4
        for got_grad, name in zip(a[2:], ("gate_up_proj", "down_proj")):  # zero, not None, on a rank no row reached
            torch.testing.assert_close(got_grad, getattr(ref.experts, name).grad[first:first + 4], rtol=1e-5, atol=1e-5)
        for u, v in zip(a, b, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    finally:
        helpers.end_ranks()


@pytest.mark.slow
@pytest.mark.parametrize("lopsided", [False, True])
def test_all_to_all_equals_all_gather_under_two_ranks(tmp_path: Path, lopsided: bool) -> None:
    """Outputs, the inputs' gradients and each rank's expert gradients: the all-to-all exchange equals the
    all-gather and the whole block, also when one rank receives no rows."""
    mp.spawn(_exchange_worker, args=(2, f"file://{tmp_path / 'init'}", lopsided), nprocs=2, join=True)
