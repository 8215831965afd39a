"""Native MTP: a checkpoint drafting with its own sequential MTP modules (DeepSeek-V3, GLM-4.x, Qwen3.5, ...),
as engines' `method: "mtp"` does. No drafter directory: the checkpoint is both target and drafter (bench's
`--native-mtp`, or DRAFTER_DIR = TARGET_DIR); the runtime is `recycle.mtp.MTP`."""

from __future__ import annotations

from recycle.formats.record import DrafterFormat

FORMAT = DrafterFormat(
    name="native-mtp",
    title="the checkpoint's own MTP modules",
    summary="the checkpoint's own MTP modules, chained as vLLM's method mtp chains them",
    native_kind="mtp",
    hooks=frozenset({"engine"}),
    tags=("mtp",),
)
