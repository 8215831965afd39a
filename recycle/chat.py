"""Conversations: reading them from `--data` / `--prompts` rows, and rendering them with the target's chat template.

The targets users re-align against are chat models, and what they draft in production is the target's own
assistant turns as its chat template renders them. So a conversation is never flattened into text here: it is
rendered by the tokenizer's own template (`apply_chat_template`), and every token gets a flag saying whether it
belongs to an assistant turn, the only positions whose drafts count in the loss and the held-out estimate.

Rows (detected one by one, so a file may mix them):
  text        {"text": "..."}                                                   (plain text, as before)
  messages    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}   (OpenAI)
  sharegpt    {"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": "..."}, ...]}       (ShareGPT)

The assistant mask comes from the template's `{% generation %}` markers where it has them (transformers'
`return_assistant_tokens_mask`); otherwise each assistant turn is found by rendering the conversation up to the
turn (with the generation prompt) and through it, the span between the two being the turn; a template for which
the shorter render is not a prefix of the longer (one that rewrites earlier turns) cannot be matched that way and
its rows are skipped with that reason. Empty reasoning blocks (`<think></think>`) are never supervised.
Imports no torch.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from recycle.errors import RecycleError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool", "function_response": "tool"}
KEPT_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")  # passed to the template as they are
EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")
MARKERS = "generation markers"
SPANS = "span matching"
MAX_CONVERSATION_CHARS = 1 << 24  # a longer conversation is a counted skip: one render must not take gigabytes
TEMPLATE_SECONDS = 10.0  # one render of a chat template (an untrusted Jinja program) may take this long, then refused


@dataclass(frozen=True)
class Conversation:
    """One conversation, its turns normalised to OpenAI messages; `kind` says how the row spelled it."""

    messages: tuple[dict, ...]
    kind: str = "messages"

    def __len__(self) -> int:  # characters, as a text document's length (the held-out share counts them)
        return sum(len(m.get("content") or "") for m in self.messages)

    def assistant_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    def to_json(self) -> dict:
        return {"messages": [dict(m) for m in self.messages]}


Document = str | Conversation


class Counter(Protocol):
    """Where reading counts what it kept and skipped (`recycle.texts.ReadLog`)."""

    def skip(self, reason: str, n: int = 1) -> None: ...

    def saw(self, kind: str) -> None: ...

    def seen(self, kind: str) -> None: ...


def _content(value: object) -> str | None:
    """A turn's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts (None: not text)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       for p in value):
        return "".join(p["text"] for p in value)
    return None


def _answered(msg: dict) -> bool:
    """Whether an assistant turn says anything: text (an empty reasoning block aside), tool calls or reasoning."""
    text = EMPTY_THINK.sub("", msg.get("content") or "")
    return bool(text.strip() or msg.get("tool_calls") or str(msg.get("reasoning_content") or "").strip())


def _turns(rows: list, role_key: str, content_key: str, roles: dict[str, str], log: Counter, answer: bool = True
           ) -> tuple[dict, ...] | None:
    out = []
    for turn in rows:
        if not isinstance(turn, dict):
            log.skip("a turn is not a JSON object")
            return None
        raw = turn.get(role_key)
        role = roles.get(raw) if isinstance(raw, str) else None
        if role is None:
            log.skip(f"unknown role {raw!r}")
            return None
        content = _content(turn.get(content_key))
        if content is None and not (role == "assistant" and turn.get("tool_calls")):
            log.skip(f"a {role} turn without text content")
            return None
        msg = {"role": role, "content": content or ""}
        msg.update({k: turn[k] for k in KEPT_KEYS if turn.get(k) is not None})
        out.append(msg)
    if sum(len(m["content"]) for m in out) > MAX_CONVERSATION_CHARS:
        log.skip(f"a conversation over {MAX_CONVERSATION_CHARS:,} characters")
        return None
    if not answer:
        return tuple(out)
    if not any(m["role"] == "assistant" for m in out):
        log.skip("no assistant turn")
        return None
    if not any(_answered(m) for m in out if m["role"] == "assistant"):
        log.skip("only empty assistant turns")
        return None
    return tuple(out)


def document(row: object, log: Counter, answer: bool = True) -> Document | None:
    """A row's document: its text, its conversation, or None with the reason counted in `log` (which also hears
    what kind each row is, kept or not: `seen`). `answer`: a conversation must hold a non-empty assistant turn
    (training data); without it a request (system and user turns only: a prompt) is a conversation too."""
    if not isinstance(row, dict):
        log.seen("other")
        log.skip("not a JSON object")
        return None
    for key, kind, role_key, content_key, roles in (
            ("messages", "messages", "role", "content", {r: r for r in ROLES}),
            ("conversations", "sharegpt", "from", "value", SHAREGPT_ROLES)):
        turns = row.get(key)
        if turns is None:
            continue
        log.seen("conversation")
        if not isinstance(turns, list) or not turns:
            log.skip(f"'{key}' is not a list of turns")
            return None
        if kind == "sharegpt" and turns and isinstance(turns[0], dict) and "role" in turns[0]:
            role_key, content_key = "role", "content"  # some ShareGPT sets spell the turns as OpenAI does
        parsed = _turns(turns, role_key, content_key, roles, log, answer)
        if parsed is None:
            return None
        log.saw(kind)
        return Conversation(parsed, kind)
    text = row.get("text")
    log.seen("other" if text is None else "text")
    if text is None:
        log.skip("neither text nor a conversation (no 'text', 'messages' or 'conversations' field)")
        return None
    if not isinstance(text, str):
        log.skip("'text' is not a string")
        return None
    if not text.strip():
        log.skip("empty text")
        return None
    log.saw("text")
    return text


def has_conversations(docs: Iterable[Document]) -> bool:
    return any(isinstance(d, Conversation) for d in docs)


# -- rendering --------------------------------------------------------------------------------------


def read_template(path: str | Path) -> str:
    """`--chat-template FILE`: a Jinja chat template, as `tokenizer.chat_template` would hold it."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RecycleError(f"--chat-template {p}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if "{%" not in text and "{{" not in text:
        raise RecycleError(f"--chat-template {p}: not a Jinja template (no {{% or {{{{ in it)")
    return text


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:160] or type(e).__name__


class RenderError(Exception):
    """A conversation the template cannot render, or whose assistant turns cannot be located."""


class _OverTime(BaseException):
    """Raised inside a render that ran past its time (a BaseException: no `except Exception` in a template's caller
    swallows it)."""


class _Watchdog:
    """Time limits on calls in any thread: one daemon thread wakes at the earliest deadline and raises `_OverTime`
    in the thread still running past it (CPython's PyThreadState_SetAsyncExc, delivered between bytecodes: Jinja
    runs its templates as Python code). A signal would reach the main thread only, and clash with other alarms."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: dict[int, tuple[int, float]] = {}  # job -> (thread id, deadline)
        self.fired: set[int] = set()
        self.next = 0
        self.thread: threading.Thread | None = None

    @staticmethod
    def _raise_in(tid: int, exc: type[BaseException] | None) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)

    def _loop(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                for job, (tid, due) in list(self.jobs.items()):
                    if due <= now:
                        del self.jobs[job]
                        self.fired.add(job)
                        self._raise_in(tid, _OverTime)
                self.cond.wait(min((d for _, d in self.jobs.values()), default=now + 3600) - now)

    def call(self, fn: Callable[[], object], seconds: float) -> object:
        """fn(), or `_OverTime` once it has run `seconds`."""
        with self.cond:
            job = self.next
            self.next += 1
            self.jobs[job] = (threading.get_ident(), time.monotonic() + seconds)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="recycle-template-watchdog", daemon=True)
                self.thread.start()
            self.cond.notify()
        try:
            return fn()
        finally:
            with self.cond:
                self.jobs.pop(job, None)
                if job in self.fired:  # fired as fn returned: clear what may not have been delivered yet
                    self.fired.discard(job)
                    self._raise_in(threading.get_ident(), None)
                    raise _OverTime


_WATCHDOG = _Watchdog()
# a forked child (a data loader, an engine's worker) has no watchdog thread and may inherit a held lock: a fresh one
os.register_at_fork(after_in_child=lambda: _WATCHDOG.__init__())


@dataclass
class Rendered:
    """A rendered conversation: its token ids and, per token, whether it belongs to an assistant turn."""

    ids: list[int]
    mask: list[bool]


@dataclass
class ChatRenderer:
    """The target tokenizer's chat template, applied to conversations (see the module docstring).

    `where` names the target in errors. `template` (from `--chat-template`) replaces the tokenizer's own.
    """

    tokenizer: object
    where: str = "the target"
    template: str | None = None
    method: str = field(init=False)

    def __post_init__(self) -> None:
        if self.template is not None:
            self.tokenizer.chat_template = self.template
        tpl = getattr(self.tokenizer, "chat_template", None)
        if not tpl:
            raise RecycleError(f"{self.where}: its tokenizer has no chat template, and the data holds conversations; "
                               "pass --chat-template FILE to supply one")
        if not isinstance(tpl, str):
            raise RecycleError(f"{self.where}: its tokenizer has several named chat templates; pass --chat-template "
                               "FILE to choose one")
        self.method = MARKERS if re.search(r"{%-?\s*generation\s*-?%}", tpl) else SPANS

    def _apply(self, messages: list[dict] | tuple[dict, ...], **kwargs) -> object:
        """`apply_chat_template`, each call bounded by TEMPLATE_SECONDS: a template is an untrusted program (the
        sandbox bounds `range()` at 100,000, not a loop nested in another), and one that runs past the limit is
        refused for the whole run, never skipped row by row."""
        limit = TEMPLATE_SECONDS
        try:
            return _WATCHDOG.call(lambda: self.tokenizer.apply_chat_template(list(messages), **kwargs), limit)
        except _OverTime:
            whose = "the --chat-template" if self.template is not None else f"{self.where}'s chat template"
            raise RecycleError(f"{whose} ran over {limit:g} s rendering one conversation (a loop in the template?): "
                               "refused; fix or replace it (--chat-template FILE)") from None
        except RecycleError:
            raise
        except Exception as e:  # a template raises whatever Jinja or its raise_exception raises
            raise RenderError(f"the chat template failed to render ({_one_line(e)})") from None

    def text(self, messages: list[dict] | tuple[dict, ...], generation_prompt: bool = False) -> str:
        return self._apply(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt(self, messages: list[dict] | tuple[dict, ...]) -> str:
        """The text an engine's chat endpoint feeds the model: the turns, then the assistant's generation prompt."""
        return self.text(messages, generation_prompt=True)

    def _spans(self, conv: Conversation, full: str) -> list[tuple[int, int]]:
        spans = []
        for i in conv.assistant_turns():
            before = self.text(conv.messages[:i], generation_prompt=True)
            upto = self.text(conv.messages[:i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise RenderError("the chat template rewrites earlier turns (renders are not prefixes of each other): "
                                  "assistant spans cannot be matched; use a template with {% generation %} markers")
            spans.append((len(before), len(upto)))
        return spans

    def render(self, conv: Conversation) -> Rendered:
        """Ids and the assistant mask of a conversation; raises RenderError for one that cannot be used."""
        full = self.text(conv.messages)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        if self.method == MARKERS:
            out = self._apply(conv.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            marked = list(out["input_ids"])
            if marked != ids:
                raise RenderError("the template's tokens differ from its rendered text's")
            mask = [bool(m) for m in out["assistant_masks"]]
        else:
            spans = self._spans(conv, full)
            mask = [any(a <= s < b for a, b in spans) for s, _ in offsets]
        for m in EMPTY_THINK.finditer(full):  # an empty reasoning block is the template's, not the model's, text
            for j, (s, _) in enumerate(offsets):
                if m.start() <= s < m.end():
                    mask[j] = False
        if not any(mask):
            raise RenderError("no assistant token survives the template (empty assistant turns)")
        return Rendered(ids, mask)

    def stop_ids(self) -> list[int]:
        """Tokens that end an assistant turn: what the template writes right after the turn's content (its first
        token), and EOS. Found by rendering a probe turn, so no template's end-of-turn marker is hard-coded."""
        probe = "\x00probe\x00"
        stops = []
        try:
            text = self.text([{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}])
            tail = text.split(probe, 1)[1]
            first = self.tokenizer(tail, add_special_tokens=False)["input_ids"][:1] if tail else []
            if first and first[0] in set(getattr(self.tokenizer, "all_special_ids", [])):
                stops += first
        except (RenderError, IndexError):
            pass
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and eos not in stops:
            stops.append(eos)
        return stops


def generation_prompt(conv: Conversation) -> tuple[dict, ...]:
    """The turns a chat prompt keeps: a request (its last turn not the assistant's: a chat-completion request) whole;
    a conversation that ends in an answer, everything before that answer."""
    if conv.messages[-1]["role"] != "assistant":
        return conv.messages
    return conv.messages[:conv.assistant_turns()[-1]]
