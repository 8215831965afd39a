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
    """RecycleError unless `base` (a config) has the target's hidden size and vocabulary, and, where
    both directories hold a tokenizer.json, the same tokenizer."""
    b, t = merged_config(base), merged_config(target)
    for what_dim, keys in (("hidden size", HIDDEN_KEYS), ("vocabulary", ("vocab_size",))):
        # a drafter narrower than its target (Gemma 4's assistants) declares the target's width it reads
        x, y = first_value(b, (BACKBONE_KEY,) + keys if what_dim == "hidden size" else keys), first_value(t, keys)
        if x is not None and y is not None and x != y:
            raise RecycleError(f"{what}: {what_dim} {x} does not fit the target's {y}")
    if base_dir is not None and target_dir is not None:
        fb, ft = tokenizer_fingerprint(base_dir), tokenizer_fingerprint(target_dir)
        if fb is not None and ft is not None and fb != ft:
            raise RecycleError(f"{what}: its tokenizer is not the target's (different vocabulary or merges)")
