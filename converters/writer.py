"""The one atomic output-directory writer.

Everything lands in a hidden temporary sibling of OUT and is renamed into place only when every
file is complete, so a failure at any point (NaN found, disk full, Ctrl-C) leaves no OUT at all,
and `--overwrite` swaps the old directory out only after the new one is whole.

Safetensors files are streamed: headers are computed from the planned shapes up front, then each
tensor is made once (even when several files or names use it), cast, written to every file that
holds it, and dropped. Peak memory is about one tensor, not one file. Stored bytes copied as they
are (raw Lazies: the MTP overlay, stitching) go file to file in the kernel (os.copy_file_range),
never through a tensor; the next tensor's source bytes are requested from the disk while this
one is worked on.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from recycle.converters.roles import Lazy, nbytes
from recycle.checkpoint import ST_NAMES, Span, read_ahead
from recycle.errors import RecycleError
from recycle.preflight import output_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
Progress = Callable[[int, int], None]
COPY_STEP = 1 << 26  # bytes per copy_file_range / fallback read
NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM})


def write_all(f: BinaryIO, data) -> None:
    """Write every byte (an unbuffered write may take fewer; Linux caps one at about 2 GiB)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def _write_made(lazy: Lazy, dtype: torch.dtype, outs: list[BinaryIO]) -> None:
    """Make the tensor once, check its shape, cast it to `dtype` and append it to every file in `outs`."""
    t = lazy.make()
    if tuple(t.shape) != lazy.shape:
        raise RecycleError(f"{', '.join(lazy.sources) or 'a tensor'}: made shape {list(t.shape)}, "
                           f"planned {list(lazy.shape)}")
    if t.dtype != dtype:
        t = t.to(dtype)
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    for f in outs:
        write_all(f, data)


def copy_span(src: Span, out: BinaryIO) -> None:
    """Append a stored byte range to `out`: file to file in the kernel where the OS allows, never a tensor."""
    with open(src.path, "rb", buffering=0) as f:
        end = src.start + src.nbytes
        offset = _kernel_copy(f.fileno(), out.fileno(), src.start, end)
        while offset < end:  # no kernel copy (another filesystem, an old kernel, not Linux): read + write
            data = os.pread(f.fileno(), min(end - offset, COPY_STEP), offset)
            if not data:
                raise RecycleError(f"{src.path}: ends before byte {end} (changed while converting?)")
            write_all(out, data)
            offset += len(data)


def _kernel_copy(src: int, dst: int, offset: int, end: int) -> int:
    """os.copy_file_range from `offset` to `end`, or until the OS declines; returns where it stopped."""
    copy = getattr(os, "copy_file_range", None)
    while copy is not None and offset < end:
        try:
            n = copy(src, dst, min(end - offset, COPY_STEP), offset)
        except OSError as e:
            if e.errno in NO_KERNEL_COPY:
                return offset
            raise
        if n == 0:
            return offset  # end of file: the read path reports it
        offset += n
    return offset


def split_plan(files: Mapping[str, Mapping[str, Lazy]], dtype: torch.dtype | None, max_shard_size: int | str | None,
               jsons: Mapping[str, dict] | None = None, keep: frozenset[str] = frozenset()
               ) -> tuple[dict[str, dict[str, Lazy]], dict[str, dict]]:
    """A write plan with every safetensors file over `max_shard_size` split into shards (`model.safetensors` →
    `model-00001-of-00003.safetensors`, ...; huggingface_hub's split, by the bytes each tensor will take in its
    output dtype), and the index JSONs made to say so: a planned index in the same folder whose `weight_map` names
    the split file now names the shards (its total_size recomputed), and a split file no planned index names gets
    `NAME.index.json`, huggingface_hub's convention, which every engine's loader and `recycle.checkpoint` read.
    Files in `keep` (a layout its readers open by name) stay whole; None: nothing splits."""
    from huggingface_hub import split_state_dict_into_shards_factory

    out_files: dict[str, dict[str, Lazy]] = {}
    out_jsons = {rel: dict(obj) for rel, obj in (jsons or {}).items()}
    if max_shard_size is None:
        return dict(files), out_jsons
    for rel, tensors in files.items():
        head, _, name = rel.rpartition("/")
        folder = f"{head}/" if head else ""
        if rel in keep or not name.endswith(".safetensors"):
            out_files[rel] = dict(tensors)
            continue
        size = lambda lazy: nbytes(lazy.shape, lazy.dtype or dtype)  # noqa: E731
        split = split_state_dict_into_shards_factory(
            dict(tensors), get_storage_size=size, get_storage_id=lambda lazy: None,
            filename_pattern=name.removesuffix(".safetensors") + "{suffix}.safetensors", max_shard_size=max_shard_size)
        if not split.is_sharded:
            out_files[rel] = dict(tensors)
            continue
        for shard, names in split.filename_to_tensors.items():
            out_files[folder + shard] = {n: tensors[n] for n in names}
        placed = split.tensor_to_filename
        indexes = [j for j, obj in out_jsons.items() if j.rpartition("/")[0] == head
                   and name in (obj.get("weight_map") or {}).values()]
        for j in indexes or [f"{rel}.index.json"]:
            obj = out_jsons.setdefault(j, {"metadata": {}, "weight_map": {}})
            wm = {n: placed.get(n, f) if f == name else f for n, f in obj["weight_map"].items()} if indexes else \
                dict(placed)
            obj["weight_map"] = dict(sorted(wm.items()))
            if set(wm) <= set(tensors):  # an index of this file alone: its byte total as huggingface_hub counts it
                obj["metadata"] = {**(obj.get("metadata") or {}), "total_size": sum(size(tensors[n]) for n in wm)}
    return out_files, out_jsons


class OutputDir:
    """`with OutputDir(out, overwrite=..., protect=[src]) as d: d.write_json(...); ...` → OUT appears whole."""

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False,
                 protect: tuple[str | os.PathLike, ...] = ()) -> None:
        self.out = output_dir(out, overwrite, protect)
        self.overwrite = overwrite
        self.tmp: Path | None = None
        self.files: dict[str, int] = {}  # relative path -> bytes written

    def __enter__(self) -> OutputDir:
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.tmp = parent / f".{self.out.name}.recycle-tmp-{uuid.uuid4().hex[:8]}"
            self.tmp.mkdir()
        except OSError as e:
            raise RecycleError(f"{self.out}: cannot write here ({e.strerror or e})") from None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            if isinstance(exc, OSError) and not isinstance(exc, RecycleError):
                raise RecycleError(f"{self.out}: writing failed ({exc.strerror or exc}); nothing was written") from None
            return
        try:
            self._commit()
        except OSError as e:
            self._discard()
            raise RecycleError(f"{self.out}: cannot move the finished output into place ({e.strerror or e})") from None

    # -- files ------------------------------------------------------------------------------------

    def path(self, rel: str) -> Path:
        assert self.tmp is not None, "use OutputDir as a context manager"
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_json(self, rel: str, obj: Mapping) -> None:
        data = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        self.path(rel).write_bytes(data)
        self.files[rel] = len(data)

    def copy_file(self, src: Path, rel: str, link: bool = False) -> None:
        """Copy (or hard-link, where allowed and asked) one file into the output."""
        dst = self.path(rel)
        if link:
            try:
                os.link(src, dst)
                self.files[rel] = dst.stat().st_size
                return
            except OSError:
                pass
        shutil.copyfile(src, dst)
        self.files[rel] = dst.stat().st_size

    def copy_tokenizer(self, src_dir: Path, sub: str = "") -> list[str]:
        copied = []
        for name in TOKENIZER_FILES:
            if (src_dir / name).is_file():
                self.copy_file(src_dir / name, f"{sub}{name}")
                copied.append(f"{sub}{name}")
        return copied

    def write_safetensors(self, files: Mapping[str, Mapping[str, Lazy]], dtype: torch.dtype,
                          progress: Progress | None = None, metadata: Mapping[str, str] | None = None) -> None:
        """Stream several safetensors files at once, making each distinct Lazy exactly once."""
        order: dict[int, Lazy] = {}  # id -> lazy, in first-use order
        for tensors in files.values():
            for lazy in tensors.values():
                order.setdefault(id(lazy), lazy)
        rank = {k: i for i, k in enumerate(order)}
        out_dtype = {k: lz.dtype or dtype for k, lz in order.items()}
        plans: dict[str, list[tuple[str, Lazy]]] = {}
        handles = {}
        try:
            for rel, tensors in files.items():
                plan = sorted(tensors.items(), key=lambda kv: rank[id(kv[1])])
                plans[rel] = plan
                handles[rel] = self._open_safetensors(rel, plan, out_dtype, metadata)
            users: dict[int, list[tuple[str, str]]] = {k: [] for k in order}
            for rel, plan in plans.items():
                for name, lazy in plan:
                    users[id(lazy)].append((rel, name))
            lazies = list(order.items())
            for i, (k, lazy) in enumerate(lazies):
                if i + 1 < len(lazies):
                    read_ahead(lazies[i + 1][1].reads)
                outs = [handles[rel] for rel, _ in users[k]]
                if lazy.raw and len(lazy.reads) == 1 and lazy.reads[0].nbytes == nbytes(lazy.shape, out_dtype[k]):
                    for f in outs:
                        copy_span(lazy.reads[0], f)
                else:
                    _write_made(lazy, out_dtype[k], outs)
                if progress:
                    progress(i + 1, len(order))
        finally:
            for f in handles.values():
                f.close()
        for rel in files:
            self.files[rel] = self.path(rel).stat().st_size

    def _open_safetensors(self, rel: str, plan: list[tuple[str, Lazy]], out_dtype: dict[int, torch.dtype],
                          metadata: Mapping[str, str] | None):
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, lazy in plan:
            dt = out_dtype[id(lazy)]
            size = nbytes(lazy.shape, dt)
            header[name] = {"dtype": ST_NAMES[dt], "shape": list(lazy.shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)
        f = open(self.path(rel), "wb", buffering=0)  # unbuffered: tensor bytes and kernel copies interleave
        write_all(f, struct.pack("<Q", len(blob)) + blob)
        return f

    def write_gguf(self, rel: str, header, tensors: Mapping[str, Lazy], dtype,
                   progress: Progress | None = None) -> None:
        """Stream one GGUF file (the `gguf` package writes the header, key/values and tensor infos; tensor data is
        appended here one tensor at a time, a stacked tensor one part at a time, so peak memory is one part).
        `header` is a `recycle.converters.gguf.Header`: its raw tensors are copied byte for byte from their GGUF, and
        `header.storage` says what each tensor is written as under `dtype` (a torch dtype, or "q8_0": quantized by
        the `gguf` package's own Q8_0 routine, part by part along the rows)."""
        import numpy as np
        from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
        from gguf.quants import quantize

        from recycle.converters.gguf import Q8_0

        ggml = {torch.float32: (GGMLQuantizationType.F32, np.float32), torch.float16: (GGMLQuantizationType.F16,
                np.float16), torch.bfloat16: (GGMLQuantizationType.BF16, np.uint16),
                Q8_0: (GGMLQuantizationType.Q8_0, np.uint8)}

        def size_of(shape: tuple[int, ...], dt) -> int:
            return math.prod(shape[:-1]) * shape[-1] // 32 * 34 if dt == Q8_0 else nbytes(shape, dt)

        def q8_shape(shape: tuple[int, ...]) -> tuple[int, ...]:  # the byte shape the gguf writer takes for Q8_0
            return (*shape[:-1], shape[-1] // 32 * 34)
        path = self.path(rel)
        w = GGUFWriter(path, header.arch)  # writes general.architecture itself
        for key, value, vtype, sub in header.kv:
            if key != "general.architecture":
                w.add_key_value(key, value, GGUFValueType[vtype], GGUFValueType[sub] if sub else None)
        plan: list[tuple[str, object, torch.dtype | None]] = []  # (name, Lazy or ReaderTensor, output dtype)
        for name, t in header.raw.items():
            w.add_tensor_info(name, t.data.shape, t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
            plan.append((name, t, None))
        for name, lazy in tensors.items():
            dt = header.storage(name, lazy.shape, dtype)
            qtype, npt = ggml[dt]
            shape = q8_shape(lazy.shape) if dt == Q8_0 else lazy.shape
            w.add_tensor_info(name, shape, np.dtype(npt), size_of(lazy.shape, dt), raw_dtype=qtype)
            plan.append((name, lazy, dt))
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        align = w.data_alignment
        pieces = [part for _, src, dt in plan if dt is not None for part in (src.parts or (src,))]
        ahead = {id(a): b for a, b in zip(pieces, pieces[1:])}  # each piece's successor: its bytes are asked for early
        try:
            for i, (name, src, dt) in enumerate(plan):
                f.write(b"\0" * (-f.tell() % align))
                if dt is None:  # a tensor of another GGUF, as stored
                    write_all(f, np.ascontiguousarray(src.data).reshape(-1).view(np.uint8))
                else:
                    for part in (src.parts or (src,)):
                        if id(part) in ahead:
                            read_ahead(ahead[id(part)].reads)
                        t = part.make()
                        if tuple(t.shape) != part.shape:
                            raise RecycleError(f"{name}: made shape {list(t.shape)}, planned {list(part.shape)}")
                        if dt == Q8_0:
                            write_all(f, quantize(t.float().numpy(), GGMLQuantizationType.Q8_0).reshape(-1))
                        else:
                            write_all(f, t.to(dt).contiguous().reshape(-1).view(torch.uint8).numpy())
                if progress:
                    progress(i + 1, len(plan))
            f.write(b"\0" * (-f.tell() % align))
        finally:
            w.close()
        self.files[rel] = path.stat().st_size

    # -- commit -----------------------------------------------------------------------------------

    def _discard(self) -> None:
        if self.tmp is not None and self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _commit(self) -> None:
        assert self.tmp is not None
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.recycle-old-{uuid.uuid4().hex[:8]}"
            os.rename(self.out, old)
        try:
            os.rename(self.tmp, self.out)
        except OSError:
            if old is not None:
                os.rename(old, self.out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
