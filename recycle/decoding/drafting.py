"""Drafting engines: adapters that turn a drafter module into draft trees, keeping its own KV cache.

Every engine speaks the same three calls to the decode loop:
  start(ids, feats)      after the prompt's prefill: the prompt tokens and the target's features
  propose(root, T, gen)  a draft tree under `root` (the token the target emitted last)
  commit(tokens, feats)  the target accepted `tokens` (root first) with these features
and never keeps a cache entry computed from a token the target did not accept.

Engines:
  AutoRegressive   no drafts (the baseline; the tree is the root alone)
  MTPStack         the native MTP modules (`recycle.mtp.MTP`) and the `--to eagle` drafter
                   (`recycle.drafters.EagleDrafter`, same computation, any number of steps)
  Eagle3Engine     the EAGLE-3 layer run recursively, EAGLE-2 style
  MedusaEngine     Medusa heads over the target's last hidden state
  ParallelEngine   Meta's parallel heads: blocks over the trunk state, each with its own KV cache
  AssistantEngine  Gemma 4's assistant: Q-only layers over the target's own KV cache (`bind`)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from recycle.decoding import cache as kv
from recycle.decoding.target import Target
from recycle.decoding.tree import DynamicTreeSpec, Expander, MaskCache, StaticTree, Tree

Shape = int | StaticTree | DynamicTreeSpec


def describe_shape(shape: Shape) -> str:
    if isinstance(shape, int):
        return f"chain:{shape}"
    if isinstance(shape, StaticTree):
        return f"static:{len(shape.parents) - 1} nodes, depth {shape.depth}"
    return f"dynamic:{shape.depth},{shape.top_k},{shape.total_tokens}"


def shape_tokens(shape: Shape) -> int:
    """How many draft tokens one round verifies beyond the committed one: a chain's K, a tree's nodes."""
    if isinstance(shape, int):
        return shape
    if isinstance(shape, StaticTree):
        return len(shape.parents) - 1
    return shape.total_tokens


class Drafter:
    """The autoregressive baseline, and the interface every engine implements."""

    kind = "ar"
    taps: tuple[str, ...] = ()
    shape: Shape = 0
    format = None  # the DrafterFormat record it drafts for (set by load_engine; None: AR decoding)

    def bind(self, cache: DynamicCache) -> None:
        """The target's KV cache for this generation (only engines that attend it keep it)."""

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        pass

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        return Tree.root(root)

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        pass

    def describe(self) -> str:
        return "none" if self.kind == "ar" else f"{self.kind} {describe_shape(self.shape)}"


AutoRegressive = Drafter


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
        self.eh = fam.concat_order != "he"
        self.pre_norm = fam.chained_state == "pre_norm"
        self.zero_pos0 = bool(fam.zero_embed_at_pos0)
        pick = self.REUSE[reuse or "last"]
        self.layers = [mtp.layers[pick(j, mtp.depth)] for j in range(self.steps)]
        self.roles = [{r: mtp._role(lyr, r) for r in ("embed", "head", "final_norm")} for lyr in self.layers]

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids = list(ids)
        self.pending = [feats["last"]]
        self.caches = [DynamicCache() for _ in range(self.steps)]
        self.done = [0] * self.steps
        empty = feats["last"][:0]
        self.carry = [_Span(empty, 0) for _ in range(self.steps)]

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
        y = layer.block(x, attention_mask=mask, position_ids=pos, past_key_values=self.caches[j], use_cache=True,
                        position_embeddings=self.mtp.rotary(x, pos))
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
        ex = Expander(root, self.shape, temperature, gen)
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
            kv.crop(self.caches[j], new_done[j])
            if k < self.steps:
                lo = new_done[k]
                self.carry[j] = _Span(nxt.rows(lo, new_done[j]), lo)
            prev, prev_out, prev_row = nxt, out, rows_of
        self.done = new_done
        return ex.tree()[0]


class Eagle3Engine(Drafter):
    """EAGLE-3: one layer over [emb(t_{i+1}); fc(aux_i)] at position i; deeper tree levels feed the
    layer's own output back at the next position (EAGLE-2 drafting), with a tree mask over the
    draft rows. Committed rows stay in the cache; draft rows are cropped after each proposal."""

    kind = "eagle3"

    def __init__(self, model: nn.Module, shape: Shape, masks: MaskCache, embed: nn.Module, aux_layers: list[int]) -> None:
        self.model, self.shape, self.masks = model, shape, masks
        self.embed = model.embed_tokens if model.embed_tokens is not None else embed
        self.taps = tuple(f"layer:{i}" for i in aux_layers)
        self.layer = model.midlayer

    def _feats(self, feats: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([feats[t] for t in self.taps], dim=-1)

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids = list(ids)
        self.pending = [self._feats(feats)]
        self.cache = DynamicCache()
        self.done = 0

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids.extend(tokens[1:])
        self.pending.append(self._feats(feats))

    def _run(self, g: torch.Tensor, tokens: list[int], positions: list[int], mask: torch.Tensor,
             rows: slice | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The midlayer with this engine's cache (the module's own forward runs without one)."""
        m, lyr = self.model, self.layer
        dev = g.device
        if g.shape[-1] == m.fc.in_features:
            g = m.fc(g)
        emb = self.embed(torch.tensor(tokens, device=dev))[None]
        g = g[None]
        pos = torch.tensor(positions, device=dev)[None]
        normed = lyr.hidden_norm(g)
        residual = normed if lyr.norm_before_residual else g
        x = torch.cat([lyr.input_layernorm(emb), normed], dim=-1)
        a, _ = lyr.self_attn(x, position_embeddings=m.rotary(g, pos), attention_mask=mask, past_key_values=self.cache)
        y = residual + a
        y = (y + lyr.mlp(lyr.post_attention_layernorm(y)))[0]
        return y, m.to_target_logits(m.lm_head(m.norm(y[rows])))

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        C = len(self.ids)
        self.ids.append(root)
        aux = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        s = self.done
        y, logits = self._run(aux, self.ids[s + 1 : C + 1], list(range(s, C)), self.masks.causal(C - s, s),
                              slice(C - s - 1, C - s))
        self.done = C
        ex = Expander(root, self.shape, temperature, gen)
        ex.expand(logits)
        state = {0: y[-1]}
        slot: dict[int, int] = {}
        while not ex.done():
            front = ex.frontier()
            m, used = len(front), len(slot)
            allow = torch.zeros(m, used + m, dtype=torch.bool)
            for i, f in enumerate(front):
                a = ex.par[f]
                while a > 0:
                    allow[i, slot[a]] = True
                    a = ex.par[a]
                allow[i, used + i] = True
            allow = torch.cat([torch.ones(m, C, dtype=torch.bool), allow], dim=1).to(self.masks.device)
            mask = torch.zeros(allow.shape, dtype=self.masks.dtype, device=self.masks.device)
            mask = mask.masked_fill_(~allow, self.masks.neg)[None, None]
            hidden = torch.stack([state[ex.par[f]] for f in front])
            y, logits = self._run(hidden, [ex.tok[f] for f in front], [C - 1 + ex.dep[f] for f in front], mask,
                                  slice(None))
            for i, f in enumerate(front):
                state[f] = y[i]
                slot[f] = used + i
            ex.expand(logits)
        kv.crop(self.cache, C)
        return ex.tree()[0]


class MedusaEngine(Drafter):
    """Medusa: head i reads the target's last committed hidden state h_{C-1} and proposes depth i+1
    (the token i+2 ahead of that state); no cache, the same head row serves every node of a level."""

    kind = "medusa"
    taps = ("last",)

    def __init__(self, model: nn.Module, shape: Shape, masks: MaskCache) -> None:
        self.model, self.shape, self.masks = model, shape, masks

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.h = feats["last"][-1:]

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.h = feats["last"][-1:]

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        depth = self.shape if isinstance(self.shape, int) else self.shape.depth
        m = self.model  # only the heads the tree reaches
        heads = [head(block(self.h)) for block, head in list(zip(m.blocks, m.lm_heads))[:depth]]
        return per_level_tree(root, self.shape, [lg[-1:] for lg in heads], temperature, gen)


def per_level_tree(root: int, shape: Shape, rows: list[torch.Tensor], temperature: float,
                   gen: torch.Generator | None) -> Tree:
    """A tree whose every node at depth d+1 draws from the same logits row `rows[d]` [1, V]: heads that
    read only the last committed state (Medusa, parallel heads) cannot condition on their parents."""
    ex = Expander(root, shape, temperature, gen)
    while not ex.done():
        ex.expand(rows[ex.level].expand(len(ex.frontier()), -1))
    return ex.tree()[0]


class ParallelEngine(Drafter):
    """Parallel heads (`recycle.drafters.parallel`): head k, a block over the trunk states with its own
    KV cache, proposes depth k+1 from the last committed trunk state; the heads' top-k choices make a
    Medusa-style static tree. The caches only ever hold committed positions."""

    kind = "parallel-heads"

    def __init__(self, heads: nn.Module, shape: Shape, masks: MaskCache, tap: str) -> None:
        self.heads, self.shape, self.masks = heads, shape, masks
        self.taps = (tap,)

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.pending = [feats[self.taps[0]]]
        self.caches = self.heads.new_caches()
        self.done = 0

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.pending.append(feats[self.taps[0]])

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        h = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        n = h.shape[0]
        pos = torch.arange(self.done, self.done + n, device=h.device)[None]
        depth = self.shape if isinstance(self.shape, int) else self.shape.depth
        # every head's block runs over the n new states (its cache must hold them all); only the last
        # state's row of the heads the tree reaches goes through the vocabulary projection
        feats = self.heads.features(h[None], pos, self.masks.causal(n, self.done), self.caches)
        self.done += n
        return per_level_tree(root, self.shape, [self.heads.head(f[0, -1:]) for f in feats[:depth]], temperature, gen)


class AssistantEngine(Drafter):
    """A Gemma 4 assistant (`recycle.drafters.gemma4`): every node of the round sits at the root's position
    C and attends the target's cached K/V at positions < C; a node's input is [target embedding of its
    token; its parent's projected output] (the root's: the target's last committed state). Nodes do not
    see each other, so a tree costs one assistant call per level and nothing is ever cropped."""

    kind = "gemma4-assistant"
    taps = ("last",)

    def __init__(self, assistant: nn.Module, shape: Shape, masks: MaskCache, target: Target) -> None:
        from recycle.drafters.gemma4 import kv_source_layers

        self.assistant, self.shape, self.masks, self.embed = assistant, shape, masks, target.embed
        self.sources = kv_source_layers(target.config)
        self.window = getattr(target.config, "sliding_window", None)

    def bind(self, cache: DynamicCache) -> None:
        self.cache = cache

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.n = len(ids)
        self.h = feats["last"][-1:]

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.n += len(tokens)
        self.h = feats["last"][-1:]

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        from recycle.drafters.gemma4 import step
        from recycle.errors import RecycleError

        C = self.n
        depth = self.shape if isinstance(self.shape, int) else self.shape.depth
        if self.window is not None and "sliding_attention" in self.sources and C + depth >= self.window:
            raise RecycleError(f"position {C}: past the target's sliding window ({self.window}); recycle's decoder "
                               "keeps whole sliding-layer caches only within it")
        layers = self.cache.layers
        kv = {t: (layers[i].keys[..., :C, :], layers[i].values[..., :C, :]) for t, i in self.sources.items()}
        ex = Expander(root, self.shape, temperature, gen)
        out: dict[int, torch.Tensor] = {-1: self.h[0]}  # node -> its projected output (-1: the root's input)
        while not ex.done():
            front = ex.frontier()
            dev = self.h.device
            tokens = torch.tensor([ex.tok[f] for f in front], device=dev)
            inputs = torch.cat([self.embed(tokens), torch.stack([out[ex.par[f]] for f in front])], dim=-1)[None]
            pos = torch.full((1, len(front)), C, dtype=torch.long, device=dev)
            logits, nxt = step(self.assistant, inputs, pos, kv, None)
            for i, f in enumerate(front):
                out[f] = nxt[0, i]
            ex.expand(logits[0])
        return ex.tree()[0]


def parse_shape(value: str | None, default: Shape, max_depth: int | None = None) -> Shape:
    """`--tree`: chain[:N], dynamic[:DEPTH,TOPK,TOTAL], or Medusa-style choices (JSON list or file)."""
    from recycle.decoding.tree import parse_dynamic, parse_tree_option
    from recycle.errors import RecycleError

    if value is None:
        return default
    v = value.strip()
    if v == "chain" or v.startswith("chain:"):
        if v == "chain":
            return default.depth if not isinstance(default, int) else default
        try:
            n = int(v.split(":", 1)[1])
        except ValueError:
            raise RecycleError(f"--tree {value!r}: expected chain:N, e.g. chain:2") from None
        if n < 0:
            raise RecycleError(f"--tree {value!r}: the chain length must be ≥ 0")
        return n
    if v == "dynamic":
        return DynamicTreeSpec()
    if v.startswith("dynamic:"):
        return parse_dynamic(v)
    shape = StaticTree.from_choices(parse_tree_option(v))
    if max_depth is not None and shape.depth > max_depth:
        raise RecycleError(f"--tree is {shape.depth} deep; this drafter drafts at most {max_depth} tokens ahead")
    return shape


DEFAULT_DYNAMIC = DynamicTreeSpec()
HYBRID_CHAIN = 3  # the default for targets that verify chains only (vLLM's and llama.cpp's MTP drafting: chains)


@dataclass
class EngineRequest:
    """What a format's engine factory (its record's `engine`) is given."""

    source: Path  # the drafter directory, or the checkpoint whose own modules draft
    target: Target
    masks: MaskCache
    tree: str | None  # --tree, unparsed
    model: nn.Module | None = None  # the drafter module (directory formats), on the target's device
    config: dict | None = None  # its config.json


def _static_default(heads: int) -> StaticTree:
    """Medusa's default tree, cut to the depth a set of heads reaches."""
    from recycle.decoding.tree import DEFAULT_MEDUSA_CHOICES

    return StaticTree.from_choices([c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= heads])


def eagle_engine(r: EngineRequest) -> Drafter:
    return MTPStack(r.model, parse_shape(r.tree, DEFAULT_DYNAMIC), r.masks, kind="eagle", reuse="last")


def eagle3_engine(r: EngineRequest) -> Drafter:
    from recycle.formats.eagle3 import aux_layers

    aux = aux_layers(r.config, r.target.num_layers)
    return Eagle3Engine(r.model, parse_shape(r.tree, DEFAULT_DYNAMIC), r.masks, r.target.embed, list(aux))


def medusa_engine(r: EngineRequest) -> Drafter:
    heads = r.model.num_heads
    return MedusaEngine(r.model, parse_shape(r.tree, _static_default(heads), max_depth=heads), r.masks)


def assistant_engine(r: EngineRequest) -> Drafter:
    shape = parse_shape(r.tree, DEFAULT_DYNAMIC)
    if r.model.generation_config.num_assistant_tokens is None:  # transformers' assistant_model= reads it
        r.model.generation_config.num_assistant_tokens = shape if isinstance(shape, int) else shape.depth
    return AssistantEngine(r.model, shape, r.masks, r.target)


def native_mtp_engine(r: EngineRequest) -> Drafter:
    from recycle.mtp import MTP

    mtp = MTP.from_checkpoint(r.source, dtype=r.target.dtype).to(r.target.device)
    # Past the stored depth the modules are chained again, module k mod n, as vLLM's `mtp` does.
    return MTPStack(mtp, parse_shape(r.tree, mtp.depth), r.masks, kind="native-mtp", reuse="cycle")


def parallel_engine(r: EngineRequest) -> Drafter:
    from recycle.drafters.parallel import ParallelHeads

    heads = ParallelHeads.from_checkpoint(r.source, r.target.model)
    return ParallelEngine(heads, parse_shape(r.tree, _static_default(heads.num_heads), max_depth=heads.num_heads),
                          r.masks, tap=f"layer:{r.target.num_layers - 1}")


def load_engine(drafter_dir: str | None, target: Target, masks: MaskCache, tree: str | None = None,
                native: bool = False, target_dir: str | None = None) -> Drafter:
    """The drafting engine for a drafter directory (its format's record builds the module and the engine, after
    the one fit check), the target's own modules (`native`, or DRAFTER_DIR = the target dir: the family's
    native format), or none (`drafter_dir` None: AR decoding)."""
    from recycle.checkpoint import Checkpoint, load_json
    from recycle.drafters import load_drafter
    from recycle.errors import RecycleError
    from recycle.families import match
    from recycle.fit import check_drafter
    from recycle.formats import native_format, of_directory

    if drafter_dir is None and not native:
        return Drafter()
    same = drafter_dir is not None and target_dir is not None and Path(drafter_dir).resolve() == Path(target_dir).resolve()
    if native or same:
        src = Path(target_dir if drafter_dir is None else drafter_dir)
        fmt = native_format(match(Checkpoint(src)).family.kind, src)
        req = EngineRequest(src, target, masks, tree)
    else:
        d = Path(drafter_dir)
        if not d.is_dir():
            raise RecycleError(f"{d}: no such drafter directory")
        fmt = of_directory(d)
        cfg = load_json(d / "config.json", "drafter config.json")
        check_drafter(fmt, cfg, target.config.to_dict(), d, target_dir, str(d))
        model = load_drafter(d, dtype=target.dtype).to(target.device)
        req = EngineRequest(d, target, masks, tree, model, cfg)
    engine = fmt.resolve("engine")(req)
    if target.recurrent and not isinstance(engine.shape, int):  # linear attention cannot take a tree mask
        if tree is not None:
            raise RecycleError(f"--tree {tree}: this target has recurrent (linear-attention) layers, which verify "
                               "chains only: use --tree chain:N")
        req.tree = f"chain:{HYBRID_CHAIN}"
        engine = fmt.resolve("engine")(req)
    engine.format = fmt
    return engine
