"""Quantized releases: which schemes recycle reads and writes back, which tensors an engine runs in FP8, and the
ignore list that keeps a BF16 layer out of an FP8 model.

DeepSeek-V3/R1/V3.2 (and GLM, Kimi, LongCat FP8 builds) ship block-FP8: e4m3 weights with a float32
`weight_scale_inv` multiplier per 128×128 block, declared by `quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`. An engine builds *every* Linear of the model as FP8 unless its module is
named in the config's ignore list, MTP layer included, and fills an FP8 parameter with whatever bytes the
checkpoint holds after only a shape check (vLLM 0.32: `model_executor/layers/quantization/fp8.py`
`Fp8Config.from_config` lines 158-174 read `ignored_layers`, else `modules_to_not_convert`; `get_quant_method`
lines 176-185 skip a layer only on an exact prefix match, `utils/quant_utils.py::is_layer_skipped` lines 617-690,
where an expert layer counts as ignored when an ignore entry contains its prefix; transformers 5.23
`FineGrainedFP8Config.__init__` reads `modules_to_not_convert`, else `ignored_layers`). vLLM's DeepSeek MTP builds
its block with the checkpoint's own prefix (`models/deepseek_mtp.py` line 106: `DeepseekV2DecoderLayer(vllm_config,
prefix, ...)`, prefix `model.layers.{idx}`), so the ignore entries are the checkpoint's module names. A BF16
tensor written where the engine expects FP8 is therefore cast to e4m3 without a scale and drafts garbage, while
verification keeps the output correct: acceptance just falls to about zero. recycle either re-quantizes such a
weight in the target's own scheme (fresh scales), or keeps it BF16 and names its module in the ignore list.

Which tensors are FP8 is DeepSeek's rule (its release and `inference/fp8_cast_bf16.py`): 2-D Linear weights of
attention and MLP/experts; not the router (`mlp.gate`, built unquantized), not `eh_proj`, the norms, embeddings
or heads (built as plain `nn.Linear`/embedding layers by the engines' MTP modules). Schemes recycle cannot write
(AWQ, GPTQ, compressed-tensors, NVFP4, MXFP4, bitsandbytes, ...) are refused by name: writing BF16 into them would
be a silently wrong checkpoint.

The block-FP8 codec lives here too (`dequantize_fp8`, `quantize_fp8`, the scale's shape and name), below the reader
(`recycle.checkpoint` dequantizes through it), and ModelOpt's FP8 (`modelopt_fp8`: `weight` + `weight_scale` per
tensor, channel or block, folded by the reader); torch is imported only when a tensor is (de)quantized.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from recycle.errors import RecycleError
from recycle.quant.codec import CODECS, Codec, Packed, check_shape

if TYPE_CHECKING:
    import torch

WRITABLE = ("fp8 (block-wise e4m3, weight_scale_inv)",)
IGNORE_KEYS = ("ignored_layers", "modules_to_not_convert")  # vLLM reads the first (else the second), transformers both
FP8_PARTS = (".self_attn.", ".mlp.")  # where the engines' Linear layers are FP8 (DeepSeek's rule)
NOT_FP8 = ("mlp.gate.weight",)  # the router: built unquantized
_FP8_PART = re.compile("|".join(map(re.escape, FP8_PARTS)))  # one C-level search per name (145k in DeepSeek-V4-Pro)
SCALE_SUFFIX = "_scale_inv"  # `W` float8_e4m3fn is stored with `W_scale_inv`, its block scale (a multiplier)
NATIVE_SCALE_SUFFIX = ".scale"  # DeepSeek's own names (DeepSeek-V4's release): `P.weight` is scaled by `P.scale`
# Elements per dequantization step: the float32 buffer (1 MiB) stays in cache, 1.7× faster than
# one 128-row block of a 7168-wide weight at a time.
DEQUANT_CHUNK = 1 << 18


@dataclass(frozen=True)
class BlockFP8:
    """DeepSeek's block-FP8: e4m3 weights, float32 `weight_scale_inv` per block of `block` = (rows, cols)."""

    block: tuple[int, int]
    config: Mapping  # the quantization_config as stored

    @property
    def ignored(self) -> list[str]:
        for key in IGNORE_KEYS:
            if self.config.get(key):
                return list(self.config[key])
        return []


def scheme(config: Mapping, where: str = "") -> BlockFP8 | None:
    """The quantization a model's config.json declares: None (unquantized), block FP8, or a refusal naming the
    method for schemes recycle cannot write."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "?")).lower()
    if method != "fp8":
        raise RecycleError(f"{where}: quantized with {method!r}, which recycle cannot write MTP tensors into "
                           f"(it writes: {', '.join(WRITABLE)}); stitch into the unquantized (BF16) release instead")
    block = q.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise RecycleError(f"{where}: an FP8 config without a 2-D weight_block_size ({block!r}): per-tensor FP8 is not "
                           f"what recycle writes (it writes: {', '.join(WRITABLE)})")
    return BlockFP8((int(block[0]), int(block[1])), dict(q))


def engine_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an engine builds this weight's layer as FP8 in a block-FP8 model (DeepSeek's rule)."""
    return (len(shape) == 2 and name.endswith(".weight") and _FP8_PART.search(name) is not None
            and not name.endswith(NOT_FP8))


def any_engine_fp8_part(names: Iterable[str]) -> bool:
    """Whether any of these names lies in a part whose Linears an engine builds FP8 (`engine_fp8`'s `FP8_PARTS`): one
    scan of the joined names, so a checkpoint naming none (DeepSeek-V4's `attn.`/`ffn.`) is not asked name by name."""
    return _FP8_PART.search("\n".join(names)) is not None


def module_of(weight: str) -> str:
    """`model.layers.61.self_attn.q_a_proj.weight` → `model.layers.61.self_attn.q_a_proj`: what ignore lists name."""
    return weight[: -len(".weight")] if weight.endswith(".weight") else weight


EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")


def ignore_entries(weights: Iterable[str]) -> list[str]:
    """The ignore entries that keep these weights' layers BF16 in every engine: each Linear's module name (vLLM
    matches exactly, fused layers by their shards: `fp8.py` `get_quant_method` lines 176-185), and for routed
    experts their container too (`...mlp.experts`: transformers fuses the experts into one module, matched by a
    prefix at a module boundary, `quantizers/quantizers_utils.py::should_convert_module`; vLLM skips a fused-MoE
    layer when an entry contains its prefix, `quant_utils.py::is_layer_skipped`)."""
    out = {module_of(w) for w in weights}
    out |= {m.group(1) for w in weights if (m := EXPERTS.match(w))}
    return sorted(out)


def with_ignored(config: Mapping, modules: Iterable[str]) -> dict:
    """config.json with `modules` added to its quantization config's ignore list, under both keys engines read (the
    config where it is: top level, or a multimodal release's `text_config`)."""
    config = dict(config)
    if "quantization_config" not in config and "quantization_config" in (config.get("text_config") or {}):
        return {**config, "text_config": with_ignored(config["text_config"], modules)}
    q = dict(config["quantization_config"])
    names = sorted(set(BlockFP8((1, 1), q).ignored) | set(modules))
    for key in IGNORE_KEYS:
        q[key] = names
    config["quantization_config"] = q
    return config


def requantize(weight: torch.Tensor, block: tuple[int, int], pow2: bool = False, row_chunks: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A weight re-quantized to block FP8 with fresh scales (`pow2`: see `quantize_fp8`), and what that cost: the max
    and mean relative error of the dequantized result per element (|ŵ − w| / max|w| of its block), for the record.
    `row_chunks`: a pre-sharded fused weight (`recycle.fused`), each row chunk in blocks of its own, scales tiled."""
    if row_chunks > 1:
        import torch  # made here: headers alone need no torch

        done = [requantize(w, block, pow2) for w in weight.chunk(row_chunks)]
        stats = {"max_rel_error": max(d[2]["max_rel_error"] for d in done),
                 "mean_rel_error": round(sum(d[2]["mean_rel_error"] for d in done) / row_chunks, 7),
                 "blocks": sum(d[2]["blocks"] for d in done)}
        return torch.cat([d[0] for d in done]), torch.cat([d[1] for d in done]), stats
    m, n = weight.shape
    if m < 1 or n < 1:
        raise RecycleError("cannot quantize an empty weight")
    q, scale = quantize_fp8(weight, block, pow2)
    w = weight.float()
    back = dequantize_fp8(q, scale, block)
    bm, bn = expected_scale_shape(weight.shape, block)
    amax = _block_amax(w, block).clamp(min=1e-12)
    rel = (back - w).abs() / amax.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :n]
    return q, scale, {"max_rel_error": round(float(rel.max()), 6), "mean_rel_error": round(float(rel.mean()), 7),
                      "blocks": bm * bn}


def scale_names(weight: str) -> tuple[str, ...]:
    """Where a quantized weight's scale may be stored: `W_scale_inv` (the HF releases' names), or `P.scale` beside
    `P.weight` (DeepSeek's native names: DeepSeek-V4's e8m0 FP8 block scales and its FP4 experts' scales)."""
    native = (weight[: -len(".weight")] + NATIVE_SCALE_SUFFIX,) if weight.endswith(".weight") else ()
    return (weight + SCALE_SUFFIX, *native)


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def expected_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(M/b0), ceil(N/b1)] for a weight of shape [M, N]."""
    m, n = shape[-2], shape[-1]
    return math.ceil(m / block[0]), math.ceil(n / block[1])


_FP8_TABLES: dict[torch.dtype, np.ndarray] = {}


def fp8_table(dtype: torch.dtype) -> np.ndarray:
    """float32 value of each of the 256 FP8 codes, made by torch's own cast (so lookups match it bit for bit)."""
    import torch  # made here: headers alone need no torch

    if dtype not in _FP8_TABLES:
        _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
    return _FP8_TABLES[dtype]


# e8m0 (OCP MX's shared exponent; DeepSeek-V4's `scale_fmt: ue8m0` block scales): code s is 2^(s - 127), 255 is NaN
E8M0_TABLE = np.append(np.ldexp(np.ones(255), np.arange(255) - 127), np.nan).astype(np.float32)
E8M0_NAN = 255


def e8m0_bytes(scale: torch.Tensor) -> np.ndarray | None:
    """The codes of an e8m0 scale (torch's float8_e8m0fnu, as safetensors gives `F8_E8M0`, or its raw bytes as
    uint8) as a uint8 array; None for a scale of another dtype. A NaN code is a corrupt scale: one line."""
    import torch  # made here: headers alone need no torch

    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        return None
    raw = scale.contiguous().view(torch.uint8).numpy()
    if raw.size and int(raw.max()) == E8M0_NAN:
        at = np.unravel_index(int(np.argmax(raw == E8M0_NAN)), raw.shape)
        raise RecycleError(f"e8m0 scale {list(scale.shape)} holds the NaN code 255 at {[int(i) for i in at]} "
                           "(a corrupt scale)")
    return raw


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as float32 multipliers: a float scale as stored, an e8m0 one (`e8m0_bytes`) as 2^(s - 127)."""
    import torch  # made here: headers alone need no torch

    raw = e8m0_bytes(scale)
    return scale.float() if raw is None else torch.from_numpy(E8M0_TABLE[raw])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype | None = None, row_chunks: int = 1) -> torch.Tensor:
    """`W[i, j] * S[i // b0, j // b1]` in float32, rounded once to `dtype` (the scale multiplies, despite its name).
    The scale is float32 (`weight_scale_inv`) or e8m0 (DeepSeek-V4's `.scale`, `F8_E8M0`: float8_e8m0fnu or its
    bytes as uint8), whose multiplier is 2^(s - 127), exact in float32.

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
    if row_chunks > 1 and m % row_chunks == 0 and row_chunks * -(-m // row_chunks // block[0]) == scale_inv.shape[0]:
        # a weight pre-sharded in `row_chunks` row chunks, each scaled in blocks of its own (recycle.fused); read so
        # wherever the scale's rows allow it, as vLLM (`_shard_fp8_qkv_proj`) and llama.cpp's converter do
        return torch.cat([dequantize_fp8(w, s, block, dtype) for w, s in
                          zip(weight.chunk(row_chunks), scale_inv.chunk(row_chunks))])
    if tuple(scale_inv.shape) != (bm, bn):
        raise RecycleError(f"FP8 scale has shape {list(scale_inv.shape)}, expected {[bm, bn]} for weight {[m, n]}")
    table = fp8_table(weight.dtype)
    codes = weight.contiguous().view(torch.uint8).numpy()
    scale_cols = scale_values(scale_inv).repeat_interleave(block[1], dim=1)[:, :n]  # [bm, n]: a scale row per row block
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


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                 pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantization in DeepSeek's convention: returns (fp8 weight, float32 scale_inv). `pow2`: each
    scale rounded up to a power of two, 2^ceil(log2(amax / 448)), so nothing clips: what an engine holding the scale
    as e8m0 keeps exactly (`scale_fmt: ue8m0`; vllm 0.32 fp8.py builds `scale_dtype=float8_e8m0fnu` when
    `is_scale_e8m0`: DeepSeek-V4's linears, models/deepseek_v4/quant_config.py)."""
    import torch  # made here: headers alone need no torch

    w = weight.float()
    m, n = w.shape
    bm, bn = expected_scale_shape(w.shape, block)
    padded = torch.zeros(bm * block[0], bn * block[1])
    padded[:m, :n] = w
    tiles = padded.view(bm, block[0], bn, block[1])
    scale = _block_amax(w, block).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (tiles / scale[:, None, :, None]).view(bm * block[0], bn * block[1])[:m, :n]
    return q.to(torch.float8_e4m3fn), scale.float()


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max|w| over each block of a 2-D float32 weight: [ceil(M/b0), ceil(N/b1)] (zero padding past the edges)."""
    import torch  # made here: headers alone need no torch

    m, n = w.shape
    bm, bn = expected_scale_shape(w.shape, block)
    tiles = torch.nn.functional.pad(w, (0, bn * block[1] - n, 0, bm * block[0] - m)).view(bm, block[0], bn, block[1])
    return tiles.abs().amax(dim=(1, 3))


class BlockFP8Codec(Codec):
    """DeepSeek's block FP8 as a storage codec: `W` e4m3 with `W_scale_inv` (or native `P.scale`) per block. The
    reader keeps these weights as stored (`fold = False`: every caller reads `W` and its scale by name); the
    codec is what the audit and the writers ask about them."""

    name, tag, bits, fold = "fp8_block", "F8_E4M3", 8.0, False

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        out = {}
        for name, info in stored.items():
            if info.dtype in ("F8_E4M3", "F8_E5M2") and len(info.shape) == 2:
                scale = next((s for s in scale_names(name) if s in stored), None)
                if scale is not None:
                    out[name] = Packed(name, self.name, info.dtype, tuple(info.shape), {"codes": name, "scale": scale})
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(parts["codes"], parts["scale"], _block(config), dtype)

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        q, scale = quantize_fp8(weight, _block(config))
        return {name: q, scale_name(name): scale}


def _block(config: Mapping) -> tuple[int, int]:
    b = config.get("weight_block_size") or (128, 128)
    return int(b[0]), int(b[1])


# -- NVIDIA ModelOpt's FP8: `X.weight` e4m3 + `X.weight_scale` (+ `X.input_scale`) ------------------------------------

MODELOPT_BLOCK_ALGOS = ("FP8_PB_WO", "FP8_BLOCK_SCALES")  # vllm 0.32 modelopt.py:125-128 (the second an alias)
_SCALE_FLOATS = ("F32", "BF16", "F16")


def modelopt_section(config: Mapping) -> Mapping:
    """hf_quant_config.json keeps ModelOpt's settings under `quantization`; config.json's form has them at the top."""
    section = config.get("quantization")
    return section if isinstance(section, Mapping) else config


def is_modelopt(config: Mapping) -> bool:
    """A ModelOpt quantization config (config.json's `quant_method: modelopt*`, or hf_quant_config.json's section
    with a `quant_algo`); compressed-tensors' (ct_float's storage) and DeepSeek's `fp8` are not."""
    method = str(config.get("quant_method", "")).lower()
    return method.startswith("modelopt") or (not method and bool(modelopt_section(config).get("quant_algo")))


def modelopt_block(config: Mapping) -> tuple[int, int]:
    """The FP8 block of a ModelOpt build: the config's `weight_block_size`, else the one `group_size` its
    MIXED_PRECISION block-FP8 layers share (vllm 0.32 modelopt.py:1584-1598), else 128×128 (KFp8Block128,
    modelopt.py:2214-2255)."""
    section = modelopt_section(config)
    b = section.get("weight_block_size") or config.get("weight_block_size")
    if isinstance(b, list | tuple) and len(b) == 2:
        return int(b[0]), int(b[1])
    layers = section.get("quantized_layers")
    sizes = {int(v.get("group_size", 128)) for v in (layers.values() if isinstance(layers, Mapping) else ())
             if isinstance(v, Mapping) and str(v.get("quant_algo", "")).upper() in MODELOPT_BLOCK_ALGOS}
    size = sizes.pop() if len(sizes) == 1 else 128
    return size, size


def modelopt_fp8_form(shape: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int]) -> str | None:
    """Which ModelOpt FP8 a weight [M, N] is by its `weight_scale`'s shape: "block" ([ceil(M/b0), ceil(N/b1)], or
    ModelOpt's export form [ob, 1, ib, 1]), "channel" ([M] or [M, 1]: FP8_PER_CHANNEL_PER_TOKEN), "tensor" ([] or
    [1]: FP8); None for any other shape."""
    m, n = shape
    bm, bn = expected_scale_shape(shape, block)
    scale = tuple(scale)
    if scale in ((bm, bn), (bm, 1, bn, 1)):
        return "block"
    if scale in ((m,), (m, 1)):
        return "channel"
    return "tensor" if scale in ((), (1,)) else None


class ModelOptFP8(Codec):
    """NVIDIA ModelOpt's FP8 weights (vllm 0.32 modelopt.py: KFp8StaticTensor 2104-2172, KFp8StaticChannel
    2174-2212, KFp8Block128 2214-2269): `X.weight` F8_E4M3 [M, N] with a float `X.weight_scale` (a multiplier)
    per tensor ([] or [1], quant_algo FP8), per output channel ([M] or [M, 1], FP8_PER_CHANNEL_PER_TOKEN) or per
    block (FP8_PB_WO: [ceil(M/128), 1, ceil(N/128), 1] as ModelOpt exports it, or 2-D), and `X.input_scale` where
    the activations are static. Grouped under a ModelOpt config only (compressed-tensors' own FP8 is `ct_float`'s,
    DeepSeek's `weight_scale_inv` is `fp8_block`'s), and never where a `weight_scale_inv` sits beside it. A scale
    of any other shape is still grouped, so reading it is one line naming its shape (`dequantize`)."""

    name, tag, bits = "modelopt_fp8", "FP8", 8.0

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        if not is_modelopt(config):
            return {}
        out: dict[str, Packed] = {}
        for name, info in stored.items():
            if info.dtype != "F8_E4M3" or len(info.shape) != 2 or not name.endswith(".weight"):
                continue
            scale = stored.get(name + "_scale")
            if scale is None or scale.dtype not in _SCALE_FLOATS or name + SCALE_SUFFIX in stored:
                continue
            parts = {"codes": name, "scale": name + "_scale"}
            if name[: -len("weight")] + "input_scale" in stored:
                parts["input_scale"] = name[: -len("weight")] + "input_scale"
            out[name] = Packed(name, self.name, self.tag, tuple(info.shape), parts)
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        """codes × scale in float32, rounded once to `dtype` (vLLM's dequantization of each form)."""
        import torch  # made here: headers alone need no torch

        codes, scale = parts["codes"], parts["scale"]
        if codes.dtype != torch.float8_e4m3fn:
            raise RecycleError(f"{packed.parts['codes']}: dtype {codes.dtype}, but a ModelOpt FP8 weight is "
                               "float8_e4m3fn (corrupt or mislabelled modelopt_fp8 tensor)")
        check_shape(packed, "codes", tuple(codes.shape), tuple(packed.shape))
        block = modelopt_block(config)
        form = modelopt_fp8_form(packed.shape, tuple(scale.shape), block)
        m, n = packed.shape
        if form is None:
            bm, bn = expected_scale_shape(packed.shape, block)
            raise RecycleError(f"{packed.parts['scale']}: shape {list(scale.shape)}, but a ModelOpt FP8 {[m, n]} "
                               f"weight's scale is [] or [1] (per tensor), [{m}] or [{m}, 1] (per channel), or "
                               f"[{bm}, {bn}] / [{bm}, 1, {bn}, 1] ({block[0]}x{block[1]} blocks) (corrupt scale)")
        s = scale.detach().float()
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise RecycleError(f"{packed.parts['scale']}: holds NaN, infinite or negative values (corrupt scale)")
        if form == "block":
            return dequantize_fp8(codes, s.reshape(expected_scale_shape(packed.shape, block)), block, dtype)
        rows = s.reshape(-1).expand(m) if form == "tensor" else s.reshape(m)
        return _scaled_rows(codes, rows.contiguous().numpy(), dtype)

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        """FP8_PB_WO as ModelOpt exports it: 128×128 (the config's block) e4m3 codes with a float32 `weight_scale`
        [ob, 1, ib, 1] = block amax / 448 (ModelOpt torch/export/quant_utils.py:536-547, 874-877; its block
        quantizer keeps the amax's [ob, 1, ib, 1] shape, quantization/nn/modules/tensor_quantizer.py:1018-1029,
        1087-1117). vLLM needs `in` divisible by 128 (modelopt.py:2231-2232): anything else is refused."""
        block = modelopt_block(config)
        if weight.dim() != 2 or not name.endswith(".weight") or weight.shape[1] % block[1]:
            raise RecycleError(f"{name}: ModelOpt's FP8_PB_WO stores `.weight` [out, in] with `in` a multiple of "
                               f"{block[1]}, not {list(weight.shape)}")
        q, scale = quantize_fp8(weight, block)
        bm, bn = scale.shape
        return {name: q, name + "_scale": scale.reshape(bm, 1, bn, 1).contiguous()}


def _scaled_rows(codes: torch.Tensor, rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`codes[i, j] * rows[i]` in float32 (codes by fp8_table lookup), cast once to `dtype`, a few rows at a time."""
    import torch  # made here: headers alone need no torch

    m, n = codes.shape
    table = fp8_table(codes.dtype)
    raw = codes.contiguous().view(torch.uint8).numpy()
    out = torch.empty((m, n), dtype=dtype)
    step = max(1, DEQUANT_CHUNK // max(1, n))
    buf = None if dtype == torch.float32 else np.empty((min(step, m), n), np.float32)
    for start in range(0, m, step):
        stop = min(m, start + step)
        f32 = out.numpy()[start:stop] if buf is None else buf[: stop - start]
        np.take(table, raw[start:stop], out=f32, mode="clip")
        f32 *= rows[start:stop, None]
        if buf is not None:
            out[start:stop].copy_(torch.from_numpy(f32))
    return out


CODECS.add(BlockFP8Codec.name, BlockFP8Codec())
CODECS.add(ModelOptFP8.name, ModelOptFP8())
