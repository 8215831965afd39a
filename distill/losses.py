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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recycle.options import LossConfig  # noqa: F401  (its defaults are explained above)


def step_weights(steps: int, decay: float) -> list[float]:
    """λ_k = decay^k normalised to sum 1."""
    raw = [decay**k for k in range(steps)]
    total = sum(raw)
    return [w / total for w in raw]


def kl_to_target(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(P_target ‖ P_draft); the target side is detached (stop-gradient)."""
    t = F.log_softmax(target_logits.detach().float(), dim=-1)
    d = F.log_softmax(draft_logits.float(), dim=-1)
    return (t.exp() * (t - d)).sum(-1).mean()


def ce_to_labels(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over rows whose label is ≥ 0 (−1 marks a label the drafter cannot emit)."""
    valid = labels >= 0
    if not bool(valid.any()):
        return draft_logits.sum() * 0.0
    return F.cross_entropy(draft_logits.float()[valid], labels[valid])


def feature_loss(draft_features: torch.Tensor, target_features: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(draft_features.float(), target_features.detach().float())


@dataclass
class StepOutput:
    """One unrolled draft step over N = B·T rows."""

    logits: torch.Tensor  # [N, V'] draft logits (V' = draft vocabulary)
    target_logits: torch.Tensor  # [N, V'] the target's logits restricted to the same vocabulary
    labels: torch.Tensor  # [N] label ids in the draft vocabulary (−1: not representable)
    features: torch.Tensor | None = None  # [N, H] the step's feature prediction, where the drafter has one
    target_features: torch.Tensor | None = None


def distill_loss(steps: list[StepOutput], cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """Σ_k λ_k L_k (module docstring); also per-step CE, KL and top-1 agreement with the target."""
    weights = step_weights(len(steps), cfg.decay)
    total = steps[0].logits.new_zeros((), dtype=torch.float32)
    info: dict = {"ce": [], "kl": [], "agree": []}
    for w, s in zip(weights, steps):
        ce = ce_to_labels(s.logits, s.labels)
        kl = kl_to_target(s.logits, s.target_logits)
        loss = cfg.ce_weight * ce + cfg.kl_weight * kl
        if cfg.feature_weight and s.features is not None and s.target_features is not None:
            loss = loss + cfg.feature_weight * feature_loss(s.features, s.target_features)
        total = total + w * loss
        with torch.no_grad():
            info["ce"].append(float(ce))
            info["kl"].append(float(kl))
            info["agree"].append(float((s.logits.argmax(-1) == s.target_logits.argmax(-1)).float().mean()))
    return total, info
