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

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from recycle.errors import RecycleError
from recycle.texts import DataSource, data_source, load_texts, split_tail  # noqa: F401  (re-exported)

ENCODE_CHUNK = 32  # documents per tokenizer call (the fast tokenizer batches internally)


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
