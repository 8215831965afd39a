"""Whether weights made for one model fit another: hidden size, vocabulary and tokenizer.

A drafter recycled from a base checkpoint is only useful on a target that speaks the same token
ids in the same hidden space: the post-trained, fine-tuned or quantized build of that base. `distill`
and `stitch` refuse anything else before they load or write a byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from recycle.errors import RecycleError
from recycle.families import first_value, merged_config

TOKENIZER_FILE = "tokenizer.json"
HIDDEN_KEYS = ("hidden_size", "dim")  # transformers' name, Meta's params.json name
BACKBONE_KEY = "backbone_hidden_size"


def tokenizer_fingerprint(directory: str | Path) -> str | None:
    """A digest of what decides token ids (the model's vocabulary and merges, the added tokens), or
    None when the directory has no tokenizer.json. Formatting, padding and chat templates do not count."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecycleError(f"{path}: unreadable tokenizer ({e})") from None
    model = data.get("model") or {}
    key = {"type": model.get("type"), "vocab": model.get("vocab"), "merges": model.get("merges"),
           "added": sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def check_fit(base: Mapping, target: Mapping, base_dir: str | Path | None, target_dir: str | Path | None,
              what: str) -> None:
    """RecycleError unless `base` (a checkpoint's or an overlay's config) has the target's hidden size and
    vocabulary, and, where both directories hold a tokenizer.json, the same tokenizer."""
    b = merged_config(base)
    _compare(first_value(b, (BACKBONE_KEY,) + HIDDEN_KEYS), first_value(b, ("vocab_size",)), (), None, target,
             base_dir, target_dir, what)


def check_drafter(fmt, drafter: Mapping, target: Mapping, drafter_dir: str | Path | None,
                  target_dir: str | Path | None, what: str) -> None:
    """The one fit check of a drafter (`fmt`, a `DrafterFormat`) against a target, from their configs alone (no
    weights): the width and vocabulary it reads, the aux layers it taps, the model types it drafts for, the
    tokenizer, and whatever its record adds (`fit_extra`). bench, plan, distill, harvest and calibration run it
    before building a model."""
    if fmt.reads is None:
        return
    r = fmt.reads(drafter, merged_config(target))
    _compare(r.hidden, r.vocab, r.aux_layers or (), r.target_types, target, drafter_dir, target_dir, what, r.hidden_key)
    if fmt.fit_extra is not None:
        fmt.fit_extra(dict(drafter), dict(target), what)


def _compare(hidden: int | None, vocab: int | None, aux: tuple[int, ...] | list[int], types: tuple[str, ...] | None,
             target: Mapping, base_dir: str | Path | None, target_dir: str | Path | None, what: str,
             hidden_key: str = "hidden size") -> None:
    t = merged_config(target)
    if types is not None and t.get("model_type") not in types and target.get("model_type") not in types:
        raise RecycleError(f"{what}: it drafts for {' or '.join(types)} models, not {t.get('model_type')!r}")
    for what_dim, x, y in ((hidden_key, hidden, first_value(t, HIDDEN_KEYS)),
                           ("vocabulary", vocab, first_value(t, ("vocab_size",)))):
        if x is not None and y is not None and x != y:
            theirs = "hidden size " if what_dim == BACKBONE_KEY else ""
            raise RecycleError(f"{what}: {what_dim} {x} does not fit the target's {theirs}{y}")
    n = first_value(t, ("num_hidden_layers", "n_layers"))
    bad = [i for i in aux if n is not None and not 0 <= int(i) <= int(n)]
    if bad:
        raise RecycleError(f"{what}: it reads the target's layer {bad[0]}; the target has {n}")
    if base_dir is not None and target_dir is not None:
        fb, ft = tokenizer_fingerprint(base_dir), tokenizer_fingerprint(target_dir)
        if fb is not None and ft is not None and fb != ft:
            raise RecycleError(f"{what}: its tokenizer is not the target's (different vocabulary or merges)")
