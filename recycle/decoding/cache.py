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

Some layers keep per-token state beside their keys and values: the sparse-attention (DSA) indexer's keys of
DeepSeek-V3.2 / GLM-5 (transformers' `DynamicIndexedLayer`). `crop` and `keep` cut those
along with the keys, by attribute (`TOKEN_STATE`); a layer holding anything else they do not know how to cut (a
compressor's running entries, a prefill kept apart, a sliding window that already evicted, MiniMax-M3's index keys:
see `TOKEN_STATE`) is refused in one line rather than left stale.

DeepSeek-V4's cache layers (`DeepseekV4HCACache`, `DeepseekV4CSACache`: a sliding-window K=V that evicts, and beside it
each compressor's buffer of tokens not yet pooled, its pooled entries, their count and the overlap window) cannot be
cut back either, and a tree breaks their pooling windows (siblings side by side). transformers replaces every piece of
that state with a new tensor (`torch.cat`, slices, `.clone()`) and never writes one in place, so a V4 target's whole
cache is snapshotted by reference (`snapshot`: the layers' attributes, no tensor copied) and put back on rejection, as
a hybrid's recurrent states are: such a target verifies chains (`rolls_back`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACache

from recycle.errors import RecycleError


def _layers(cache: Cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RecycleError(f"{type(cache).__name__} has no per-layer storage; the tree decoder needs a DynamicCache")
    return [lyr for lyr in layers if getattr(lyr, "keys", None) is not None and lyr.keys.numel() > 0]


# per-token state a cache layer keeps beside its keys and values, by attribute → the dimension its tokens run along
# (transformers' DynamicIndexedLayer, DeepSeek-V3.2's and GLM-5's DSA: indexer_keys [B, T, D], indexer_position_ids
# [P, B, T]; their indexer scores every key under the attention mask given, so a tree's rows select as plain decoding
# does). MiniMax-M3's `idx_keys` is not listed: its indexer takes a key's cache column for its position and pools keys
# in column blocks, which a tree's layout (columns ≠ positions, siblings side by side) breaks; refused.
TOKEN_STATE = {"indexer_keys": 1, "indexer_position_ids": -1}
# what else a layer may hold that is no per-token state: a plain or sliding layer's flags and counters, and the
# recurrent states of a hybrid layer (put back by snapshot/restore, never cut)
_KNOWN = (frozenset(vars(DynamicSlidingWindowLayer(sliding_window=2))) | frozenset(vars(LinearAttentionLayer()))
          | {"dtype", "device"} | TOKEN_STATE.keys())
_SCALAR = (bool, int, float, str, torch.dtype, torch.device)
# cache layers whose state is only ever replaced, never written in place, and cannot be cut: a cache holding one is
# rolled back whole, by reference (the module docstring)
WHOLE = (DeepseekV4HCACache,)
_PLANS: dict[type, tuple[tuple[str, int], ...]] = {}


def token_state(lyr: object) -> tuple[tuple[str, int], ...]:
    """(attribute, token dimension) of a layer's per-token state beyond keys and values; refuses (one line) a
    layer that holds state `crop`/`keep` cannot cut consistently with its keys."""
    plan = _PLANS.get(type(lyr))
    if plan is None:
        found = vars(lyr)
        other = sorted(k for k, v in found.items() if k not in _KNOWN and not isinstance(v, _SCALAR))
        if other:
            raise RecycleError(f"{type(lyr).__name__} keeps {', '.join(other)} beside its keys and values, which "
                               "recycle's tree decoder cannot cut back to the accepted tokens")
        plan = _PLANS[type(lyr)] = tuple((k, d) for k, d in TOKEN_STATE.items() if k in found)
    return plan


def _cut(lyr: object, length: int, src: torch.Tensor | None = None, prefix: int = 0) -> None:
    """Keep a layer's first `length` tokens in keys, values and its per-token state; with `src`, first write the
    tokens at `src` (along each tensor's token dimension) just after `prefix`."""
    window = getattr(lyr, "cumulative_length", None)
    if isinstance(window, int) and window != lyr.keys.shape[-2]:
        if src is None and window <= length:  # it has seen no token past `length`: nothing to cut
            return
        raise RecycleError(f"{type(lyr).__name__}: its sliding window already evicted tokens ({window} seen, "
                           f"{lyr.keys.shape[-2]} kept); recycle's tree decoder cannot cut it back")
    for name, dim in (("keys", -2), ("values", -2), *token_state(lyr)):
        t = getattr(lyr, name)
        if t is None or t.shape[dim] <= length:
            continue
        if src is not None:
            t.narrow(dim, prefix, src.numel()).copy_(t.index_select(dim, src))
        setattr(lyr, name, t.narrow(dim, 0, length))
    if isinstance(window, int):
        lyr.cumulative_length = lyr.keys.shape[-2]


def seq_length(cache: Cache) -> int:
    layers = _layers(cache)
    return layers[0].keys.shape[-2] if layers else 0


def crop(cache: Cache, length: int) -> None:
    """Keep the first `length` entries of every layer."""
    for lyr in _layers(cache):
        _cut(lyr, length)


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
        _cut(lyr, prefix + n, src, prefix)


def recurrent_layers(cache: Cache) -> list:
    """The cache's linear-attention (recurrent) layers: empty for an attention-only target."""
    return [lyr for lyr in getattr(cache, "layers", ()) if isinstance(lyr, LinearAttentionCacheLayerMixin)]


def whole(cache: Cache) -> bool:
    """Whether the cache holds a layer that is rolled back whole (`WHOLE`: DeepSeek-V4's)."""
    return any(isinstance(lyr, WHOLE) for lyr in getattr(cache, "layers", ()))


def rolls_back(cache: Cache) -> bool:
    """Whether a target with this cache verifies chains, its state put back after a rejection (`snapshot`)."""
    return bool(recurrent_layers(cache)) or whole(cache)


Snapshot = list[tuple[object, dict, dict, dict] | tuple[object, dict]]


def _attributes(attrs: dict) -> dict:
    """A layer's attributes, the dicts among them copied (their tensors shared: they are replaced, never written)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in attrs.items()}


def snapshot(cache: Cache) -> Snapshot:
    """Copies of every recurrent layer's conv and recurrent states (and whether it has seen a token); where the
    cache is rolled back whole (`whole`), every layer's attributes by reference."""
    if whole(cache):
        return [(lyr, _attributes(vars(lyr))) for lyr in cache.layers]
    out = []
    for lyr in recurrent_layers(cache):
        clone = lambda states: {i: None if t is None else t.clone() for i, t in states.items()}
        out.append((lyr, clone(lyr.conv_states), clone(lyr.recurrent_states), dict(lyr.has_previous_state)))
    return out


def restore(snap: Snapshot) -> None:
    """Put the states back as `snapshot` found them (recurrent states in place: the layers keep their tensors)."""
    for entry in snap:
        if len(entry) == 2:
            lyr, saved = entry
            vars(lyr).clear()
            vars(lyr).update(_attributes(saved))
            continue
        lyr, conv, rec, seen = entry
        for states, saved in ((lyr.conv_states, conv), (lyr.recurrent_states, rec)):
            for i, t in saved.items():
                if t is None or states[i] is None:
                    states[i] = t
                else:
                    states[i].copy_(t)
        lyr.has_previous_state.update(seen)
