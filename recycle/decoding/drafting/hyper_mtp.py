"""DeepSeek-V4's own MTP modules drafting (`native-mtp` on a `deepseek_v4` checkpoint): `StreamChain`, registered in
`CHAINS` under the runtime's name (`recycle.mtp.deepseek_v4`).

V4's modules chain the trunk's hyper-connection streams [C, H] per position (the target's "streams" tap), not one
state, so `MTPStack` cannot run them. A V4 target verifies chains (its compressor caches are rolled back whole,
`recycle.decoding.cache`), so this drafts chains: step k at position i reads step k-1's streams at i and the token
t_{i+k}, exactly `DeepseekV4MTP.forward`, with the drafts as the last tokens.

The modules keep no cache: each propose runs every step over a tail of the sequence. A module's block attends over its
sliding window W (V4's MTP layers: compress ratio 0), so step k at the last position needs step k-1 over the W
positions before it, and an n-step chain is exact from the last n·(W−1)+1 positions: bounded per draft token whatever
the context (DeepSeek-V4-Flash: W = 128, n = 1, 128 rows of one block per draft; a 3-step chain 382 rows). A module
whose block compresses (ratio > 0) pools every token since position 0, so there the tail is the whole sequence.
"""

from __future__ import annotations

import torch

from recycle.decoding.drafting.base import CHAINS, Drafter
from recycle.decoding.tree import Expander, Shape, Tree
from recycle.errors import RecycleError
from recycle.mtp.deepseek_v4 import DeepseekV4MTP

TAP = "streams"


@CHAINS.register("deepseek_v4")
class StreamChain(Drafter):
    """Chains of V4's MTP modules: past the stored depth n, step k runs module k mod n (`reuse="cycle"`, vLLM's `mtp`)
    or module n−1 (`"last"`, the `--to eagle` drafter, as distill trains it)."""

    taps = (TAP,)
    REUSE = {"cycle": lambda k, n: k % n, "last": lambda k, n: min(k, n - 1)}

    def __init__(self, mtp: DeepseekV4MTP, shape: Shape, kind: str = "native-mtp", reuse: str = "cycle") -> None:
        if not isinstance(shape, int):
            raise RecycleError("DeepSeek-V4's MTP modules draft chains only (its target verifies chains): use --tree chain:N")
        self.mtp, self.shape, self.kind = mtp, shape, kind
        self.layers = [mtp.layers[self.REUSE[reuse](k, mtp.depth)] for k in range(shape)]
        types = mtp.config.mtp_layer_types if getattr(mtp.config, "mtp_layer_types", None) else ["sliding_attention"]
        window = int(mtp.config.sliding_window)
        self.tail = None if any(t != "sliding_attention" for t in types) else shape * (window - 1) + 1

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids = list(ids)
        self.streams = feats[TAP]  # [N, C, H]: positions [len(ids) - N, len(ids))
        self._trim()

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids.extend(tokens[1:])
        self.streams = torch.cat([self.streams, feats[TAP]])
        self._trim()

    def _trim(self) -> None:
        if self.tail is not None and self.streams.shape[0] > self.tail:
            self.streams = self.streams[-self.tail :]

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        C = len(self.ids)  # the root's position; streams cover [lo, C)
        self.ids.append(root)  # committed: the target emitted it (commit adds the accepted drafts)
        ex = Expander(root, self.shape, temperature, gen, self.draft_sample)
        if ex.done():
            return ex.tree()[0]
        lo = C - self.streams.shape[0]
        seq = list(self.ids)
        dev = self.streams.device
        positions = torch.arange(lo, C, device=dev)[None]
        state = self.streams[None]
        context = self.mtp.context(state, positions)
        for k, layer in enumerate(self.layers):
            tokens = torch.tensor([seq[lo + k + 1 : C + k + 1]], device=dev)
            state, normed, _ = self.mtp.step(layer, state, tokens, context, heads=False)
            ex.expand(self.mtp.role(layer, "head")(normed[0, -1:]))  # the last row's draft: the next token
            seq.append(ex.tok[ex.frontier()[0]])
            if ex.done():
                break
        return ex.tree()[0]
