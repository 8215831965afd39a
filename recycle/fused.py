"""Tensors a release stores fused where transformers' decoder layer holds the parts (a row's `ModuleLayout.fused`).

MiMo-V2.5 and V2.5-Pro store each attention's q, k and v projections as one `qkv_proj`, pre-sharded for tensor
parallelism: `num_key_value_heads` row chunks, chunk c being [Q_c | K_c | V_c], that share of each part's rows (vLLM's
`_shard_fp8_qkv_proj` reads it so, `model_executor/models/mimo_v2.py`). `split` cuts such a tensor into the parts the
model holds, sized by the model's own parameters; `fuse` writes them back. An FP8 weight's block scales may be tiled per
chunk (`ceil(chunk rows / 128)` scale rows each) where a chunk is not a whole number of blocks: `scale_chunks` says
how many chunks the reader dequantizes separately.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from recycle.errors import RecycleError

if TYPE_CHECKING:
    import torch

    from recycle.families import Fused

SUFFIXES = (".weight", ".bias")


def chunks(spec: Fused, config: Mapping | object) -> int:
    """How many row chunks `spec`'s tensor is stored in (1: not pre-sharded), read from a config dict or object."""
    if spec.chunks_key is None:
        return 1
    n = config.get(spec.chunks_key) if isinstance(config, Mapping) else getattr(config, spec.chunks_key, None)
    if not isinstance(n, int) or n < 1:
        raise RecycleError(f"config.json: {spec.chunks_key} is {n!r}; the fused {spec.name} is stored in that many "
                           f"chunks")
    return n


def _hit(name: str, tails: Mapping[str, Fused]) -> tuple[Fused, str, str] | None:
    """(spec, prefix, suffix) where `name` is `prefix + tail + suffix` for one of `tails` (name → its spec)."""
    for tail, spec in tails.items():
        for suffix in SUFFIXES:
            end = tail + suffix
            if name == end or name.endswith("." + end):
                return spec, name[: len(name) - len(end)], suffix
    return None


def spec_of(name: str, specs: tuple[Fused, ...]) -> Fused | None:
    """The spec whose fused tensor `name` is, if any."""
    hit = _hit(name, {s.name: s for s in specs})
    return None if hit is None else hit[0]


def scale_chunks(name: str, specs: tuple[Fused, ...], config: Mapping) -> int:
    """How many row chunks an FP8 reader may dequantize `name` in, each with its own tile of block scales."""
    spec = spec_of(name, specs)
    return 1 if spec is None else chunks(spec, config)


def tiled_scale_shape(name: str, shape: tuple[int, ...], specs: tuple[Fused, ...], config: Mapping,
                      block: tuple[int, int]) -> tuple[int, int] | None:
    """The block-scale shape of a fused FP8 weight whose `n` row chunks are each scaled in blocks of their own
    (`n · ceil(rows / n / block)` scale rows); None where `name` is no pre-sharded fused tensor."""
    n = scale_chunks(name, specs, config)
    if n == 1 or len(shape) != 2 or shape[0] % n:
        return None
    return n * math.ceil(shape[0] // n / block[0]), math.ceil(shape[1] / block[1])


def scale_fits(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], specs: tuple[Fused, ...],
               config: Mapping, block: tuple[int, int]) -> bool:
    """Whether an FP8 weight's block scales have a shape its readers take: one grid over the whole weight, or, for a
    pre-sharded fused weight, a tile per chunk."""
    from recycle.quant import expected_scale_shape

    return tuple(scale_shape) in (expected_scale_shape(shape, block), tiled_scale_shape(name, shape, specs, config, block))


def split(state: Mapping[str, torch.Tensor], specs: tuple[Fused, ...], config: Mapping,
          rows_of: Callable[[str], int | None]) -> dict[str, torch.Tensor]:
    """`state` with each fused tensor cut into its parts, each part's rows as the model holds them (`rows_of`, by the
    part's name; None: the model has no such parameter). A tensor whose rows do not make that cut is refused in one
    line: cut elsewhere it would load, and compute something else."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        hit = _hit(name, {s.name: s for s in specs})
        if hit is None:
            out[name] = t
            continue
        spec, prefix, suffix = hit
        n = chunks(spec, config)
        parts = [prefix + p + suffix for p in spec.parts]
        rows = [rows_of(p) for p in parts]
        if all(r is None for r in rows):  # a tensor of layers the model does not hold (a target's MTP modules)
            out[name] = t
            continue
        if None in rows:
            raise RecycleError(f"{name}: the model has no {parts[rows.index(None)]} to take its share")
        if sum(rows) != t.shape[0] or any(r % n for r in rows):
            raise RecycleError(f"{name}: {t.shape[0]} rows are not {n} chunks of "
                               f"{' + '.join(str(r // n) for r in rows)} rows ({', '.join(p.rsplit('.', 2)[-2] for p in parts)}, "
                               f"{spec.chunks_key or 'one chunk'})")
        pieces = t.reshape(n, t.shape[0] // n, *t.shape[1:]).split([r // n for r in rows], dim=1)
        for part, piece in zip(parts, pieces):
            out[part] = piece.reshape(-1, *t.shape[1:]).contiguous()
    return out


def fuse(state: Mapping[str, torch.Tensor], specs: tuple[Fused, ...], config: Mapping | object
         ) -> dict[str, torch.Tensor]:
    """The inverse of `split`: every complete set of parts in `state` becomes its fused tensor."""
    import torch  # made here: headers alone need no torch

    out = dict(state)
    firsts = {s.parts[0]: s for s in specs}
    for name in list(state):
        hit = _hit(name, firsts)
        if hit is None:
            continue
        spec, prefix, suffix = hit
        parts = [prefix + p + suffix for p in spec.parts]
        if not all(p in out for p in parts):
            continue
        n = chunks(spec, config)
        tensors = [out.pop(p) for p in parts]
        shares = [t.reshape(n, t.shape[0] // n, *t.shape[1:]) for t in tensors]
        out[prefix + spec.name + suffix] = torch.cat(shares, dim=1).reshape(-1, *tensors[0].shape[1:]).contiguous()
    return out
