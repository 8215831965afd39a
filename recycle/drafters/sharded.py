"""A drafter built on the meta device, sharded, then filled from its own safetensors files rank by rank.

`meta_drafter(dir)` builds the drafter a directory holds with no bytes read (the headers give shapes and dtypes).
The caller shards it (FSDP2's `fully_shard` and the expert split both work on meta tensors), then `materialize`
allocates each rank's own pieces on its device (`to_empty`) and reads into them only what the rank holds:

  * a DTensor sharded on its first dimension (FSDP2's `Shard(0)`, the split experts): this rank's rows, through
    safetensors' `get_slice` (a stored tensor the runtime layout keeps as it is), or, for fused routed experts
    (stored one tensor per expert), only this rank's experts, fused here with transformers' own conversion;
  * a plain tensor (frozen embedding and head copies, frozen groups, buffers stored in the file): read whole;
  * a buffer the file does not hold (rotary `inv_freq`): computed again by a fresh instance of its module, which
    computes it in its constructor.

The names follow the EAGLE drafter's convention (`layers.{k}.block.*` in the checkpoint's block layout, the rest
as the module names them): the formats sharded under torchrun are the ones whose unroller is `shardable`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from recycle.drafters import load_drafter
from recycle.errors import RecycleError
from recycle.formats import of_directory
from recycle.io.weights import weight_files

WEIGHTS = "model.safetensors"
BLOCK = ".block."
EXPERT = re.compile(r"experts\.(\d+)\.")


def meta_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The drafter of `path` on the meta device: built from the files' headers, nothing read."""
    with torch.device("meta"):
        return load_drafter(path, dtype=dtype)


def local_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of a DTensor's first dimension this rank holds (None: not a DTensor, whole here)."""
    if not isinstance(t, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
        raise RecycleError("a drafter tensor sharded on other than its first dimension cannot be read per rank")
    return int(offset[0]), int(offset[0]) + int(shape[0])


class _Files:
    """The drafter's weight files, opened once; each read counted (`read_bytes`: what this rank took from disk)."""

    def __init__(self, directory: Path, fmt) -> None:
        self.handles, self.where = [], {}
        for f in weight_files(directory, WEIGHTS):
            h = safe_open(str(f), "pt")
            self.handles.append(h)
            for disk in h.keys():
                self.where[disk] = h
        self.module = fmt.module_names({d: d for d in self.where})  # module name -> disk name
        self.read_bytes = 0

    def read(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """The stored tensor's rows [start, stop) (all of them when `rows` is None), in its stored dtype (the copy
        into the module's tensor casts it: exact, and no second copy of it in the module's dtype)."""
        disk = self.module.get(name)
        if disk is None:
            raise RecycleError(f"{name}: not in the drafter's weight files")
        sl = self.where[disk].get_slice(disk)
        t = sl[rows[0]:rows[1]] if rows is not None else sl[:]
        self.read_bytes += t.numel() * t.element_size()
        return t


def block_name(name: str) -> tuple[str, str] | None:
    """`layers.0.block.mlp.x` -> ("layers.0.block.", "mlp.x"); None outside a block."""
    if BLOCK not in name:
        return None
    head, rel = name.split(BLOCK, 1)
    return head + BLOCK, rel


def per_expert(names) -> bool:
    """Whether every name is one routed expert's tensor (`...experts.N....`)."""
    names = list(names)
    return bool(names) and all(EXPERT.search(n) for n in names)


def shifted(name: str, first: int) -> str:
    """A per-expert name with its expert number moved by `first`: a rank's experts, numbered from 0 where it holds
    them, to their numbers in the whole drafter."""
    return EXPERT.sub(lambda m: f"experts.{int(m[1]) + first}.", name)


def _read_block(files: _Files, model: nn.Module, prefix: str, rel: str, global_shape, rows) -> torch.Tensor:
    """A block tensor's rows (all of them when `rows` is None) in the runtime layout, from its stored tensor(s)."""
    start, stop = rows if rows is not None else (0, global_shape[0])
    probe = torch.empty((stop - start, *global_shape[1:]), device="meta")
    k = int(prefix.split(".")[1])  # `layers.{k}.block.`: the module whose names these are
    stored = model.block_to_stored(k, {rel: probe})
    if len(stored) == 1 and tuple(next(iter(stored.values())).shape) == tuple(probe.shape):  # one tensor, its rows
        return files.read(prefix + next(iter(stored)), rows)
    if not per_expert(stored):
        raise RecycleError(f"{prefix + rel}: its stored layout cannot be read per rank")
    # per-expert tensors: this rank's experts (renumbered from 0 for the conversion), fused as from_pretrained fuses
    sub = {n: files.read(prefix + shifted(n, start), None) for n in stored}
    return model.block_to_runtime(k, sub)[rel]


def _fresh_buffers(model: nn.Module, computed: set[str], device: torch.device) -> None:
    """Buffers a module computes in its constructor and no file stores (rotary `inv_freq`): made again there, by a
    fresh instance of the module built from its config on `device`."""
    owners = {n.rpartition(".")[0] for n in computed}
    for owner in sorted(owners):
        module = model.get_submodule(owner)
        config = getattr(module, "config", None)
        if config is None:
            raise RecycleError(f"{type(module).__name__}: a computed buffer cannot be made again on its own")
        with torch.device(device):
            fresh = type(module)(config)
        for n in module._non_persistent_buffers_set:
            setattr(module, n, getattr(fresh, n).to(device))


@torch.no_grad()
def materialize(model: nn.Module, directory: str | os.PathLike, device: torch.device) -> int:
    """Allocate a meta-built (and possibly sharded) drafter's own pieces on `device` and fill them from the
    directory's weight files, each rank reading only what it holds. Returns the bytes this rank read."""
    d = Path(directory)
    files = _Files(d, of_directory(d))
    buffers = {n for n, _ in model.named_buffers()}
    computed = {f"{m}.{b}".lstrip(".") for m, mod in model.named_modules() for b in mod._non_persistent_buffers_set
                if getattr(mod, b, None) is not None} & buffers
    persistent = buffers - computed
    model.to_empty(device=device)
    _fresh_buffers(model, computed, device)
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        rows = local_rows(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        block = block_name(name)
        if block is None:
            value = files.read(name, rows)
        else:
            value = _read_block(files, model, *block, tuple(t.shape), rows)
        if tuple(value.shape) != tuple(local.shape):
            raise RecycleError(f"{name}: read {list(value.shape)}, this rank holds {list(local.shape)}")
        local.copy_(value)
    return files.read_bytes


__all__ = ["block_name", "local_rows", "materialize", "meta_drafter", "per_expert", "shifted"]
