"""A drafter directory's own weight files: one safetensors file or the shards its index lists (huggingface_hub's
convention), read whole or as meta tensors from their headers. Every reader of a drafter's own weights goes through
`weight_files`; the shard names an index gives must stay inside the directory (`recycle.checkpoint.shard_path`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from recycle.checkpoint import shard_path
from recycle.errors import RecycleError
from recycle.preflight import load_json

if TYPE_CHECKING:
    import torch

# One weights file split by huggingface_hub (`model.safetensors` → `model-00001-of-00003.safetensors` + its index).
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")


def whole_file(rel: str) -> str:
    """The weights file a shard belongs to (`nextn/x-00002-of-00003.safetensors` → `nextn/x.safetensors`); any other
    name as it is."""
    head, _, name = rel.rpartition("/")
    m = SHARD_NAME.match(name)
    return rel if m is None else f"{head}{'/' if head else ''}{m['stem']}.safetensors"


def weight_files(d: str | os.PathLike, name: str) -> list[Path]:
    """The files that hold the weights file `name` of directory `d`: `d/name` itself, or the shards its index
    (`name.index.json`, huggingface_hub's convention) lists, all present; [] when neither is there. A directory
    may hold either form: every reader of a drafter's own weights goes through here."""
    d = Path(d)
    if (d / name).is_file():
        return [shard_path(d, name, d)]
    index = d / f"{name}.index.json"
    if not index.is_file():
        return []
    weight_map = load_json(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise RecycleError(f"{index}: no 'weight_map' object")
    for f in set(weight_map.values()):
        shard_path(d, f, index)
    files = [d / f for f in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RecycleError(f"{index}: names shard '{missing[0]}', which is missing")
    return files


def load_weights(d: str | os.PathLike, name: str, meta: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the weights file `name` of `d`, whole or sharded (`weight_files`); `meta`: from the headers
    alone, on the meta device. A missing, truncated or foreign file is one RecycleError."""
    from safetensors.torch import load_file  # torch: only once tensors are read (names alone need none)

    files = weight_files(d, name)
    if not files:
        raise RecycleError(f"{Path(d) / name}: missing")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = meta_state(f) if meta else load_file(str(f))
        except RecycleError:
            raise
        except Exception as e:  # a truncated or foreign file
            raise RecycleError(f"{f}: corrupt or unreadable safetensors ({' '.join(str(e).split())[:160]})") from None
        twice = next((k for k in part if k in state), None)
        if twice is not None:
            raise RecycleError(f"{Path(d) / name}: tensor {twice} is stored in two shards")
        state.update(part)
    return state


def meta_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors as meta tensors (names, shapes, dtypes from its header; nothing read):
    enough to build and check a module on the meta device (`push` validates a 27 GB drafter this way)."""
    import torch  # here: names alone need none

    from recycle.checkpoint import DTYPES  # made with torch, on first use

    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            dtype = DTYPES.get(sl.get_dtype(), (0, None))[1]
            if dtype is None:
                raise RecycleError(f"{path}: tensor {name} has dtype {sl.get_dtype()}, which torch cannot hold")
            out[name] = torch.empty(tuple(sl.get_shape()), dtype=dtype, device="meta")
    return out
