"""The bootstrap over prompts behind every interval bench reports (the sweep's acceptance and τ, the context decay's
slope): prompts are resampled with replacement, never tokens, because the tokens of one prompt are correlated and
resampling them would understate the spread; a fixed seed gives the same interval every time. Imports no torch."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator

RESAMPLES = 1000
LEVEL = 0.95  # the 2.5th and 97.5th percentiles


def resamples(n: int, seed: int, count: int = RESAMPLES) -> Iterator[list[int]]:
    """`count` resamples of `n` items' indices, each `n` draws with replacement."""
    rng = random.Random(seed)
    for _ in range(count):
        yield [rng.randrange(n) for _ in range(n)]


def interval(values: list[float]) -> tuple[float, float]:
    """The central LEVEL interval of `values` (inclusive percentiles; one value: itself twice)."""
    if len(values) == 1:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=round(2 / (1 - LEVEL)), method="inclusive")
    return cuts[0], cuts[-1]
