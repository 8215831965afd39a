"""distill --loss: weighted kl, tv, kl@T, tv@T and ce terms, parsed before anything loads, computed chunk-wise from the
kept chunk of the target's log-probabilities, counted by the plan and named in the record (issue 50)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recycle.distill.losses import StepOutput, TargetLogits, distill_loss, divergence_rows
from recycle.distill.memory import TERM_TENSORS, term_tensors
from recycle.distill.train import DistillOptions, distill
from recycle.errors import RecycleError
from recycle.options import DEFAULT_LOSS, LossConfig, LossTerm, parse_loss

from tests.cli_helpers import assert_bad_input, run_cli
from tests.helpers import TINY, metrics
from tests.trained import FIXTURE


def test_terms_parse_with_weights_temperatures_and_either_separator() -> None:
    assert parse_loss("kl+tv") == (LossTerm("kl"), LossTerm("tv"))
    assert parse_loss(" tv@0.7=0.5, ce=0.1 ,kl@1") == (LossTerm("tv", 0.7, 0.5), LossTerm("ce", None, 0.1),
                                                      LossTerm("kl"))
    assert [t.key for t in parse_loss("kl@1.0,tv@2")] == ["kl", "tv@2"]
    assert LossConfig(loss="tv,kl@0.7=2").described() == "tv,kl@0.7=2"
    assert LossConfig().described() == DEFAULT_LOSS
    assert LossConfig(kl_weight=0.5, ce_weight=0.0).described() == "kl=0.5"


@pytest.mark.parametrize("spec,needle", [
    ("kl,tvd", "unknown term 'tvd'"), ("ce@0.7", "takes no temperature"), ("kl,kl@1", "kl is named twice"),
    ("kl=0,tv=0", "every weight is 0"), ("tv=-1", "finite number ≥ 0"), ("kl@0", "above 0"), ("kl,,tv", "empty term"),
    ("kl@nan", "finite number ≥ 0"),
])
def test_bad_terms_are_one_line(spec: str, needle: str) -> None:
    with pytest.raises(RecycleError, match=None) as e:
        parse_loss(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_loss_and_the_old_weights_do_not_mix() -> None:
    with pytest.raises(RecycleError, match="drop --ce-weight"):
        LossConfig(loss="tv", ce_weight=0.3).terms()


def test_an_unknown_term_exits_2_before_any_model_loads(converted, tmp_path: Path) -> None:
    res = run_cli("distill", str(converted("eagle")), "--target", str(FIXTURE), "--tokens", "1k", "--loss", "kl,tvd",
                  "-o", str(tmp_path / "o"))
    assert_bad_input(res, "--loss: unknown term 'tvd'")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.distill").exists()


def test_tv_is_one_minus_the_sampled_acceptance_and_kl_at_t_scales_both_sides() -> None:
    torch.manual_seed(0)
    t, d = torch.randn(5, 11) * 2, torch.randn(5, 11) * 2
    logp = F.log_softmax(t, -1)
    p, q = logp.exp(), F.softmax(d, -1)
    accept = torch.minimum(p, q).sum(-1)  # the chance a draft x ~ q passes min(1, p(x)/q(x))
    torch.testing.assert_close(divergence_rows("tv", None, logp, d), 1 - accept)
    pt, qt = F.softmax(t / 0.7, -1), F.softmax(d / 0.7, -1)
    torch.testing.assert_close(divergence_rows("kl", 0.7, logp, d), (pt * (pt.log() - qt.log())).sum(-1))
    torch.testing.assert_close(divergence_rows("tv", 0.7, logp, d), 0.5 * (pt - qt).abs().sum(-1))


def _steps(rows: int, vocab: int = 13, hidden: int = 6) -> tuple[list[StepOutput], list[torch.Tensor]]:
    torch.manual_seed(1)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(rows + 2, hidden)
    shared = TargetLogits(states, head)
    drafts = [torch.randn(rows, hidden, requires_grad=True) for _ in range(2)]
    steps = [StepOutput(x, states[k:k + rows], torch.randint(0, vocab, (rows,)), head=head, target_head=head,
                        shared=shared, positions=torch.arange(k, k + rows)) for k, x in enumerate(drafts)]
    return steps, drafts


def test_chunked_terms_equal_the_whole_batch_value_and_gradient() -> None:
    cfg = LossConfig(loss="kl=0.5,tv,tv@0.7=0.3,kl@2,ce=0.1")
    whole, drafts = _steps(12)
    loss, info = distill_loss(whole, cfg, chunk=10_000)
    loss.backward()
    grads = [x.grad.clone() for x in drafts]
    chunked, drafts2 = _steps(12)
    loss2, info2 = distill_loss(chunked, cfg, chunk=5)  # several chunks, each piece recomputed in backward
    loss2.backward()
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(grads, [x.grad for x in drafts2]):
        torch.testing.assert_close(b, a)
    assert set(info) == set(info2) == {"ce", "kl", "agree", "tv", "tv@0.7", "kl@2"}
    assert all(info[k] == pytest.approx(info2[k], rel=1e-5) for k in info)
    # the loss is the terms' weighted sum, step by step (λ_k = 0.8^k / Σ)
    lam = [1 / 1.8, 0.8 / 1.8]
    want = sum(w * (0.5 * info["kl"][k] + info["tv"][k] + 0.3 * info["tv@0.7"][k] + info["kl@2"][k]
                    + 0.1 * info["ce"][k]) for k, w in enumerate(lam))
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)


def test_the_plan_counts_each_term() -> None:
    assert [term_tensors(t) for t in parse_loss("kl,ce,tv,kl@0.7,tv@0.7")] == [
        0, 0, TERM_TENSORS["tv"], TERM_TENSORS["kl@T"], TERM_TENSORS["tv@T"]]


def test_the_record_and_the_metrics_name_the_loss(converted, tmp_path: Path) -> None:
    rec = distill(DistillOptions(drafter=str(converted("eagle")), target=str(FIXTURE), tokens=2 * 2 * 48,
                                 out=str(tmp_path / "o"), eval_every=1000, loss=LossConfig(loss="kl,tv@0.7=0.5,ce=0.1"),
                                 **TINY))
    entry = json.loads((Path(rec["out"]) / "recycle.json").read_text())["distillation"][-1]
    assert entry["losses"]["loss"] == "kl,tv@0.7=0.5,ce=0.1"
    assert entry["losses"]["terms"][1] == {"term": "tv", "temperature": 0.7, "weight": 0.5}
    row = metrics(tmp_path / "o.distill")[-1]
    assert len(row["tv@0.7"]) == len(row["kl"]) and all(0 <= v <= 1 for v in row["tv@0.7"])
