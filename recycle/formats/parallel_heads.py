"""Parallel prediction heads (Meta's multi-token prediction): the checkpoint's extra heads draft natively, one
Medusa-style tree per step (`recycle.drafters.parallel`), and convert to Medusa heads."""

from __future__ import annotations

from recycle.formats.record import DrafterFormat

FORMAT = DrafterFormat(
    name="parallel-heads",
    title="parallel prediction heads (Meta's multi-token prediction)",
    summary="the checkpoint's own parallel prediction heads, drafting one Medusa-style tree per step",
    native_kind="parallel_heads",
    hooks=frozenset({"engine"}),
    single_pass=True,
    static_tree=True,
)
