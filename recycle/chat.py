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

import re
from collections.abc import Iterable
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


def _content(value: object) -> str | None:
    """A turn's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts (None: not text)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       for p in value):
        return "".join(p["text"] for p in value)
    return None


def _turns(rows: list, role_key: str, content_key: str, roles: dict[str, str], log: Counter) -> tuple[dict, ...] | None:
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
    if not any(m["role"] == "assistant" for m in out):
        log.skip("no assistant turn")
        return None
    return tuple(out)


def document(row: object, log: Counter) -> Document | None:
    """A row's document: its text, its conversation, or None with the reason counted in `log`."""
    if not isinstance(row, dict):
        log.skip("not a JSON object")
        return None
    for key, kind, role_key, content_key, roles in (
            ("messages", "messages", "role", "content", {r: r for r in ROLES}),
            ("conversations", "sharegpt", "from", "value", SHAREGPT_ROLES)):
        turns = row.get(key)
        if turns is None:
            continue
        if not isinstance(turns, list) or not turns:
            log.skip(f"'{key}' is not a list of turns")
            return None
        if kind == "sharegpt" and turns and isinstance(turns[0], dict) and "role" in turns[0]:
            role_key, content_key = "role", "content"  # some ShareGPT sets spell the turns as OpenAI does
        parsed = _turns(turns, role_key, content_key, roles, log)
        if parsed is None:
            return None
        log.saw(kind)
        return Conversation(parsed, kind)
    text = row.get("text")
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

    def text(self, messages: list[dict] | tuple[dict, ...], generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template raises whatever Jinja or its raise_exception raises
            raise RenderError(f"the chat template failed to render ({_one_line(e)})") from None

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
            try:
                out = self.tokenizer.apply_chat_template(list(conv.messages), tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True)
            except Exception as e:  # noqa: BLE001
                raise RenderError(f"the chat template failed to render ({_one_line(e)})") from None
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


def render_all(renderer: ChatRenderer, docs: Iterable[Document], log: Counter | None = None
               ) -> Iterable[Rendered | str]:
    """Each document rendered (conversations) or as it is (text); a conversation that cannot be rendered is skipped,
    its reason counted in `log`."""
    for d in docs:
        if isinstance(d, Conversation):
            try:
                yield renderer.render(d)
            except RenderError as e:
                if log is not None:
                    log.skip(str(e))
        else:
            yield d


def generation_prompt(conv: Conversation) -> tuple[dict, ...]:
    """The turns a chat prompt keeps: everything before the conversation's last assistant turn."""
    return conv.messages[:conv.assistant_turns()[-1]]
