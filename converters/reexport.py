"""A distilled (or converted) drafter as a `recycle convert` source: re-export any layout from it.

`recycle distill` trains the modules in the drafter's own layout and rewrites `mtp_overlay/` with them (FP8 kept
FP8). That overlay is a checkpoint in the family's own names and layout, so it is what `convert` reads; for a
family whose modules borrow the trunk's embedding or LM head (they store no copy), the drafter's own `embed.weight`
and `head.weight` stand in under the trunk's names. The view is a temporary directory of links (plus those two
tensors where needed); the drafter directory is never written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from recycle.checkpoint import Checkpoint, allow_links_into, shard_path
from recycle.errors import RecycleError
from recycle.formats import of_config
from recycle.preflight import load_json

IO_FILE = "recycle-drafter-io.safetensors"
DRAFTER_IO = {"embed": "embed.weight", "head": "head.weight"}


@contextlib.contextmanager
def source_view(path: str | os.PathLike) -> Iterator[Path]:
    """The checkpoint `convert` reads: `path` itself, or for a drafter whose format keeps its modules in the source's
    layout (EAGLE: `mtp_overlay/`) a view of that folder."""
    src = Path(path)
    fmt = of_config(load_json(src / "config.json", "config.json"))
    if fmt is None or fmt.source_layout is None:
        yield src
        return
    overlay = src / fmt.source_layout
    if not (overlay / "config.json").is_file():
        raise RecycleError(f"{src}: a drafter without {fmt.source_layout}/ (converted with --layouts that left it out, "
                           "or dropped by distill): there is nothing in the source's layout to convert")
    from safetensors.torch import save_file

    from recycle.families import match

    view = Path(tempfile.mkdtemp(prefix="recycle-source-"))
    try:
        with allow_links_into(src):  # where a hard link cannot cross filesystems, the view's symlinks point into src
            for p in overlay.iterdir():
                if p.is_file() and not p.name.endswith(".index.json"):
                    _link(shard_path(overlay, p.name, overlay), view / p.name)  # a link out of it is refused
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                         "generation_config.json"):
                if (src / name).is_file() and not (view / name).exists():
                    _link(src / name, view / name)
            m = match(Checkpoint(view), strict=False)  # trunk names; the convert after it checks the row
            borrowed = {role: m.family.layout.trunk[role][0] for mod in m.modules for role, t in mod.shared.items()
                        if t is None and role in DRAFTER_IO and m.family.layout.trunk.get(role)}
            if borrowed:
                own = Checkpoint(src)
                save_file({trunk: own.get(DRAFTER_IO[role]).contiguous() for role, trunk in borrowed.items()},
                          str(view / IO_FILE), metadata={"format": "pt"})
            yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(src.resolve(), dst)
