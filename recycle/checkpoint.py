"""Lazy reader over a checkpoint directory of safetensors shards.

Opening a checkpoint reads `config.json` and every shard's header (through the safetensors
library), never tensor data; tensors are read one at a time on demand. FP8 block-scaled weights
(DeepSeek's convention: `W` float8_e4m3fn and `W_scale_inv` float32 of shape
[ceil(M/b0), ceil(N/b1)], a *multiplier*) are dequantized on request, wherever the scale is stored.
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
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from safetensors import SafetensorError, safe_open

from recycle.errors import RecycleError
from recycle.preflight import checkpoint_dir, load_json  # noqa: F401  (load_json: re-exported)

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
# Elements per dequantization step: the float32 buffer (1 MiB) stays in cache, 1.7× faster than
# one 128-row block of a 7168-wide weight at a time.
DEQUANT_CHUNK = 1 << 18
SCALE_SUFFIX = "_scale_inv"
INDEX_FILE = "model.safetensors.index.json"
# One weights file split by huggingface_hub (`model.safetensors` → `model-00001-of-00003.safetensors` + its index).
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")
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


@dataclass(frozen=True)
class TensorInfo:
    """Header facts about one stored tensor."""

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

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
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
        self._open(file, "numpy")  # safetensors validates the header: truncated files, overlapping or bad offsets
        header, base = read_header(self.path / file)  # the same header's JSON once more: one parse, not a call a tensor
        offsets = {}
        for name in sorted(header):  # safetensors' own order (its keys() sorts)
            if name == "__metadata__":
                continue
            entry = header[name]
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            if dtype not in ST_DTYPES:
                raise RecycleError(f"{self.path / file}: tensor {name} has unknown dtype {dtype}")
            info = TensorInfo(name, file, dtype, tuple(int(d) for d in entry["shape"]))
            if name in self.tensors:
                raise RecycleError(f"{self.path}: tensor {name} is stored in both {self.tensors[name].file} and {file}")
            self.tensors[name] = info
            offsets[name] = (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
        self._offsets[file] = offsets

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
        """The block scale of an FP8 weight, whichever shard holds it."""
        return self.tensors.get(name + SCALE_SUFFIX)

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


def expected_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(M/b0), ceil(N/b1)] for a weight of shape [M, N]."""
    m, n = shape[-2], shape[-1]
    return math.ceil(m / block[0]), math.ceil(n / block[1])


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


_FP8_TABLES: dict[torch.dtype, np.ndarray] = {}


def fp8_table(dtype: torch.dtype) -> np.ndarray:
    """float32 value of each of the 256 FP8 codes, made by torch's own cast (so lookups match it bit for bit)."""
    import torch  # made here: headers alone need no torch

    if dtype not in _FP8_TABLES:
        _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
    return _FP8_TABLES[dtype]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """`W[i, j] * S[i // b0, j // b1]` in float32, rounded once to `dtype` (the scale multiplies, despite its name).

    Goes a few rows at a time: codes → float32 by a 256-entry table lookup (np.take, ~5× faster
    than torch's FP8 cast), times the rows' scale row, cast into the output. No float32 copy of
    the whole weight exists, and the values equal `W.float() * S` cast to `dtype`, bit for bit.
    """
    import torch  # made here: headers alone need no torch

    dtype = dtype or torch.float32
    if weight.dim() != 2 or weight.element_size() != 1 or not weight.is_floating_point():
        raise RecycleError(f"FP8 block dequantization needs a 2-D FP8 weight, got {weight.dtype} {list(weight.shape)}")
    m, n = weight.shape
    bm, bn = expected_scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != (bm, bn):
        raise RecycleError(f"FP8 scale has shape {list(scale_inv.shape)}, expected {[bm, bn]} for weight {[m, n]}")
    table = fp8_table(weight.dtype)
    codes = weight.contiguous().view(torch.uint8).numpy()
    scale_cols = scale_inv.float().repeat_interleave(block[1], dim=1)[:, :n]  # [bm, n]: one scale row per row block
    out = torch.empty((m, n), dtype=dtype)
    rows = _chunk_rows(n, block[0])
    buf = None if dtype == torch.float32 else np.empty((min(rows, m), n), np.float32)
    for start in range(0, m, rows):
        stop = min(m, start + rows)
        f32 = out.numpy()[start:stop] if buf is None else buf[: stop - start]
        np.take(table, codes[start:stop], out=f32, mode="clip")  # "clip" writes straight into `out`; u8 is in range
        chunk = torch.from_numpy(f32)
        _scale_rows(chunk, scale_cols, start, block[0])
        if buf is not None:
            out[start:stop].copy_(chunk)
    return out


def _chunk_rows(n: int, b0: int) -> int:
    """Rows per dequantization step: about DEQUANT_CHUNK elements, a multiple of the row block or a
    divisor of it, so no step covers part of two row blocks."""
    want = max(1, DEQUANT_CHUNK // max(1, n))
    if want >= b0:
        return want // b0 * b0
    return max(d for d in range(1, want + 1) if b0 % d == 0)


def _scale_rows(chunk: torch.Tensor, scale_cols: torch.Tensor, start: int, b0: int) -> None:
    """Multiply rows `start`.. in place by their row block's scale row."""
    i, rows = start // b0, chunk.shape[0]
    if start % b0 or rows <= b0:  # inside one row block
        chunk.mul_(scale_cols[i])
        return
    full = rows // b0 * b0
    chunk[:full].view(full // b0, b0, -1).mul_(scale_cols[i:i + full // b0, None, :])
    if full < rows:
        chunk[full:].mul_(scale_cols[i + full // b0])


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantization in DeepSeek's convention: returns (fp8 weight, float32 scale_inv)."""
    import torch  # made here: headers alone need no torch

    w = weight.float()
    m, n = w.shape
    bm, bn = expected_scale_shape(w.shape, block)
    padded = torch.zeros(bm * block[0], bn * block[1])
    padded[:m, :n] = w
    tiles = padded.view(bm, block[0], bn, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).view(bm * block[0], bn * block[1])[:m, :n]
    return q.to(torch.float8_e4m3fn), scale.float()


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
    import torch  # made here: headers alone need no torch

    from safetensors.torch import load_file

    files = weight_files(d, name)
    if not files:
        raise RecycleError(f"{Path(d) / name}: missing")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = meta_state(f) if meta else load_file(str(f))
        except RecycleError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise RecycleError(f"{f}: corrupt or unreadable safetensors ({' '.join(str(e).split())[:160]})") from None
        twice = next((k for k in part if k in state), None)
        if twice is not None:
            raise RecycleError(f"{Path(d) / name}: tensor {twice} is stored in two shards")
        state.update(part)
    return state


def meta_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors as meta tensors (names, shapes, dtypes from its header; nothing read):
    enough to build and check a module on the meta device (`push` validates a 27 GB drafter this way)."""
    import torch  # made here: headers alone need no torch

    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            dtype = __getattr__("DTYPES").get(sl.get_dtype(), (0, None))[1]
            if dtype is None:
                raise RecycleError(f"{path}: tensor {name} has dtype {sl.get_dtype()}, which torch cannot hold")
            out[name] = torch.empty(tuple(sl.get_shape()), dtype=dtype, device="meta")
    return out
