"""Text to ids, below everything that reads text (distill's stream and held-out rows, harvest, calibration).

`load_tokenizer` is the one way recycle loads a tokenizer: the target's (its drafter's where the target ships
none), transformers kept quiet, a corrupt file refused in one line, and no length limit (callers cut documents into
windows and check prompts against the model's positions themselves). `encode` turns documents into ids with
their assistant masks: plain text is tokenized in bounded calls, conversations (`recycle.chat`) are rendered with
the target's chat template by the renderer `chat_renderer` checks before any model loads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from recycle.chat import ChatRenderer, Conversation, Document, RenderError, has_conversations, read_template
from recycle.errors import RecycleError
from recycle.texts import ReadLog, data_source

ENCODE_CHUNK = 32  # documents per tokenizer call (the fast tokenizer batches internally)
ENCODE_CHARS = 1 << 20  # characters per tokenizer call at most (it holds ~100 bytes per character while it works)
CHECK_CONVERSATIONS = 256  # rendered before any model loads: a template that renders none of them is refused
UNLIMITED = 1 << 62  # a tokenizer's model_max_length when its callers cut the ids themselves
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a directory with either ships a tokenizer


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports (an MTP checkpoint always has 'unexpected' MTP tensors)."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer(path: str | os.PathLike, fallback: str | os.PathLike | None = None):
    """The tokenizer of directory `path` (a target), or of `fallback` (its drafter) where `path` ships none, with no
    length limit: documents are cut into windows and prompts checked against the positions, never fed whole. A
    missing or corrupt tokenizer is one RecycleError."""
    from transformers import AutoTokenizer

    where = path
    if fallback is not None and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        where = fallback
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(where, trust_remote_code=False)  # never a release's code
    except Exception as e:  # a corrupt tokenizer file is bad input
        raise RecycleError(f"{where}: no usable tokenizer ({' '.join(str(e).split())[:160]})") from None
    tok.model_max_length = UNLIMITED
    return tok


def chat_renderer(docs: list[Document], tokenizer, where: str, template: str | Path | None = None,
                  log: ReadLog | None = None) -> ChatRenderer | None:
    """The renderer for a source's conversations (None when it holds only text), checked on the first
    CHECK_CONVERSATIONS of them now, before any model loads: a target without a template, or a template that
    renders none of them, is refused in one line."""
    if not has_conversations(docs):
        return None
    renderer = ChatRenderer(tokenizer, where, read_template(template) if template else None)
    sample = [d for d in docs if isinstance(d, Conversation)][:CHECK_CONVERSATIONS]
    errors = []
    for conv in sample:
        try:
            renderer.render(conv)
            return renderer
        except RenderError as e:
            errors.append(str(e))
    raise RecycleError(f"--data: none of the first {len(sample)} conversations renders with {where}'s chat template "
                       f"({errors[0]})")


def source_renderer(opts, tokenizer, docs: list[Document] | None = None) -> ChatRenderer | None:
    """`chat_renderer` for a distill or harvest run's options (`--data`, `--target`, `--chat-template`)."""
    src = data_source(opts.data)
    return chat_renderer(docs if docs is not None else src.train(), tokenizer, str(opts.target), opts.chat_template,
                         src.log)


def tokenized(texts: list[str], tokenizer) -> Iterator[list[int]]:
    """Each text's ids, tokenized in calls of at most ENCODE_CHARS characters (or one text): a chunk of long
    documents never makes the tokenizer hold gigabytes."""
    group: list[str] = []
    chars = 0
    for t in texts:
        if group and chars + len(t) > ENCODE_CHARS:
            yield from tokenizer(group, add_special_tokens=False)["input_ids"]
            group, chars = [], 0
        group.append(t)
        chars += len(t)
    if group:
        yield from tokenizer(group, add_special_tokens=False)["input_ids"]


def encode(docs: list[Document], tokenizer, renderer: ChatRenderer | None, skipped: Callable[[int, str], None]
           ) -> Iterator[tuple[list[int], list[bool] | None]]:
    """Each document's ids and mask, EOS appended (masked out after a conversation; text's mask None). A
    conversation that fails to render yields nothing and is reported to `skipped(index, reason)`."""
    eos = tokenizer.eos_token_id
    for start in range(0, len(docs), ENCODE_CHUNK):
        chunk = docs[start:start + ENCODE_CHUNK]
        encoded = tokenized([d for d in chunk if not isinstance(d, Conversation)], tokenizer)
        for i, d in enumerate(chunk):
            if not isinstance(d, Conversation):
                yield next(encoded) + ([eos] if eos is not None else []), None
                continue
            try:
                r = renderer.render(d)
            except RenderError as e:
                skipped(start + i, str(e))
                continue
            yield r.ids + ([eos] if eos is not None else []), r.mask + ([False] if eos is not None else [])
