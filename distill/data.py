"""Training text → fixed-length token sequences, in a deterministic, resumable order.

Sources (`--data`): a text file, a JSONL file (one `{"text": ...}` per line), a directory of text
files (`*.txt *.md *.py *.jsonl`, sorted), or a dataset saved with `datasets.save_to_disk`
(imported only then, so `datasets` stays optional); the tail of its text is held out (never
trained on) for the held-out estimate. A built-in corpus by name: `stdlib` (the default, what the
bundled fixture was trained on) or `py:PACKAGE` (an installed package's source), each with its
train/held-out split by file, so training never overlaps the held-out prompts `recycle bench` decodes.

Packing follows the fixture's own training: documents are encoded with the target's tokenizer, each
followed by EOS, concatenated, and cut into `seq_len` windows; no padding, so every token the
target reads is a real one. Epoch e visits documents in a shuffled order seeded by (seed, e), so a
position in the stream is just (epoch, sequences taken) and a resumed run rebuilds the same stream
and skips to it (re-encoding is cheap next to the target's forward).

`--self-distill` (Medusa's recipe, formats-target §3.3): each packed sequence keeps its first
`prompt_len` tokens as a prompt and the target regenerates the rest (greedy, or sampled with a seed
derived from the batch index so a resumed run regenerates the same text), so the drafter learns
the target's own distribution, not the corpus's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from recycle.errors import RecycleError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".json")
ENCODE_CHUNK = 32  # documents per tokenizer call (the fast tokenizer batches internally)


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
        from datasets import DatasetDict, load_from_disk  # optional dependency, imported only here
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


@dataclass
class Position:
    """Where the stream is: epoch and sequences already taken in it (saved in checkpoints)."""

    epoch: int = 0
    taken: int = 0


class PackedStream:
    """Deterministic stream of `seq_len`-token windows over shuffled, EOS-separated documents."""

    def __init__(self, texts: Callable[[], list[str]], tokenizer, seq_len: int, seed: int = 0) -> None:
        if seq_len < 8:
            raise RecycleError(f"--seq-len must be at least 8, got {seq_len}")
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        tokenizer.model_max_length = 1 << 62  # documents are cut into windows here, never fed whole
        self._texts_fn, self._texts = texts, None
        self.eos = tokenizer.eos_token_id
        self.pos = Position()
        self._it: Iterator[list[int]] | None = None

    def texts(self) -> list[str]:
        if self._texts is None:
            self._texts = self._texts_fn()
            if not self._texts:
                raise RecycleError("the training data holds no text")
        return self._texts

    def _epoch(self, epoch: int) -> Iterator[list[int]]:
        texts = self.texts()
        order = list(range(len(texts)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        buf: list[int] = []
        produced = 0
        for start in range(0, len(order), ENCODE_CHUNK):
            batch = [texts[i] for i in order[start:start + ENCODE_CHUNK]]
            for ids in self.tokenizer(batch, add_special_tokens=False)["input_ids"]:
                buf.extend(ids)
                if self.eos is not None:
                    buf.append(self.eos)
            while len(buf) >= self.seq_len:
                yield buf[:self.seq_len]
                produced += 1
                buf = buf[self.seq_len:]
        if produced == 0:
            raise RecycleError(f"the training data holds fewer than --seq-len {self.seq_len} tokens")

    def seek(self, pos: Position) -> None:
        """Continue from `pos` (rebuilds the epoch's order and skips what was taken)."""
        self.pos = Position(pos.epoch, 0)
        self._it = self._epoch(pos.epoch)
        for _ in range(pos.taken):
            next(self._it)
            self.pos.taken += 1

    def take(self, n: int) -> torch.Tensor:
        """The next n sequences as a [n, seq_len] long tensor (rolls over into the next epoch)."""
        rows = []
        if self._it is None:
            self.seek(self.pos)
        while len(rows) < n:
            try:
                rows.append(next(self._it))
                self.pos.taken += 1
            except StopIteration:
                self.pos = Position(self.pos.epoch + 1, 0)
                self._it = self._epoch(self.pos.epoch)
        return torch.tensor(rows, dtype=torch.long)


def heldout_batch(tokenizer, seq_len: int, rows: int, data: str | Path | None = None) -> torch.Tensor:
    """A fixed evaluation batch from the held-out side of `--data` (the stdlib held-out split without it).

    One window per document, from the middle of each (documents in a fixed shuffled order), so the
    rows span `rows` documents and start in their body, not in licence headers; held-out text with too
    few long documents is packed like the training stream instead, and text shorter than one window
    gives one shorter window.
    """
    texts = data_source(data).heldout()
    if not texts:
        raise RecycleError(f"--data {data}: no held-out text (its tail is empty)")
    order = list(range(len(texts)))
    random.Random("heldout").shuffle(order)
    tokenizer.model_max_length = 1 << 62
    eos = tokenizer.eos_token_id
    windows: list[list[int]] = []
    packed: list[int] = []
    for start in range(0, len(order), ENCODE_CHUNK):
        for enc in tokenizer([texts[i] for i in order[start:start + ENCODE_CHUNK]], add_special_tokens=False)["input_ids"]:
            if len(enc) >= 2 * seq_len and len(windows) < rows:
                mid = (len(enc) - seq_len) // 2
                windows.append(enc[mid:mid + seq_len])
            if len(packed) < rows * seq_len:
                packed.extend(enc + ([eos] if eos is not None else []))
        if len(windows) >= rows:
            return torch.tensor(windows, dtype=torch.long)
    if len(packed) < 8:
        raise RecycleError(f"--data {data}: its held-out side holds only {len(packed)} tokens")
    width = min(seq_len, len(packed))
    n = max(1, min(rows, len(packed) // width))
    return torch.tensor([packed[i * width:(i + 1) * width] for i in range(n)], dtype=torch.long)


@torch.no_grad()
def regenerate(model, batch: torch.Tensor, prompt_len: int, temperature: float, seed: int) -> torch.Tensor:
    """Self-distillation: keep each row's first `prompt_len` tokens, let the target write the rest.

    EOS is suppressed until the row is full (`min_new_tokens`), so rows keep their length and the
    token budget counts the same as for corpus data.
    """
    length = batch.shape[1]
    if not 1 <= prompt_len < length:
        raise RecycleError(f"--prompt-len must be in [1, {length - 1}], got {prompt_len}")
    new = length - prompt_len
    prompts = batch[:, :prompt_len].to(next(model.parameters()).device)
    kwargs: dict = {"do_sample": temperature > 0}
    if temperature > 0:
        kwargs["temperature"] = temperature
        kwargs["top_k"] = 0
        torch.manual_seed(seed)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=getattr(model.config, "pad_token_id", None) or 0, **kwargs)
    return out[:, :length].cpu()
