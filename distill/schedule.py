"""The budget → steps plan: the one place a `--tokens` budget becomes optimizer steps, rows and cache keys.

The budget counts target tokens read. Each step reads `batch × world` rows of `seq_len` tokens (the global
batch), except the last, which is cut so the run stops exactly at the budget: its whole rows first, then one
shorter row. Step i therefore starts after i · batch · world · seq_len tokens, and the plan is arithmetic:
no step needs the ones before it to be known, so a resumed run, `recycle harvest` and the online producer
compute the same steps the training loop does, and a budget of a billion tokens costs nothing to plan.

A rank's share of a step is its micro-batches: its full rows together, each cut row alone. They are named by
keys (`s{step}r{rank}f`, `s{step}c{row}`), which is how a `--cache-hidden` directory is filled ahead of time;
the held-out rows have the key `eval`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

EVAL_KEY = "eval"  # the held-out rows' key in a --cache-hidden directory `recycle harvest` filled


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

    def micro_batches(self, rank: int = 0, world: int = 1) -> list[MicroBatch]:
        """One rank's share: rows rank, rank + world, ...; its full rows together, each cut row alone."""
        mine = range(rank, len(self.lengths), world)
        full = tuple(i for i in mine if self.lengths[i] == self.seq_len)
        out = [MicroBatch(full, self.seq_len, f"s{self.index:08d}r{rank}f")] if full else []
        return out + [MicroBatch((i,), self.lengths[i], f"s{self.index:08d}c{i}")
                      for i in mine if self.lengths[i] != self.seq_len]


@dataclass(frozen=True)
class Schedule:
    tokens: int  # the budget: target tokens read
    batch: int  # rows per step and rank
    seq_len: int
    world: int = 1

    @property
    def rows(self) -> int:
        """Rows per step, all ranks together."""
        return self.batch * self.world

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.tokens / (self.rows * self.seq_len)))

    def tokens_before(self, index: int) -> int:
        return min(self.tokens, index * self.rows * self.seq_len)

    def step(self, index: int) -> Step:
        remaining = self.tokens - self.tokens_before(index)
        if remaining >= self.rows * self.seq_len:
            lengths = [self.seq_len] * self.rows
        else:
            full, rest = divmod(remaining, self.seq_len)
            lengths = [self.seq_len] * full + ([rest] if rest else [])
        return Step(index, tuple(lengths), self.seq_len)

    def steps(self, start: int = 0) -> Iterator[Step]:
        """Every step from `start` (a resumed run's) to the last."""
        for i in range(start, self.total_steps):
            yield self.step(i)


def eval_prompt_len(length: int, wanted: int, steps: int = 1) -> int:
    """How many tokens of each held-out row stay as the prompt (the target writes the rest); 0 when the
    rows are too short to continue, and then they are scored on the held-out text itself."""
    p = min(wanted, length // 4)
    return p if p >= 1 and length - p > steps + 1 else 0
