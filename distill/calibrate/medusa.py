"""Calibrated Medusa heads: fit each head's ResBlock so that it reproduces what the source head computes.

A Medusa head reads only the target's last hidden state h_p (final-normed) and must name the token
two or more ahead. The source's heads know how, but from other inputs: a parallel head (Meta) runs a
transformer block over the trunk state; a sequential MTP module (DeepSeek) also reads the embedding
of the next token, which a Medusa head never sees. Neither maps exactly onto `h + SiLU(W h + b)`,
so the ResBlock is *fitted*: on calibration text, the target gives h_p and the source head its
feature y_p (the normed input of its LM head) for the token the Medusa head will predict; W, b
(from zero: Medusa's identity init) minimise KL(softmax(L y) ‖ softmax(L (h + SiLU(W h + b)))) with L
the head's own LM head, kept as it is. A sequential module (or a Gemma 4 assistant's
chain) is fed the target's own greedy tokens, so its output is a function of h_p that a ResBlock can approach.
An assistant is narrower than its target and reads the target's K/V: its feature is its final-normed output
and its LM head its own tied head, while the Medusa heads score with the target's head. Fit and held-out error
go into recycle.json; the tensors are `approx`.

`collect` runs the models (the caller's part); `fit` is a pure function of the cached features.
`calibrate_medusa` is the format's step between the converter and the writer (`CALIBRATORS["medusa"]`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from recycle.checkpoint import Checkpoint
from recycle.distill.calibrate.registry import CALIBRATORS, windows
from recycle.errors import RecycleError
from recycle.registry import Registry

DEFAULT_STEPS = 400
DEFAULT_LR = 2e-3
MINIBATCH = 1024
HELDOUT = 0.1  # share of the positions kept out of the fit to report its error


@dataclass
class Features:
    """Calibration set: target states h [N, H], and per calibrated head its source feature [N, h], the Medusa
    head's LM head [V, H] and, where the source scores with another one (an assistant's [V, h]), that head."""

    h: torch.Tensor
    targets: list[torch.Tensor]
    lm_heads: list[torch.Tensor]
    tokens: int = 0
    notes: list[str] = field(default_factory=list)
    source_heads: list[torch.Tensor] | None = None


@dataclass
class Fitted:
    weight: torch.Tensor  # [H, H]
    bias: torch.Tensor  # [H]
    report: dict


def _resblock(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return h + F.silu(h @ w.T + b)


def _scores(h: torch.Tensor, y: torch.Tensor, lm: torch.Tensor, src: torch.Tensor, w: torch.Tensor,
            b: torch.Tensor) -> dict:
    """Held-out KL(source ‖ Medusa) and top-1 agreement of the Medusa head with the source head."""
    with torch.no_grad():
        kl, agree, n = 0.0, 0, 0
        for s in range(0, h.shape[0], MINIBATCH):
            t = F.log_softmax(y[s:s + MINIBATCH] @ src.T, -1)
            d = F.log_softmax(_resblock(h[s:s + MINIBATCH], w, b) @ lm.T, -1)
            kl += float((t.exp() * (t - d)).sum())
            agree += int((t.argmax(-1) == d.argmax(-1)).sum())
            n += t.shape[0]
    return {"kl": kl / max(n, 1), "top1_agreement": agree / max(n, 1)}


def fit(feats: Features, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR, seed: int = 0,
        progress: Callable | None = None) -> list[Fitted]:
    """One ResBlock per head, from the identity, by Adam on minibatches of the training positions.
    `progress(done, total, label)` every 10 steps."""
    n = feats.h.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held, train = perm[: max(1, int(n * HELDOUT))], perm[max(1, int(n * HELDOUT)):]
    if len(train) < 1:
        raise RecycleError("--calibrate: too few positions to fit on; give more tokens")
    h = feats.h.float()
    out = []
    gen = torch.Generator().manual_seed(seed + 1)
    heads = len(feats.targets)
    for head, (y, lm, src) in enumerate(zip(feats.targets, feats.lm_heads, feats.source_heads or feats.lm_heads)):
        y, lm, src = y.float(), lm.float(), src.float()
        w = torch.zeros(h.shape[1], h.shape[1], requires_grad=True)
        b = torch.zeros(h.shape[1], requires_grad=True)
        before = _scores(h[held], y[held], lm, src, w.detach(), b.detach())
        opt = torch.optim.Adam([w, b], lr=lr)
        for step in range(steps):
            if progress and step % 10 == 0:
                progress(head * steps + step, heads * steps, f"calibrating: fitting {heads} ResBlocks (steps)")
            idx = train[torch.randint(0, len(train), (min(MINIBATCH, len(train)),), generator=gen)]
            with torch.no_grad():
                target = F.log_softmax(y[idx] @ src.T, -1)
            draft = F.log_softmax(_resblock(h[idx], w, b) @ lm.T, -1)
            loss = (target.exp() * (target - draft)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        after = _scores(h[held], y[held], lm, src, w.detach(), b.detach())
        out.append(Fitted(w.detach().clone(), b.detach().clone(),
                          {"heldout_positions": len(held), "fit_positions": len(train), "identity": before,
                           "calibrated": after}))
    return out


# -- collecting the features (runs the target and the source heads) ---------------------------------


@dataclass
class Heads:
    """A source's heads opened beside the target, as the fit reads them: how many Medusa heads they calibrate, the
    LM head each Medusa head scores with, what one window gives (the target's final-normed states h [B, T, H] and
    per head the source's feature [B, T, h]), and where the source scores its feature with a head of its own."""

    depth: int
    lm_heads: list[torch.Tensor]
    run: Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]
    source_heads: list[torch.Tensor] | None = None
    notes: list[str] = field(default_factory=list)


class HeadSource(Protocol):
    """Opens a source of one family kind beside the target (`model`, float32) for `heads` Medusa heads fitted on
    windows of `seq_len` positions (each window `depth` + 1 tokens longer, for what the source reads ahead)."""

    def __call__(self, ckpt: Checkpoint, source: str | Path, target: str | Path, model, heads: int,
                 seq_len: int) -> Heads: ...


# keyed by the source family's `kind` (recycle/families.py): what a source's heads are follows from its row
HEAD_SOURCES: Registry[HeadSource] = Registry("Medusa calibration source")


@HEAD_SOURCES.register("parallel_heads")
def parallel_heads(ckpt: Checkpoint, source: str | Path, target: str | Path, model, heads: int,
                   seq_len: int) -> Heads:
    """Meta's parallel heads: head k reads the trunk state at p, as Medusa head k does, and scores with the
    target's head."""
    from recycle.drafters.parallel import ParallelHeads

    src = ParallelHeads.from_checkpoint(source, model)
    depth = min(heads, src.num_heads)
    layer = len(model.get_decoder().layers) - 1

    def run(w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model.get_decoder()(input_ids=w[:, :seq_len], use_cache=False, output_hidden_states=True)
        return out.last_hidden_state, src.features(out.hidden_states[layer])

    return Heads(depth, [model.get_output_embeddings().weight] * depth, run)


@HEAD_SOURCES.register("drafter")
def assistant(ckpt: Checkpoint, source: str | Path, target: str | Path, model, heads: int, seq_len: int) -> Heads:
    """A Gemma 4 assistant chains as deep as asked, fed the target's greedy tokens and K/V; it scores its
    final-normed output with its own tied head."""
    from recycle.drafters import load_drafter
    from recycle.drafters.gemma4 import target_states_and_kv, teacher_forced
    from recycle.fit import check_drafter
    from recycle.formats import of_directory

    check_drafter(of_directory(source), ckpt.config, model.config.to_dict(), source, target, f"--target {target}")
    src = load_drafter(source)

    def run(w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        full, kv = target_states_and_kv(model.get_decoder(), model.config, w)
        greedy = model.get_output_embeddings()(full).argmax(-1)
        chain = teacher_forced(src, model.get_input_embeddings(), torch.cat([w[:, :1], greedy[:, :-1]], 1), full,
                               kv, heads, seq_len)
        return full[:, :seq_len], chain

    notes = ["the assistant's centroid-masked logits approximated by its full tied head for the fit"] \
        if src.config.use_ordered_embeddings else []
    return Heads(heads, [model.get_output_embeddings().weight] * heads, run, [src.lm_head.weight] * heads, notes)


@HEAD_SOURCES.register("mtp")
def mtp_modules(ckpt: Checkpoint, source: str | Path, target: str | Path, model, heads: int,
                seq_len: int) -> Heads:
    """Sequential MTP modules: the tokens they read are the target's own greedy ones, a function of h_p as a Medusa
    head needs; module j's feature is its final-normed output, scored with its own head."""
    from recycle.mtp import MTP

    src = MTP.from_checkpoint(ckpt)
    depth = min(heads, src.depth)

    def run(w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        full = model.get_decoder()(input_ids=w[:, :seq_len + depth], use_cache=False).last_hidden_state
        h = full[:, :seq_len]
        greedy = model.get_output_embeddings()(full).argmax(-1)
        mo = src(h, torch.cat([w[:, :1], greedy[:, :-1]], 1), depth=depth)
        feats = []
        for j in range(depth):
            norm = src.role(src.layers[j], "final_norm")
            feats.append(norm(mo.states[j]) if norm is not None else mo.states[j])
        return h, feats

    return Heads(depth, [src.role(src.layers[j], "head").weight for j in range(depth)], run)


@torch.no_grad()
def collect(source: str | Path | Checkpoint, target: str | Path, heads: int, tokens: int, data: str | None = None,
            seq_len: int = 256, batch: int = 8, progress: Callable | None = None) -> Features:
    """Run `target` on calibration text and the source's heads beside it; return what `fit` needs.

    Medusa head j at position p predicts the token p+j+2: a parallel head k = j reads the trunk
    state at p; sequential MTP depth j+1 at p reads h_p and the tokens up to p+j+1, taken as the target's
    own greedy tokens (the argmax at p+j), which is what greedy verification will feed it: token p+1 is then
    a function of h_p, so the fit need not average over a token the Medusa head cannot see. Heads past
    the source's depth are not calibrated (they keep the identity). Which heads a source has follows from its
    family's kind (`HEAD_SOURCES`).
    """
    from recycle.decoding.target import load_target
    from recycle.encode import load_tokenizer
    from recycle.families import match

    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)  # a convert's: with its --family
    family = match(ckpt).family
    model = load_target(target, dtype=torch.float32)
    tok = load_tokenizer(target)
    src = HEAD_SOURCES.get(family.kind, family.title)(ckpt, ckpt.path, target, model, heads, seq_len)
    depth = src.depth
    wins = windows(tok, data, tokens, seq_len + depth + 1)
    hs, ys = [], [[] for _ in range(depth)]
    for s in range(0, wins.shape[0], batch):
        if progress:
            progress(s, wins.shape[0], "calibrating: the target and the source heads over the text")
        h, feats = src.run(wins[s:s + batch])
        hs.append(h.reshape(-1, h.shape[-1]))
        for j in range(depth):
            ys[j].append(feats[j].reshape(-1, feats[j].shape[-1]))
    past = f"heads {depth}..{heads - 1} are past the source's {depth} head(s): not calibrated (identity ResBlocks)"
    notes = ([] if depth == heads else [past]) + src.notes
    return Features(torch.cat(hs), [torch.cat(y) for y in ys], [t.detach() for t in src.lm_heads],
                    tokens=int(wins.shape[0] * seq_len), notes=notes,
                    source_heads=[t.detach() for t in src.source_heads] if src.source_heads else None)


@CALIBRATORS.register("medusa")
def calibrate_medusa(plan, w, opts, progress: Callable | None = None) -> dict:
    """Medusa's calibration (`CALIBRATORS["medusa"]`): replace the plan's identity ResBlocks by ones fitted to
    the source's heads, in both of its layouts; returns the record for recycle.json."""
    from recycle.converters.medusa import DEFAULT_HEADS, LAYERS
    from recycle.converters.roles import APPROX
    from recycle.formats.medusa import FD_WEIGHTS, WEIGHTS, faster_decoding_names
    from recycle.io.writer import Lazy

    heads = opts.heads or DEFAULT_HEADS
    target = opts.target or w.ckpt.path
    feats = collect(w.ckpt, target, heads, opts.calibrate, opts.data, progress=progress)
    steps = opts.calibrate_steps or DEFAULT_STEPS
    fitted = fit(feats, steps=steps, progress=progress)
    names = faster_decoding_names(heads, LAYERS)
    for i, f in enumerate(fitted):
        rep = f.report
        note = (f"calibrated on {feats.tokens:,} tokens: held-out KL to the source head "
                f"{rep['identity']['kl']:.3f} → {rep['calibrated']['kl']:.3f}, top-1 agreement "
                f"{rep['identity']['top1_agreement']:.3f} → {rep['calibrated']['top1_agreement']:.3f}")
        for p, t in (("weight", f.weight), ("bias", f.bias)):
            lazy = Lazy(tuple(t.shape), (lambda t=t: t), (f"calibration: source head {i}",), APPROX, note)
            name = f"blocks.{i}.layers.{LAYERS - 1}.{p}"
            plan.tensors[WEIGHTS][name] = lazy
            plan.tensors[FD_WEIGHTS][names[name]] = lazy
    plan.notes.extend(feats.notes)
    return {"tokens": feats.tokens, "data": opts.data or "stdlib", "target": str(Path(target).resolve()),
            "steps": steps, "lr": DEFAULT_LR,
            "objective": "KL(P_source_head ‖ P_medusa_head), the head's LM head fixed, ResBlock from the identity",
            "heads": [f.report for f in fitted]}
