"""Distillation losses: what a draft step is trained toward, and how the steps are weighted.

Per draft step k (0-based; step k at anchor position i predicts t_{i+k+2}, whose target
distribution is the frozen target's softmax at position i+k+1):

    L_k = w_ce · CE(t_{i+k+2}) + β · KL(sg(P_target) ‖ P_draft) + γ · SmoothL1(f_draft, f_target)
    L   = Σ_k λ_k L_k / Σ_k λ_k,      λ_k = decay^k

`--loss` replaces the first two terms by any weighted list of `kl`, `tv` (½·Σ|P_target − P_draft|: 1 − TV is
exactly the acceptance of a draft sampled from P_draft at T = 1), `kl@T` / `tv@T` (both distributions at temperature
T: the serving temperature) and `ce`; each is computed chunk-wise from the same kept chunk of the target's
log-probabilities as KL, so memory stays at a few [chunk, V] tensors per term (distill/memory.py counts them).

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

from recycle.options import LossConfig, LossTerm


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


LOSS_CHUNK_ROWS = 2048  # the most rows of [rows, V] float32 logits the loss holds at once (drafter and target)
CHUNK_ROWS = LOSS_CHUNK_ROWS  # the former name


class TargetLogits:
    """The target's log-probabilities at the positions the draft steps score, one chunk of positions at a time, each
    computed once for every step that scores it.

    Step k at anchor i is scored against the target at position i+k+1, so the K steps of an unroll score the same
    positions shifted by one: K·T rows of logits name only T+K−1 positions per sequence. The head matmul and the
    log-softmax run once per position (and once more in backward, where the loss recomputes its chunks), instead of
    once per step and position. `states` are the target's final-normed states at every position [P, D] and `head`
    turns a chunk of them into logits (None: `states` are logits already). The kept chunk is one [≤ LOSS_CHUNK_ROWS,
    V] float32 tensor (DeepSeek-V3: 2048 × 129,280 × 4 B = 1.06 GB) plus its argmax; asking for another chunk
    drops it first."""

    def __init__(self, states: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.states, self.head = states, head
        self._kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.rows_computed = 0  # positions run through the head so far (the tests count them)

    def chunk(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log P_target [n, V] float32, the target's argmax [n]) at `positions` (indices into `states`)."""
        kept = self._kept
        if kept is None or kept[0].shape != positions.shape or not torch.equal(kept[0], positions):
            self._kept = None
            with torch.no_grad():
                lo, n = int(positions[0]), positions.numel()
                contiguous = int(positions[-1]) - lo + 1 == n
                x = self.states[lo:lo + n] if contiguous else self.states.index_select(0, positions.to(
                    self.states.device))
                t = (x if self.head is None else self.head(x)).detach().float()
                self._kept = (positions, F.log_softmax(t, dim=-1), t.argmax(-1))
            self.rows_computed += positions.numel()
        return self._kept[1], self._kept[2]

    def release(self) -> None:
        self._kept = None


@dataclass
class StepOutput:
    """One unrolled draft step over N = B·T rows.

    `draft` and `target` are what the two heads read (final-normed states) and `head` / `target_head` turn a chunk
    of them into logits over the same vocabulary, so no [N, V] tensor exists for the whole batch: at DeepSeek-V3's
    129,280-word vocabulary and 8 × 2048 rows that is 8.5 GB per tensor and per step. With no heads, `draft` and
    `target` are logits already (small vocabularies, tests).

    `shared` and `positions` (set together by the unrollers): the steps of one unroll score rows of one
    `TargetLogits`, row r of this step against its position `positions[r]` (strictly increasing), so the loss computes
    each position's teacher logits once for all steps. Without them the step's `target` rows are its own.
    """

    draft: torch.Tensor  # [N, d]: draft head input (or draft logits [N, V'], V' = the draft vocabulary)
    target: torch.Tensor  # [N, D]: the target's final-normed state (or its logits over V')
    labels: torch.Tensor  # [N] label ids in the draft vocabulary (−1: not representable)
    features: torch.Tensor | None = None  # [N, H] the step's feature prediction, where the drafter has one
    target_features: torch.Tensor | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    target_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    mask: torch.Tensor | None = None  # [N] bool: rows that count (None: all)
    shared: TargetLogits | None = None
    positions: torch.Tensor | None = None  # [N] long: row r's position in `shared.states`

    def logits(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft and target logits of `rows` (the target's detached, float32)."""
        d = self.draft[rows] if self.head is None else self.head(self.draft[rows])
        with torch.no_grad():
            t = self.target[rows] if self.target_head is None else self.target_head(self.target[rows])
        return d, t.detach().float()

    @property
    def rows(self) -> int:
        return self.draft.shape[0]

    def scored(self) -> tuple[TargetLogits, torch.Tensor]:
        """The target this step is scored against and the position of each row in it (its own rows, unshared)."""
        if self.shared is not None and self.positions is not None:
            return self.shared, self.positions
        return TargetLogits(self.target, self.target_head), torch.arange(self.rows, device=self.target.device)


Divergence = tuple[str, float | None]  # a --loss term beyond KL at T = 1: ("tv", None), ("kl", 0.7) ...


def divergence_rows(name: str, temperature: float | None, logp: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Per row [n]: `kl` KL(P_T ‖ Q_T) or `tv` ½·Σ|P_T − Q_T| between the target's distribution (its log-probabilities
    `logp` at T = 1, float32, constants) and the draft's (`draft` logits), both at `temperature` (None: 1).
    log_softmax(logp / T) = log_softmax(logits / T): the kept chunk's log-probabilities serve any temperature.
    1 − TV is the probability that a draft sampled from Q_T is accepted against P_T (Leviathan et al. 2023, Thm 3.5),
    the acceptance at T exactly, where KL only bounds it (Pinsker)."""
    dl = draft.float()
    if temperature is not None:
        logp, dl = F.log_softmax(logp / temperature, dim=-1), dl / temperature
    dl = F.log_softmax(dl, dim=-1)
    if name == "kl":
        return (logp.exp() * (logp - dl)).sum(-1)
    return 0.5 * (logp.exp() - dl.exp()).abs().sum(-1)


def _piece(step: StepOutput, rows: slice, target: TargetLogits, positions: torch.Tensor, local,
           divergences: tuple[Divergence, ...] = ()) -> torch.Tensor:
    """[Σ KL, Σ CE over labelled rows, Σ agreement, Σ of each of `divergences`] over `rows` of a step, whose target
    rows are `local` of the chunk of `positions`."""
    d = step.draft[rows] if step.head is None else step.head(step.draft[rows])
    logp, top = target.chunk(positions)
    logp, top = logp[local], top[local]
    keep = torch.ones(d.shape[0], dtype=torch.bool, device=d.device) if step.mask is None else step.mask[rows]
    sums = [(divergence_rows("kl", None, logp, d) * keep).sum(), (ce_rows(d, step.labels[rows]) * keep).sum(),
            ((d.argmax(-1) == top) & keep).sum().float()]
    sums += [(divergence_rows(name, t, logp, d) * keep).sum() for name, t in divergences]
    return torch.stack(sums)


def _release_after_backward(target: TargetLogits, drafts: list[torch.Tensor]) -> None:
    """Drop the chunk the backward's recomputation keeps once every step's rows have their gradient (no piece is
    left to recompute), instead of when the steps are dropped: the next micro-batch never sees it."""
    waiting = [d for d in drafts if d.requires_grad]
    left = [len(waiting)]

    def done(grad: torch.Tensor) -> None:
        left[0] -= 1
        if left[0] == 0:
            target.release()

    for d in waiting:
        d.register_hook(done)


def distill_terms(steps: list[StepOutput], chunk: int = LOSS_CHUNK_ROWS, grad: bool = True,
                  divergences: tuple[Divergence, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """Per step: KL (mean over counted rows), CE (mean over labelled counted rows), top-1 agreement, and each of
    `divergences` (mean over counted rows, keyed as --loss names it: tv, kl@0.7 ...).

    The steps that share a `TargetLogits` are scored an outer chunk of ≤ `chunk` positions at a time, each of those
    steps an inner piece (its rows whose positions fall in the chunk, ≤ `chunk` rows: positions are distinct within a
    step), so the teacher's logits of a chunk are computed once for all steps. When the rows of all pieces together
    exceed `chunk` and gradients flow, each piece is checkpointed (its logits recomputed in backward, the teacher's
    once per chunk: backward visits the pieces in reverse, a chunk's steps together), so at most one chunk of rows
    is live at any micro-batch size; otherwise nothing is recomputed."""
    sums = [steps[0].draft.new_zeros(3 + len(divergences), dtype=torch.float32) for _ in steps]
    groups: dict[int, tuple[TargetLogits, list[tuple[int, torch.Tensor]]]] = {}
    for j, s in enumerate(steps):
        target, pos = s.scored()
        groups.setdefault(id(target), (target, []))[1].append((j, pos))
    for target, members in groups.values():
        where = [(j, pos, pos.cpu()) for j, pos in members]
        union = torch.unique(torch.cat([c for _, _, c in where]))  # sorted
        total = sum(c.numel() for _, _, c in where)
        recompute = grad and torch.is_grad_enabled() and total > chunk
        for lo in range(0, union.numel(), chunk):
            part = union[lo:lo + chunk]
            chunk_pos = part.to(target.states.device)
            for j, _, cpu in where:
                a = int(torch.searchsorted(cpu, part[0]))
                b = int(torch.searchsorted(cpu, part[-1], right=True))
                if a == b:
                    continue
                local = torch.searchsorted(part, cpu[a:b])
                first = int(local[0])
                local = slice(first, first + b - a) if int(local[-1]) - first + 1 == b - a else local.to(
                    target.states.device)
                args = (steps[j], slice(a, b), target, chunk_pos, local, divergences)
                sums[j] = sums[j] + (checkpoint(_piece, *args, use_reentrant=False) if recompute else _piece(*args))
        target.release()
        if recompute:
            _release_after_backward(target, [steps[j].draft for j, _, _ in where])
    out = []
    for s, total in zip(steps, sums):
        keep = s.mask if s.mask is not None else torch.ones(s.rows, dtype=torch.bool, device=s.labels.device)
        counted = keep.sum().clamp(min=1)
        labelled = ((s.labels >= 0) & keep).sum().clamp(min=1)
        terms = {"kl": total[0] / counted, "ce": total[1] / labelled, "agree": (total[2] / counted).detach()}
        terms.update((LossTerm(name, t).key, x / counted) for (name, t), x in zip(divergences, total[3:]))
        out.append(terms)
    return out


def step_terms(step: StepOutput, chunk: int = LOSS_CHUNK_ROWS, grad: bool = True) -> dict[str, torch.Tensor]:
    """`distill_terms` of one step."""
    return distill_terms([step], chunk, grad)[0]


def divergences(terms: tuple[LossTerm, ...]) -> tuple[Divergence, ...]:
    """The divergences a loss needs beyond those every step computes (KL at T = 1, CE)."""
    return tuple((t.name, t.temperature) for t in terms if t.name != "ce" and t.key != "kl")


def distill_loss(steps: list[StepOutput], cfg: LossConfig, chunk: int = LOSS_CHUNK_ROWS) -> tuple[torch.Tensor, dict]:
    """Σ_k λ_k L_k (module docstring), L_k the weighted sum of --loss's terms; also per-step CE, KL, top-1 agreement
    with the target, and each term beyond them (tv, kl@T ...)."""
    weights = step_weights(len(steps), cfg.decay)
    terms = cfg.terms()
    extra = divergences(terms)
    total = steps[0].draft.new_zeros((), dtype=torch.float32)
    info: dict = {k: [] for k in ("ce", "kl", "agree", *(LossTerm(n, t).key for n, t in extra))}
    for w, s, got in zip(weights, steps, distill_terms(steps, chunk, divergences=extra)):
        loss = sum((t.weight * got[t.key] for t in terms), start=total.new_zeros(()))
        if cfg.feature_weight and s.features is not None and s.target_features is not None:
            loss = loss + cfg.feature_weight * feature_loss(s.features, s.target_features)
        total = total + w * loss
        for k in info:
            info[k].append(float(got[k].detach()))
    return total, info
