"""KV-cache surgery after verification: keep the prefix plus the accepted path, drop the rest.

The target ran over the whole tree, so its cache holds prefix + every tree node. Only the accepted
path's entries are valid next step; recomputing them would cost a target forward, so they are
gathered instead (index_select along the sequence dim of every layer's key and value, written
just after the prefix) and the tail is cropped. A chain whose accepted nodes are already in place
only needs the crop.

Recurrent layers (Gated DeltaNet in Qwen3-Next/3.5, Mamba in hybrids) hold one state that has already
absorbed every verified token, rejected ones included, and transformers cannot crop it (its
`LinearAttentionLayer.is_croppable` is False once a recurrent state exists). So a hybrid target's
linear-attention states are snapshotted before each verification (`snapshot`, a few KB per layer) and,
when drafts were rejected, put back (`restore`) for the loop to run the accepted tokens again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from recycle.errors import RecycleError


def _layers(cache: Cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RecycleError(f"{type(cache).__name__} has no per-layer storage; the tree decoder needs a DynamicCache")
    return [lyr for lyr in layers if getattr(lyr, "keys", None) is not None and lyr.keys.numel() > 0]


def seq_length(cache: Cache) -> int:
    layers = _layers(cache)
    return layers[0].keys.shape[-2] if layers else 0


def crop(cache: Cache, length: int) -> None:
    """Keep the first `length` entries of every layer."""
    for lyr in _layers(cache):
        if lyr.keys.shape[-2] > length:
            lyr.keys = lyr.keys[..., :length, :]
            lyr.values = lyr.values[..., :length, :]


def keep(cache: Cache, prefix: int, nodes: Sequence[int], index: torch.Tensor | None = None) -> None:
    """Keep entries [0, prefix) plus prefix+nodes[j] (in order) and drop everything after.

    `nodes` are tree-node indices (increasing, as on a root-to-leaf path). `index` may carry them
    already as a long tensor on the cache's device to save a host→device copy.
    """
    n = len(nodes)
    if list(nodes) == list(range(n)):
        crop(cache, prefix + n)
        return
    layers = _layers(cache)
    if not layers:
        return
    idx = index if index is not None else torch.tensor(list(nodes), device=layers[0].keys.device)
    src = idx + prefix
    for lyr in layers:
        for name in ("keys", "values"):
            t = getattr(lyr, name)
            t[..., prefix : prefix + n, :] = t.index_select(-2, src)
            setattr(lyr, name, t[..., : prefix + n, :])


def recurrent_layers(cache: Cache) -> list:
    """The cache's linear-attention (recurrent) layers: empty for an attention-only target."""
    return [lyr for lyr in getattr(cache, "layers", ()) if isinstance(lyr, LinearAttentionCacheLayerMixin)]


Snapshot = list[tuple[object, dict, dict, dict]]


def snapshot(cache: Cache) -> Snapshot:
    """Copies of every recurrent layer's conv and recurrent states (and whether it has seen a token)."""
    out = []
    for lyr in recurrent_layers(cache):
        clone = lambda states: {i: None if t is None else t.clone() for i, t in states.items()}
        out.append((lyr, clone(lyr.conv_states), clone(lyr.recurrent_states), dict(lyr.has_previous_state)))
    return out


def restore(snap: Snapshot) -> None:
    """Put the recurrent states back as `snapshot` found them (in place: the layers keep their tensors)."""
    for lyr, conv, rec, seen in snap:
        for states, saved in ((lyr.conv_states, conv), (lyr.recurrent_states, rec)):
            for i, t in saved.items():
                if t is None or states[i] is None:
                    states[i] = t
                else:
                    states[i].copy_(t)
        lyr.has_previous_state.update(seen)
