"""FP4 storage codecs: e2m1 codes, two per byte (the first value in the low nibble), with a scale per block.

- `mxfp4`: OCP MXFP4 as gpt-oss releases store it. `P_blocks` U8 [E, rows, G, 16] (32 codes per block) and
  `P_scales` U8 [E, rows, G] (e8m0: 2^(s - 127)) make the logical `P` [E, G*32, rows], transposed as transformers
  gives it (5.23 `integrations/mxfp4.py` `_convert_moe_packed_tensors`, lines 229-285: low nibble first, `ldexp`
  by s - 127, then `transpose(1, 2)`, so `gate_up_proj` is [E, hidden, 2*intermediate] as `GptOssExperts` holds it).
- `mxfp4_native`: DeepSeek-V4's own names (routed experts, MTP's included): `X.weight` I8 (or U8) [out, in/2], or
  F4 [out, in], with `X.scale` F8_E8M0 [out, in/32] make `X.weight` [out, in] (vLLM 0.32
  `layers/fused_moe/flashinfer_moe_ep.py` `_dequant_mxfp4_ue8m0_gran32`, lines 184-204; transformers 5.23
  `finegrained_fp8.py` `Fp8Dequantize._unpack_fp4`, lines 1121-1128; vLLM maps `experts.N.wK.scale` to the MXFP4
  MoE's `weight_scale`, `models/deepseek_v41/amd/model.py` line 931). "native" as in `fp8.NATIVE_SCALE_SUFFIX`:
  DeepSeek's `P.scale` beside `P.weight`; its e8m0 FP8 weights are `fp8.py`'s (`dequantize_fp8` reads e8m0).
- `nvfp4`: NVIDIA ModelOpt's NVFP4 (`quant_algo: NVFP4`): `X.weight` U8 [out, in/2], `X.weight_scale` F8_E4M3
  [out, in/16], `X.weight_scale_2` F32 (one value) and, where present, `X.input_scale` make `X.weight` [out, in]
  = e2m1 × (weight_scale × weight_scale_2), the product of scales first (ModelOpt `qtensor/nvfp4_tensor.py`
  `NVFP4QTensor.dequantize`, lines 390-406; vLLM 0.32 `utils/nvfp4_emulation_utils.py` `dequantize_to_dtype`,
  lines 559-613, with `weight_global_scale` = `weight_scale_2` as stored, `quantization/modelopt.py` line 2062).
  compressed-tensors stores the reciprocal, `weight_global_scale` = 1 / `weight_scale_2` (0.20
  `entrypoints/convert/converters/modelopt_nvfp4.py` lines 117-122) and divides by it.

Headers alone find the weights (`group`: one pass over the names, no torch). Dequantization goes a slice of rows
at a time: each byte → its two float32 values by one 8-byte table lookup, times the block's scale, cast into the
output; values equal the engines' float32 arithmetic rounded once to `dtype`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from recycle.errors import RecycleError
from recycle.quant.codec import CODECS, Codec, Packed, check_shape
from recycle.quant.fp8 import DEQUANT_CHUNK, E8M0_TABLE, e8m0_bytes

if TYPE_CHECKING:
    import torch

# e2m1 code → value (sign bit 8; 1 is 0.5, the one subnormal), as every engine's table
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# byte → its two values (low nibble first) as one uint64, so one np.take unpacks a byte
PAIRS = np.stack([E2M1[np.arange(256) & 15], E2M1[np.arange(256) >> 4]], axis=1).copy().view(np.uint64).ravel()
E2M1_MAX, E4M3_MAX = 6.0, 448.0
MX_BLOCK, NV_BLOCK = 32, 16
E8M0 = ("F8_E8M0", "U8")  # an e8m0 scale, typed or as its bytes
FP4_CODES = {"I8": 2, "U8": 2, "F4": 1}  # DeepSeek-V4's FP4 codes, by stored dtype: values per stored element


# -- shared arithmetic --------------------------------------------------------------------------------------------

def _bytes(t: torch.Tensor, packed: Packed, role: str, want: tuple[int, ...]) -> np.ndarray:
    """A part's stored bytes as uint8 [*want], after checking its dtype is one byte wide and its shape is `want`."""
    import torch

    if t.element_size() != 1 or t.is_complex():
        raise RecycleError(f"{packed.parts.get(role, packed.name)}: dtype {t.dtype}, but a {packed.tag} {role} part is "
                           f"one byte per element (corrupt or mislabelled {packed.codec} tensor)")
    check_shape(packed, role, tuple(t.shape), want)
    return t.contiguous().view(torch.uint8).numpy()


def _rows_per_step(cols: int) -> int:
    return max(1, DEQUANT_CHUNK // max(1, cols))


def _decode(codes: np.ndarray, scale: np.ndarray, block: int, out: np.ndarray) -> None:
    """`out` [r, 2*b] float32 = e2m1 of codes [r, b] (u8) × scale [r, 2*b/block] (float32), block by block."""
    pairs = out.view(np.uint64)  # [r, b]: each uint64 is the 8 bytes of two float32 values, the low nibble's first
    np.take(PAIRS, codes, out=pairs, mode="clip")
    r, g = scale.shape
    np.multiply(out.reshape(r, g, block), scale[:, :, None], out=out.reshape(r, g, block))


def _unpack_rows(codes: np.ndarray, scale: np.ndarray, block: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 2*b] in `dtype` from codes [rows, b] and float32 block scales [rows, 2*b/block], a few rows at a
    time (no float32 copy of the whole weight)."""
    import torch

    rows, half = codes.shape
    cols = 2 * half
    out = torch.empty((rows, cols), dtype=dtype)
    step = _rows_per_step(cols)
    direct, bf16 = dtype == torch.float32, dtype == torch.bfloat16
    buf = None if direct else np.empty((min(step, rows), cols), np.float32)
    tmp = np.empty_like(buf, dtype=np.uint32) if bf16 else None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        f32 = out.numpy()[start:stop] if direct else buf[: stop - start]
        _decode(codes[start:stop], scale[start:stop], block, f32)
        if bf16:
            _round_bf16(f32, tmp[: stop - start], out[start:stop].view(torch.int16).numpy())
        elif not direct:
            out[start:stop].copy_(torch.from_numpy(f32))
    return out


def _round_bf16(f32: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> None:
    """bfloat16 bits of float32 values, rounded to nearest even as torch's cast rounds (no NaN reaches here: scales
    are checked, e2m1 has none). In numpy, one thread: torch's parallel cast of a 1 MiB chunk stalls for ~20× as
    long on two busy cores."""
    u = f32.view(np.uint32)
    np.right_shift(u, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    tmp += 0x7FFF
    tmp += u
    np.right_shift(tmp, 16, out=tmp)
    np.copyto(out, tmp, casting="unsafe")


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by their scale) → e2m1 codes (uint8, 0..15), rounded to nearest with ties to
    the even code, beyond ±6 clamped to ±6 (ModelOpt's `NVFP4QTensor._cast_fp4`, bounds 0.25 .. 5, lines 230-250);
    a negative value keeps its sign bit even where it rounds to zero (`weight < 0`, as ModelOpt)."""
    import torch

    a = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8)
    for bound, tie_up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                          (5.0, False)):
        idx += (a >= bound) if tie_up else (a > bound)
    return idx | ((x < 0).to(torch.uint8) << 3)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., 2n] → bytes [..., n], the even element in the low nibble (ModelOpt `nvfp4_tensor.py` line
    337, compressed-tensors `pack_fp4_to_uint8`, transformers' unpacking)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _finite(weight: torch.Tensor, name: str, codec: str) -> torch.Tensor:
    import torch

    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise RecycleError(f"{name}: holds NaN or infinite values, which {codec} cannot store")
    return w


def mx_quantize(w: torch.Tensor, name: str, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization of float32 [..., n] (n a multiple of 32) along its last dimension: packed codes
    [..., n/2] (uint8) and e8m0 exponents [..., n/32] (uint8). The exponent is ceil(log2(amax / 6)), at least -127,
    so no value clips (ModelOpt `qtensor/mxfp4_tensor.py` `MXFP4QTensor.quantize`, lines 72-80); rounding is to
    nearest, ties to even."""
    import torch

    if w.shape[-1] % MX_BLOCK:
        raise RecycleError(f"{name}: {w.shape[-1]} inputs are not a multiple of {MX_BLOCK}, which {codec} needs")
    blocks = w.reshape(*w.shape[:-1], -1, MX_BLOCK)
    amax = blocks.abs().amax(-1)
    mant, exp = torch.frexp(amax / E2M1_MAX)  # amax/6 = mant * 2^exp, mant in [0.5, 1): ceil(log2) is exp - (mant == .5)
    e = torch.where(amax > 0, exp - (mant == 0.5).to(exp.dtype), torch.full_like(exp, -127)).clamp(-127, 127)
    q = e2m1_codes(blocks * torch.ldexp(torch.ones(e.shape), -e)[..., None]).reshape(w.shape)  # exact 2^-e
    return pack_pairs(q), (e + 127).to(torch.uint8)


def _e8m0_values(t: torch.Tensor, packed: Packed, role: str, want: tuple[int, ...]) -> np.ndarray:
    check_shape(packed, role, tuple(t.shape), want)
    raw = e8m0_bytes(t)
    if raw is None:
        raise RecycleError(f"{packed.parts.get(role, packed.name)}: dtype {t.dtype}, but a {packed.tag} scale is "
                           f"e8m0 (float8_e8m0fnu or uint8)")
    return E8M0_TABLE[raw]


# -- gpt-oss: P_blocks + P_scales ---------------------------------------------------------------------------------

class MXFP4(Codec):
    """gpt-oss's MXFP4 experts: `P_blocks` U8 [E, rows, G, 16] + `P_scales` U8 [E, rows, G] → `P` [E, G*32, rows]."""

    name, tag, bits = "mxfp4", "MXFP4", 4.0
    scan_dtypes = frozenset({"U8"})

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        out: dict[str, Packed] = {}
        for name, info in stored.items():
            if not name.endswith("_blocks") or info.dtype != "U8":
                continue
            base = name[: -len("_blocks")]
            scales = stored.get(base + "_scales")
            if scales is None or scales.dtype not in E8M0:
                continue
            b, s = tuple(info.shape), tuple(scales.shape)
            if len(b) != 4 or b[-1] != MX_BLOCK // 2 or b[:-1] != s:
                raise RecycleError(f"{name}: shape {list(b)} with {base}_scales {list(s)}, but MXFP4 blocks are "
                                   f"[experts, rows, groups, 16] with scales [experts, rows, groups] (corrupt or "
                                   "mislabelled MXFP4 tensors)")
            out[base] = Packed(base, self.name, self.tag, (b[0], b[2] * MX_BLOCK, b[1]),
                               {"codes": name, "scale": base + "_scales"})
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        import torch

        e, cols, rows = packed.shape
        g = cols // MX_BLOCK
        codes = _bytes(parts["codes"], packed, "codes", (e, rows, g, MX_BLOCK // 2)).reshape(e, rows, cols // 2)
        scale = _e8m0_values(parts["scale"], packed, "scale", (e, rows, g))
        out = torch.empty((e, cols, rows), dtype=dtype)
        step = _rows_per_step(cols)
        as_np = {torch.float32: torch.float32, torch.bfloat16: torch.int16}.get(dtype)  # numpy holds their bits
        for k in range(e):
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                chunk = _unpack_rows(codes[k, start:stop], scale[k, start:stop], MX_BLOCK, dtype)
                if as_np is None:
                    out[k, :, start:stop].copy_(chunk.T)
                else:  # a transposing copy in numpy: one thread (see `_round_bf16`)
                    np.copyto(out[k, :, start:stop].view(as_np).numpy(), chunk.view(as_np).numpy().T)
        return out

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        if weight.dim() != 3:
            raise RecycleError(f"{name}: gpt-oss MXFP4 stores [experts, in, out] weights, not {list(weight.shape)}")
        w = _finite(weight, name, self.name).transpose(1, 2).contiguous()  # [E, out, in]: blocks run along `in`
        codes, exps = mx_quantize(w, name, self.name)
        e, rows, n = w.shape
        return {name + "_blocks": codes.reshape(e, rows, n // MX_BLOCK, MX_BLOCK // 2), name + "_scales": exps}


# -- DeepSeek-V4: X.weight (I8 pairs) + X.scale (e8m0 per 32) -----------------------------------------------------

class MXFP4Native(Codec):
    """DeepSeek-V4's FP4 weights: `X.weight` I8/U8 [..., out, in/2] (or F4 [..., out, in]) + `X.scale` F8_E8M0
    [..., out, in/32] → `X.weight` [..., out, in]."""

    name, tag, bits = "mxfp4_native", "MXFP4", 4.0
    scan_dtypes = frozenset(FP4_CODES)

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        out: dict[str, Packed] = {}
        get = stored.get
        for name, info in [(n, i) for n, i in stored.items() if i.dtype in FP4_CODES and n.endswith(".weight")]:
            scale_name = name[:-6] + "scale"  # `X.weight` → `X.scale`
            scale = get(scale_name)
            if scale is None or scale.dtype != "F8_E8M0":
                continue
            w, s, dt = tuple(info.shape), tuple(scale.shape), info.dtype
            cols = w[-1] * FP4_CODES[dt] if w else 0
            if len(w) < 2 or w[:-1] != s[:-1] or cols != s[-1] * MX_BLOCK or not cols:
                raise RecycleError(f"{name}: {dt} {list(w)} with {scale_name} {list(s)}, but FP4 codes "
                                   f"[out, in/2] need an e8m0 scale [out, in/{MX_BLOCK}] (corrupt or mislabelled "
                                   "FP4 tensors)")
            out[name] = Packed(name, self.name, self.tag, (*w[:-1], cols), {"codes": name, "scale": scale_name})
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        *lead, cols = packed.shape
        rows = math.prod(lead)
        codes = _bytes(parts["codes"], packed, "codes", (*lead, cols // 2)).reshape(rows, cols // 2)
        scale = _e8m0_values(parts["scale"], packed, "scale", (*lead, cols // MX_BLOCK)).reshape(rows, -1)
        return _unpack_rows(codes, scale, MX_BLOCK, dtype).reshape(packed.shape)

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        import torch

        if weight.dim() < 2 or not name.endswith(".weight"):
            raise RecycleError(f"{name}: DeepSeek's FP4 storage holds [out, in] `.weight` tensors")
        codes, exps = mx_quantize(_finite(weight, name, self.name), name, self.name)
        # DeepSeek-V4's release stores the pairs as I8 (transformers 5.23 `FP8Experts`: int8, K halved)
        return {name: codes.view(torch.int8), name[: -len("weight")] + "scale": exps.view(torch.float8_e8m0fnu)}


def ggml_mxfp4_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`mxfp4_native` storage ([rows, in/2] code pairs, element 2i in the low nibble; e8m0 [rows, in/32]) as GGML's
    MXFP4 blocks: per 32 inputs one e8m0 byte, then 16 bytes whose byte j holds element j (low nibble) and j+16
    (high). Bit for bit, no rounding: both index e2m1 codes in the same order, and GGML's doubled table with its
    halved scale (`GGML_E8M0_TO_FP32_HALF`, ggml-impl.h) gives the same values. Returns uint8 [rows, in/32·17]."""
    import torch

    p, e = codes.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    rows, half = p.shape
    groups = half * 2 // MX_BLOCK
    if half * 2 % MX_BLOCK or tuple(e.shape) != (rows, groups):
        raise RecycleError(f"FP4 codes {list(p.shape)} with scales {list(e.shape)}: not [rows, in/2] with "
                           f"[rows, in/{MX_BLOCK}]")
    vals = torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(rows, groups, MX_BLOCK)
    packed = vals[..., :16] | (vals[..., 16:] << 4)
    return torch.cat((e.reshape(rows, groups, 1), packed), dim=-1).reshape(rows, groups * 17)

# -- NVIDIA ModelOpt: weight + weight_scale + weight_scale_2 (+ input_scale) ----------------------------------------

class NVFP4(Codec):
    """ModelOpt's NVFP4: `X.weight` U8 [..., out, in/2], `X.weight_scale` F8_E4M3 [..., out, in/16],
    `X.weight_scale_2` F32 (one value, or one per leading index: fused experts), `X.input_scale` F32 where present
    → `X.weight` [..., out, in]."""

    name, tag, bits = "nvfp4", "NVFP4", 4.0
    scan_dtypes = frozenset({"U8"})

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        out: dict[str, Packed] = {}
        for name, info in stored.items():
            if info.dtype != "U8" or not name.endswith(".weight"):
                continue
            scale = stored.get(name + "_scale")
            if scale is None or scale.dtype != "F8_E4M3":
                continue
            base = name[: -len("weight")]
            glob = stored.get(name + "_scale_2")
            w, s = tuple(info.shape), tuple(scale.shape)
            if glob is None or glob.dtype != "F32" or (math.prod(glob.shape) != 1 and tuple(glob.shape) != w[:-2]):
                got = "none" if glob is None else f"{glob.dtype} {list(glob.shape)}"
                raise RecycleError(f"{name}: an NVFP4 weight (U8 {list(w)} with an F8_E4M3 weight_scale) whose "
                                   f"weight_scale_2 is {got}, not one F32 value (or one per leading index) (corrupt "
                                   "or incomplete NVFP4 tensors)")
            if len(w) < 2 or w[:-1] != s[:-1] or 2 * w[-1] != s[-1] * NV_BLOCK or not w[-1]:
                raise RecycleError(f"{name}: U8 {list(w)} with {name}_scale {list(s)}, but NVFP4 codes [out, in/2] "
                                   f"need a scale [out, in/{NV_BLOCK}] (corrupt or mislabelled NVFP4 tensors)")
            parts = {"codes": name, "scale": name + "_scale", "global_scale": name + "_scale_2"}
            if base + "input_scale" in stored:
                parts["input_scale"] = base + "input_scale"
            out[name] = Packed(name, self.name, self.tag, (*w[:-1], 2 * w[-1]), parts)
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        import torch

        from recycle.quant.fp8 import fp8_table

        *lead, cols = packed.shape
        rows = math.prod(lead)
        codes = _bytes(parts["codes"], packed, "codes", (*lead, cols // 2)).reshape(rows, cols // 2)
        sc = parts["scale"]
        if sc.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise RecycleError(f"{packed.parts['scale']}: dtype {sc.dtype}, but an NVFP4 weight_scale is float8_e4m3fn")
        scale = fp8_table(torch.float8_e4m3fn)[_bytes(sc, packed, "scale", (*lead, cols // NV_BLOCK))]
        glob = parts["global_scale"]
        per = math.prod(lead[:-1])  # one weight_scale_2 for all, or one per leading index (`out` rows each)
        if glob.dtype != torch.float32 or glob.numel() not in (1, per):
            raise RecycleError(f"{packed.parts['global_scale']}: {glob.dtype} {list(glob.shape)}, but an NVFP4 "
                               "weight_scale_2 is one float32 value (or one per leading index)")
        g = glob.detach().reshape(-1).numpy()
        if not (np.isfinite(g).all() and (g > 0).all()) or not np.isfinite(scale).all() or (scale < 0).any():
            raise RecycleError(f"{packed.name}: NVFP4 scales hold NaN, infinite or non-positive values "
                               f"(weight_scale_2 = {g.tolist()[:4]}): corrupt scales")
        # the scales' product first, as ModelOpt and vLLM multiply
        scale = scale.reshape(rows, -1) * (g[:1] if g.size == 1 else np.repeat(g, lead[-1]))[:, None]
        return _unpack_rows(codes, scale, NV_BLOCK, dtype).reshape(packed.shape)

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        """ModelOpt's weight export (`qtensor/nvfp4_tensor.py`): weight_scale_2 = amax / (6 × 448) (line 207), each
        16 inputs' scale = block amax / (6 × weight_scale_2) in e4m3, 0 → 1 (lines 194-198), clamped to
        [2^-9, 448] (line 46); codes = e2m1(w / (scale × weight_scale_2)) (lines 325-335). No `input_scale`: it is
        the activations' calibration, which a weight alone does not give."""
        import torch

        if weight.dim() < 2 or weight.shape[-1] % NV_BLOCK or not name.endswith(".weight"):
            raise RecycleError(f"{name}: NVFP4 stores `.weight` [out, in] with `in` a multiple of {NV_BLOCK}, not "
                               f"{list(weight.shape)}")
        w = _finite(weight, name, self.name)
        amax = w.abs().amax()
        g = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.ones(())
        blocks = w.reshape(*w.shape[:-1], -1, NV_BLOCK)
        scale = blocks.abs().amax(-1) / (E2M1_MAX * g)
        scale[scale == 0] = 1.0
        scale = scale.clamp(min=2.0 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
        q = e2m1_codes(blocks / (scale.float() * g)[..., None]).reshape(w.shape)
        return {name: pack_pairs(q), name + "_scale": scale, name + "_scale_2": g.reshape(()).float()}


CODECS.add(MXFP4.name, MXFP4())
CODECS.add(MXFP4Native.name, MXFP4Native())
CODECS.add(NVFP4.name, NVFP4())
