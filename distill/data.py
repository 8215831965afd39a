"""Training text → fixed-length token sequences, in a deterministic, resumable order.

Sources (`--data`): a text file, a JSONL file (one `{"text": ...}` per line), a directory of text
files (`*.txt *.md *.py *.jsonl`, sorted), or a dataset saved with `datasets.save_to_disk`
(imported only then, so `datasets` stays optional); the tail of its text is held out (never
trained on) for the held-out estimate. A built-in corpus by name: `stdlib` (the default, what the
bundled fixture was trained on) or `py:PACKAGE` (an installed package's source), each with its
train/held-out split by file, so training never overlaps the held-out prompts `recycle bench` decodes.

Packing (`--packing`): documents are encoded with the target's tokenizer, each followed by EOS. `stream` (the
fixture's own training) concatenates them and cuts `seq_len` windows: no padding, but a document straddles two
windows. `whole` keeps every document of at most `seq_len` tokens (its EOS counted) inside one window: each is
placed first-fit into one of at most WHOLE_OPEN windows being filled (when none has room and all are open, the
fullest is closed), a window is emitted as soon as it is full, a longer document is cut into window-length pieces
(its tail piece placed like a short document), and what no document fills is padding (EOS ids) at the window's end,
masked False so it counts in no loss and no estimate (the mask below). Epoch e visits documents in a shuffled order seeded by (seed, e), so a
position in the stream is just (epoch, sequences taken) and a resumed run rebuilds the same stream
and skips to it (re-encoding is cheap next to the target's forward). Memory is bounded: no document is longer than
`recycle.texts.DOC_CHARS` characters (longer text is read as pieces), the tokenizer sees at most
`recycle.encode.ENCODE_CHARS` per call, and windows are cut as each document arrives.

Conversations (`recycle.chat`) are rendered with the target's chat template instead, and carry a mask over
their tokens: True on the assistant turns (plain text: every token), False on the template's and the other
roles' tokens and on the EOS after a conversation. Windows carry their slice of it, so the mask survives packing;
distill shifts it with the draft steps (`mask_steps`), and only masked-in predictions count in the loss and the
held-out estimate. A source with no conversation has no mask at all (None), exactly as before.

`--self-distill` (Medusa's recipe, formats-target §3.3): each packed sequence keeps its first
`prompt_len` tokens as a prompt and the target regenerates the rest (greedy, or sampled with a seed
derived from the batch index so a resumed run regenerates the same text), so the drafter learns
the target's own distribution, not the corpus's. On conversations the target writes each assistant turn itself
instead, turn by turn after the turns before it (`regenerate_turns`); user, system and tool turns stay byte for byte.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from recycle.chat import ChatRenderer, Conversation, Document, has_conversations
from recycle.encode import ENCODE_CHUNK, UNLIMITED, encode
from recycle.errors import RecycleError
from recycle.texts import ReadLog, data_source

PACKINGS = ("whole", "stream")  # --packing's choices (the first is the default)
WHOLE_OPEN = 16  # whole-document packing: windows filled at once (the bounded lookahead of first-fit)

# (indices of the documents, the documents, a key naming the chunk's place in the stream) -> the documents to encode
Rewrite = Callable[[list[int], list[Document], str], list[Document]]
# (prompts' token ids, max new tokens, temperature (0: greedy), seed, stop token ids) -> each prompt's new token ids
Generate = Callable[[list[list[int]], int, float, int, list[int]], list[list[int]]]


@dataclass
class Position:
    """Where the stream is: epoch and sequences already taken in it (saved in checkpoints)."""

    epoch: int = 0
    taken: int = 0
    length: int | None = None  # a curriculum stage's window length (None: --seq-len's stream)


class PackedStream:
    """Deterministic stream of `seq_len`-token windows over shuffled, EOS-separated documents, with their
    assistant masks where the documents hold conversations (rendered by `renderer`; `log` counts what it skips;
    `rewrite(indices, documents, key)` replaces a chunk of documents before they are encoded: `--self-distill` on
    conversations)."""

    def __init__(self, texts: Callable[[], list[Document]], tokenizer, seq_len: int, seed: int = 0,
                 renderer: ChatRenderer | None = None, log: ReadLog | None = None,
                 rewrite: Rewrite | None = None, packing: str = "stream") -> None:
        if seq_len < 8:
            raise RecycleError(f"--seq-len must be at least 8, got {seq_len}")
        if packing not in PACKINGS:
            raise RecycleError(f"--packing {packing!r}: choose {' or '.join(PACKINGS)}")
        self.tokenizer, self.seq_len, self.seed, self.packing = tokenizer, seq_len, seed, packing
        self.real = self.padded = 0  # tokens emitted: real ones and padding (whole packing's share: `padding_share`)
        self.renderer, self.log, self.rewrite = renderer, log, rewrite
        self.failed: set[int] = set()
        tokenizer.model_max_length = UNLIMITED  # documents are cut into windows here, never fed whole
        self._texts_fn, self._texts = texts, None
        self.eos = tokenizer.eos_token_id
        self.pos = Position()
        self._it: Iterator[list[int]] | None = None

    def texts(self) -> list[Document]:
        if self._texts is None:
            self._texts = self._texts_fn()
            if not self._texts:
                raise RecycleError("the training data holds no text")
            if has_conversations(self._texts) and self.renderer is None:
                raise RecycleError("the training data holds conversations: a chat renderer is needed")
        return self._texts

    @property
    def masked(self) -> bool:
        """Windows carry a mask: conversations' assistant tokens, or whole packing's padding."""
        return self.renderer is not None or self.packing == "whole"

    @property
    def padding_share(self) -> float:
        """The share of the tokens emitted so far that are padding (0 for stream packing)."""
        return self.padded / max(1, self.real + self.padded)

    def _skipped(self, index: int, reason: str) -> None:
        if index not in self.failed and self.log is not None:  # counted once, not once per epoch
            self.log.skip(reason)
        self.failed.add(index)

    def order(self, epoch: int) -> list[int]:
        """The documents' indices in the order epoch `epoch` reads them."""
        order = list(range(len(self.texts())))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _documents(self, epoch: int) -> Iterator[tuple[list[int], list[bool]]]:
        """Epoch `epoch`'s documents, encoded (EOS after each), with their masks (all True for text)."""
        texts = self.texts()
        order = self.order(epoch)
        for start in range(0, len(order), ENCODE_CHUNK):
            idx = order[start:start + ENCODE_CHUNK]
            chunk = [texts[i] for i in idx]
            if self.rewrite is not None:
                chunk = self.rewrite(idx, chunk, f"{self.seed}:{epoch}:{start}")
            for ids, mask in encode(chunk, self.tokenizer, self.renderer, lambda i, why, idx=idx: self._skipped(idx[i], why)):
                yield ids, (mask if mask is not None else [True] * len(ids))

    def _epoch(self, epoch: int) -> Iterator[tuple[list[int], list[bool] | None]]:
        windows = self._whole(epoch) if self.packing == "whole" else self._stream(epoch)
        produced = 0
        for ids, mask, gap in windows:
            self.real, self.padded = self.real + len(ids) - gap, self.padded + gap
            yield ids, (mask if self.masked else None)
            produced += 1
        if produced == 0:
            raise RecycleError(f"the training data holds fewer than --seq-len {self.seq_len} tokens")

    def _stream(self, epoch: int) -> Iterator[tuple[list[int], list[bool], int]]:
        buf: list[int] = []
        mbuf: list[bool] = []
        n = self.seq_len
        for ids, mask in self._documents(epoch):
            buf.extend(ids)
            mbuf.extend(mask)
            at = 0  # windows are cut as each document arrives, by offset: the buffer holds one document's ids
            while len(buf) - at >= n:
                yield buf[at:at + n], mbuf[at:at + n], 0
                at += n
            del buf[:at], mbuf[:at]

    def _whole(self, epoch: int) -> Iterator[tuple[list[int], list[bool], int]]:
        """First-fit over at most WHOLE_OPEN open windows (see the module's docstring): (ids, mask, padding)."""
        n = self.seq_len
        pad = self.eos if self.eos is not None else 0
        open_: list[tuple[list[int], list[bool]]] = []

        def close(w: tuple[list[int], list[bool]]) -> tuple[list[int], list[bool], int]:
            ids, mask = w
            gap = n - len(ids)
            return ids + [pad] * gap, mask + [False] * gap, gap

        for ids, mask in self._documents(epoch):
            at = 0
            while len(ids) - at >= n:  # a document of exactly a window fills one; a longer one is cut into pieces
                yield ids[at:at + n], mask[at:at + n], 0
                at += n
            ids, mask = ids[at:], mask[at:]
            if not ids:
                continue
            at = next((i for i, w in enumerate(open_) if n - len(w[0]) >= len(ids)), None)
            if at is None:
                if len(open_) >= WHOLE_OPEN:
                    yield close(open_.pop(max(range(len(open_)), key=lambda i: len(open_[i][0]))))
                at = len(open_)
                open_.append(([], []))
            open_[at][0].extend(ids)
            open_[at][1].extend(mask)
            if len(open_[at][0]) == n:
                yield (*open_.pop(at), 0)
        for w in open_:  # the epoch's end: what is left, padded, in the order the windows opened
            yield close(w)

    def seek(self, pos: Position) -> None:
        """Continue from `pos` (rebuilds the epoch's order and skips what was taken)."""
        self.pos = Position(pos.epoch, 0)
        self._it = self._epoch(pos.epoch)
        for _ in range(pos.taken):
            next(self._it)
            self.pos.taken += 1

    def take(self, n: int) -> torch.Tensor:
        """The next n sequences as a [n, seq_len] long tensor (rolls over into the next epoch)."""
        return self.take_masked(n)[0]

    def take_masked(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next n sequences and their assistant masks ([n, seq_len] bool; None for a text-only source)."""
        rows, masks = [], []
        if self._it is None:
            self.seek(self.pos)
        while len(rows) < n:
            try:
                ids, mask = next(self._it)
                rows.append(ids)
                masks.append(mask)
                self.pos.taken += 1
            except StopIteration:
                self.pos = Position(self.pos.epoch + 1, 0)
                self._it = self._epoch(self.pos.epoch)
        return torch.tensor(rows, dtype=torch.long), (torch.tensor(masks, dtype=torch.bool) if self.masked else None)


class Staged:
    """A curriculum's streams, one window length at a time (`--curriculum`): `make(length)` builds the stream of a
    length (its own document order), which starts at its beginning the first time a step asks for that length; the
    position names the length it is in, so a resumed run continues in the right stage."""

    def __init__(self, make: Callable[[int], PackedStream], seq_len: int) -> None:
        self.make, self.seq_len = make, seq_len
        self.current = make(seq_len)
        self.real = self.padded = 0  # what earlier stages' streams emitted

    def texts(self) -> list[Document]:
        return self.current.texts()

    @property
    def pos(self) -> Position:
        p = self.current.pos
        return Position(p.epoch, p.taken, None if self.current.seq_len == self.seq_len else self.current.seq_len)

    @property
    def padding_share(self) -> float:
        padded = self.padded + self.current.padded
        return padded / max(1, self.real + self.current.real + padded)

    def _to(self, length: int) -> None:
        if self.current.seq_len != length:
            self.real, self.padded = self.real + self.current.real, self.padded + self.current.padded
            self.current = self.make(length)

    def seek(self, pos: Position) -> None:
        self._to(pos.length or self.seq_len)
        self.current.seek(Position(pos.epoch, pos.taken))

    def take_masked(self, n: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next n windows of `length` tokens (default --seq-len), from that length's stream."""
        self._to(length or self.seq_len)
        return self.current.take_masked(n)


def heldout_batch(tokenizer, seq_len: int, rows: int, data: str | Path | None = None) -> torch.Tensor:
    """The held-out rows alone (text sources; see `heldout_rows`)."""
    return heldout_rows(tokenizer, seq_len, rows, data)[0]


def heldout_rows(tokenizer, seq_len: int, rows: int, data: str | Path | None = None,
                 renderer: ChatRenderer | None = None,
                 rewrite: Rewrite | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fixed evaluation batch from the held-out side of `--data` (the stdlib held-out split without it), with its
    assistant mask when it holds conversations; `rewrite` replaces each chunk of documents before it is encoded
    (`--self-distill` on conversations: only the documents the batch reads are regenerated).

    One window per document, from the middle of each (documents in a fixed shuffled order), so the
    rows span `rows` documents and start in their body, not in licence headers; held-out text with too
    few long documents is packed like the training stream instead, and text shorter than one window
    gives one shorter window. Conversations are packed whole.
    """
    texts = data_source(data).heldout()
    if not texts:
        raise RecycleError(f"--data {data}: no held-out text (its tail is empty)")
    if has_conversations(texts) and renderer is None:
        raise RecycleError(f"--data {data}: its held-out side holds conversations: a chat renderer is needed")
    order = list(range(len(texts)))
    random.Random("heldout").shuffle(order)
    tokenizer.model_max_length = UNLIMITED
    windows: list[list[int]] = []
    packed: list[int] = []
    pmask: list[bool] = []
    def documents() -> Iterator[tuple[list[int], list[bool] | None]]:
        for start in range(0, len(order), ENCODE_CHUNK):
            idx = order[start:start + ENCODE_CHUNK]
            chunk = [texts[i] for i in idx]
            if rewrite is not None:
                chunk = rewrite(idx, chunk, f"heldout:{start}")
            yield from encode(chunk, tokenizer, renderer, lambda i, why: None)

    for ids, mask in documents():
        body = ids[:-1] if tokenizer.eos_token_id is not None else ids
        if mask is None and len(body) >= 2 * seq_len and len(windows) < rows:
            mid = (len(body) - seq_len) // 2
            windows.append(body[mid:mid + seq_len])
        if len(packed) < rows * seq_len:
            packed.extend(ids)
            pmask.extend(mask if mask is not None else [True] * len(ids))
        if len(windows) >= rows:
            return torch.tensor(windows, dtype=torch.long), None
        if len(packed) >= rows * seq_len and renderer is not None:
            break
    if len(packed) < 8:
        raise RecycleError(f"--data {data}: its held-out side holds only {len(packed)} tokens")
    width = min(seq_len, len(packed))
    n = max(1, min(rows, len(packed) // width))
    ids_t = torch.tensor([packed[i * width:(i + 1) * width] for i in range(n)], dtype=torch.long)
    mask_t = torch.tensor([pmask[i * width:(i + 1) * width] for i in range(n)], dtype=torch.bool)
    return ids_t, (mask_t if renderer is not None else None)


def mask_steps(steps: list, mask: torch.Tensor | None) -> list:
    """Only assistant predictions count: step k at anchor i predicts t_{i+k+2} (every unroller's convention,
    `recycle.distill.unroll`), so its rows keep mask[:, i+k+2]. A None mask leaves the steps as they are."""
    if mask is None:
        return steps
    t = steps[0].rows // mask.shape[0] if steps else 0
    for k, s in enumerate(steps):
        keep = mask[:, k + 2:k + 2 + t].reshape(-1).to(s.labels.device)
        s.mask = keep if s.mask is None else (s.mask & keep)
    return steps


def in_process(model, pad_id: int | None, batch: int = 32) -> Generate:
    """`Generate` with the target in this process (transformers' `generate`): prompts left-padded into batches of
    `batch`, each row stopping at the first stop id (the rest of its batch runs on; what follows is cut)."""

    @torch.no_grad()
    def generate(prompts: list[list[int]], max_new: int, temperature: float, seed: int, stops: list[int]
                 ) -> list[list[int]]:
        device = next(model.parameters()).device
        pad = pad_id if pad_id is not None else (stops[-1] if stops else 0)
        kwargs: dict = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0)
            torch.manual_seed(seed)
        out: list[list[int]] = []
        for lo in range(0, len(prompts), batch):
            part = prompts[lo:lo + batch]
            width = max(len(p) for p in part)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in part], device=device)
            attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=device)
            out += model.generate(ids, attention_mask=attn, max_new_tokens=max_new, eos_token_id=stops or None,
                                  pad_token_id=pad, **kwargs)[:, width:].tolist()
        return out

    return generate


def regenerate_turns(generate: Generate, renderer: ChatRenderer, docs: list[Document], temperature: float, seed: int,
                     max_new_tokens: int) -> list[Document]:
    """Self-distillation on conversations: the target writes every assistant turn, in order, each after the turns
    before it as regenerated (greedy, or sampled at `temperature`, round r seeded with `seed + r`), until the
    template's end-of-turn token or `max_new_tokens`. User, system and tool turns are kept byte for byte; text
    documents pass through. `generate` runs the target: in this process (`in_process`) or in vLLM (`harvest`)."""
    tok = renderer.tokenizer
    stops = renderer.stop_ids()
    work = [[dict(m) for m in d.messages] if isinstance(d, Conversation) else None for d in docs]
    rounds = max((len(d.assistant_turns()) for d in docs if isinstance(d, Conversation)), default=0)
    for r in range(rounds):
        todo = [(ci, d.assistant_turns()[r]) for ci, d in enumerate(docs)
                if isinstance(d, Conversation) and len(d.assistant_turns()) > r]
        prompts = [tok(renderer.prompt(work[ci][:ti]), add_special_tokens=False)["input_ids"] for ci, ti in todo]
        for (ci, ti), new in zip(todo, generate(prompts, max_new_tokens, temperature, seed + r, stops)):
            end = next((j for j, t in enumerate(new) if t in stops), len(new))
            msg = {k: v for k, v in work[ci][ti].items() if k in ("role", "name")}
            msg["content"] = tok.decode(new[:end], skip_special_tokens=False)
            work[ci][ti] = msg
    return [Conversation(tuple(w), d.kind) if w is not None else d for w, d in zip(work, docs)]


class Regenerated:
    """`harvest --self-distill` on conversations: each conversation the stream reads, regenerated once, a block of
    `block` at a time in the order the stream's first epoch reads them (so one engine run serves many chunks;
    later epochs reuse what the first one regenerated). `rewrite` is the stream's hook; `done` what was written."""

    def __init__(self, stream: PackedStream, generate: Generate, temperature: float, seed: int, max_new: int,
                 block: int) -> None:
        self.stream, self.generate = stream, generate
        self.temperature, self.seed, self.max_new, self.block = temperature, seed, max_new, max(1, block)
        self.done: dict[int, Document] = {}
        self.runs = 0

    def rewrite(self, indices: list[int], docs: list[Document], key: str) -> list[Document]:
        missing = [i for i in indices if i not in self.done]
        if missing:
            order = self.stream.order(0)
            at = order.index(missing[0])
            todo = list(dict.fromkeys(missing + [i for i in order[at:] if i not in self.done][:self.block]))
            texts = self.stream.texts()
            new = regenerate_turns(self.generate, self.stream.renderer, [texts[i] for i in todo], self.temperature,
                                   self.seed + 1000 * self.runs, self.max_new)
            self.done.update(zip(todo, new))
            self.runs += 1
        return [self.done[i] for i in indices]


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
