"""Benchmark prompt sets: deterministic, offline, and never seen by the fixture in training.

Code prompts are snippets of a corpus's held-out files (the same split the fixtures were trained
without), taken from the first top-level `def`/`class` on, so they are code and not licence
headers; natural-language prompts are the opening sentences of those modules' and their functions'
docstrings. Both are text, so any target's tokenizer can encode them. `--prompts` takes a corpus
name (`stdlib`: code and English, the default; `py:PACKAGE`: code from an installed package's
held-out files, e.g. the post-trained fixture's domain `py:transformers`) or the user's own JSONL,
one `{"prompt": "..."}` per line (optionally `"set": "NAME"`: bench and plan report per set). A line may
instead hold a conversation (OpenAI `messages` or ShareGPT `conversations`, `recycle.chat`): a chat request
(system and user turns, or any conversation whose last turn is not the assistant's) is the prompt whole; one that
ends in an answer gives the turns before that answer. Bench renders either with the target's chat template up to
the assistant's generation prompt, as an engine's chat endpoint feeds the model.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from pathlib import Path

from recycle.chat import Conversation, document, generation_prompt
from recycle.corpus import STDLIB, documents, is_corpus_name
from recycle.errors import RecycleError

CODE_CHARS = 420  # ≈ 100 tokens of Python with a 4k BPE vocabulary
NL_MIN, NL_MAX = 120, 400


def code_prompts(n: int = 12, source: str = STDLIB) -> list[str]:
    """The first `def`/`class` of each held-out file (sorted by path), ~CODE_CHARS cut at a line end."""
    out: list[str] = []
    for doc in documents("heldout", source=source):
        lines = doc.text.splitlines(keepends=True)
        start = next((i for i, ln in enumerate(lines) if ln.startswith(("def ", "class "))), None)
        if start is None:
            continue
        text = ""
        for ln in lines[start:]:
            if len(text) + len(ln) > CODE_CHARS:
                break
            text += ln
        if len(text) >= CODE_CHARS // 2:
            out.append(text)
        if len(out) == n:
            break
    return out


def _sentences(doc: str) -> str:
    """A docstring's first paragraph, whitespace-folded, cut at sentence ends to at most NL_MAX chars."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) <= NL_MAX:
        return para
    cut = [m.end() for m in re.finditer(r"[.!?](?=\s)", para) if m.end() <= NL_MAX]
    return para[: cut[-1]] if cut else ""


def text_prompts(n: int = 6) -> list[str]:
    """English from held-out modules' docstrings: the longest qualifying one per file, in path order."""
    out: list[str] = []
    for doc in documents("heldout"):
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        best = ""
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                s = _sentences(ast.get_docstring(node) or "")
                if NL_MIN <= len(s) and len(s) > len(best) and s.isascii() and not re.search(r"[>{}\[\]=]", s):
                    best = s
        if best:
            out.append(best)
        if len(out) == n:
            break
    return out


def default_prompts() -> list[tuple[str, str]]:
    """(set name, prompt) pairs: the code set first, then the natural-language set."""
    return [("code", p) for p in code_prompts()] + [("text", p) for p in text_prompts()]


Prompt = str | Conversation  # a conversation is rendered by bench, with the target's template


def prompt_set(value: str | Path, limit: int | None = None) -> list[tuple[str, Prompt]]:
    """`--prompts`: a corpus name (see the module docstring) or a JSONL file; the first `limit` prompts."""
    if is_corpus_name(str(value)):
        name = str(value)
        prompts = default_prompts() if name == STDLIB else [(name, p) for p in code_prompts(source=name)]
        if not prompts:
            raise RecycleError(f"--prompts {name}: its held-out files hold no code prompt")
    else:
        prompts = read_jsonl(value)
    return prompts[:limit] if limit else prompts


class _Refuse:
    """A row's skip reason is a user error here: a prompts file is small and every line was meant."""

    def __init__(self, where: str) -> None:
        self.where = where

    def skip(self, reason: str, n: int = 1) -> None:
        raise RecycleError(f"{self.where}: {reason}")

    def saw(self, kind: str) -> None:
        pass

    def seen(self, kind: str) -> None:
        pass


def read_jsonl(path: str | Path) -> list[tuple[str, Prompt]]:
    """A user's prompts: one JSON object per non-blank line, a non-empty string "prompt" or a conversation (a request
    whole, or the turns before its closing answer: `generation_prompt`, as a `Conversation` prompt)."""
    p = Path(path)
    if not p.is_file():
        raise RecycleError(f"{p}: no such prompts file")
    try:
        with p.open(encoding="utf-8") as f:  # line by line: a prompts file is never read whole
            out = _rows(p, f)
    except UnicodeDecodeError as e:
        raise RecycleError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise RecycleError(f"{p}: holds no prompts")
    return out


def _rows(p: Path, lines: Iterable[str]) -> list[tuple[str, Prompt]]:
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecycleError(f"{p}:{i}: not JSON ({e.msg})") from None
        prompt: Prompt
        if isinstance(obj, dict) and ("messages" in obj or "conversations" in obj):
            conv = document(obj, _Refuse(f"{p}:{i}"), answer=False)
            prompt = Conversation(generation_prompt(conv), conv.kind)
            if not prompt.messages:
                raise RecycleError(f"{p}:{i}: the conversation opens with the assistant: no prompt before it")
        elif not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise RecycleError(f'{p}:{i}: expected {{"prompt": "..."}} with a non-empty string, or a conversation '
                               '("messages" or "conversations")')
        else:
            prompt = obj["prompt"]
        group = obj.get("set", "user")
        if not isinstance(group, str) or not group:
            raise RecycleError(f'{p}:{i}: "set" must be a non-empty string (the prompt set it belongs to)')
        out.append((group, prompt))
    return out


def prompt_text(prompt: Prompt) -> str:
    """What a report shows of a prompt: its text, or a conversation's last turn."""
    return prompt if isinstance(prompt, str) else prompt.messages[-1]["content"]


def encode_prompts(tokenizer, prompts: list[tuple[str, Prompt]], where: str, template: str | Path | None = None
                   ) -> list[list[int]]:
    """Token ids of each prompt: text as it is; a conversation rendered with the target's chat template (or
    `--chat-template`) through the assistant's generation prompt. A target without a template is refused."""
    from recycle.chat import ChatRenderer, RenderError, read_template

    renderer = None
    out = []
    for _, prompt in prompts:
        if isinstance(prompt, Conversation):
            renderer = renderer or ChatRenderer(tokenizer, where, read_template(template) if template else None)
            try:
                prompt = renderer.prompt(prompt.messages)
            except RenderError as e:
                raise RecycleError(f"--prompts: {e}") from None
        out.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return out
