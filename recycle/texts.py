"""Where text comes from: `--data` paths and built-in corpora, split into a training side and a held-out side.

A path (a text file, JSONL or JSON rows, a directory of text files, a dataset saved with
`datasets.save_to_disk`) or `hf:NAME` (a dataset in the local `datasets` cache, loaded offline) gives up the
tail of its documents as the held-out side; a built-in corpus (`stdlib`, `py:PACKAGE`: `recycle.corpus`) has
its train/held-out split by file. Rows are plain text or conversations (OpenAI `messages`, ShareGPT
`conversations`: `recycle.chat`), detected row by row; a document is a `str` or a `Conversation`. Distillation
(`recycle.distill.data`), harvest and calibration (`recycle.distill.calibrate`) read text through here.

Memory stays bounded by the data's size, whatever its shape: a text file is read a block at a time, and a text
longer than DOC_CHARS characters (a whole file on one line, a huge row) becomes several documents of at most
that many, cut at a line end or a space where there is one (no tokenizer ever sees gigabytes at once). What a
path's reading skips is counted (`ReadLog`) and said once, in one line (a JSONL line that is not JSON by number).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from recycle.chat import Conversation, Document, document
from recycle.errors import RecycleError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".json")
SNIFF_BYTES = 8192  # a file whose first bytes hold a NUL, or do not decode as UTF-8, is binary
DOC_CHARS = 1 << 20  # the longest text one document holds (≈ 250k tokens); a longer one is cut into several
NOT_JSON = "not valid JSON"
LISTED_LINES = 5  # broken lines named in a message; the rest are counted


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """"1 document", "2 documents" (`nouns` where the plural is not noun + s)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def _cut(text: str, start: int, end: int) -> int:
    """Where a piece starting at `start` ends, at most at `end`: after the last line end in its second half, else
    before its last space (so the next piece's first word keeps its leading space), else at `end`."""
    lo = start + (end - start) // 2
    i = text.rfind("\n", lo, end)
    if i >= 0:
        return i + 1
    i = max(text.rfind(" ", lo, end), text.rfind("\t", lo, end))
    return i if i > start else end


def split_long(text: str, limit: int | None = None) -> list[str]:
    """`text` as pieces of at most `limit` (DOC_CHARS) characters that join back into it."""
    limit = limit or DOC_CHARS
    if len(text) <= limit:
        return [text]
    out, start = [], 0
    while len(text) - start > limit:
        end = _cut(text, start, start + limit)
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


def _text_pieces(path: Path) -> Iterator[str]:
    """A text file's `split_long` pieces, read a block at a time (the same pieces as splitting the whole)."""
    limit = DOC_CHARS
    buf = ""
    with path.open(encoding="utf-8", errors="replace") as f:
        while block := f.read(limit):
            buf += block
            *done, buf = split_long(buf, limit)
            yield from done
    if buf:
        yield buf


@dataclass
class ReadLog:
    """What reading `--data` found: documents kept, rows read by kind (text, messages, sharegpt), and what was
    skipped and why (the distill record says); `kinds` counts every row read, kept or not (conversation, text,
    other), and `bad_lines` names the lines that are not JSON (file, line number), the first LISTED_LINES."""

    documents: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    bad_lines: list[tuple[str, int]] = field(default_factory=list)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def saw(self, kind: str) -> None:
        self.rows[kind] = self.rows.get(kind, 0) + 1

    def seen(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def broken(self, path: Path, line: int) -> None:
        """A line (or a .json file) that is not JSON: counted, and named while few."""
        self.seen("other")
        self.skip(NOT_JSON)
        if len(self.bad_lines) < LISTED_LINES:
            self.bad_lines.append((str(path), line))

    def to_json(self) -> dict:
        return {"documents": self.documents, "rows": dict(self.rows), "skipped": dict(self.skipped)}

    def read(self) -> str:
        """Every row read, by kind: "4 conversations", "3 rows (2 text, 1 other)"."""
        names = {"conversation": ("conversation",), "text": ("text row",), "other": ("other row",)}
        kinds = {k: n for k, n in self.kinds.items() if n}
        total = sum(kinds.values())
        if len(kinds) == 1:
            kind = next(iter(kinds))
            return plural(total, *names.get(kind, ("row",)))
        return f"{plural(total, 'row')} ({', '.join(f'{kinds[k]:,} {k}' for k in names if k in kinds)})"

    def why(self, where: str) -> str:
        """"1 not valid JSON (line 4), 2 no assistant turn": what was skipped and why."""
        def lines() -> str:
            if not self.bad_lines:
                return ""
            named = [f"line {n}" if f == where else f"{Path(f).name} line {n}" for f, n in self.bad_lines]
            more = self.skipped[NOT_JSON] - len(named)
            return f" ({', '.join(named)}{f' and {more:,} more' if more > 0 else ''})"

        return ", ".join(f"{n:,} {r}" + (lines() if r == NOT_JSON else "") for r, n in self.skipped.items())


_SAID: set[str] = set()  # warnings already printed (a source is read again for its held-out side)


def _warn(text: str) -> None:
    """One line on stderr, once per process (rank 0 only under torchrun)."""
    if text in _SAID or os.environ.get("RANK", "0") != "0":
        return
    _SAID.add(text)
    print(f"recycle: warning: {text}", file=sys.stderr, flush=True)


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


def _documents(rows: Iterable[object], log: ReadLog) -> Iterator[Document]:
    """Each row's document (`recycle.chat.document`), a long text as its `split_long` pieces."""
    for row in rows:
        doc = document(row, log)
        if isinstance(doc, str):
            yield from split_long(doc)
        elif doc is not None:
            yield doc


def _jsonl_rows(path: Path, log: ReadLog) -> Iterator[object]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if line.isspace() or not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.broken(path, n)
                continue
            del line  # a row of a gigabyte is held once, not twice
            yield row


def _json_texts(path: Path, log: ReadLog) -> list[Document]:
    """A .json file: a list of rows (text or conversations), or one such row."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        log.broken(path, e.lineno)
        return []
    rows = data if isinstance(data, list) else [data]
    return list(_documents(rows, log))


def _file_texts(path: Path, log: ReadLog) -> list[Document]:
    if is_binary(path):
        log.seen("other")
        log.skip("binary file")
        return []
    if path.suffix == ".jsonl":
        return list(_documents(_jsonl_rows(path, log), log))
    if path.suffix == ".json":
        return _json_texts(path, log)
    log.seen("text")
    pieces = [t for t in _text_pieces(path) if t and not t.isspace()]
    if not pieces:
        log.skip("empty file")
        return []
    log.saw("text")
    return pieces


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


DATASET_COLUMNS = ("text", "messages", "conversations")
HUB_PREFIX = "hf:"


def _rows_of(ds, where: str, log: ReadLog) -> list[Document]:
    from datasets import DatasetDict

    if isinstance(ds, DatasetDict):
        ds = ds["train"] if "train" in ds else ds[sorted(ds)[0]]
    if not set(DATASET_COLUMNS) & set(ds.column_names):
        raise RecycleError(f"{where}: the dataset has none of the columns {', '.join(DATASET_COLUMNS)} (columns: "
                           f"{', '.join(ds.column_names)})")
    keep = [c for c in ds.column_names if c in DATASET_COLUMNS]

    def rows() -> Iterator[dict]:
        for row in ds.select_columns(keep):
            # Arrow fills the fields a turn lacks with None; a column of another row kind is None too
            row = {k: v for k, v in row.items() if v is not None}
            if "messages" in row or "conversations" in row:
                key = "messages" if "messages" in row else "conversations"
                row[key] = [{k: v for k, v in t.items() if v is not None} if isinstance(t, dict) else t
                            for t in row[key]]
            yield row

    return list(_documents(rows(), log))


def _import_datasets(where: str):
    try:
        import datasets  # optional dependency, imported only here
    except ImportError:
        raise RecycleError(f"{where}: a `datasets` dataset; pip install datasets to read it") from None
    return datasets


def _dataset_texts(path: Path, log: ReadLog) -> list[Document]:
    datasets = _import_datasets(str(path))
    return _rows_of(datasets.load_from_disk(str(path)), str(path), log)


def _cached_dataset_texts(name: str, log: ReadLog) -> list[Document]:
    """`hf:NAME`: a dataset already in the local `datasets`/Hub cache, loaded with the Hub switched off (nothing is
    fetched at run time)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets = _import_datasets(HUB_PREFIX + name)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # a missing cache entry surfaces as one of several exception types
        raise RecycleError(f"--data {HUB_PREFIX}{name}: not in the local datasets cache ({' '.join(str(e).split())[:120]}); "
                           "recycle never downloads: fetch it once with datasets.load_dataset, or save it with "
                           "save_to_disk and pass that directory") from None
    return _rows_of(ds, HUB_PREFIX + name, log)


HELDOUT_SHARE = 0.05  # of a `--data` path's text, taken from its tail as the held-out side


def _path_texts(path: Path, log: ReadLog) -> Callable[[], list[Document]]:
    """A loader of every document under a `--data` path (validated now, read on call); what it skips is counted
    in `log`, and a path that yields no document at all is refused."""
    if _is_saved_dataset(path):
        read = lambda: _dataset_texts(path, log)
    elif path.is_file():
        if is_binary(path):
            raise RecycleError(f"--data {path}: not text (binary bytes in its first {SNIFF_BYTES // 1024} KB)")
        read = lambda: _file_texts(path, log)
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise RecycleError(f"--data {path}: holds no text files ({' '.join(TEXT_SUFFIXES)})")
        read = lambda: [t for p in files for t in _file_texts(p, log)]
    return _checked(str(path), read, log)


def _checked(where: str, read: Callable[[], list[Document]], log: ReadLog) -> Callable[[], list[Document]]:
    """`read`, refusing a source that yields no document at all (with what was skipped, and why)."""

    def texts() -> list[Document]:
        out = read()
        log.documents = len(out)
        if not out:
            if not log.kinds:
                raise RecycleError(f"--data {where}: holds no text documents (nothing in it)")
            hint = "; rows need a \"text\", \"messages\" or \"conversations\" field" if log.kinds.get("other") else ""
            raise RecycleError(f"--data {where}: holds no text documents or usable conversations: {log.read()} read, "
                               f"all skipped ({log.why(where)}{hint})")
        if log.skipped:
            _warn(f"--data {where}: skipped {sum(log.skipped.values()):,} of {log.read()}: {log.why(where)}")
        return out

    return texts


def split_tail(texts: list[Document], share: float = HELDOUT_SHARE) -> tuple[list[Document], list[Document]]:
    """(train, held-out): the held-out side is the tail of the documents holding `share` of the text.

    Whole documents go to the held-out side, last first, while they fit in `share` of the
    characters; when even the last document is larger than the share, its tail is cut off at a
    line boundary instead (a text; a conversation is never cut: it goes whole, unless it is the only one).
    Deterministic, and the two sides never share a character.
    """
    total = sum(len(t) for t in texts)
    want = max(1, int(total * share))
    held: list[Document] = []
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
        if isinstance(last, Conversation):
            if len(rest) > 1:
                held.insert(0, rest.pop())
            break
        cut = last.rfind("\n", 0, len(last) - need) + 1 or len(last) - need
        rest[-1] = last[:cut]
        held.insert(0, last[cut:])
        break
    def kept(docs: list[Document]) -> list[Document]:
        return [t for t in docs if isinstance(t, Conversation) or t.strip()]

    return kept(rest), kept(held)


@dataclass(frozen=True)
class DataSource:
    """What `--data` names, read lazily: the documents to train on and the held-out ones.

    A built-in corpus ("stdlib", "py:PACKAGE") has a train and a held-out split by file; a path
    (text, JSONL, directory, saved dataset) gives up the tail of its text (`split_tail`) as held-out,
    which training never reads. No `--data`: the stdlib corpus (the bundled fixture's text).
    """

    name: str
    train: Callable[[], list[Document]]
    heldout: Callable[[], list[Document]]
    log: ReadLog = field(default_factory=ReadLog)  # filled as the path is read (built-in corpora skip nothing)


def data_source(data: str | Path | None) -> DataSource:
    """Validate `--data` now; the texts are read when asked for."""
    from recycle.corpus import STDLIB, corpus_root, documents, is_corpus_name

    if data is None or is_corpus_name(str(data)):
        name = STDLIB if data is None else str(data)
        corpus_root(name)  # an unknown package fails here, before any loading
        return DataSource(name, lambda: [d.text for d in documents("train", source=name)],
                          lambda: [d.text for d in documents("heldout", source=name)])
    log = ReadLog()
    if str(data).startswith(HUB_PREFIX):
        every = _checked(str(data), lambda: _cached_dataset_texts(str(data)[len(HUB_PREFIX):], log), log)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise RecycleError(f"--data {path}: no such file or directory")
        every = _path_texts(path, log)
    cache: dict[str, tuple[list[Document], list[Document]]] = {}

    def sides() -> tuple[list[Document], list[Document]]:
        if "s" not in cache:
            cache["s"] = split_tail(every())
        return cache["s"]

    return DataSource(str(data), lambda: sides()[0], lambda: sides()[1], log)


def load_texts(data: str | Path | None) -> Callable[[], list[Document]]:
    """A loader of the training documents of a source (validated now, read on call)."""
    return data_source(data).train
