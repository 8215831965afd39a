"""Lazy reader over a checkpoint directory of safetensors shards.

Opening a checkpoint reads `config.json` and every shard's header (through the safetensors
library), never tensor data; tensors are read one at a time on demand. FP8 block-scaled weights
(DeepSeek's convention: `W` float8_e4m3fn and `W_scale_inv` float32 of shape
[ceil(M/b0), ceil(N/b1)], a *multiplier*) are dequantized on request (`recycle.quant`'s codec), wherever the
scale is stored.

Two views of the names: `stored` is every tensor as the files hold it; `tensors` is the model's weights, where a
weight a quantized release packs into several tensors (NVFP4 codes + scales, AWQ `qweight`/`qzeros`/`scales`,
gpt-oss `_blocks`/`_scales`, ...) is one entry under its logical name (`...q_proj.weight`, its logical shape,
dtype the codec's tag, `is_packed`), found by the codecs registered in `recycle.quant.CODECS` from headers alone.
`get` dequantizes it through its codec; `packed[name]` says which stored tensors it is made of. Block-FP8
weights stay as stored in both views (the weight and its `_scale_inv`), as every caller has always read them.
`span` gives a tensor's byte range in its shard, so stored bytes can be copied without a tensor.

A checkpoint is untrusted input (a Hub download): every file it reads must lie inside its directory. A shard
index naming `../x.safetensors` or an absolute path, or a shard that is a symlink resolving outside, is refused
in one line (`shard_path`), so no command reads, copies or links a file the checkpoint merely points at; the one
exception is huggingface_hub's own cache, whose `snapshots/REV/` files link into the repository's `blobs/`.
"""

from __future__ import annotations

import contextlib
import gc
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
from recycle.quant import CODECS, SCALE_SUFFIX, Packed, dequantize_fp8, expected_scale_shape, scale_names

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
    "F8_E8M0": (1, "float8_e8m0fnu"),  # MX block scales (DeepSeek-V4, gpt-oss): 2^(e-127)
    "F4": (0.5, "float4_e2m1fn_x2"),  # e2m1 pairs; the header counts values, torch makes [.., n/2] pairs
    "F6_E2M3": (0.75, None),
    "F6_E3M2": (0.75, None),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "C64": (8, "complex64"),
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
# Every packed storage but compressed-tensors' FP8 (found by its config) has a part in one of these (int or u8
# codes, FP4): a checkpoint with neither such a part nor a quantization config skips the codecs.
PACKED_STORAGE = frozenset({"I32", "U8", "I8", "F4", "I16", "U32"})
# The names users give (--dtype, --precision) → torch's (config.json's torch_dtype).
TORCH_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
INDEX_FILE = "model.safetensors.index.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"  # NVIDIA ModelOpt's exports declare their scheme here ("quantization")
# Stored bits per element of a packed weight's codes, by codec tag (`TensorInfo.nbytes` of a folded weight:
# its codes alone; `Checkpoint.nbytes` counts every stored part). Filled by `Checkpoint` from the codecs.
PACKED_BITS: dict[str, float] = {}
# Config keys that describe storage, not the computation (the runtime holds dequantized weights);
# here, not in recycle.mtp, so converters need not import transformers.
STORAGE_KEYS = ("quantization_config", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")


_TORCH_TABLES: dict[str, dict] = {}
_KNOWN_DTYPES = {k: k for k in ST_DTYPES}


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: reading a checkpoint makes a record per tensor and no cycle, and each
    collection would walk every record made so far (a third of DeepSeek-V4-Pro's header read). On the way out what
    was made goes to the oldest generation unscanned (`gc.freeze` then `gc.unfreeze`, unless someone else holds
    objects frozen): else the next young collection walks all 300k records once more (0.1 s) to find no garbage."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        if collecting:
            gc.enable()


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
        if self.dtype in PACKED_BITS:
            return math.ceil(self.numel * PACKED_BITS[self.dtype] / 8)
        return math.ceil(self.numel * ST_DTYPES[self.dtype][0])

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def is_packed(self) -> bool:
        """A weight a quantized release stores as several tensors (`Checkpoint.packed`), read through its codec."""
        return self.dtype in PACKED_BITS

    @property
    def quantized(self) -> bool:
        """Stored values that need decoding (block FP8 or packed) before they mean anything."""
        return self.dtype in FP8_DTYPES or self.dtype in PACKED_BITS

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
        self.stored: dict[str, TensorInfo] = {}  # every tensor as the files hold it
        self._handles: dict[str, object] = {}
        self._offsets: dict[str, dict[str, tuple[int, int]]] = {}  # file -> name -> (first byte, end), absolute
        self.files = self._shard_files()
        with _no_gc():  # one small record per tensor (145k in DeepSeek-V4-Pro), none of them cyclic
            for file in self.files:
                self._read_header(file)
            if self.index is not None:
                self._check_index()
            self.quant_config: dict = self._quant_config()
            self.packed: dict[str, Packed] = {}  # logical weight -> its stored parts, for packed storages
            self.tensors: dict[str, TensorInfo] = self._fold()  # the model's weights (see the module docstring)

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

    def _quant_config(self) -> dict:
        """The release's quantization config: config.json's `quantization_config` (or its text_config's), else
        ModelOpt's `hf_quant_config.json` "quantization" section; {} when unquantized."""
        q = self.config.get("quantization_config") or (self.config.get("text_config") or {}).get("quantization_config")
        if not q and (self.path / QUANT_CONFIG_FILE).is_file():
            q = load_json(self.path / QUANT_CONFIG_FILE, "ModelOpt quantization config").get("quantization")
        if q is not None and not isinstance(q, dict):
            raise RecycleError(f"{self.path}: quantization_config is {type(q).__name__}, not an object")
        return dict(q or {})

    def _fold(self) -> dict[str, TensorInfo]:
        """`tensors`: the stored names with each codec's packed weights folded into one logical entry each."""
        dtypes = {i.dtype for i in self.stored.values()}
        if not self.quant_config and not dtypes & PACKED_STORAGE:
            return self.stored  # unquantized: no codec can find a packed weight (each has an int, u8 or f4 part)
        found: list[dict[str, Packed]] = []
        for name in CODECS:
            codec = CODECS.get(name)
            scan = getattr(codec, "scan_dtypes", None)
            if not getattr(codec, "fold", True) or (scan is not None and not dtypes & scan):
                continue
            group = codec.group(self.stored, self.quant_config)
            for tag in {p.tag for p in group.values()}:
                PACKED_BITS.setdefault(tag, codec.bits_of(tag))
            self.packed.update(group)
            found.append(group)
        if not self.packed:
            return self.stored
        names_of = [tuple(p.parts.values()) for group in found for p in group.values()]  # stored parts, first first
        parts = [n for names in names_of for n in names]
        claimed = set(parts)
        if len(claimed) == len(parts) and len(self.packed) == len(names_of) and all(
                logical == p.name == names[0] for (logical, p), names in zip(self.packed.items(), names_of)):
            return self._fold_in_place(n for names in names_of for n in names[1:])
        first: dict[str, Packed] = {}  # the stored name whose place a packed weight takes in `tensors` → it
        for group in found:
            for p in group.values():
                first[next(iter(p.parts.values()))] = p
        if len(claimed) != len(parts):  # a stored tensor two weights (or two codecs) read
            seen: dict[str, str] = {}
            for logical, p in self.packed.items():
                for part in p.parts.values():
                    if part in seen:
                        raise RecycleError(f"{self.path}: tensor {part} reads as part of both {seen[part]} and "
                                           f"{logical} ({p.codec}): an ambiguous quantized layout")
                    seen[part] = logical
        out: dict[str, TensorInfo] = {}
        for n, info in self.stored.items():  # the stored order, each packed weight where its first part is
            p = first.get(n)
            if p is not None:
                out[p.name] = TensorInfo(p.name, info.file, p.tag, tuple(p.shape))
            elif n not in claimed:
                if n in out or n in self.packed:
                    raise RecycleError(f"{self.path}: {n} is stored both as a tensor and packed "
                                       f"({self.packed[n].codec})")
                out[n] = info
        return out

    def _fold_in_place(self, others: Iterable[str]) -> dict[str, TensorInfo]:
        """The fold where every packed weight is named as its first part (DeepSeek-V4's `X.weight`, NVFP4's) and no
        stored tensor is read twice: the stored view, each packed weight's entry replaced where it stands and its
        `others` parts left out; what the walk over every stored name below gives (145k in V4-Pro), in the
        weights' own order (sequential in memory: the same work in random order takes twice as long)."""
        out = dict(self.stored)
        for name, p in self.packed.items():
            out[name] = TensorInfo(name, out[name].file, p.tag, tuple(p.shape))
        for name in others:
            del out[name]
        return out

    def _read_header(self, file: str) -> None:
        # safetensors parses and validates the header (truncated files, overlapping or bad offsets, unknown dtypes);
        # its parse gives names, dtypes and shapes, which costs less than parsing the JSON again here (DeepSeek-V4-Pro:
        # 145,109 tensors, 0.53 s against 0.85 s). Byte offsets are read when first asked for (`span`).
        handle = self._open(file, "numpy")
        tensors = self.stored
        for name in handle.keys():  # sorted
            part = handle.get_slice(name)
            dtype = _KNOWN_DTYPES.get(part.get_dtype())  # the table's own string: 145k equal strings made one each
            if dtype is None:
                raise RecycleError(f"{self.path / file}: tensor {name} has unknown dtype {part.get_dtype()}")
            info = TensorInfo(name, file, dtype, tuple(part.get_shape()))
            if tensors.setdefault(name, info) is not info:  # one lookup: added, or an earlier file's is kept
                raise RecycleError(f"{self.path}: tensor {name} is stored in both {tensors[name].file} and {file}")

    def _check_index(self) -> None:
        weight_map: dict = self.index["weight_map"]  # type: ignore[index]
        for name, file in weight_map.items():
            info = self.stored.get(name)
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
        """Parameter count (scale tensors excluded; a packed weight counts its logical elements)."""
        infos = self.tensors.values() if names is None else (self.tensors[n] for n in names)
        return sum(i.numel for i in infos if not i.is_scale)

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """Stored bytes of these weights (all by default), a packed weight's parts all counted."""
        if names is None:
            return sum(i.nbytes for i in self.stored.values())
        return sum(sum(self.stored[p].nbytes for p in self.packed[n].parts.values()) if n in self.packed
                   else self.tensors[n].nbytes for n in names)

    def scale_for(self, name: str) -> TensorInfo | None:
        """The block scale of an FP8 weight, whichever shard holds it (`W_scale_inv`, or DeepSeek's native `P.scale`)."""
        return next((self.stored[s] for s in scale_names(name) if s in self.stored), None)

    def block_size(self) -> tuple[int, int]:
        q = self.config.get("quantization_config") or {}
        b = q.get("weight_block_size") or [128, 128]
        return int(b[0]), int(b[1])

    # -- data ---------------------------------------------------------------------------------

    def raw(self, name: str) -> torch.Tensor:
        """The tensor exactly as stored (a stored name: `stored`, not a packed weight's logical name)."""
        info = self.stored.get(name)
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
        info = self.stored.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        if info.file not in self._offsets:
            self._offsets[info.file] = data_offsets(self.path / info.file)
        start, end = self._offsets[info.file][name]
        return Span(self.path / info.file, start, end - start)

    def spans(self, name: str) -> tuple[Span, ...]:
        """Every byte range `get(name)` reads: the tensor's, and its scale's when FP8; a packed weight's parts."""
        if name in self.packed:
            return tuple(self.span(p) for p in self.packed[name].parts.values())
        scale = self.scale_for(name) if self.tensors[name].is_fp8 else None
        return (self.span(name),) + ((self.span(scale.name),) if scale is not None else ())

    def get(self, name: str, dtype: torch.dtype | None = None, row_chunks: int = 1) -> torch.Tensor:
        """The tensor's values: FP8 weights dequantized block-wise with their `_scale_inv`, packed weights through
        their codec (to `dtype`, bfloat16 by default). `row_chunks`: an FP8 weight stored in that many row chunks
        may carry a tile of block scales per chunk (`recycle.fused`)."""
        import torch  # made here: headers alone need no torch

        info = self.tensors.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        if name in self.packed:
            p = self.packed[name]
            parts = {role: self.raw(stored) for role, stored in p.parts.items()}
            return CODECS.get(p.codec).dequantize(parts, p, self.quant_config, dtype or torch.bfloat16)
        t = self.raw(name)
        if info.is_fp8:
            scale = self.scale_for(name)
            if scale is None:
                raise RecycleError(f"{self.path}: FP8 tensor {name} has no {name}{SCALE_SUFFIX}")
            return dequantize_fp8(t, self.raw(scale.name), self.block_size(), dtype or torch.bfloat16, row_chunks)
        return t if dtype is None else t.to(dtype)

    def sample_rows(self, name: str, n: int = 64) -> np.ndarray | None:
        """`n` evenly spaced rows of a 2-D tensor as float32 (None for FP8: their values need the scale's blocks):
        enough to tell two copies of an embedding apart without reading either. Read as bytes at the header's
        offsets and widened with numpy (BF16 is the top half of a float32), so no torch is imported."""
        info = self.stored.get(name)
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

    def head(self, name: str, rows: int) -> torch.Tensor:
        """A stored tensor's first `rows` rows exactly as stored, through safetensors' slice; FP4, which that slice
        cannot cut (its header counts values, torch's dtype holds pairs), read at the header's offsets."""
        import torch  # made here: headers alone need no torch

        info = self.stored.get(name)
        if info is None:
            raise RecycleError(f"{self.path}: no tensor named {name}")
        if info.dtype != "F4":
            return self._open(info.file).get_slice(name)[:rows]
        shape = (min(rows, info.shape[0]), *info.shape[1:-1], info.shape[-1] // 2)
        span, size = self.span(name), math.prod(shape)
        with open(span.path, "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), size, span.start)
        if len(raw) != size:
            raise RecycleError(f"{span.path}: ends inside {name} (truncated shard)")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(shape).view(torch.float4_e2m1fn_x2)

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
        if name in self.packed:  # one leading slice (an expert of a fused [E, out, in] weight) at a time
            yield from self._packed_chunks(self.packed[name])
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


    def _packed_chunks(self, p: Packed) -> Iterable[torch.Tensor]:
        import torch  # made here: headers alone need no torch

        codec = CODECS.get(p.codec)
        parts = {role: self.raw(stored) for role, stored in p.parts.items()}
        lead = p.shape[0]
        if len(p.shape) < 3 or any(t.dim() == 0 or t.shape[0] != lead for t in parts.values()):
            yield codec.dequantize(parts, p, self.quant_config, torch.float32)
            return
        one = p._replace(shape=tuple(p.shape[1:]))
        for i in range(lead):
            yield codec.dequantize({r: t[i] for r, t in parts.items()}, one, self.quant_config, torch.float32)


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
