"""Draft vocabularies for EAGLE-3: the N most frequent target tokens over a corpus.

Follows EAGLE-3's own recipe (`traineagle3/cnets.py`): count tokens, keep the top N, sort them by
target id; d2t/t2d are then derived from that ascending list. Ties break toward the lower id and,
if the corpus shows fewer than N distinct tokens, the lowest unseen ids fill the rest, so the
result is deterministic for a given tokenizer and corpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from recycle.errors import RecycleError

DEFAULT_CORPUS_CHARS = 4_000_000  # of the stdlib train split: enough for stable top-N counts, seconds to tokenize
BATCH = 256


def count_tokenizer(ckpt_dir: Path):
    """The checkpoint's tokenizer.json as a bare `tokenizers.Tokenizer`: counting a corpus's tokens for the draft
    vocabulary needs ids only, no chat template or special-token handling (`recycle.encode.load_tokenizer`)."""
    from tokenizers import Tokenizer

    path = ckpt_dir / "tokenizer.json"
    if not path.is_file():
        raise RecycleError(f"{ckpt_dir}: --draft-vocab needs the checkpoint's tokenizer.json to count tokens")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise RecycleError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None


def corpus_texts(corpus: str | os.PathLike | None, max_chars: int = DEFAULT_CORPUS_CHARS) -> Iterable[str]:
    """The given text file, else the first `max_chars` of recycle's stdlib train split."""
    if corpus is not None:
        p = Path(corpus)
        try:
            yield p.read_text(encoding="utf-8", errors="ignore")
        except OSError as e:
            raise RecycleError(f"{p}: cannot read the vocabulary corpus ({e.strerror or e})") from None
        return
    from recycle.corpus import documents

    seen = 0
    for doc in documents("train"):
        yield doc.text
        seen += len(doc.text)
        if seen >= max_chars:
            return


def token_counts(ckpt_dir: Path, vocab: int, corpus: str | os.PathLike | None = None) -> torch.Tensor:
    tok = count_tokenizer(ckpt_dir)
    counts = torch.zeros(vocab, dtype=torch.long)
    batch: list[str] = []

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            ids = torch.tensor([i for i in enc.ids if 0 <= i < vocab], dtype=torch.long)
            counts.index_add_(0, ids, torch.ones_like(ids))
        batch.clear()

    for text in corpus_texts(corpus):
        batch.extend(text[i:i + 4096] for i in range(0, len(text), 4096))
        if len(batch) >= BATCH:
            flush()
    if batch:
        flush()
    if int(counts.sum()) == 0:
        raise RecycleError("the vocabulary corpus produced no tokens")
    return counts


def draft_vocab(ckpt_dir: Path, n: int, vocab: int, corpus: str | os.PathLike | None = None) -> torch.Tensor:
    """Ascending target ids of the N most frequent tokens."""
    if not 1 <= n <= vocab:
        raise RecycleError(f"--draft-vocab must be between 1 and the vocabulary size {vocab}, got {n}")
    counts = token_counts(ckpt_dir, vocab, corpus)
    # Stable sort on -count keeps ascending ids among ties; unseen ids (count 0) follow in id order.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:n]).values
