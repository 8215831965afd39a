"""Distillation losses: what a draft step is trained toward, and how the steps are weighted.

Per draft step k (0-based; step k at anchor position i predicts t_{i+k+2}, whose target
distribution is the frozen target's softmax at position i+k+1):

    L_k = w_ce · CE(t_{i+k+2}) + β · KL(sg(P_target) ‖ P_draft) + γ · SmoothL1(f_draft, f_target)
    L   = Σ_k λ_k L_k / Σ_k λ_k,      λ_k = decay^k

Defaults and why:
  * β = 1, w_ce = 0.1 (the MTP-D objective, KL-dominated). Under greedy verification a draft is
    accepted when it equals the *target's* argmax, not the corpus token; on a small target (the
    fixture's top-1 vs truth is 0.37) the two disagree most of the time, so the KL term carries the
    acceptance signal and the hard label only keeps the drafter anchored to real text. With
    `--self-distill` the labels are the target's own tokens and the two terms agree.
  * decay = 0.8 (EAGLE-3's 0.8^k over its training-time-test steps; Medusa-1 uses the same kind of
    decay per head): early positions gate every later one (τ = 1 + Σ_d Π_{j≤d} α_j), so they weigh
    most, but later steps still get enough gradient to improve, which is what plain recycled MTP
    modules lack (nebius/FastMTP: acceptance decays with depth). Normalising by Σλ keeps the loss
    scale, hence the learning rate, independent of the number of steps.
  * γ = 0 (feature regression off). EAGLE-1 regressed the next target feature; EAGLE-3 dropped it
    because it constrains the drafter for no acceptance gain, and a recycled MTP module's chained
    state was never trained to equal the target's feature (DeepSeek chains its own pre-norm state),
    so pulling it there first destroys what recycling keeps. `--feature-weight` turns it on for
    EAGLE-style drafters, comparing the step's final-normed state with the target's final-normed
    hidden state at the predicted position.

KL is computed in float32 with the target's probabilities as constants (no gradient reaches the
frozen target); positions whose label is outside an EAGLE-3 draft vocabulary are masked from CE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from recycle.options import LossConfig


def step_weights(steps: int, decay: float) -> list[float]:
    """λ_k = decay^k normalised to sum 1."""
    raw = [decay**k for k in range(steps)]
    total = sum(raw)
    return [w / total for w in raw]


def kl_rows(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_target ‖ P_draft) per row [N]; the target side is detached (stop-gradient)."""
    t = F.log_softmax(target_logits.detach().float(), dim=-1)
    return (t.exp() * (t - F.log_softmax(draft_logits.float(), dim=-1))).sum(-1)


def kl_to_target(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(P_target ‖ P_draft)."""
    return kl_rows(draft_logits, target_logits).mean()


def ce_rows(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CE per row [N], 0 where the label is −1 (a token the drafter cannot emit)."""
    return F.cross_entropy(draft_logits.float(), labels.clamp(min=0), reduction="none") * (labels >= 0)


def ce_to_labels(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over rows whose label is ≥ 0."""
    return ce_rows(draft_logits, labels).sum() / (labels >= 0).sum().clamp(min=1)


def feature_loss(draft_features: torch.Tensor, target_features: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(draft_features.float(), target_features.detach().float())


CHUNK_ROWS = 2048  # rows per loss chunk: one chunk's [rows, V] float32 logits (drafter and target) is the peak


@dataclass
class StepOutput:
    """One unrolled draft step over N = B·T rows.

    `draft` and `target` are what the two heads read (final-normed states) and `head` / `target_head` turn a chunk
    of them into logits over the same vocabulary, so no [N, V] tensor exists for the whole batch: at DeepSeek-V3's
    129,280-word vocabulary and 8 × 2048 rows that is 8.5 GB per tensor and per step. With no heads, `draft` and
    `target` are logits already (small vocabularies, tests).
    """

    draft: torch.Tensor  # [N, d]: draft head input (or draft logits [N, V'], V' = the draft vocabulary)
    target: torch.Tensor  # [N, D]: the target's final-normed state (or its logits over V')
    labels: torch.Tensor  # [N] label ids in the draft vocabulary (−1: not representable)
    features: torch.Tensor | None = None  # [N, H] the step's feature prediction, where the drafter has one
    target_features: torch.Tensor | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    target_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    mask: torch.Tensor | None = None  # [N] bool: rows that count (None: all)

    def logits(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft and target logits of `rows` (the target's detached, float32)."""
        d = self.draft[rows] if self.head is None else self.head(self.draft[rows])
        with torch.no_grad():
            t = self.target[rows] if self.target_head is None else self.target_head(self.target[rows])
        return d, t.detach().float()

    @property
    def rows(self) -> int:
        return self.draft.shape[0]


def _chunk(step: StepOutput, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ KL, Σ CE over labelled rows, Σ agreement) over one chunk of rows."""
    d, t = step.logits(rows)
    keep = torch.ones(d.shape[0], dtype=torch.bool, device=d.device) if step.mask is None else step.mask[rows]
    kl = (kl_rows(d, t) * keep).sum()
    ce = (ce_rows(d, step.labels[rows]) * keep).sum()
    agree = ((d.argmax(-1) == t.argmax(-1)) & keep).sum().float()
    return kl, ce, agree


def step_terms(step: StepOutput, chunk: int = CHUNK_ROWS, grad: bool = True) -> dict[str, torch.Tensor]:
    """KL (mean over counted rows), CE (mean over labelled counted rows) and top-1 agreement of one step, a chunk
    of rows at a time; with more than one chunk and gradients, each chunk's logits are recomputed in the backward
    pass (activation checkpointing) instead of kept."""
    n = step.rows
    kl = ce = agree = step.draft.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk):
        rows = slice(start, min(n, start + chunk))
        if grad and n > chunk and torch.is_grad_enabled():
            parts = checkpoint(lambda r=rows: _chunk(step, r), use_reentrant=False)
        else:
            parts = _chunk(step, rows)
        kl, ce, agree = kl + parts[0], ce + parts[1], agree + parts[2]
    keep = step.mask if step.mask is not None else torch.ones(n, dtype=torch.bool, device=step.labels.device)
    counted = keep.sum().clamp(min=1)
    labelled = ((step.labels >= 0) & keep).sum().clamp(min=1)
    return {"kl": kl / counted, "ce": ce / labelled, "agree": agree / counted}


def distill_loss(steps: list[StepOutput], cfg: LossConfig, chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, dict]:
    """Σ_k λ_k L_k (module docstring); also per-step CE, KL and top-1 agreement with the target."""
    weights = step_weights(len(steps), cfg.decay)
    total = steps[0].draft.new_zeros((), dtype=torch.float32)
    info: dict = {"ce": [], "kl": [], "agree": []}
    for w, s in zip(weights, steps):
        terms = step_terms(s, chunk)
        loss = cfg.ce_weight * terms["ce"] + cfg.kl_weight * terms["kl"]
        if cfg.feature_weight and s.features is not None and s.target_features is not None:
            loss = loss + cfg.feature_weight * feature_loss(s.features, s.target_features)
        total = total + w * loss
        for k in ("ce", "kl", "agree"):
            info[k].append(float(terms[k].detach()))
    return total, info
