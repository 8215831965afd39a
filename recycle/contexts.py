"""Acceptance by context position (`recycle bench --context-buckets 0-512,512-2k,2k-8k`, issue 50).

A bucket `LO-HI` holds the positions LO … HI-1. Per bucket, `--context-prompts N` long prompts are cut from the
held-out documents of the prompt source (`--data`, else the `--prompts` corpus, else stdlib), encoded with the
target's tokenizer and joined with EOS between documents. Their lengths spread evenly across the bucket (the centres
of N equal steps) and leave room for `--max-new-tokens` and the tree's draft tokens, so every generated token, and
every draft verified, sits at a position inside the bucket. The design is paired: prompt k of every bucket ends at the
same place in the held-out stream (N end points, STRIDE tokens apart), so the text the drafter continues is the same
in every bucket and only the context before it grows; prompts that each started at a document would confound the
context's length with where in a file the prompt ends (a short one ends in a header, a long one in the code).

Each prompt is decoded once with the drafter per temperature (no autoregressive baseline: acceptance is the
figure). Its context position is its length plus half the tokens it generated. Per bucket: acceptance per depth
and τ over its prompts; across buckets, the decay: the least-squares slope of per-prompt depth-1 acceptance
against the context position (per 1k positions), with a 95% interval from a bootstrap over prompts (tokens
within a prompt are correlated: prompts are resampled, never tokens; a fixed seed).

Parsing and the checks import no torch (options.py runs them before any model loads); the decoding imports it when
it runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from recycle.bench_result import ContextBucket, ContextDecay, ContextPrompt, ContextResult, ContextRun
from recycle.errors import RecycleError
from recycle.resample import RESAMPLES, interval, resamples

Bucket = tuple[int, int]  # positions [lo, hi)
PER_K = 1024  # the slope's unit: per 1k positions
MIN_PROMPT = 16  # the shortest long prompt (a bucket starting at 0 still gets a context to draft from)
STRIDE = 509  # held-out tokens between two long prompts' end points
UNITS = {"": 1, "k": 1024, "K": 1024, "M": 1024 * 1024}
_NUMBER = re.compile(r"^\s*(\d+)\s*([kKM]?)\s*$")


# -- the buckets ------------------------------------------------------------------------------------------------
def _position(text: str, item: str) -> int:
    m = _NUMBER.match(text)
    if m is None:
        raise RecycleError(f"--context-buckets {item!r}: expected LO-HI positions such as 0-512 or 2k-8k "
                           "(k = ×1024, M = ×1024²)")
    return int(m.group(1)) * UNITS[m.group(2)]


def parse_buckets(value: str | Iterable[Bucket] | None) -> tuple[Bucket, ...]:
    """`--context-buckets`: `LO-HI` items joined by commas (k = ×1024, M = ×1024²), or (lo, hi) pairs; each lo < hi,
    ascending and non-overlapping (a gap between buckets is allowed). None or empty: no buckets."""
    if value is None:
        return ()
    if isinstance(value, str):
        if not value.strip():
            return ()
        pairs = []
        for item in value.split(","):
            lo, sep, hi = item.partition("-")
            if not sep:
                raise RecycleError(f"--context-buckets {item.strip()!r}: expected LO-HI, e.g. 0-512,512-2k")
            pairs.append((_position(lo, item.strip()), _position(hi, item.strip())))
    else:
        pairs = [(int(lo), int(hi)) for lo, hi in value]
    for i, (lo, hi) in enumerate(pairs):
        if lo >= hi:
            raise RecycleError(f"--context-buckets {label((lo, hi))}: its start must be below its end")
        if i and lo < pairs[i - 1][1]:
            raise RecycleError(f"--context-buckets {label(pairs[i - 1])},{label((lo, hi))}: buckets must ascend "
                               "without overlapping (each starts at or after the previous one's end)")
    return tuple(pairs)


def _short(n: int) -> str:
    for unit, size in (("M", 1024 * 1024), ("k", 1024)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def label(bucket: Bucket) -> str:
    """0-512, 512-2k, 2k-8k: the bucket as the command line writes it."""
    return f"{_short(bucket[0])}-{_short(bucket[1])}"


def lengths(bucket: Bucket, n: int, max_new: int, extra: int) -> list[int]:
    """The `n` prompt lengths in `bucket`: the centres of n equal steps from max(lo, MIN_PROMPT) to the longest
    prompt that leaves room for `max_new` tokens and `extra` draft tokens before hi."""
    lo, hi = bucket
    first, last = max(lo, MIN_PROMPT), hi - max_new - extra
    return [round(first + (j + 0.5) * (last - first) / n) for j in range(n)]


def check_buckets(buckets: Sequence[Bucket], positions: int | None, max_new: int, extra: int, tree: str = "") -> None:
    """Refuse a bucket past the target's context, or too narrow to hold a prompt of MIN_PROMPT tokens (or from
    its start), --max-new-tokens and `extra` draft tokens (`tree` names them)."""
    for b in buckets:
        if positions is not None and b[1] > positions:
            raise RecycleError(f"--context-buckets {label(b)}: ends at position {b[1]}, past the target's context of "
                               f"{positions} positions (max_position_embeddings)")
        first = max(b[0], MIN_PROMPT)
        if b[1] - first < max_new + extra:
            plus = f" + {extra} draft tokens ({tree})" if extra else ""
            raise RecycleError(f"--context-buckets {label(b)}: too narrow for a prompt from position {first} with "
                               f"--max-new-tokens {max_new}{plus}: widen it or lower --max-new-tokens")


# -- the long prompts -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LongPrompt:
    bucket: Bucket
    end: int  # where in the held-out stream it ends: prompt k of every bucket ends at the same place
    ids: list[int]


def ends(longest: int, n: int) -> list[int]:
    """The `n` end points of the long prompts in the held-out stream, STRIDE tokens apart, the first after `longest`
    tokens: prompt k of every bucket ends at the k-th, so buckets differ only in how much text precedes it."""
    return [longest + k * STRIDE for k in range(n)]


@dataclass(frozen=True)
class Streams:
    """The held-out documents of a source, encoded (EOS after each), enough of them for every long prompt."""

    source: str
    docs: list[list[int]]

    def prompts(self, buckets: Sequence[Bucket], n: int, max_new: int, extra: int) -> list[LongPrompt]:
        """`n` prompts per bucket (`lengths`): prompt k of each bucket is the text before the k-th end point (`ends`),
        as long as the bucket's k-th length. Paired across buckets, the text a prompt ends with (and the drafter
        continues) is the same in every bucket: what changes is only the context before it."""
        stream = [t for doc in self.docs for t in doc]
        sizes = {b: lengths(b, n, max_new, extra) for b in buckets}
        longest = max(x for xs in sizes.values() for x in xs)
        points = ends(longest, n)
        if len(stream) < points[-1]:
            raise RecycleError(f"--context-buckets: the held-out text of {self.source} holds {len(stream)} tokens, "
                               f"fewer than the {points[-1]} its {n} prompts per bucket need (the longest, "
                               f"{longest}, plus {STRIDE} between end points); give a larger --data or narrower "
                               "buckets")
        return [LongPrompt(b, end, stream[end - length:end]) for b in buckets
                for end, length in zip(points, sizes[b])]


def encode_streams(source: str, docs: list, tokenizer, where: str, template: str | None, need: int) -> Streams:
    """Encode `docs` (texts or conversations, recycle.encode's bounded encoder, EOS after each) until they hold
    `need` tokens. Too few is one RecycleError."""
    from recycle.encode import chat_renderer, encode

    renderer = chat_renderer(docs, tokenizer, where, template)
    encoded: list[list[int]] = []
    total = 0
    for ids, _ in encode(docs, tokenizer, renderer, lambda i, why: None):
        encoded.append(ids)
        total += len(ids)
        if total >= need:
            break
    if total < need:
        raise RecycleError(f"--context-buckets: the held-out side of {source} holds {total} tokens, too few for the "
                           f"long prompts ({need} tokens: the longest prompt plus {STRIDE} between end points); give "
                           "a larger --data or narrower buckets")
    return Streams(source, encoded)


def given_tree_tokens(tree: str | None) -> int:
    """The draft tokens a round of `--tree` verifies, as far as known before the drafter loads (no --tree: 0, the
    engine's default shape is checked once it has loaded)."""
    if tree is None:
        return 0
    from recycle.decoding.tree import parse_shape, shape_tokens

    return shape_tokens(parse_shape(tree, 0))


def context_streams(opts, tokenizer, prompts: Sequence[tuple[str, object]]) -> Streams:
    """The encoded held-out documents bench's `opts` cut long prompts from: `--data`, else the corpus `--prompts`
    named (a py:PACKAGE set), else stdlib's (a --prompts file's prompts are short: they are not the source)."""
    from recycle.corpus import STDLIB, is_corpus_name
    from recycle.texts import data_source

    name = opts.data if opts.data is not None else next((s for s, _ in prompts if is_corpus_name(s)), STDLIB)
    src = data_source(name)
    longest = max(n for b in opts.context_buckets
                  for n in lengths(b, opts.context_prompts, opts.max_new_tokens, given_tree_tokens(opts.tree)))
    need = ends(longest, opts.context_prompts)[-1]
    return encode_streams(src.name, src.heldout(), tokenizer, str(opts.target), opts.chat_template, need)


# -- the figures ------------------------------------------------------------------------------------------------
def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The least-squares slope of ys on xs (None: fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def decay(positions: Sequence[float], acceptance: Sequence[float], seed: int = 0,
          count: int = RESAMPLES) -> ContextDecay:
    """Depth-1 acceptance's slope per 1k positions, with the 95% interval of `count` bootstrap resamples of the
    prompts (`recycle.resample`; a resample whose positions are all equal has no slope and adds nothing)."""
    xs = [p / PER_K for p in positions]
    s = slope(xs, acceptance)
    low = high = None
    got: list[float] = []
    if s is not None and len({round(x, 9) for x in xs}) >= 3:
        for pick in resamples(len(xs), seed, count):
            b = slope([xs[i] for i in pick], [acceptance[i] for i in pick])
            if b is not None:
                got.append(b)
        low, high = interval(got)
    return ContextDecay(slope_per_1k=s, low=low, high=high,
                        includes_zero=None if low is None else low <= 0 <= high,
                        prompts=len(xs), resamples=len(got), seed=seed)


def _summed(rows: Sequence[ContextPrompt]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    depth = max((len(r.tried) for r in rows), default=0)
    tried = tuple(sum(r.tried[d] for r in rows if d < len(r.tried)) for d in range(depth))
    acc = tuple(sum(r.accepted[d] for r in rows if d < len(r.accepted)) for d in range(depth))
    return acc, tried


def bucket_figures(bucket: Bucket, rows: Sequence[ContextPrompt]) -> ContextBucket:
    acc, tried = _summed(rows)
    steps = sum(r.steps for r in rows)
    return ContextBucket(
        bucket=label(bucket), lo=bucket[0], hi=bucket[1], prompts=len(rows),
        new_tokens=sum(r.new_tokens for r in rows),
        acceptance=tuple(a / t if t else 0.0 for a, t in zip(acc, tried)), accepted=acc, tried=tried,
        tau=sum(r.new_tokens - 1 for r in rows) / steps if steps else 1.0,
    )


def run_figures(temperature: float, draft_sample: str, buckets: Sequence[Bucket], rows: Sequence[ContextPrompt],
                seed: int) -> ContextRun:
    """One temperature's buckets and decay from its per-prompt rows."""
    tried = [r for r in rows if r.tried and r.tried[0]]
    return ContextRun(
        temperature=temperature, draft_sample=draft_sample,
        buckets=tuple(bucket_figures(b, [r for r in rows if r.bucket == label(b)]) for b in buckets),
        decay=decay([r.position for r in tried], [r.accepted[0] / r.tried[0] for r in tried], seed),
        prompts=tuple(rows),
    )


Progress = Callable[[int, int, str], None]


def measure(streams: Streams, buckets: Sequence[Bucket], per_bucket: int, *, target, engine, masks, eos: int | None,
            temperatures: Sequence[float], draft_samples: Sequence[str], seed: int, max_new: int, extra: int,
            progress: Progress | None = None) -> ContextResult:
    """Decode every long prompt with the drafter at each temperature (the decode loop of recycle.decoding), with the
    first of `draft_samples` (none: the tree shape's default rule)."""
    from recycle.decoding import generate
    from recycle.decoding.tree import default_rule

    draft_sample = draft_samples[0] if draft_samples else default_rule(engine.shape)
    t0 = time.perf_counter()
    prompts = streams.prompts(buckets, per_bucket, max_new, extra)
    runs = []
    total, done = len(prompts) * len(temperatures), 0
    before, engine.draft_sample = engine.draft_sample, draft_sample
    try:
        for t in temperatures:
            rows = _decoded(prompts, t, generate, target, engine, masks, eos, seed, max_new)
            done += len(prompts)
            if progress:
                progress(done, total, "context buckets")
            runs.append(run_figures(t, draft_sample if t > 0 else "greedy", buckets, rows, seed))  # T = 0: top-k
    finally:
        engine.draft_sample = before
    return ContextResult(source=streams.source, prompts_per_bucket=per_bucket, seconds=time.perf_counter() - t0,
                         runs=tuple(runs))


def _decoded(prompts: Sequence[LongPrompt], temperature: float, generate, target, engine, masks, eos: int | None,
             seed: int, max_new: int) -> list[ContextPrompt]:
    rows = []
    for p in prompts:
        s = generate(target, engine, p.ids, max_new, temperature=temperature, seed=seed, eos=eos, masks=masks).stats
        rows.append(ContextPrompt(bucket=label(p.bucket), end=p.end, prompt_tokens=len(p.ids),
                                  new_tokens=s.new_tokens, position=len(p.ids) + s.new_tokens / 2,
                                  steps=s.steps, tried=tuple(s.tried), accepted=tuple(s.accepted), tau=s.tau))
    return rows


__all__ = ["Bucket", "LongPrompt", "Streams", "bucket_figures", "check_buckets", "context_streams", "decay", "ends",
           "encode_streams", "given_tree_tokens", "label", "lengths", "measure", "parse_buckets", "run_figures", "slope"]
