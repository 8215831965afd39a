"""An MTP-only GGUF side file for llama.cpp (`recycle convert --to gguf`): the module llama.cpp's `draft-mtp`
drafts with, next to any trunk GGUF of the same model (`-md mtp.gguf`). Written by `recycle.converters.gguf`
from the family's `gguf` record (`recycle.ggufarch`); llama.cpp reads it, no Python engine does, so it has no
module, unroller or decoding engine of recycle's own: distill a drafter first (`--to eagle`), then convert that
drafter to a side file."""

from __future__ import annotations

from recycle.formats.record import DrafterFormat, Layout

SIDE_FILE = "mtp.gguf"

FORMAT = DrafterFormat(
    name="gguf",
    title="llama.cpp MTP side file (GGUF)",
    summary="an MTP-only GGUF that llama.cpp's draft-mtp loads next to a trunk GGUF",
    convertible=True,
    hooks=frozenset({"converter"}),
    options=frozenset({"target", "module"}),
    target_file=".gguf",
    extra_dtypes=("q8_0",),
    layouts={SIDE_FILE: Layout("llama.cpp MTP-only GGUF (blk.N.nextn.*, the module's block as blk.N.*)", (
        "# llama.cpp (b9180+): the trunk GGUF you run, quantized or not, plus this side file",
        "llama-server -m TRUNK.gguf -md {local}/mtp.gguf --spec-type draft-mtp --spec-draft-n-max 2",),
        readers="llama.cpp b9180 and later (`--spec-type draft-mtp`; checked at commit 0c1e570)")},
    serving_note="llama.cpp drafts with one MTP module and reuses it for every draft position.",
    tags=("gguf", "llama.cpp"),
)
