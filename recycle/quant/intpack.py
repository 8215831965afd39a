"""AWQ and GPTQ: int codes packed into int32 words, with per-group scales and zero points.

AWQ (AutoAWQ's GEMM layout, `quant_method: "awq"`, `version: "gemm"`, 4-bit): a Linear `X` [out, in] stores
`X.qweight` I32 [in, out/8], `X.qzeros` I32 [in/g, out/8] and `X.scales` F16 [in/g, out]. Eight output columns share
a word in AutoAWQ's interleaved order: nibble i of word c holds column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6,
1, 3, 5, 7] (AutoAWQ `awq/modules/linear/gemm.py:220-227` packs, `awq/utils/packing_utils.py:4-5,87-100` unpacks
with the reverse order [0, 4, 1, 5, 2, 6, 3, 7]; vllm 0.32 model_executor/layers/quantization/auto_awq.py:76 and
92-127, awq_triton.py:54-67). W = (q − z) · s, with z and s of the input row's group.

GPTQ (`quant_method: "gptq"`, bits 2/4/8): `X.qweight` I32 [in·bits/32, out] packs `32/bits` consecutive input rows
per word, low bits first; `X.qzeros` I32 [groups, out·bits/32] packs output columns the same way; `X.scales`
[groups, out]; `X.g_idx` I32 [in] names each input row's group (GPTQModel `nn_modules/qlinear/__init__.py`
`pack_original`: lines 1537-1539 and 1581-1583; `dequantize_weight`/`_dequantize_from_codes`: 947-1003). The
`checkpoint_format` "gptq" (v1, the default) stores each zero point minus one, subtracted from the whole word
(`utils/model.py:900-931`) and added back the same way on load (`utils/model.py:750-830`); "gptq_v2" stores them
as they are. vllm 0.32 auto_gptq.py:95-160 builds GPTQ symmetric only (uint4b8/uint8b128: the zero point is
2^(bits-1) whatever qzeros say), registers no g_idx (auto_gptq.py:376-431) and refuses desc_act with groups
(utils/gptq_utils.py:23-50): a build whose stored zero points disagree with `sym: true` is refused here in one line,
since vLLM would serve other weights than its parts say.

`group()` reads headers only and takes the release's `quantization_config` (method, bits, group_size, and GPTQ's
`dynamic` per-module overrides, matched as vllm 0.32 utils/gptq_utils.py:85-103 does).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from recycle.errors import RecycleError
from recycle.quant.codec import CODECS, Codec, Packed, check_shape

if TYPE_CHECKING:
    import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of the eight is nibble AWQ_REVERSE[j]
SCALE_DTYPES = frozenset({"F16", "BF16", "F32"})
INDEX_DTYPES = frozenset({"I32", "I64"})
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _method(config: Mapping) -> str:
    return str(config.get("quant_method", "")).lower()


def _divides(n: int, g: int) -> int:
    return -(-n // g)


def _expect(p: Packed, role: str, info: Any, shape: tuple[int, ...], dtypes: frozenset[str]) -> None:
    check_shape(p, role, tuple(info.shape), shape)
    if info.dtype not in dtypes:
        raise RecycleError(f"{p.parts[role]}: dtype {info.dtype}, but a {p.tag} weight's {role} is "
                           f"{' or '.join(sorted(dtypes))} (corrupt or mislabelled {p.codec} tensor)")


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] int32 words → [..., n, 32/bits] unsigned codes (uint8), lowest bits first."""
    import torch

    if bits == 4 and sys.byteorder == "little":  # a 4-bit code never straddles a byte: split bytes (cheaper)
        b = words.contiguous().view(torch.uint8)
        out = torch.empty((*words.shape, 8), dtype=torch.uint8)
        pairs = out.view(*b.shape, 2)  # slot assignment: torch.stack of the halves is several times slower
        pairs[..., 0] = b & 0xF
        pairs[..., 1] = b >> 4
        return out
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _awq_codes(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [rows, n] → codes [n·8, rows] (uint8): the output columns in order, and transposed (on the int32
    words, the cheapest place). Column j of a word's eight is nibble AWQ_REVERSE[j], the low or high half of byte
    AWQ_REVERSE[j] // 2 (little-endian words)."""
    import torch

    rows, n = words.shape
    if sys.byteorder != "little":
        return _unpack_words(words, 4)[..., list(AWQ_REVERSE)].reshape(rows, n * 8).T.contiguous()
    b = words.T.contiguous().view(torch.uint8).view(n, rows, 4)
    low, high = b & 0xF, b >> 4
    out = torch.empty((n, 8, rows), dtype=torch.uint8)
    for j, nibble in enumerate(AWQ_REVERSE):
        out[:, j] = (high if nibble % 2 else low)[:, :, nibble // 2]
    return out.view(n * 8, rows)


def _grouped(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor | None, group: int,
             dtype: torch.dtype) -> torch.Tensor:
    """W[o, i] = (q[o, i] − z[g(i), o]) · s[g(i), o], for codes q [out, in] and z, s [groups, out], with g(i) =
    g_idx[i] or i // group; computed in float32, returned contiguous in `dtype`."""
    import torch

    rows, cols = q.shape
    zt, st = z.T.float(), s.T.float()  # [out, groups]: small
    if g_idx is None and cols % group == 0:
        w = q.view(rows, cols // group, group).float()  # one widening pass, then in place (mixed-dtype ops are slow)
        return w.sub_(zt.unsqueeze(-1)).mul_(st.unsqueeze(-1)).view(rows, cols).to(dtype)
    idx = g_idx.long() if g_idx is not None else torch.arange(cols) // group
    return q.float().sub_(zt[:, idx]).mul_(st[:, idx]).to(dtype)



def _qweights(stored: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any, Any]]:
    """(module prefix with its dot, qweight, qzeros, scales) of every complete 2-D `qweight` triple (AWQ and GPTQ
    both store these three); an incomplete one, or not a Linear, stays visible under its own stored names."""
    for name, info in stored.items():
        if not name.endswith(".qweight"):
            continue
        base = name[: -len("qweight")]
        zeros, scales = stored.get(base + "qzeros"), stored.get(base + "scales")
        if zeros is not None and scales is not None and len(info.shape) == 2 and len(scales.shape) == 2:
            yield base, info, zeros, scales

class AWQ(Codec):
    """AutoAWQ GEMM: `X.qweight` [in, out/8] + `X.qzeros` [in/g, out/8] + `X.scales` [in/g, out] → `X.weight`
    [out, in]."""

    name, tag, bits = "awq", "INT4", 4.0

    def _args(self, config: Mapping) -> tuple[int, int]:
        bits = config.get("bits", config.get("w_bit", 4))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise RecycleError(f"AWQ version {version!r}: recycle reads AutoAWQ's GEMM layout only (GEMV packs "
                               "along the input dimension in another order); re-export the build as GEMM")
        if bits != 4:
            raise RecycleError(f"AWQ with bits {bits!r}: AutoAWQ's GEMM layout is 4-bit (awq/modules/linear/gemm.py"
                               ":221-224)")
        if config.get("zero_point", True) is False:
            raise RecycleError("AWQ with zero_point false: AutoAWQ's GEMM packer writes zero points "
                               "(gemm.py:187), so recycle does not guess how such a build decodes")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or group == 0 or group < -1:
            raise RecycleError(f"AWQ group_size {group!r} is not a positive int (or -1)")
        return bits, group

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        if _method(config) != "awq":
            return {}
        _, group = self._args(config)
        out: dict[str, Packed] = {}
        for base, info, zeros, scales in _qweights(stored):
            rows, cols = info.shape[0], scales.shape[1]
            n_groups = 1 if group == -1 else _divides(rows, group)
            p = Packed(base + "weight", self.name, self.tag, (cols, rows),
                       {"codes": base + "qweight", "zeros": base + "qzeros", "scale": base + "scales"})
            if cols % 8:
                raise RecycleError(f"{base}scales: {cols} output columns, but AWQ packs eight per int32 word "
                                   "(corrupt or mislabelled AWQ tensor)")
            _expect(p, "codes", info, (rows, cols // 8), frozenset({"I32"}))
            _expect(p, "scale", scales, (n_groups, cols), SCALE_DTYPES)
            _expect(p, "zeros", zeros, (n_groups, cols // 8), frozenset({"I32"}))
            out[p.name] = p
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        import torch

        _, group = self._args(config)
        cols, rows = packed.shape
        group = rows if group == -1 else group
        n_groups = _divides(rows, group)
        qw, qz, s = parts["codes"], parts["zeros"], parts["scale"]
        check_shape(packed, "codes", tuple(qw.shape), (rows, cols // 8))
        check_shape(packed, "zeros", tuple(qz.shape), (n_groups, cols // 8))
        check_shape(packed, "scale", tuple(s.shape), (n_groups, cols))
        if qw.dtype != torch.int32 or qz.dtype != torch.int32:
            raise RecycleError(f"{packed.name}: AWQ qweight/qzeros are int32, not {qw.dtype}/{qz.dtype}")
        q = _awq_codes(qw)  # [out, in]
        z = _awq_codes(qz).T  # [groups, out]
        return _grouped(q, z, s, None, group, dtype)


class GPTQ(Codec):
    """GPTQ (v1 and v2 zero points): `X.qweight` [in·b/32, out] + `X.qzeros` [groups, out·b/32] + `X.scales`
    [groups, out] (+ `X.g_idx` [in]) → `X.weight` [out, in]."""

    name, tag, bits = "gptq", "INT4", 4.0

    def bits_of(self, tag: str) -> float:
        return float(tag.removeprefix("INT"))

    def _args(self, config: Mapping, module: str) -> tuple[int, int, bool, str] | None:
        """(bits, group_size, sym, checkpoint format) for one module, or None where a `dynamic` "-:" rule leaves
        it unquantized."""
        fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
        if fmt not in GPTQ_FORMATS:
            raise RecycleError(f"GPTQ checkpoint_format {fmt!r}: recycle reads {' and '.join(GPTQ_FORMATS)} "
                               "(GPTQModel's planar, Marlin and other repacked layouts are not these)")
        bits, group = config.get("bits", 4), config.get("group_size", 128)
        for pattern, override in (config.get("dynamic") or {}).items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], module):
                    return None
            elif re.match(pattern.removeprefix("+:"), module):
                if isinstance(override, Mapping):
                    bits, group = override.get("bits", bits), override.get("group_size", group)
                break
        if bits not in (2, 4, 8):
            raise RecycleError(f"{module}: GPTQ with {bits!r}-bit codes; recycle reads 2-, 4- and 8-bit GPTQ (3-bit "
                               "codes straddle words)")
        if not isinstance(group, int) or group == 0 or group < -1:
            raise RecycleError(f"{module}: GPTQ group_size {group!r} is not a positive int (or -1)")
        return bits, group, bool(config.get("sym", True)), fmt

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        if _method(config) != "gptq":
            return {}
        out: dict[str, Packed] = {}
        for base, info, zeros, scales in _qweights(stored):
            args = self._args(config, base[:-1])
            if args is None:
                continue
            bits, group, _, _ = args
            per = 32 // bits
            rows, cols = info.shape[0] * per, scales.shape[1]
            g_idx = stored.get(base + "g_idx")
            n_groups = 1 if group == -1 else _divides(rows, group)
            parts = {"codes": base + "qweight", "zeros": base + "qzeros", "scale": base + "scales"}
            if g_idx is not None:
                parts["g_idx"] = base + "g_idx"
            p = Packed(base + "weight", self.name, f"INT{bits}", (cols, rows), parts)
            if cols % per:
                raise RecycleError(f"{base}scales: {cols} output columns, but {bits}-bit GPTQ zero points pack "
                                   f"{per} per int32 word (corrupt or mislabelled GPTQ tensor)")
            _expect(p, "codes", info, (rows // per, cols), frozenset({"I32"}))
            _expect(p, "scale", scales, (n_groups, cols), SCALE_DTYPES)
            _expect(p, "zeros", zeros, (n_groups, cols // per), frozenset({"I32"}))
            if g_idx is not None:
                _expect(p, "g_idx", g_idx, (rows,), INDEX_DTYPES)
            out[p.name] = p
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        import torch

        module = packed.name[: -len(".weight")]
        args = self._args(config, module)
        if args is None:
            raise RecycleError(f"{packed.name}: the GPTQ config's `dynamic` rules leave {module} unquantized, but "
                               "it is stored packed")
        bits, group, sym, fmt = args
        per = 32 // bits
        cols, rows = packed.shape
        group = rows if group == -1 else group
        n_groups = _divides(rows, group)
        qw, qz, s = parts["codes"], parts["zeros"], parts["scale"]
        check_shape(packed, "codes", tuple(qw.shape), (rows // per, cols))
        check_shape(packed, "zeros", tuple(qz.shape), (n_groups, cols // per))
        check_shape(packed, "scale", tuple(s.shape), (n_groups, cols))
        if qw.dtype != torch.int32 or qz.dtype != torch.int32:
            raise RecycleError(f"{packed.name}: GPTQ qweight/qzeros are int32, not {qw.dtype}/{qz.dtype}")
        if fmt == "gptq":  # v1: every zero point was stored minus one, word-wide (GPTQModel utils/model.py:814-830, 928-931)
            ones = sum(1 << (bits * j) for j in range(per))
            qz = ((qz.long() + ones) & 0xFFFFFFFF).to(torch.int64)
            qz = torch.where(qz >= 1 << 31, qz - (1 << 32), qz).to(torch.int32)
        z = _unpack_words(qz, bits).reshape(n_groups, cols)
        if sym and bool((z != 1 << (bits - 1)).any()):
            raise RecycleError(f"{packed.parts['zeros']}: zero points other than {1 << (bits - 1)} under `sym: true` "
                               f"(checkpoint_format {fmt!r}); vLLM builds symmetric GPTQ with that fixed zero point, "
                               "so these parts would serve other weights (corrupt, or the wrong checkpoint_format)")
        q = _unpack_words(qw.T.contiguous(), bits).reshape(cols, rows)  # [in/per, out] words → [out, in] codes
        g_idx = None
        if "g_idx" in parts:
            g_idx = parts["g_idx"]
            check_shape(packed, "g_idx", tuple(g_idx.shape), (rows,))
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups):
                raise RecycleError(f"{packed.parts['g_idx']}: group indices outside [0, {n_groups}) (corrupt g_idx)")
            if bool((g_idx.long() == torch.arange(rows) // group).all()):
                g_idx = None  # the trivial order (desc_act false): the reshape path
        return _grouped(q, z, s, g_idx, group, dtype)


CODECS.add(AWQ.name, AWQ())
CODECS.add(GPTQ.name, GPTQ())
