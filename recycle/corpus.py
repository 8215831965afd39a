"""An offline text corpus every machine already has: the Python standard library's own source.

The trained fixture, the bench prompts and the distillation data all need real text with real
structure, and none of them may touch the network; CPython ships ~12 MB of code that fits. Files
are split into train / held-out by a hash of their path (not by random draw) so the split is the
same on every run and every machine, and a file never straddles the two sides.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5
# Directories whose contents are tests or third-party code, not the library itself.
EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")
EXCLUDED_PREFIXES = ("idlelib/idle_test/", "lib2to3/tests/")


@dataclass(frozen=True)
class Doc:
    """One source file: its posix path relative to the stdlib root, and its text."""

    path: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Deterministic ~5% held-out membership from the sha1 of the posix relative path."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def _included(relpath: str) -> bool:
    parts = relpath.split("/")
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return False
    return not relpath.startswith(EXCLUDED_PREFIXES)


def stdlib_files(root: Path | None = None) -> list[str]:
    """Posix relative paths of the included `*.py` files, sorted (the order never depends on the filesystem)."""
    root = root or stdlib_root()
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    return sorted(r for r in rels if _included(r))


def split_paths(paths: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out) preserving the input order."""
    train = [p for p in paths if not is_heldout(p)]
    held = [p for p in paths if is_heldout(p)]
    return train, held


def documents(split: str = "train", root: Path | None = None) -> Iterator[Doc]:
    """The documents of one split ("train", "heldout" or "all"); undecodable bytes are dropped."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    root = root or stdlib_root()
    for rel in stdlib_files(root):
        if split != "all" and is_heldout(rel) != (split == "heldout"):
            continue
        text = (root / rel).read_bytes().decode("utf-8", errors="ignore")
        if text.strip():
            yield Doc(rel, text)
