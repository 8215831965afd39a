"""Lazy reader over a checkpoint directory of safetensors shards.

Opening a checkpoint reads `config.json` and every shard's header (through the safetensors
library), never tensor data; tensors are read one at a time on demand. FP8 block-scaled weights
(DeepSeek's convention: `W` float8_e4m3fn and `W_scale_inv` float32 of shape
[ceil(M/b0), ceil(N/b1)], a *multiplier*) are dequantized on request (`recycle.quant`'s codec), wherever the
scale is stored.
`span` gives a tensor's byte range in its shard, so stored bytes can be copied without a tensor.

A checkpoint is untrusted input (a Hub download): every file it reads must lie inside its directory. A shard
index naming `../x.safetensors` or an absolute path, or a shard that is a symlink resolving outside, is refused
in one line (`shard_path`), so no command reads, copies or links a file the checkpoint merely points at; the one
exception is huggingface_hub's own cache, whose `snapshots/REV/` files link into the repository's `blobs/`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from safetensors import SafetensorError, safe_open

from recycle.errors import RecycleError
from recycle.preflight import checkpoint_dir, load_json
from recycle.quant import SCALE_SUFFIX, dequantize_fp8, expected_scale_shape, scale_names

if TYPE_CHECKING:
    import torch

# safetensors dtype string → (bytes per element, torch's dtype name or None when torch has none). Torch is
# imported only when a tensor is made: reading headers (`recycle inspect`) needs none of it.
ST_DTYPES: dict[str, tuple[float, str | None]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
    "U16": (2, None),
    "U32": (4, None),
    "U64": (8, None),
    "F8_E8M0": (1, None),
    "F4": (0.5, None),
    "F6_E2M3": (0.75, None),
    "F6_E3M2": (0.75, None),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "C64": (8, "complex64"),
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
# The names users give (--dtype, --precision) → torch's (config.json's torch_dtype).
TORCH_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
INDEX_FILE = "model.safetensors.index.json"
# Config keys that describe storage, not the computation (the runtime holds dequantized weights);
# here, not in recycle.mtp, so converters need not import transformers.
STORAGE_KEYS = ("quantization_config", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")


_TORCH_TABLES: dict[str, dict] = {}


def __getattr__(name: str):
    """The torch-keyed tables, made (and torch imported) on first use: `DTYPES` (safetensors name → (bytes, torch
    dtype or None)), `ST_NAMES` (torch dtype → safetensors name), `SHORT_DTYPES` (bf16/fp16/fp32 → torch dtype)."""
    if name not in ("DTYPES", "ST_NAMES", "SHORT_DTYPES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _TORCH_TABLES:
        import torch

        dtypes = {k: (b, getattr(torch, t) if t else None) for k, (b, t) in ST_DTYPES.items()}
        _TORCH_TABLES["DTYPES"] = dtypes
        _TORCH_TABLES["ST_NAMES"] = {t: k for k, (_, t) in dtypes.items() if t is not None}
        _TORCH_TABLES["SHORT_DTYPES"] = {k: getattr(torch, v) for k, v in TORCH_NAMES.items()}
    return _TORCH_TABLES[name]


class TensorInfo(NamedTuple):
    """Header facts about one stored tensor (a NamedTuple: DeepSeek-V4-Pro's headers make 145,109 of them, and a
    frozen dataclass costs twice the time to build)."""

    name: str
    file: str  # shard file name, relative to the checkpoint directory
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.numel * ST_DTYPES[self.dtype][0])

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def is_scale(self) -> bool:
        return self.name.endswith(SCALE_SUFFIX)


class Span(NamedTuple):
    """Where a tensor's stored bytes lie: shard file, first byte, length."""

    path: Path
    start: int
    nbytes: int


def read_ahead(spans: Iterable[Span]) -> None:
    """Ask the kernel to start reading these byte ranges now (POSIX_FADV_WILLNEED), so a cold read
    overlaps the work on the tensor before; a no-op where the OS has no such advice."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for sp in spans:
        try:
            fd = os.open(sp.path, os.O_RDONLY)
        except OSError:
            continue  # the read itself reports a missing file
        try:
            advise(fd, sp.start, sp.nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


_LINK_ROOTS: list[Path] = []  # directories a view recycle made links into (`allow_links_into`)


@contextlib.contextmanager
def allow_links_into(root: str | os.PathLike) -> Iterator[None]:
    """While open, shards may be symlinks into `root` too: for a view recycle itself makes of a directory
    (`converters/reexport.py`), never for a path named by a checkpoint's own files."""
    real = Path(root).resolve()
    _LINK_ROOTS.append(real)
    try:
        yield
    finally:
        _LINK_ROOTS.remove(real)


def shard_path(d: str | os.PathLike, name: object, where: str | os.PathLike) -> Path:
    """`d/name` for a weights file that a checkpoint's index (`where`) or listing names, if it stays inside `d`:
    a relative name without `..`, and no symlink resolving outside `d` (huggingface_hub's cache layout,
    `snapshots/REV/f` → `../../blobs/HASH`, excepted). Anything else is one RecycleError."""
    if not isinstance(name, str) or not name:
        raise RecycleError(f"{where}: names a shard {name!r}, which is not a file name")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or "\\" in name:
        raise RecycleError(f"{where}: names shard '{name}', a path outside the checkpoint directory; refused "
                           "(shard names must stay inside it)")
    root = Path(d).resolve()
    real = (root / rel).resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (real.is_relative_to(root) or (blobs is not None and real.is_relative_to(blobs))
            or any(real.is_relative_to(r) for r in _LINK_ROOTS)):
        raise RecycleError(f"{where}: shard '{name}' is a link to {real}, outside the checkpoint directory; refused "
                           "(copy the file into the directory instead)")
    return Path(d) / rel


class Checkpoint:
    """A checkpoint directory: config, shard headers, and tensors on demand.

    Example:
        ckpt = Checkpoint("fixtures/deepseek_v3_tiny")
        ckpt.tensors["model.layers.2.eh_proj.weight"].shape
        w = ckpt.get("model.layers.2.self_attn.o_proj.weight")  # dequantized if FP8
    """

    def __init__(self, path: str | os.PathLike, family: str | None = None) -> None:
        self.path = Path(path)
        self.family = family  # the family-table row the user named (`--family`); None: detected
        self.config: dict = checkpoint_dir(self.path)
        self.index: dict | None = None
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[str, object] = {}
        self._offsets: dict[str, dict[str, tuple[int, int]]] = {}  # file -> name -> (first byte, end), absolute
        self.files = self._shard_files()
        for file in self.files:
            self._read_header(file)
        if self.index is not None:
            self._check_index()

    # -- layout -------------------------------------------------------------------------------

    def _shard_files(self) -> list[str]:
        index_path = self.path / INDEX_FILE
        files: set[str] = set()
        if index_path.exists():
            self.index = load_json(index_path, "safetensors index")
            weight_map = self.index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise RecycleError(f"{index_path}: no 'weight_map' object")
            for f in set(weight_map.values()):  # every name checked before any is opened
                shard_path(self.path, f, index_path)
            files = set(weight_map.values())
            for f in sorted(files):
                if not (self.path / f).is_file():
                    raise RecycleError(f"{index_path}: names shard '{f}', which is missing")
        # Files the index does not list still count (GLM-4.6 ships its MTP in mtp.safetensors).
        listed = {p.name for p in self.path.glob("*.safetensors")}
        for f in sorted(listed - files):
            shard_path(self.path, f, self.path)
        files |= listed
        if not files:
            raise RecycleError(f"{self.path}: no *.safetensors files")
        return sorted(files)

    def _open(self, file: str, framework: str = "pt"):
        """The file's safetensors handle: "pt" to make torch tensors, "numpy" for its header alone (no torch)."""
        handle = self._handles.get(file) if framework == "pt" else None
        if handle is None:
            try:
                handle = safe_open(str(self.path / file), framework=framework)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                if "unknown variant" in msg:
                    msg = "unknown dtype " + msg.split("unknown variant")[1].split(",")[0].strip()
                raise RecycleError(f"{self.path / file}: corrupt or unreadable safetensors ({msg})") from None
            if framework == "pt":
                self._handles[file] = handle
        return handle

    def _read_header(self, file: str) -> None:
        # safetensors parses and validates the header (truncated files, overlapping or bad offsets, unknown dtypes);
        # its parse gives names, dtypes and shapes, which costs less than parsing the JSON again here (DeepSeek-V4-Pro:
        # 145,109 tensors, 0.53 s against 0.85 s). Byte offsets are read when first asked for (`span`).
        handle = self._open(file, "numpy")
        tensors = self.tensors
        for name in handle.keys():  # sorted
            part = handle.get_slice(name)
            dtype = part.get_dtype()
            if dtype not in ST_DTYPES:
                raise RecycleError(f"{self.path / file}: tensor {name} has unknown dtype {dtype}")
            if name in tensors:
                raise RecycleError(f"{self.path}: tensor {name} is stored in both {tensors[name].file} and {file}")
            tensors[name] = TensorInfo(name, file, dtype, tuple(part.get_shape()))

    def _check_index(self) -> None:
        weight_map: dict = self.index["weight_map"]  # type: ignore[index]
        for name, file in weight_map.items():
            info = self.tensors.get(name)
            if info is None:
                raise RecycleError(f"{self.path / INDEX_FILE}: maps {name} to {file}, which does not hold it")
            if info.file != file:
                raise RecycleError(f"{self.path / INDEX_FILE}: maps {name} to {file}, but it is in {info.file}")

    # -- facts --------------------------------------------------------------------------------

    @property
    def bytes_total(self) -> int:
        """Bytes on disk over all shard files."""
        return sum((self.path / f).stat().st_size for f in self.files)

    def params(self, names: Iterable[str] | None = None) -> int:
        """Parameter count (scale tensors excluded)."""
        infos = self.tensors.values() if names is None else (self.tensors[n] for n in names)
        return sum(i.numel for i in infos if not i.is_scale)

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        infos = self.tensors.values() if names is None else (self.tensors[n] for n in names)
        return sum(i.nbytes for i in infos)

    def scale_for(self, name: str) -> TensorInfo | None:
        """The block scale of an FP8 weight, whichever shard holds it (`W_scale_inv`, or DeepSeek's native `P.scale`)."""
        return next((self.tensors[s] for s in scale_names(name) if s in self.tensors), None)

    def block_size(self) -> tuple[int, int]:
        q = self.config.get("quantization_config") or {}
        b = q.get("weight_block_size") or [128, 128]
        return int(b[0]), int(b[1])

    # -- data ---------------------------------------------------------------------------------

    def raw(self, name: str) -> torch.Tensor:
        """The tensor exactly as stored."""
        info = self.tensors.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        if ST_DTYPES[info.dtype][1] is None:
            raise RecycleError(f"{self.path}: tensor {name} has dtype {info.dtype}, which torch cannot read")
        try:
            return self._open(info.file).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise RecycleError(f"{self.path / info.file}: cannot read {name} ({str(e).splitlines()[0]})") from None

    def span(self, name: str) -> Span:
        """The byte range of a tensor's stored data in its shard (header offsets, no tensor made)."""
        info = self.tensors.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        if info.file not in self._offsets:
            self._offsets[info.file] = data_offsets(self.path / info.file)
        start, end = self._offsets[info.file][name]
        return Span(self.path / info.file, start, end - start)

    def spans(self, name: str) -> tuple[Span, ...]:
        """Every byte range `get(name)` reads: the tensor's, and its scale's when FP8."""
        scale = self.scale_for(name) if self.tensors[name].is_fp8 else None
        return (self.span(name),) + ((self.span(scale.name),) if scale is not None else ())

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor's values: FP8 weights dequantized block-wise with their `_scale_inv` (to `dtype`,
        bfloat16 by default)."""
        import torch  # made here: headers alone need no torch

        info = self.tensors.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        t = self.raw(name)
        if info.is_fp8:
            scale = self.scale_for(name)
            if scale is None:
                raise RecycleError(f"{self.path}: FP8 tensor {name} has no {name}{SCALE_SUFFIX}")
            return dequantize_fp8(t, self.raw(scale.name), self.block_size(), dtype or torch.bfloat16)
        return t if dtype is None else t.to(dtype)

    def sample_rows(self, name: str, n: int = 64) -> np.ndarray | None:
        """`n` evenly spaced rows of a 2-D tensor as float32 (None for FP8: their values need the scale's blocks):
        enough to tell two copies of an embedding apart without reading either. Read as bytes at the header's
        offsets and widened with numpy (BF16 is the top half of a float32), so no torch is imported."""
        info = self.tensors.get(name)
        if info is None or info.is_fp8 or len(info.shape) != 2 or info.dtype not in ("F32", "F16", "BF16"):
            return None
        span = self.span(name)
        width = info.shape[1] * int(ST_DTYPES[info.dtype][0])
        rows = np.unique(np.linspace(0, info.shape[0] - 1, min(n, info.shape[0])).astype(np.int64))
        with open(span.path, "rb", buffering=0) as f:
            raw = b"".join(os.pread(f.fileno(), width, span.start + int(i) * width) for i in rows)
        if len(raw) != width * len(rows):
            raise RecycleError(f"{span.path}: ends inside {name} (truncated shard)")
        if info.dtype == "BF16":
            return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(len(rows), -1)
        return np.frombuffer(raw, "<f4" if info.dtype == "F32" else "<f2").astype(np.float32).reshape(len(rows), -1)

    def iter_chunks(self, name: str, max_elements: int = 1 << 24) -> Iterable[torch.Tensor]:
        """The tensor's float32 values in row chunks, so statistics over a 129k×7k embedding stay small.

        FP8 chunks are aligned to the scale's row blocks and dequantized chunk by chunk.
        """
        import torch  # made here: headers alone need no torch

        info = self.tensors.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        if len(info.shape) < 2 or info.numel <= max_elements:
            yield self.get(name, torch.float32)
            return
        rows = info.shape[0]
        step = max(1, max_elements // max(1, info.numel // rows))
        scale = None
        block = self.block_size()
        if info.is_fp8:
            step = max(block[0], step // block[0] * block[0])
            scale_info = self.scale_for(name)
            if scale_info is None:
                raise RecycleError(f"{self.path}: FP8 tensor {name} has no {name}{SCALE_SUFFIX}")
            scale = self.raw(scale_info.name)
            if tuple(scale.shape) != expected_scale_shape(info.shape, block):
                raise RecycleError(f"{self.path}: {scale_info.name} has shape {list(scale.shape)}, "
                                   f"expected {list(expected_scale_shape(info.shape, block))}")
        sl = self._open(info.file).get_slice(name)
        for start in range(0, rows, step):
            chunk = sl[start:start + step]
            if scale is not None:
                s = scale[start // block[0]:(start + chunk.shape[0] + block[0] - 1) // block[0]]
                yield dequantize_fp8(chunk, s, block)
            else:
                yield chunk.float()


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and where its data begins."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise RecycleError(f"{path}: cannot read the safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise RecycleError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + n


def data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (first byte, end) of each tensor's data in a safetensors file, from its JSON header."""
    header, base = read_header(path)
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}
