"""Draft trees: the token tree a drafter proposes, its attention mask and positions, and tree shapes.

A tree is stored flat in topological order: node 0 is the root (the token the target sampled last
step, not yet run through it), every other node's parent has a smaller index. A chain is a tree
with one branch, so one verifier and one decode loop serve chains, static trees (Medusa choices)
and dynamic trees (EAGLE-2) alike.

Mask convention: an additive float mask (0 = attend, dtype-min = blocked) of shape
[1, 1, nodes, prefix + nodes]. transformers returns a 4D mask untouched for both eager and sdpa
attention (`masking_utils._preprocess_mask_arguments`), so the same tensor serves both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recycle.errors import RecycleError, did_you_mean


@dataclass
class Tree:
    """A draft tree. `q[i]` is the distribution node i was drawn from (None: chosen deterministically)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.q:
            self.q = [None] * len(self.tokens)

    @classmethod
    def root(cls, token: int) -> Tree:
        return cls([token], [-1], [0])

    def add(self, token: int, parent: int, q: torch.Tensor | None = None) -> int:
        """Append a child of `parent`; returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.q.append(q)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].append(i)
        return out

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row i is True at i and at every ancestor of i (what node i may attend to)."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def windowed(mask: torch.Tensor, positions: list[int], prefix: int, window: int) -> torch.Tensor:
    """A sliding-window layer's mask: rows at `positions` also blocked from keys `window` or more positions back
    (transformers' `sliding_window_overlay`: key k visible from query q iff k > q - window); the keys are the cache's
    positions 0..prefix-1, then the rows' own."""
    dev = mask.device
    rows = torch.tensor(positions, device=dev)
    cols = torch.cat([torch.arange(prefix, device=dev), rows])
    return mask.masked_fill(cols[None, :] <= rows[:, None] - window, torch.finfo(mask.dtype).min)


class MaskCache:
    """Tree masks and depth offsets, built once per tree shape and reused (static trees hit every step).

    Why: on a CPU-bound tiny model, per-step Python work and allocation are a visible share of the
    step time; a chain or a Medusa tree has the same shape every step.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self.neg = torch.finfo(dtype).min
        self._shapes: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._zeros = torch.zeros(0, dtype=dtype, device=self.device)

    def tree_part(self, parents: Sequence[int], depths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(parents)
        hit = self._shapes.get(key)
        if hit is None:
            anc = ancestor_matrix(parents).to(self.device)
            part = torch.zeros(anc.shape, dtype=self.dtype, device=self.device).masked_fill_(~anc, self.neg)
            hit = (part, torch.tensor(list(depths), dtype=torch.long, device=self.device))
            if len(self._shapes) < 4096:
                self._shapes[key] = hit
        return hit

    def mask(self, parents: Sequence[int], depths: Sequence[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(additive mask [1, 1, N, prefix+N], position ids [1, N]) for a tree placed after `prefix` tokens."""
        part, dep = self.tree_part(parents, depths)
        n = part.shape[0]
        if self._zeros.shape[0] < prefix * n:
            self._zeros = torch.zeros(max(prefix * n, 2 * self._zeros.shape[0]), dtype=self.dtype, device=self.device)
        left = self._zeros[: prefix * n].view(n, prefix)
        full = torch.cat([left, part], dim=1)[None, None]
        return full, (dep + prefix)[None]

    def causal(self, n: int, prefix: int) -> torch.Tensor:
        """[1, 1, n, prefix+n] causal mask for n consecutive tokens after a prefix."""
        return self.mask(list(range(-1, n - 1)), list(range(n)), prefix)[0]


def chain_parents(length: int) -> list[int]:
    """Parents of a chain with `length` draft tokens below the root."""
    return list(range(-1, length))


# A Medusa-style default for a 2–4 head drafter on a tiny model: wide at depth 1, narrowing fast.
DEFAULT_MEDUSA_CHOICES: list[list[int]] = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [1, 0], [0, 2], [2, 0], [1, 1],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1],
]  # fmt: skip


def validate_choices(choices: object, max_depth: int | None = None) -> list[list[int]]:
    """Check a Medusa-choices list: non-empty paths of non-negative ints, prefix-closed; sorted by (len, path)."""
    if not isinstance(choices, list) or not choices:
        raise RecycleError("a tree must be a non-empty JSON list of paths, e.g. [[0], [1], [0, 0]]")
    paths: list[tuple[int, ...]] = []
    for c in choices:
        if not isinstance(c, list) or not c or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in c):
            raise RecycleError(f"tree path {c!r} is not a non-empty list of non-negative integers")
        paths.append(tuple(c))
    if len(set(paths)) != len(paths):
        raise RecycleError("tree paths repeat")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise RecycleError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
    if max_depth is not None:
        deep = [list(p) for p in paths if len(p) > max_depth]
        if deep:
            raise RecycleError(f"tree path {deep[0]} is deeper than the drafter's {max_depth} heads")
    return [list(p) for p in sorted(paths, key=lambda p: (len(p), p))]


def parse_tree_option(value: str | None) -> list[list[int]] | None:
    """`--tree`: a JSON list of paths, or a file holding one."""
    if value is None:
        return None
    text = value
    if not value.lstrip().startswith("["):
        path = Path(value)
        if not path.is_file():
            raise RecycleError(f"--tree: {value} is neither a JSON list of paths nor a file")
        text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecycleError(f"--tree: not valid JSON ({e.msg} at char {e.pos})") from None
    return validate_choices(data)


@dataclass(frozen=True)
class StaticTree:
    """A tree shape from Medusa choices: node i > 0 is path `paths[i-1]`; rank = top-k index at its depth."""

    paths: list[list[int]]
    parents: list[int]
    depths: list[int]
    ranks: list[int]

    @classmethod
    def from_choices(cls, choices: list[list[int]]) -> StaticTree:
        paths = validate_choices(choices)
        index = {(): 0}
        parents, depths, ranks = [-1], [0], [0]
        for i, p in enumerate(paths, start=1):
            index[tuple(p)] = i
            parents.append(index[tuple(p[:-1])])
            depths.append(len(p))
            ranks.append(p[-1])
        return cls(paths, parents, depths, ranks)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def topk_per_depth(self) -> list[int]:
        """How many candidates each depth needs (max rank + 1)."""
        out = [0] * self.depth
        for d, r in zip(self.depths[1:], self.ranks[1:]):
            out[d - 1] = max(out[d - 1], r + 1)
        return out


@dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2 dynamic tree parameters: expand the `top_k` best frontier nodes per depth by cumulative
    draft log-prob, `depth` drafter passes, keep the `total_tokens` best nodes overall."""

    # EAGLE ships depth 5–7, top_k 8–10, total 60. On a CPU, verifying a wide tree costs nearly as
    # much per token as decoding it, so the default stays small (see BENCHMARKS.md, issue 5).
    depth: int = 3
    top_k: int = 2
    total_tokens: int = 6

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise RecycleError("dynamic tree depth, top_k and total_tokens must be ≥ 1")


def parse_dynamic(value: str) -> DynamicTreeSpec:
    """`--tree dynamic:DEPTH,TOPK,TOTAL` (EAGLE-2 style)."""
    try:
        d, k, t = (int(x) for x in value.split(":", 1)[1].split(","))
    except ValueError:
        raise RecycleError(f"--tree {value!r}: expected dynamic:DEPTH,TOPK,TOTAL, e.g. dynamic:3,2,6") from None
    return DynamicTreeSpec(d, k, t)


Shape = int | StaticTree | DynamicTreeSpec  # a chain of K tokens, Medusa choices, or an EAGLE-2 dynamic tree


def parse_shape(value: str | None, default: Shape, max_depth: int | None = None) -> Shape:
    """`--tree`: chain[:N], dynamic[:DEPTH,TOPK,TOTAL], or Medusa-style choices (JSON list or file)."""
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


def medusa_default(heads: int) -> StaticTree:
    """Medusa's default tree, cut to the depth a set of heads reaches."""
    return StaticTree.from_choices([c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= heads])


DRAFT_SAMPLES = ("greedy", "probabilistic")  # vLLM 0.32: vllm/config/speculative.py:85 (the field, default greedy: :600)


def default_rule(shape: Shape) -> str:
    """The draft-sampling rule a shape takes by default: `probabilistic` where its drafts can be sampled without
    biasing their law (chains, static trees), `greedy` for a dynamic tree (it keeps the best-scored candidates)."""
    return "greedy" if isinstance(shape, DynamicTreeSpec) else "probabilistic"


def check_rule(rule: str, shape: Shape) -> None:
    """Refuse an unknown rule, and probabilistic drafts on a dynamic tree (one line)."""
    if rule not in DRAFT_SAMPLES:
        raise RecycleError(f"--draft-sample {rule!r}: choose {' or '.join(DRAFT_SAMPLES)}"
                           f"{did_you_mean(rule, DRAFT_SAMPLES)}")
    if rule == "probabilistic" and isinstance(shape, DynamicTreeSpec):
        raise RecycleError("--draft-sample probabilistic needs a chain or a static --tree: a dynamic tree keeps only "
                           "its best-scored candidates, which biases the sampled drafts' law (speculative sampling "
                           "would no longer be lossless); use --draft-sample greedy")


class Expander:
    """Grows a draft tree level by level from the drafter's logits, for any tree shape.

    The drafting engines differ in how they get logits (per-depth MTP modules, one recursive
    EAGLE layer, Medusa heads); the choice of children does not, so it lives here once.
    `frontier()` names the candidate nodes whose children the next level needs; `expand(rows)`
    takes one logits row per frontier node. Candidate 0 is the root.

    The draft-sampling rule (`rule`, vLLM's `draft_sample_method`; None: `default_rule(shape)`) picks the
    children at temperature T > 0. `greedy`: the top-k of the draft distribution, recorded as q = δ (None).
    `probabilistic`: sampled from q = softmax(logits / T), a node's children drawn without replacement in
    rank order, child j recorded with q less its earlier siblings' tokens, renormalised: the law verify()'s
    sibling-wise rejection assumes. At T = 0 both are the top-k.
    """

    def __init__(self, root: int, shape: Shape, temperature: float = 0.0,
                 gen: torch.Generator | None = None, rule: str | None = None) -> None:
        rule = default_rule(shape) if rule is None else rule
        check_rule(rule, shape)
        self.shape, self.temperature, self.gen = shape, temperature, gen
        self.sampled = rule == "probabilistic" and temperature > 0
        self.tok, self.par, self.dep, self.score = [root], [-1], [0], [0.0]
        self.q: list[torch.Tensor | None] = [None]
        self.level = 0
        self._front = [0]
        self._static_id = [0]  # candidate -> static node (static shapes)
        if isinstance(shape, StaticTree):
            self._kids: list[list[int]] = [[] for _ in shape.parents]
            for i, p in enumerate(shape.parents[1:], start=1):
                self._kids[p].append(i)
        self.max_depth = shape if isinstance(shape, int) else shape.depth

    def frontier(self) -> list[int]:
        return self._front

    def done(self) -> bool:
        return self.level >= self.max_depth or not self._front

    def _add(self, parent: int, token: int, score: float, q: torch.Tensor | None = None) -> int:
        self.tok.append(token)
        self.par.append(parent)
        self.dep.append(self.dep[parent] + 1)
        self.score.append(score)
        self.q.append(q)
        return len(self.tok) - 1

    def expand(self, logits: torch.Tensor) -> None:
        """logits [len(frontier), V] (any float dtype): the draft distribution below each frontier node."""
        shape, front = self.shape, self._front
        self.level += 1
        new: list[int] = []
        if isinstance(shape, int):
            if self.sampled:
                (tok, q), = self._draw(logits[0], 1)
                new.append(self._add(front[0], tok, 0.0, q))
            else:
                new.append(self._add(front[0], int(logits[0].argmax()), 0.0))
        elif isinstance(shape, StaticTree):
            k = max(shape.ranks[c] for f in front for c in self._kids[self._static_id[f]]) + 1
            top = None if self.sampled else logits.topk(k, dim=-1).indices.tolist()
            for row, f in enumerate(front):
                kids = self._kids[self._static_id[f]]  # in rank order (paths sorted)
                drawn = self._draw(logits[row], len(kids)) if self.sampled else None
                for j, c in enumerate(kids):
                    if drawn is not None and j >= len(drawn):
                        break  # q had mass on fewer tokens than this node has children
                    tok, q = drawn[j] if drawn is not None else (top[row][shape.ranks[c]], None)
                    cid = self._add(f, tok, 0.0, q)
                    self._static_id.append(c)
                    if self._kids[c]:
                        new.append(cid)
        else:
            lp = torch.log_softmax(logits.float(), dim=-1)
            val, idx = lp.topk(min(shape.top_k, lp.shape[-1]), dim=-1)
            val, idx = val.tolist(), idx.tolist()
            born = []
            for row, f in enumerate(front):
                base = self.score[f]
                born.extend(self._add(f, t, base + v) for v, t in zip(val[row], idx[row]))
            born.sort(key=lambda c: (-self.score[c], c))
            new = sorted(born[: shape.top_k])
        self._front = new

    def _draw(self, logits: torch.Tensor, n: int) -> list[tuple[int, torch.Tensor]]:
        """`n` tokens drawn without replacement from q = softmax(logits / T), each with the law it was drawn from:
        q with the tokens drawn before it removed, renormalised. On the CPU, beside the loop's generator and the
        target's law verify() compares it with."""
        q = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        out = []
        for _ in range(n):
            if float(q.sum()) <= 0.0:  # fewer tokens with mass than children: the rest are not drawn
                break
            tok = int(torch.multinomial(q, 1, generator=self.gen))
            out.append((tok, q))
            q = q.clone()
            q[tok] = 0.0
            q = q / q.sum() if float(q.sum()) > 0 else q
        return out

    def tree(self) -> tuple[Tree, list[int]]:
        """The final tree and, per tree node, its candidate id (dynamic shapes keep the best total_tokens)."""
        keep = list(range(len(self.tok)))
        if isinstance(self.shape, DynamicTreeSpec):
            ranked = sorted(keep[1:], key=lambda c: (-self.score[c], c))
            keep = [0] + sorted(ranked[: self.shape.total_tokens])
        where = {c: i for i, c in enumerate(keep)}
        t = Tree([self.tok[c] for c in keep], [where.get(self.par[c], -1) for c in keep],
                 [self.dep[c] for c in keep], [self.q[c] for c in keep])
        return t, keep


def per_level_tree(root: int, shape: Shape, rows: list[torch.Tensor], temperature: float,
                   gen: torch.Generator | None, rule: str | None = None) -> Tree:
    """A tree whose every node at depth d+1 draws from the same logits row `rows[d]` [1, V]: heads that
    read only the last committed state (Medusa, parallel heads) cannot condition on their parents."""
    ex = Expander(root, shape, temperature, gen, rule)
    while not ex.done():
        ex.expand(rows[ex.level].expand(len(ex.frontier()), -1))
    return ex.tree()[0]
