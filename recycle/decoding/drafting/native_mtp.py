"""Native MTP drafting (`native-mtp`): a checkpoint's own sequential MTP modules, run as `MTPStack`, which the
`--to eagle` drafter (`eagle.py`) runs too."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from recycle.decoding.cache import crop, token_state
from recycle.decoding.drafting.base import CHAINS, ENGINES, Drafter, EngineRequest
from recycle.decoding.tree import Expander, MaskCache, Shape, Tree, parse_shape, windowed
from recycle.errors import RecycleError
from recycle.mtp import MTP


def _rows_mask(n_true: int, anc: torch.Tensor, prefix: int, masks: MaskCache) -> torch.Tensor:
    """Additive mask for `n_true` causal rows followed by tree rows whose mutual visibility is `anc` [m, m];
    tree rows see every causal row; causal rows do not see tree rows."""
    m = anc.shape[0]
    allow = torch.zeros(n_true + m, n_true + m, dtype=torch.bool)
    allow[:n_true, :n_true] = torch.ones(n_true, n_true, dtype=torch.bool).tril_()
    allow[n_true:, :n_true] = True
    allow[n_true:, n_true:] = anc
    allow = torch.cat([torch.ones(n_true + m, prefix, dtype=torch.bool), allow], dim=1).to(masks.device)
    return torch.zeros(allow.shape, dtype=masks.dtype, device=masks.device).masked_fill_(~allow, masks.neg)[None, None]


@dataclass
class _Span:
    """Chained states of consecutive positions [start, start + len)."""

    states: torch.Tensor  # [n, H]
    start: int

    @property
    def end(self) -> int:
        return self.start + self.states.shape[0]

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """States of positions [lo, hi)."""
        return self.states[lo - self.start : hi - self.start]

    def cat(self, other: torch.Tensor) -> _Span:
        return _Span(torch.cat([self.states, other]) if self.states.numel() else other, self.start)


class MTPStack(Drafter):
    """MTP-semantics drafting: step k runs module min(k, n-1) at the *hidden state's* position.

    Step k at position i reads the step-(k-1) state at i and the token t_{i+k} (MTP depth k,
    formats-source §0.2), attending to step k's own cache over positions < i. So step k keeps a
    cache of its own, whose entries are exact only where t_{i+k} is a committed token: at each
    propose, step k computes positions [done_k, C-1] (C = the root's position) in one call, the
    committed ones (i + k ≤ C) are kept, and the rows reading draft tokens are cropped afterwards.
    In a tree, a draft node at depth d owns the row of step k at position C+d-k (it reads that
    node's token), and sees its ancestors' rows: one call per step covers every node of the tree.
    """

    kind = "mtp"
    taps = ("last",)

    REUSE = {"last": lambda j, n: min(j, n - 1), "cycle": lambda j, n: j % n}

    def __init__(self, mtp: nn.Module, shape: Shape, masks: MaskCache, kind: str = "mtp",
                 reuse: str | None = None) -> None:
        """`reuse`: which module runs a step past the stored depth. None: none does (the chain stops
        at the depth); "last": the last module (the EAGLE drafter, as trained by distill); "cycle":
        module k mod n (vLLM's `mtp`, TensorRT-LLM's MTP Eagle: one module chained for every step)."""
        self.mtp, self.masks, self.kind = mtp, masks, kind
        depth = shape if isinstance(shape, int) else shape.depth
        self.steps = depth if reuse else min(depth, mtp.depth)
        if isinstance(shape, int):
            shape = self.steps
        self.shape = shape
        fam = mtp.family
        self.eh = fam.run.concat_order != "he"
        self.pre_norm = fam.run.chained_state == "pre_norm"
        self.zero_pos0 = bool(fam.run.zero_embed_at_pos0)
        pick = self.REUSE[reuse or "last"]
        picked = [pick(j, mtp.depth) for j in range(self.steps)]
        self.layers = [mtp.layers[i] for i in picked]
        self.roles = [{r: mtp.role(lyr, r) for r in ("embed", "head", "final_norm")} for lyr in self.layers]
        # each step's cache: the cache layer transformers gives the block's layer index (the config's `layer_types`
        # reach the MTP layers), cropped and tree-extended in place by recycle's crop
        base = int(getattr(mtp.config, "num_hidden_layers", 0) or 0)
        config = copy.copy(mtp.config)
        config.num_hidden_layers = base + mtp.depth
        types_, kwargs = get_layer_types_and_kwargs(config)  # what DynamicCache(config=...) builds, per layer
        self.slots = [base + i for i in picked]
        self.kinds = [(DYNAMIC_LAYER_TYPE_MAPPING[types_[slot]], kwargs[slot]) for slot in self.slots]
        self.windows: list[int | None] = []
        for layer, (kind, kw) in zip(self.layers, self.kinds):
            template = kind(**kw)
            if issubclass(kind, LinearAttentionCacheLayerMixin):
                raise RecycleError(
                    f"{fam.title}: its MTP block keeps {kind.__name__} state ({layer.layer_type} layers), a recurrent "
                    "state recycle's tree drafting cannot crop: it cannot draft with this block (inspect, convert "
                    "and distill work)")
            window = None
            if issubclass(kind, DynamicSlidingWindowLayer):
                if kind is not DynamicSlidingWindowLayer or layer.layer_type != "sliding_attention":
                    raise RecycleError(
                        f"{fam.title}: its MTP block's {layer.layer_type} layers ({kind.__name__}) need a mask "
                        "recycle's tree drafting cannot build: it cannot draft with this block (inspect, convert "
                        "and distill work)")
                window = template.sliding_window  # the whole cache kept, the window applied in the mask
            else:
                try:
                    token_state(template)  # a layer holding state crop cannot cut
                except RecycleError as e:
                    raise RecycleError(f"{fam.title}: its MTP block's cache: {e}: it cannot draft with this block "
                                       "(inspect, convert and distill work)") from None
            self.windows.append(window)

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids = list(ids)
        self.pending = [feats["last"]]
        self.caches = [self._cache(j) for j in range(self.steps)]
        self.done = [0] * self.steps
        empty = feats["last"][:0]
        self.carry = [_Span(empty, 0) for _ in range(self.steps)]

    def _cache(self, j: int) -> DynamicCache:
        """Step j's cache: empty plain layers below the block's index, then the block's own kind (a sliding-window
        block a plain layer: `windowed` masks its window)."""
        kind, kw = self.kinds[j]
        cache = DynamicCache()
        cache.layers[:] = [DynamicLayer() for _ in range(self.slots[j])]
        cache.layers.append(DynamicLayer() if self.windows[j] is not None else kind(**kw))
        return cache

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids.extend(tokens[1:])
        self.pending.append(feats["last"])

    def _step(self, j: int, hidden: torch.Tensor, tokens: list[int], positions: list[int], mask: torch.Tensor,
              draft_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of step j over rows; returns (chained states [R, H], logits of draft_rows)."""
        layer, roles = self.layers[j], self.roles[j]
        dev = hidden.device
        tok = torch.tensor(tokens, device=dev)
        pos = torch.tensor(positions, device=dev)
        e = roles["embed"](tok)
        if self.zero_pos0 and 0 in positions:
            e = e.masked_fill((pos == 0)[:, None], 0.0)
        e, h = layer.embed_norm(e), layer.hidden_norm(hidden)
        x = layer.proj(torch.cat([e, h] if self.eh else [h, e], dim=-1))[None]
        pos = pos[None]
        if self.windows[j] is not None:
            mask = windowed(mask, positions, self.done[j], self.windows[j])
        y = layer.block(x, attention_mask=mask, position_ids=pos, past_key_values=self.caches[j], use_cache=True,
                        position_embeddings=self.mtp.rope(x, pos, layer.layer_type))
        y = (y[0] if isinstance(y, tuple) else y)[0]
        norm = roles["final_norm"]
        normed = (norm(y[draft_rows]) if norm is not None else y[draft_rows]) if self.pre_norm else None
        out = y if self.pre_norm else (norm(y) if norm is not None else y)
        if not draft_rows:
            return out, y[:0]
        return out, roles["head"](normed if self.pre_norm else out[draft_rows])

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        C = len(self.ids)  # the root's position
        self.ids.append(root)
        ex = Expander(root, self.shape, temperature, gen, self.draft_sample)
        expanded: list[int] = []  # draft nodes with children below them, in creation order
        prev = _Span(torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0], self.done[0])
        self.pending = []
        prev_out: torch.Tensor | None = None
        prev_row: dict[int, int] = {}
        new_done = [max(self.done[j], C - j) for j in range(self.steps)]
        for j in range(self.steps):
            k = j + 1
            s, hi = self.done[j], C - k  # committed rows this call: positions [s, hi]
            n_true = max(0, hi - s + 1)
            parts, tokens, positions = [], [], []
            if n_true:
                parts.append(prev.rows(s, hi + 1))
                tokens += self.ids[s + k : hi + k + 1]
                positions += list(range(s, hi + 1))
            nodes = [n for n in expanded if C + ex.dep[n] - k >= 0]
            for n in nodes:  # node n (depth d) owns the row at position C+d-k; its input is its parent's row
                p, pos = ex.par[n], C + ex.dep[n] - k
                parts.append(prev.rows(pos, pos + 1) if p == 0 else prev_out[prev_row[p]][None])
                tokens.append(ex.tok[n])
                positions.append(pos)
            rows_of = {n: n_true + i for i, n in enumerate(nodes)}
            live = not ex.done()
            draft_rows = ([n_true - 1] if j == 0 else [rows_of[f] for f in ex.frontier()]) if live else []
            if nodes:
                idx = {n: i for i, n in enumerate(nodes)}
                anc = torch.eye(len(nodes), dtype=torch.bool)
                for i, n in enumerate(nodes):
                    if ex.par[n] in idx:
                        anc[i] |= anc[idx[ex.par[n]]]
                mask = _rows_mask(n_true, anc, s, self.masks)
            else:
                mask = self.masks.causal(n_true, s)
            hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
            out, logits = self._step(j, hidden, tokens, positions, mask, draft_rows)
            if live:
                ex.expand(logits)
                expanded.extend(ex.frontier())
            # step k's committed states: input of the next call, and (cropped) the carry to the next propose
            nxt = self.carry[j].cat(out[:n_true]) if n_true else self.carry[j]
            crop(self.caches[j], new_done[j])
            if k < self.steps:
                lo = new_done[k]
                self.carry[j] = _Span(nxt.rows(lo, new_done[j]), lo)
            prev, prev_out, prev_row = nxt, out, rows_of
        self.done = new_done
        return ex.tree()[0]


@ENGINES.register("native-mtp")
def native_mtp_engine(r: EngineRequest) -> Drafter:
    mtp = MTP.from_checkpoint(r.source, dtype=r.target.dtype).to(r.target.device)
    shape = parse_shape(r.tree, mtp.depth)
    runtime = mtp.family.run.runtime
    if runtime is not None:  # a runtime of its own (DeepSeek-V4's streams): its own drafting, `CHAINS`
        return CHAINS.get(runtime, mtp.family.title)(mtp, shape)
    # Past the stored depth the modules are chained again, module k mod n, as vLLM's `mtp` does.
    return MTPStack(mtp, shape, r.masks, kind="native-mtp", reuse="cycle")
