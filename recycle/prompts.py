"""Benchmark prompt sets: deterministic, offline, and never seen by the fixture in training.

Code prompts are snippets of a corpus's held-out files (the same split the fixtures were trained
without), taken from the first top-level `def`/`class` on, so they are code and not licence
headers; natural-language prompts are the opening sentences of those modules' and their functions'
docstrings. Both are text, so any target's tokenizer can encode them. `--prompts` takes a corpus
name (`stdlib`: code and English, the default; `py:PACKAGE`: code from an installed package's
held-out files, e.g. the post-trained fixture's domain `py:transformers`) or the user's own JSONL,
one `{"prompt": "..."}` per line (optionally `"set": "NAME"`: bench and plan report per set).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

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


def prompt_set(value: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """`--prompts`: a corpus name (see the module docstring) or a JSONL file; the first `limit` prompts."""
    if is_corpus_name(str(value)):
        name = str(value)
        prompts = default_prompts() if name == STDLIB else [(name, p) for p in code_prompts(source=name)]
        if not prompts:
            raise RecycleError(f"--prompts {name}: its held-out files hold no code prompt")
    else:
        prompts = read_jsonl(value)
    return prompts[:limit] if limit else prompts


def read_jsonl(path: str | Path) -> list[tuple[str, str]]:
    """A user's prompts: one JSON object with a non-empty string "prompt" per non-blank line."""
    p = Path(path)
    if not p.is_file():
        raise RecycleError(f"{p}: no such prompts file")
    out = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecycleError(f"{p}:{i}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise RecycleError(f'{p}:{i}: expected {{"prompt": "..."}} with a non-empty string')
        group = obj.get("set", "user")
        if not isinstance(group, str) or not group:
            raise RecycleError(f'{p}:{i}: "set" must be a non-empty string (the prompt set it belongs to)')
        out.append((group, obj["prompt"]))
    if not out:
        raise RecycleError(f"{p}: holds no prompts")
    return out
