"""Verification: walk the draft tree against the target's logits; return the accepted path and the next token.

Both rules are lossless: greedy reproduces the target's argmax chain exactly, and sampling
returns tokens distributed exactly as the target's (temperature-scaled) distribution.
"""

from __future__ import annotations

import random

import torch

from recycle.decoding.tree import Tree


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32 (row or rows)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def verify(
    tree: Tree,
    logits: torch.Tensor,
    temperature: float,
    rng: random.Random,
    gen: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Accepted root-to-node path (node indices, root first) and the token the target emits after it.

    logits: [len(tree), V], row i = the target's prediction for the child of node i.

    Greedy (temperature 0): a child is accepted iff its token is the target's argmax at the parent;
    the emitted token is the argmax at the last accepted node.

    Sampling (temperature T > 0), sibling-wise speculative sampling (Leviathan et al. 2023, Chen et
    al. 2023, generalised to trees as in SpecInfer / EAGLE). At the current node let p be the
    target's distribution. Try its children in order; child x, drawn from q (q = δ_x when drafted
    deterministically, e.g. top-k), is accepted with probability min(1, p(x) / q(x)). On rejection
    p ← norm(max(p − q, 0)) and, because siblings are drawn without replacement, the next sibling's
    q is the previous q with x removed and renormalised (the drafter records that q on the node).
    Accepting moves to the child and restarts with the target's p there; if no child is accepted,
    the emitted token is drawn from the residual p. Each sibling test leaves the law of the emitted
    token equal to p, so the output is distributed exactly as the target's.
    """
    kids = tree.children()
    node, path = 0, [0]
    if temperature <= 0:
        best = logits.argmax(dim=-1).tolist()
        while True:
            want = best[node]
            nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
            if nxt is None:
                return path, want
            node = nxt
            path.append(node)
    p = target_probs(logits[node], temperature)
    while True:
        for c in kids[node]:
            x, q = tree.tokens[c], tree.q[c]
            qx = 1.0 if q is None else float(q[x])
            if rng.random() * qx < float(p[x]):  # u < p(x)/q(x), without dividing by a tiny q
                node = c
                path.append(c)
                p = target_probs(logits[node], temperature)
                break
            if q is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q).clamp_(min=0.0)
            total = float(p.sum())
            if total <= 0.0:  # p was covered by q exactly; any residual law is fine, it has no mass
                p = target_probs(logits[node], temperature)
            else:
                p /= total
        else:
            return path, sample(p, gen)
