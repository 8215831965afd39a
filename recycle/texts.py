"""Where text comes from: `--data` paths and built-in corpora, split into a training side and a held-out side.

A path (a text file, JSONL with a `text` field, a directory of text files, a dataset saved with
`datasets.save_to_disk`, imported only then) gives up the tail of its text as the held-out side; a
built-in corpus (`stdlib`, `py:PACKAGE`: `recycle.corpus`) has its train/held-out split by file. Both
distillation (`recycle.distill.data`) and calibration (`recycle.converters.calibrate`) read text through here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from recycle.errors import RecycleError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".json")
SNIFF_BYTES = 8192  # a file whose first bytes hold a NUL, or do not decode as UTF-8, is binary


@dataclass
class ReadLog:
    """What reading `--data` found: documents kept, and what was skipped and why (the distill record says)."""

    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def to_json(self) -> dict:
        return {"documents": self.documents, "skipped": dict(self.skipped)}


def is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 3  # a multi-byte character cut at the sniff's end is still text
    return False


def _row_text(row: object, log: ReadLog) -> str | None:
    """A row's text (`{"text": ...}`), or None with the reason counted."""
    if not isinstance(row, dict):
        log.skip("not a JSON object")
        return None
    text = row.get("text")
    if not isinstance(text, str):
        log.skip("no 'text' field" if "text" not in row else "'text' is not a string")
        return None
    if not text.strip():
        log.skip("empty text")
        return None
    return text


def _jsonl_texts(path: Path, log: ReadLog) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.skip("not valid JSON")
                continue
            text = _row_text(row, log)
            if text is not None:
                yield text


def _json_texts(path: Path, log: ReadLog) -> list[str]:
    """A .json file: a list of `{"text": ...}` rows (or one such object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError:
        log.skip("not valid JSON")
        return []
    rows = data if isinstance(data, list) else [data]
    return [t for t in (_row_text(r, log) for r in rows) if t is not None]


def _file_texts(path: Path, log: ReadLog) -> list[str]:
    if is_binary(path):
        log.skip("binary file")
        return []
    if path.suffix == ".jsonl":
        return list(_jsonl_texts(path, log))
    if path.suffix == ".json":
        return _json_texts(path, log)
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        log.skip("empty file")
        return []
    return [text]


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _dataset_texts(path: Path, log: ReadLog) -> list[str]:
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
    return [t for t in (_row_text({"text": t}, log) for t in ds["text"]) if t is not None]


HELDOUT_SHARE = 0.05  # of a `--data` path's text, taken from its tail as the held-out side


def _path_texts(path: Path, log: ReadLog) -> Callable[[], list[str]]:
    """A loader of every document under a `--data` path (validated now, read on call); what it skips is counted
    in `log`, and a path that yields no document at all is refused."""
    if _is_saved_dataset(path):
        read = lambda: _dataset_texts(path, log)  # noqa: E731
    elif path.is_file():
        if is_binary(path):
            raise RecycleError(f"--data {path}: not text (binary bytes in its first {SNIFF_BYTES // 1024} KB)")
        read = lambda: _file_texts(path, log)  # noqa: E731
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise RecycleError(f"--data {path}: holds no text files ({' '.join(TEXT_SUFFIXES)})")
        read = lambda: [t for p in files for t in _file_texts(p, log)]  # noqa: E731

    def texts() -> list[str]:
        out = read()
        log.documents = len(out)
        if not out:
            why = ", ".join(f"{n} {r}" for r, n in log.skipped.items()) or "nothing in it"
            raise RecycleError(f"--data {path}: holds no text documents ({why}; rows need a \"text\" field)")
        return out

    return texts


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
    log: ReadLog = field(default_factory=ReadLog)  # filled as the path is read (built-in corpora skip nothing)


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
    log = ReadLog()
    every = _path_texts(path, log)
    cache: dict[str, tuple[list[str], list[str]]] = {}

    def sides() -> tuple[list[str], list[str]]:
        if "s" not in cache:
            cache["s"] = split_tail(every())
        return cache["s"]

    return DataSource(str(path), lambda: sides()[0], lambda: sides()[1], log)


def load_texts(data: str | Path | None) -> Callable[[], list[str]]:
    """A loader of the training documents of a source (validated now, read on call)."""
    return data_source(data).train
