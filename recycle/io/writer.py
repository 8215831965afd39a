"""The one atomic output-directory writer.

Everything lands in a hidden temporary sibling of OUT and is renamed into place only when every
file is complete, so a failure at any point (NaN found, disk full, Ctrl-C) leaves no OUT at all,
and `--overwrite` swaps the old directory out only after the new one is whole: in one atomic exchange
(renameat2 RENAME_EXCHANGE) where the filesystem has it, else two renames, and a run stopped between them
leaves the old output aside, which the next run into OUT puts back. A writer holds OUT's lock
(`recycle.preflight.OutputLock`) from before it looks at OUT until OUT is in place, so a second run into the
same OUT refuses, and it removes what a stopped run left beside OUT. `--overwrite` replaces only a directory
recycle wrote (`recycle.preflight.output_dir`); nothing is ever written outside OUT.

What it writes are `Lazy` tensors (a shape, a maker, where the values come from), defined here so that converters
and distill, above, plan them and this floor writes them. Safetensors files are streamed: headers are computed from
the planned shapes up front, then each tensor is made once (even when several files or names use it), cast, written to every file that
holds it, and dropped. Peak memory is about one tensor, not one file. Stored bytes copied as they
are (raw Lazies: the MTP overlay, stitching) go file to file in the kernel (os.copy_file_range),
never through a tensor; the next tensor's source bytes are requested from the disk while this
one is worked on.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from recycle.checkpoint import ST_NAMES, Span, read_ahead
from recycle.errors import RecycleError
from recycle.preflight import (
    DEFAULT_SHARD_SIZE,
    OLD_INFIX,
    SMALL_SHARD,
    TMP_INFIX,
    OutputLock,
    note,
    output_dir,
    parse_size,
    sibling,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")  # the files whose sha256 the record keeps (OutputDir.sha256)
Progress = Callable[[int, int], None]
COPY_STEP = 1 << 26  # bytes per copy_file_range / fallback read
NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM})
Q8_0 = "q8_0"  # GGML's 8-bit blocks (32 weights + one f16 scale), as llama.cpp's Q8_0 stores them
# GGML's MXFP4 blocks (one e8m0 byte + 16 bytes of e2m1 pairs per 32 weights): a Lazy whose `dtype` says so makes
# these bytes itself (uint8 [..., in/32·17]; recycle.quant.fp4.ggml_mxfp4_blocks), whatever the file's type
MXFP4 = "mxfp4"


@dataclass(eq=False)
class Lazy:
    """An output tensor not read yet: shape, dtype, a maker, and its provenance for recycle.json.

    `dtype` None means "the output's float dtype" (the writer casts); integer/bool tensors (d2t,
    t2d) and raw copies set it. Identity matters: the writer makes each Lazy once, however many
    files or names use it. `reads` are the stored byte ranges `make` reads (the writer asks the
    kernel for the next tensor's while it works on this one); a raw Lazy's one span *is* its output,
    so the writer copies those bytes file to file instead of making a tensor.
    """

    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]
    sources: tuple[str, ...]
    kind: str  # its provenance in recycle.json: "exact", "approx" or "fresh" (`recycle.converters.roles`)
    note: str = ""
    dtype: torch.dtype | str | None = None  # str: MXFP4, block bytes for a GGUF
    raw: bool = False  # written byte for byte in its stored dtype (the overlay)
    reads: tuple[Span, ...] = ()
    parts: tuple[Lazy, ...] = ()  # a stack of these along a new first dim: writers may stream them one by one

    def derive(self, shape: tuple[int, ...], fn: Callable[[torch.Tensor], torch.Tensor], kind: str | None = None,
               note: str | None = None) -> Lazy:
        """A tensor computed from this one (same sources); `kind` defaults to this one's."""
        return Lazy(tuple(shape), lambda: fn(self.make()), self.sources, kind or self.kind,
                    self.note if note is None else note, reads=self.reads)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def safetensors_header(plan: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: Mapping[str, str] | None
                       ) -> tuple[bytes, dict[str, int], int]:
    """A safetensors file's leading bytes (length and JSON header, padded to 8) for tensors laid out in `plan`'s
    order; each tensor's byte offset in the file, and the file's size."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset, starts = 0, {}
    for name, shape, dt in plan:
        size = nbytes(shape, dt)
        header[name] = {"dtype": ST_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + size]}
        starts[name] = offset
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    return head, {name: len(head) + start for name, start in starts.items()}, len(head) + offset


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
    Files in `keep` (a layout its readers open by name) stay whole; None: nothing splits. A limit under 1 MB
    (`SMALL_SHARD`) that splits anything is written as asked, with a note that says how many files it makes."""
    from huggingface_hub import split_state_dict_into_shards_factory

    out_files: dict[str, dict[str, Lazy]] = {}
    split_files = 0
    out_jsons = {rel: dict(obj) for rel, obj in (jsons or {}).items()}
    if max_shard_size is None:
        return dict(files), out_jsons
    for rel, tensors in files.items():
        head, _, name = rel.rpartition("/")
        folder = f"{head}/" if head else ""
        if rel in keep or not name.endswith(".safetensors"):
            out_files[rel] = dict(tensors)
            continue
        size = lambda lazy: nbytes(lazy.shape, lazy.dtype or dtype)
        split = split_state_dict_into_shards_factory(
            dict(tensors), get_storage_size=size, get_storage_id=lambda lazy: None,
            filename_pattern=name.removesuffix(".safetensors") + "{suffix}.safetensors", max_shard_size=max_shard_size)
        if not split.is_sharded:
            out_files[rel] = dict(tensors)
            continue
        split_files += 1
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
    if split_files and parse_size(max_shard_size) < SMALL_SHARD:
        shards = sum(1 for rel in out_files if rel not in files)
        note(f"--max-shard-size {parse_size(max_shard_size):,} bytes is under 1 MB: {split_files} safetensors "
             f"file(s) become {shards} shards (the default, {DEFAULT_SHARD_SIZE}, is what loaders expect)")
    return out_files, out_jsons


class OutputDir:
    """`with OutputDir(out, overwrite=..., protect=[inputs]) as d: d.write_json(...); ...` → OUT appears whole.

    Entering takes OUT's lock (unless `acquire()` took it earlier: a run that works long before it writes, like
    distill, holds it from its start and calls `release()` at its end); `records`: the record files that mark
    this writer's earlier outputs when they are not recycle's own (`recycle.preflight.RECORDS`)."""

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False,
                 protect: tuple[str | os.PathLike | None, ...] = (), records: tuple[str, ...] | None = None) -> None:
        self.protect, self.records = tuple(protect), records
        self.out = output_dir(out, overwrite, self.protect, records)
        self.overwrite = overwrite
        self.lock = OutputLock(self.out)
        self.own_lock = False  # taken by __enter__ (released by __exit__), not by the caller
        self.tmp: Path | None = None
        self.files: dict[str, int] = {}  # relative path -> bytes written

    def acquire(self) -> OutputDir:
        """Take OUT's lock (a second run into OUT refuses in one line), clean what a stopped run left beside OUT,
        and check OUT again now that no other run can change it."""
        if self.lock.held:
            return self
        self.lock.acquire()
        try:
            for line in self.lock.sweep():
                note(line)
            output_dir(self.out, self.overwrite, self.protect, self.records)
        except BaseException:
            self.lock.release()
            raise
        return self

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> OutputDir:
        self.own_lock = not self.lock.held
        self.acquire()
        try:
            self.tmp = sibling(self.out, TMP_INFIX, uuid.uuid4().hex[:8])
            self.tmp.mkdir()
        except OSError as e:
            self._unlock()
            raise RecycleError(f"{self.out}: cannot write here ({e.strerror or e})") from None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self._discard()
                if isinstance(exc, OSError) and not isinstance(exc, RecycleError):
                    raise RecycleError(f"{self.out}: writing failed ({exc.strerror or exc}); nothing was written") \
                        from None
                return
            try:
                self._commit()
            except OSError as e:
                self._discard()
                raise RecycleError(f"{self.out}: cannot move the finished output into place ({e.strerror or e})") \
                    from None
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self.own_lock:
            self.lock.release()
            self.own_lock = False

    # -- files ------------------------------------------------------------------------------------

    def path(self, rel: str) -> Path:
        """Where file `rel` of OUT is written; a name that would leave OUT (absolute, `..`) is refused."""
        assert self.tmp is not None, "use OutputDir as a context manager"
        p = self.tmp / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not p.resolve().is_relative_to(self.tmp.resolve()):
            raise RecycleError(f"{rel}: a file name outside the output directory {self.out}; nothing written")
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

    def sha256(self) -> dict[str, str]:
        """The sha256 of every weight file written so far (relative path -> hex digest), read back from the temporary
        directory: the record (recycle.json) keeps them, so `recycle push` can tell a file replaced after recycle
        wrote it."""
        assert self.tmp is not None, "use OutputDir as a context manager"
        digests = {}
        for rel in sorted(self.files):
            if rel.endswith(WEIGHT_SUFFIXES):
                with open(self.tmp / rel, "rb") as f:
                    digests[rel] = hashlib.file_digest(f, "sha256").hexdigest()
        return digests

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
        head, _, _ = safetensors_header([(name, lazy.shape, out_dtype[id(lazy)]) for name, lazy in plan], metadata)
        f = open(self.path(rel), "wb", buffering=0)  # unbuffered: tensor bytes and kernel copies interleave
        write_all(f, head)
        return f

    # -- one safetensors file written by several processes (distill's ranks), each its own tensors ----------------

    def create_safetensors(self, rel: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                           metadata: Mapping[str, str] | None = None) -> None:
        """A safetensors file's header (`plan`: every tensor's name, shape and dtype, in the file's order) and its
        full size, its tensors' bytes left for `write_safetensors_part` (any process, in any order)."""
        head, _, size = safetensors_header(plan, metadata)
        with open(self.path(rel), "wb") as f:
            write_all(f, head)
            f.truncate(size)
        self.files[rel] = size

    def write_safetensors_part(self, rel: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                               tensors: Mapping[str, Lazy], metadata: Mapping[str, str] | None = None) -> None:
        """Some of a file's tensors (`create_safetensors` made it, with the same `plan` and `metadata`), each made,
        cast to its planned dtype and written at its offset, one at a time."""
        _, at, _ = safetensors_header(plan, metadata)
        dtypes = {name: dt for name, _, dt in plan}
        fd = os.open(self.path(rel), os.O_WRONLY)
        try:
            for name, lazy in tensors.items():
                t = lazy.make()
                if tuple(t.shape) != lazy.shape:
                    raise RecycleError(f"{name}: made shape {list(t.shape)}, planned {list(lazy.shape)}")
                view = memoryview(t.to(dtypes[name]).contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
                offset = at[name]
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
        finally:
            os.close(fd)

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


        ggml = {torch.float32: (GGMLQuantizationType.F32, np.float32), torch.float16: (GGMLQuantizationType.F16,
                np.float16), torch.bfloat16: (GGMLQuantizationType.BF16, np.uint16),
                Q8_0: (GGMLQuantizationType.Q8_0, np.uint8), MXFP4: (GGMLQuantizationType.MXFP4, np.uint8)}
        block_bytes = {Q8_0: 34, MXFP4: 17}  # per 32 weights

        def byte_shape(shape: tuple[int, ...], dt) -> tuple[int, ...]:  # the shape the gguf writer takes
            return (*shape[:-1], shape[-1] // 32 * block_bytes[dt]) if dt in block_bytes else shape

        def size_of(shape: tuple[int, ...], dt) -> int:
            return math.prod(byte_shape(shape, dt)) if dt in block_bytes else nbytes(shape, dt)
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
            dt = MXFP4 if lazy.dtype == MXFP4 else header.storage(name, lazy.shape, dtype)
            qtype, npt = ggml[dt]
            w.add_tensor_info(name, byte_shape(lazy.shape, dt), np.dtype(npt), size_of(lazy.shape, dt), raw_dtype=qtype)
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
                        made = byte_shape(part.shape, dt) if dt == MXFP4 else part.shape  # MXFP4: its bytes
                        if tuple(t.shape) != made:
                            raise RecycleError(f"{name}: made shape {list(t.shape)}, planned {list(made)}")
                        if dt == MXFP4:
                            write_all(f, t.contiguous().reshape(-1).numpy())
                        elif dt == Q8_0:
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
        """The new output into place: OUT is at every moment the old output or the new one (an atomic exchange),
        or, where the filesystem cannot exchange, the old one waits aside as `.OUT.recycle-old-*` between two
        renames (a stopped run's is put back by the next run into OUT)."""
        assert self.tmp is not None
        if self.out.exists() and exchange(self.tmp, self.out):
            shutil.rmtree(self.tmp, ignore_errors=True)  # the old output, now under the temporary name
            return
        old = None
        if self.out.exists():
            old = sibling(self.out, OLD_INFIX, uuid.uuid4().hex[:8])
            os.rename(self.out, old)
        try:
            os.rename(self.tmp, self.out)
        except OSError:
            if old is not None:
                os.rename(old, self.out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NO_EXCHANGE = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EPERM})


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE, through libc); False where the system or the
    filesystem has no such call (the caller renames twice), an OSError for any other failure."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            fn = lib.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIBC.append(lib)
    return _LIBC[0]
