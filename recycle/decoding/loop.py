"""The one decode loop: draft a tree → run the target over it → verify → keep the accepted path's cache.

Plain autoregressive decoding is the same loop with a drafter that proposes the root alone, so
the baseline shares every line of cache and sampling code with the speculative runs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

import recycle.decoding.cache as kv  # by attribute: tests stand in for a step (kv.restore)
from recycle.decoding.drafting.base import Drafter
from recycle.decoding.target import Target
from recycle.decoding.tree import MaskCache
from recycle.decoding.verify import sample, target_probs, verify
from recycle.errors import RecycleError
from recycle.hardware import sync


@dataclass
class DecodeStats:
    """What one generation measured. Times in seconds; `accepted[d]`/`tried[d]` count draft depth d+1."""

    new_tokens: int = 0
    forwards: int = 0  # target forwards, prefill included (and a hybrid target's re-runs after a rejection)
    rollbacks: int = 0  # hybrid and V4 targets: verifications whose rejected drafts sent their states back
    steps: int = 0  # speculative steps (forwards after the prefill)
    tree_nodes: int = 0  # draft nodes verified, summed over steps
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # per step: accepted drafts + 1
    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens per speculative step (accepted drafts + the target's own token)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 1.0

    def record(self, path_len: int, available: list[bool]) -> None:
        """available[d]: the node accepted at depth d had at least one child to try."""
        self.accept_lengths.append(path_len)
        for d, avail in enumerate(available):
            if not avail:
                break
            while len(self.tried) <= d:
                self.tried.append(0)
                self.accepted.append(0)
            self.tried[d] += 1
            if d + 1 < path_len:
                self.accepted[d] += 1
            else:
                break


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats


@torch.inference_mode()
def generate(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos: int | None = None,
    masks: MaskCache | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` after `prompt` (stops after `eos` when given)."""
    dev = target.device
    masks = masks or MaskCache(target.dtype, dev)
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    st = DecodeStats()
    sync(dev)
    t0 = time.perf_counter()
    cache = target.new_cache()
    rolls_back = target.rolls_back  # a hybrid or DeepSeek-V4 target: states rolled back on rejection
    drafter.bind(cache)
    ids = torch.tensor([prompt], device=dev)
    pos = torch.arange(len(prompt), device=dev)[None]
    logits, feats = target.forward(ids, pos, None, cache, logits_for=slice(-1, None))
    tok = int(logits[0].argmax()) if temperature <= 0 else sample(target_probs(logits[0].cpu(), temperature), gen)
    out = [tok]
    drafter.start(prompt, feats)
    st.forwards = 1
    sync(dev)
    t1 = time.perf_counter()
    st.prefill_s = t1 - t0
    while len(out) < max_new_tokens and tok != eos:
        prefix = len(prompt) + len(out) - 1  # cache length; the root sits at this position
        tree = drafter.propose(tok, temperature, gen)
        sync(dev)
        t2 = time.perf_counter()
        ids = torch.tensor([tree.tokens], device=dev)
        if len(tree) == 1:
            mask, pos = None, torch.tensor([[prefix]], device=dev)
        else:
            mask, pos = masks.mask(tree.parents, tree.depths, prefix)
        if rolls_back:
            if mask is not None and tree.parents != list(range(-1, len(tree) - 1)):
                raise RecycleError("this target (recurrent layers, or DeepSeek-V4's compressors) verifies chains only: "
                                   "use --tree chain:N")
            saved = kv.snapshot(cache)
            mask = None  # a chain is causal
        logits, feats = target.forward(ids, pos, mask, cache)
        path, tok = verify(tree, logits if dev.type == "cpu" or temperature <= 0 else logits.cpu(), temperature, rng, gen)
        accepted = [tree.tokens[i] for i in path]
        if rolls_back and len(path) < len(tree):
            # the recurrent states (or V4's compressors) absorbed the rejected drafts: back to before the chain, then the accepted tokens
            # again (their logits are not needed: `tok` came from this verification)
            kv.restore(saved)
            kv.crop(cache, prefix)
            _, feats = target.forward(ids[:, : len(path)], pos[:, : len(path)], None, cache, logits_for=slice(0, 0))
            st.rollbacks += 1
            st.forwards += 1
        else:
            kv.keep(cache, prefix, path)
            if len(path) < len(tree):
                sel = torch.tensor(path, device=dev)
                feats = {k: v.index_select(0, sel) for k, v in feats.items()}
        sync(dev)
        t3 = time.perf_counter()
        drafter.commit(accepted, feats)
        t4 = time.perf_counter()
        st.draft_s += (t2 - t1) + (t4 - t3)
        st.verify_s += t3 - t2
        t1 = t4
        kids = tree.children()
        st.record(len(path), [bool(kids[n]) for n in path])
        st.forwards += 1
        st.steps += 1
        st.tree_nodes += len(tree) - 1
        for t in accepted[1:] + [tok]:
            out.append(t)
            if t == eos or len(out) >= max_new_tokens:
                break
        tok = out[-1]
    sync(dev)
    st.total_s = time.perf_counter() - t0
    st.new_tokens = len(out)
    return Generation(out, st)
