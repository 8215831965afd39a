"""Offline corpora every machine already has: Python source that ships with the interpreter or a package.

The trained fixtures, the bench prompts and the distillation data all need real text with real
structure, and none of them may touch the network. Two kinds of source:

  "stdlib"       the Python standard library's own source (~12 MB; the bundled fixture's training text)
  "py:PACKAGE"   the source of an installed package, e.g. "py:transformers" (the domain the
                 post-trained fixture moved to; constraints.txt pins the version, so the text is the
                 same on every machine that installs from it)

Files are split into train / held-out by a hash of their path (not by random draw), so the split is
the same on every run and every machine, and a file never straddles the two sides.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recycle.errors import RecycleError

HELDOUT_PERCENT = 5
STDLIB = "stdlib"
PACKAGE_PREFIX = "py:"
# Directories whose contents are tests or third-party code, not the library itself.
EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")
EXCLUDED_PREFIXES = ("idlelib/idle_test/", "lib2to3/tests/")


@dataclass(frozen=True)
class Doc:
    """One source file: its posix path relative to the corpus root, and its text."""

    path: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_corpus_name(name: str | None) -> bool:
    """Whether a `--data`/`--prompts` value names a built-in corpus rather than a path."""
    return name == STDLIB or (isinstance(name, str) and name.startswith(PACKAGE_PREFIX))


def corpus_root(source: str = STDLIB) -> Path:
    """The directory whose `*.py` files a corpus holds (a package's own directory for "py:NAME")."""
    if source == STDLIB:
        return stdlib_root()
    if not source.startswith(PACKAGE_PREFIX) or not source[len(PACKAGE_PREFIX):].isidentifier():
        raise RecycleError(f"unknown corpus {source!r}: use 'stdlib' or 'py:PACKAGE' (an installed package)")
    name = source[len(PACKAGE_PREFIX):]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RecycleError(f"corpus {source!r}: no installed package named {name!r}")
    return Path(next(iter(spec.submodule_search_locations)))


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


def documents(split: str = "train", root: Path | None = None, source: str = STDLIB) -> Iterator[Doc]:
    """The documents of one split ("train", "heldout" or "all") of a corpus; undecodable bytes are dropped.

    A package's paths are hashed with the package name in front ("transformers/models/..."), so two
    corpora never share a split decision by accident.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    root = root or corpus_root(source)
    label = "" if source == STDLIB else source[len(PACKAGE_PREFIX):] + "/"
    for rel in stdlib_files(root):
        key = label + rel
        if split != "all" and is_heldout(key) != (split == "heldout"):
            continue
        text = (root / rel).read_bytes().decode("utf-8", errors="ignore")
        if text.strip():
            yield Doc(key, text)
