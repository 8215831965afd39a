"""Where text comes from: `--data` paths and built-in corpora, split into a training side and a held-out side.

A path (a text file, JSONL with a `text` field, a directory of text files, a dataset saved with
`datasets.save_to_disk`, imported only then) gives up the tail of its text as the held-out side; a
built-in corpus (`stdlib`, `py:PACKAGE`: `recycle.corpus`) has its train/held-out split by file. Both
distillation (`recycle.distill.data`) and calibration (`recycle.converters.calibrate`) read text through here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from recycle.errors import RecycleError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".json")


def _jsonl_texts(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="ignore") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise RecycleError(f"{path}:{n}: not valid JSON (expected one {{\"text\": ...}} per line)") from None
            text = row.get("text") if isinstance(row, dict) else None
            if isinstance(text, str) and text.strip():
                yield text


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _dataset_texts(path: Path) -> list[str]:
    try:
        # optional dependency, imported only here
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise RecycleError(f"{path}: looks like a saved `datasets` dataset; pip install datasets to read it") from None
    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        ds = ds["train"] if "train" in ds else ds[sorted(ds)[0]]
    if "text" not in ds.column_names:
        raise RecycleError(f"{path}: the dataset has no 'text' column (columns: {', '.join(ds.column_names)})")
    return [t for t in ds["text"] if isinstance(t, str) and t.strip()]


HELDOUT_SHARE = 0.05  # of a `--data` path's text, taken from its tail as the held-out side


def _path_texts(path: Path) -> Callable[[], list[str]]:
    """A loader of every document under a `--data` path (validated now, read on call)."""
    if _is_saved_dataset(path):
        return lambda: _dataset_texts(path)
    if path.is_file():
        if path.suffix == ".jsonl":
            return lambda: list(_jsonl_texts(path))
        return lambda: [path.read_text(encoding="utf-8", errors="ignore")]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise RecycleError(f"--data {path}: holds no text files ({' '.join(TEXT_SUFFIXES)})")

    def directory() -> list[str]:
        out: list[str] = []
        for p in files:
            out.extend(_jsonl_texts(p) if p.suffix == ".jsonl" else [p.read_text(encoding="utf-8", errors="ignore")])
        return [t for t in out if t.strip()]

    return directory


def split_tail(texts: list[str], share: float = HELDOUT_SHARE) -> tuple[list[str], list[str]]:
    """(train, held-out): the held-out side is the tail of the documents holding `share` of the text.

    Whole documents go to the held-out side, last first, while they fit in `share` of the
    characters; when even the last document is larger than the share, its tail is cut off at a
    line boundary instead.
    Deterministic, and the two sides never share a character.
    """
    total = sum(len(t) for t in texts)
    want = max(1, int(total * share))
    held: list[str] = []
    got = 0
    rest = list(texts)
    while rest and got < want:
        last = rest[-1]
        need = want - got
        if len(last) <= need:
            held.insert(0, rest.pop())
            got += len(last)
            continue
        if held:  # the next document would overshoot the share: stop short of it
            break
        cut = last.rfind("\n", 0, len(last) - need) + 1 or len(last) - need
        rest[-1] = last[:cut]
        held.insert(0, last[cut:])
        break
    return [t for t in rest if t.strip()], [t for t in held if t.strip()]


@dataclass(frozen=True)
class DataSource:
    """What `--data` names, read lazily: the documents to train on and the held-out ones.

    A built-in corpus ("stdlib", "py:PACKAGE") has a train and a held-out split by file; a path
    (text, JSONL, directory, saved dataset) gives up the tail of its text (`split_tail`) as held-out,
    which training never reads. No `--data`: the stdlib corpus (the bundled fixture's text).
    """

    name: str
    train: Callable[[], list[str]]
    heldout: Callable[[], list[str]]


def data_source(data: str | Path | None) -> DataSource:
    """Validate `--data` now; the texts are read when asked for."""
    from recycle.corpus import STDLIB, corpus_root, documents, is_corpus_name

    if data is None or is_corpus_name(str(data)):
        name = STDLIB if data is None else str(data)
        corpus_root(name)  # an unknown package fails here, before any loading
        return DataSource(name, lambda: [d.text for d in documents("train", source=name)],
                          lambda: [d.text for d in documents("heldout", source=name)])
    path = Path(data).expanduser()
    if not path.exists():
        raise RecycleError(f"--data {path}: no such file or directory")
    every = _path_texts(path)
    cache: dict[str, tuple[list[str], list[str]]] = {}

    def sides() -> tuple[list[str], list[str]]:
        if "s" not in cache:
            cache["s"] = split_tail(every())
        return cache["s"]

    return DataSource(str(path), lambda: sides()[0], lambda: sides()[1])


def load_texts(data: str | Path | None) -> Callable[[], list[str]]:
    """A loader of the training documents of a source (validated now, read on call)."""
    return data_source(data).train
