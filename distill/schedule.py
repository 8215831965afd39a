"""The budget → steps plan: the one place a `--tokens` budget becomes optimizer steps, rows and cache keys.

The budget counts target tokens read. Each step reads `batch × world` rows of `seq_len` tokens (the global
batch), except the last, which is cut so the run stops exactly at the budget: its whole rows first, then one
shorter row. Step i therefore starts after i · batch · world · seq_len tokens, and the plan is arithmetic:
no step needs the ones before it to be known, so a resumed run, `recycle harvest` and the online producer
compute the same steps the training loop does, and a budget of a billion tokens costs nothing to plan.

A rank's share of a step is its micro-batches: its full rows together, each cut row alone. They are named by
keys (`s{step}r{rank}f`, `s{step}c{row}`), which is how a `--cache-hidden` directory is filled ahead of time;
the held-out rows have the key `eval`.

A curriculum (`--curriculum`) runs shorter windows first: stage i (window length L_i, a share of the budget) takes
the steps from round(share before it × total steps) to round(its share's end × total steps), the rest run at
`seq_len`. Every step reads the same tokens in every stage (rows × seq_len / L_i rows of L_i), so the steps, the
learning rate and the arithmetic above are those of a run without a curriculum. A cache `recycle harvest` filled holds one process's keys (every full row of
a step under `s{step}r0f`); under torchrun each rank reads its own block of those rows, a key with a row span
(`s{step}r0f@2:4`), so a cache harvested once serves any world size that divides its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

EVAL_KEY = "eval"  # the held-out rows' key in a --cache-hidden directory `recycle harvest` filled
SPAN = "@"  # `KEY@LO:HI`: rows LO..HI-1 of the file KEY


def split_key(key: str) -> tuple[str, slice | None]:
    """(the file's key, the rows of it this key names: None for all)."""
    name, sep, span = key.partition(SPAN)
    if not sep:
        return key, None
    lo, hi = span.split(":")
    return name, slice(int(lo), int(hi))


@dataclass(frozen=True)
class MicroBatch:
    rows: tuple[int, ...]  # indices into the step's global batch
    length: int  # tokens per row
    key: str  # the cache key of its features


@dataclass(frozen=True)
class Step:
    index: int
    lengths: tuple[int, ...]  # the global batch's row lengths
    seq_len: int

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def micro_batches(self, rank: int = 0, world: int = 1, block: int | None = None) -> list[MicroBatch]:
        """One rank's share: rows rank, rank + world, ...; its full rows together, each cut row alone. `block` (a
        cache one process harvested): the full rows are the rank's block of `block` rows instead, read from the
        one-process key with their span."""
        mine = range(rank, len(self.lengths), world)
        cut = [MicroBatch((i,), self.lengths[i], f"s{self.index:08d}c{i}") for i in mine
               if self.lengths[i] != self.seq_len]
        if block is not None:
            full = tuple(i for i, n in enumerate(self.lengths) if n == self.seq_len)[rank * block:(rank + 1) * block]
            key = f"s{self.index:08d}r0f" + (f"{SPAN}{full[0]}:{full[-1] + 1}" if full and world > 1 else "")
            return ([MicroBatch(full, self.seq_len, key)] if full else []) + cut
        full = tuple(i for i in mine if self.lengths[i] == self.seq_len)
        out = [MicroBatch(full, self.seq_len, f"s{self.index:08d}r{rank}f")] if full else []
        return out + cut


@dataclass(frozen=True)
class Stage:
    """One window length of a run: its steps [first, end), its rows per step (all ranks) and per rank."""

    index: int
    length: int
    first: int
    end: int
    rows: int
    per_rank: int

    @property
    def steps(self) -> int:
        return self.end - self.first


@dataclass(frozen=True)
class Schedule:
    tokens: int  # the budget: target tokens read
    batch: int  # rows per step and rank
    seq_len: int
    world: int = 1
    curriculum: tuple[tuple[int, float], ...] = ()  # (window length, share of the budget) run before seq_len

    @property
    def rows(self) -> int:
        """Rows per step, all ranks together."""
        return self.batch * self.world

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.rows * self.seq_len)))

    def stages(self) -> list[Stage]:
        """The curriculum's stages, then --seq-len's (the only one without a curriculum); a stage may hold no step."""
        out, at, share = [], 0, 0.0
        for length, part in (*self.curriculum, (self.seq_len, None)):
            share = 1.0 if part is None else share + part
            end = self.total_steps if part is None else min(self.total_steps, round(share * self.total_steps))
            per_rank = max(1, self.batch * self.seq_len // length)
            out.append(Stage(len(out), length, at, max(at, end), per_rank * self.world, per_rank))
            at = max(at, end)
        return out

    def stage(self, index: int) -> Stage:
        """The stage step `index` runs in."""
        stages = self.stages()
        return next((s for s in stages if s.first <= index < s.end), stages[-1])

    def tokens_before(self, index: int) -> int:
        return min(self.tokens, index * self.rows * self.seq_len)

    def step(self, index: int) -> Step:
        remaining = self.tokens - self.tokens_before(index)
        stage = self.stage(index) if self.curriculum else None
        length, rows = (stage.length, stage.rows) if stage else (self.seq_len, self.rows)
        if remaining >= rows * length:
            lengths = [length] * rows
        else:
            full, rest = divmod(remaining, length)
            lengths = [length] * full + ([rest] if rest else [])
        return Step(index, tuple(lengths), length)

    def steps(self, start: int = 0) -> Iterator[Step]:
        """Every step from `start` (a resumed run's) to the last."""
        for i in range(start, self.total_steps):
            yield self.step(i)


EVAL_WRITTEN = 192  # the most tokens the target writes after a held-out row's prompt (a 256-token row's rest)


def eval_prompt_len(length: int, wanted: int, steps: int = 1) -> int:
    """How many tokens of each held-out row stay as the prompt (the target writes the rest); 0 when the
    rows are too short to continue, and then they are scored on the held-out text itself. A long row keeps all but
    its last EVAL_WRITTEN tokens: a long held-out context, then the target's own text, as long prompts are served
    (and the target's greedy writing stays bounded: 16 rows of 1,984 tokens took the fixture over 12 minutes)."""
    p = max(min(wanted, length // 4), length - EVAL_WRITTEN)
    return p if p >= 1 and length - p > steps + 1 else 0


def time_left(budget: int, done: int, tokens_per_s: float) -> float:
    """Seconds the rest of a budget takes at a measured rate (infinite at none)."""
    return max(0, budget - done) / tokens_per_s if tokens_per_s > 0 else math.inf
