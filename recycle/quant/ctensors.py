"""compressed-tensors (llm-compressor's builds): which config group a module belongs to, and one storage codec per
format, each decompressing and compressing through the `compressed-tensors` package's own compressors.

A build declares `quantization_config: {quant_method: "compressed-tensors", format, config_groups, ignore}`. Each
group has `targets` (module names, `re:` regexes, or class names such as "Linear"), `weights` (num_bits, type,
strategy, group_size, block_structure, symmetric, actorder) and, optionally, its own `format`; the top-level `format`
holds where a group names none (vLLM 0.32 compressed_tensors/compressed_tensors.py:788-792). Per format, a quantized
Linear `X` stores (compressed-tensors 0.20 `compressors/*/base.py`, `compression_param_names`):

- `pack-quantized` (int4/int8 W4A16, `ct_pack`): `X.weight_packed` I32 [out, ceil(in*bits/32)], `X.weight_scale`
  [out, groups] (channel: [out, 1]), `X.weight_shape` [2], `X.weight_zero_point` I32 [ceil(out*bits/32), groups]
  when asymmetric, `X.weight_g_idx` [in] with an activation order;
- `nvfp4-pack-quantized` (`ct_nvfp4`): `X.weight_packed` U8 [out, in/2], `X.weight_scale` F8_E4M3 [out, in/16],
  `X.weight_global_scale` F32 [1];
- `float-quantized` (FP8, `ct_float`): `X.weight` F8_E4M3 [out, in] and `X.weight_scale` per tensor [1], channel
  [out, 1], group [out, groups] or block [ceil(out/b0), ceil(in/b1)] (DeepSeek names its block scale
  `weight_scale_inv`; compressed-tensors does not);
- `naive-quantized` / `int-quantized` (`ct_naive`): `X.weight` I8 (F8_E4M3 for float args) [out, in], `X.weight_scale`,
  and `X.weight_zero_point` (the scale's shape) when asymmetric.

Which group quantizes a module follows vLLM 0.32's lookup (compressed_tensors/utils.py:73-130): the first target
that equals the module's name or `re:`-matches it (re.match, config_utils.py:392-412), else a class-name target.
From headers alone no class is seen: a "Linear" target is taken to mean every 2-D weight, and other class names
match nothing (such a module's parts stay unfolded, under their stored names). `ignore` entries match the same
way (exact or `re:`) and leave a module unquantized (compressed_tensors/utils.py:53-70). A module with no group, or
whose group is another format, is not this codec's storage; `group()` returns nothing for it.

`group()` reads headers only (no torch, no compressed_tensors); `dequantize` and `quantize` import the package
(the `quant` extra) and refuse in one line without it.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from recycle.errors import RecycleError
from recycle.quant.codec import CODECS, Codec, Packed, check_shape

if TYPE_CHECKING:
    import torch

METHOD = "compressed-tensors"
NEEDS_PACKAGE = "reading a compressed-tensors build needs `pip install recycle[quant]`"
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})
# role (shared with the other codecs: codes, scale, ...) → the compressors' local parameter name
LOCAL = {"codes": "weight", "packed": "weight_packed", "scale": "weight_scale", "global_scale": "weight_global_scale",
         "zero_point": "weight_zero_point", "shape": "weight_shape", "g_idx": "weight_g_idx"}
# vLLM's formats whose weights carry no activation quantization (compressed_tensors utils `is_activation_...`):
# only used to infer a missing format the way compressed-tensors does (compressors/format.py priority list)
INFERRED = ("mixed-precision", "dense")


class Group(NamedTuple):
    """One config group as it applies to a module: its key, its dict as stored, its format, and its weight args
    with compressed-tensors' defaults filled in (strategy inferred as `QuantizationArgs` does)."""

    key: str
    scheme: Mapping
    format: str
    num_bits: int
    type: str  # "int" | "float"
    strategy: str  # tensor | channel | group | tensor_group | block
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool
    actorder: str | None


def _args(key: str, scheme: Mapping, top_format: Any) -> Group:
    w = scheme.get("weights")
    if not isinstance(w, Mapping):
        raise RecycleError(f"compressed-tensors config group {key!r} has no `weights` arguments")
    bits = int(w.get("num_bits", 8))
    typ = str(w.get("type", "int")).lower()
    gs = w.get("group_size")
    block = w.get("block_structure")
    if isinstance(block, str):
        block = [int(x) for x in block.split("x")]
    strategy = w.get("strategy")
    if strategy is None:  # QuantizationArgs.validate_model_after
        strategy = "tensor" if gs is None else "group" if gs > 0 else "channel"
    strategy = str(strategy).lower()
    if strategy in ("group", "tensor_group") and not (isinstance(gs, int) and gs > 0):
        raise RecycleError(f"compressed-tensors config group {key!r}: strategy {strategy} needs a positive group_size")
    if strategy == "block" and not (isinstance(block, list | tuple) and len(block) == 2 and min(block) > 0):
        raise RecycleError(f"compressed-tensors config group {key!r}: block strategy needs a [rows, cols] "
                           f"block_structure, not {block!r}")
    actorder = w.get("actorder")
    fmt = scheme.get("format") or top_format
    if not fmt or fmt in INFERRED:
        fmt = _infer_format(bits, typ, gs, scheme.get("input_activations"))
    return Group(key, scheme, str(fmt), bits, typ, strategy, gs if isinstance(gs, int) else None,
                 (int(block[0]), int(block[1])) if strategy == "block" else None, bool(w.get("symmetric", True)),
                 None if actorder in (None, False) else str(actorder))


def _infer_format(bits: int, typ: str, group_size: Any, acts: Any) -> str:
    """The format compressed-tensors 0.20 infers for a Linear (compressors/format.py:17-27, first `can_compress`)."""
    if typ == "float" and bits == 4:
        return "nvfp4-pack-quantized" if group_size == 16 else "mxfp4-pack-quantized"
    if typ == "float" and bits == 8:
        return "float-quantized" if acts else "naive-quantized"
    if typ == "int" and acts:
        return "int-quantized"
    if typ == "int" and 1 <= bits <= 8:
        return "pack-quantized"
    return "naive-quantized"


def _matches(name: str, target: str) -> bool:
    """vLLM's `is_equal_or_regex_match` without substring matching (utils/config_utils.py:392-412)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


class Lookup:
    """A config's groups and ignore list, parsed once: `resolve(module, two_d)` is `config_group` for many
    modules (a checkpoint's headers)."""

    def __init__(self, config: Mapping):
        ignore = [str(e) for e in config.get("ignore") or ()]
        self.ignore_names = {e for e in ignore if not e.startswith("re:")}
        regexes = [e[3:] for e in ignore if e.startswith("re:")]  # one alternation, each re.match-anchored
        self.ignore_re = re.compile("|".join(f"(?:{r})" for r in regexes)) if regexes else None
        # vLLM keys its map by target (later groups overwrite earlier ones) and tries names before classes
        by_target: dict[str, str] = {}
        schemes: dict[str, Mapping] = {}
        for key, scheme in (config.get("config_groups") or {}).items():
            if not isinstance(scheme, Mapping):
                raise RecycleError(f"compressed-tensors config group {key!r} names a preset ({scheme!r}); recycle "
                                   "reads groups written out in full, as llm-compressor saves them")
            schemes[key] = scheme
            for target in scheme.get("targets") or ():
                by_target[str(target)] = key
        self.groups = {key: _args(key, scheme, config.get("format")) for key, scheme in schemes.items()}
        self.targets = [(t, re.compile(t[3:]) if t.startswith("re:") else None, self.groups[k])
                        for t, k in by_target.items()]
        self.linear = self.groups[by_target["Linear"]] if "Linear" in by_target else None
        self.formats = {g.format for g in self.groups.values()}

    @staticmethod
    def _hit(module: str, target: str, pattern: re.Pattern | None) -> bool:
        return pattern.match(module) is not None if pattern is not None else target == module

    def resolve(self, module: str, two_d: bool = True) -> Group | None:
        if module in self.ignore_names or (self.ignore_re is not None and self.ignore_re.match(module)):
            return None
        for target, pattern, group in self.targets:
            if self._hit(module, target, pattern):
                return group
        return self.linear if two_d else None


def config_group(module: str, config: Mapping, two_d: bool = True) -> Group | None:
    """The config group that quantizes `module` (a checkpoint module name, `model.layers.0.mlp.down_proj`), or None
    where `ignore` names it or no group targets it. `two_d`: whether its weight is 2-D, which is what a "Linear"
    class target is taken to mean from headers alone."""
    return Lookup(config).resolve(module, two_d)


def _divides(n: int, g: int) -> int:
    return -(-n // g)


def _package():
    try:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationScheme
    except ImportError:
        raise RecycleError(NEEDS_PACKAGE) from None
    return BaseCompressor, QuantizationScheme


class CompressedTensors(Codec):
    """The common part of the four formats: finding a module's group, the package's compressor by format."""

    formats: tuple[str, ...] = ()
    suffix: str = ""  # the local name of the part every weight of the format has, after "X."

    # -- headers ----------------------------------------------------------------------------------------------

    def group(self, stored: Mapping[str, Any], config: Mapping) -> dict[str, Packed]:
        if str(config.get("quant_method", "")).lower() != METHOD:
            return {}
        lookup = Lookup(config)
        if not lookup.formats & set(self.formats):
            return {}
        out: dict[str, Packed] = {}
        end = "." + self.suffix
        for name, info in stored.items():
            if not name.endswith(end):
                continue
            module = name[: -len(end)]
            if module + ".weight_scale" not in stored:
                continue  # an unquantized weight (ct_float/ct_naive's codes share its name), or scales missing
            g = lookup.resolve(module, len(info.shape) == 2)
            if g is None or g.format not in self.formats:
                continue
            p = self._packed(module, g, stored)
            if p is not None:
                out[p.name] = p
        return out

    @abstractmethod
    def _packed(self, module: str, g: Group, stored: Mapping[str, Any]) -> Packed | None:
        """The Packed weight of `module` in config group `g`, from its stored parts; None where they are not this
        format's (the format's own subclass says)."""

    def _scale_shape(self, g: Group, out: int, cols: int) -> tuple[int, ...]:
        """The `weight_scale` shape compressed-tensors makes for a [out, cols] weight (lifecycle/initialize.py
        `initialize_qparams`, strategy by strategy)."""
        if g.strategy == "tensor":
            return (1,)
        if g.strategy == "channel":
            return (out, 1)
        if g.strategy in ("group", "tensor_group"):
            return (out, _divides(cols, g.group_size))
        if g.strategy == "block":
            return (_divides(out, g.block[0]), _divides(cols, g.block[1]))
        raise RecycleError(f"compressed-tensors group {g.key!r}: weight strategy {g.strategy!r} is not one recycle "
                           "reads (tensor, channel, group, tensor_group, block)")

    @staticmethod
    def _expect(p: Packed, role: str, info: Any, shape: tuple[int, ...], dtypes: frozenset[str] | str) -> None:
        allowed = {dtypes} if isinstance(dtypes, str) else dtypes
        if info.shape == shape and info.dtype in allowed:
            return
        check_shape(p, role, tuple(info.shape), shape)
        if info.dtype not in allowed:
            raise RecycleError(f"{p.parts[role]}: dtype {info.dtype}, but a {p.tag} weight's {LOCAL[role]} is "
                               f"{' or '.join(sorted(allowed))} (corrupt or mislabelled {p.codec} tensor)")

    # -- tensors ----------------------------------------------------------------------------------------------

    def _scheme(self, module: str, config: Mapping, shape: tuple[int, ...]):
        """The module's group as the package's `QuantizationScheme`, with its compressor."""
        base, scheme_type = _package()
        g = config_group(module, config, len(shape) == 2)
        if g is None or g.format not in self.formats:
            raise RecycleError(f"{module}: the compressed-tensors config gives it no {'/'.join(self.formats)} group "
                               f"(ignored, untargeted, or another format)")
        try:
            scheme = scheme_type.model_validate(dict(g.scheme))
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            first = str(e).splitlines()
            raise RecycleError(f"{module}: compressed-tensors rejects config group {g.key!r} "
                               f"({first[-1].strip() if first else type(e).__name__})") from None
        return g, scheme, base.get_value_from_registry(g.format)

    def dequantize(self, parts: Mapping[str, torch.Tensor], packed: Packed, config: Mapping,
                   dtype: torch.dtype) -> torch.Tensor:
        module = packed.name[: -len(".weight")]
        g, scheme, compressor = self._scheme(module, config, packed.shape)
        self._check(parts, packed, g)
        state = {LOCAL[role]: t for role, t in parts.items()}
        try:
            weight = compressor.decompress(state, scheme)["weight"]
        except (ValueError, RuntimeError, AssertionError, IndexError, KeyError) as e:
            raise RecycleError(f"{packed.name}: compressed-tensors cannot decompress its {g.format} parts "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if tuple(weight.shape) != tuple(packed.shape):
            raise RecycleError(f"{packed.name}: its {g.format} parts decompress to {list(weight.shape)}, not "
                               f"{list(packed.shape)} (corrupt or mislabelled {packed.codec} tensors)")
        return weight.to(dtype)

    def _check(self, parts: Mapping[str, torch.Tensor], packed: Packed, g: Group) -> None:
        """Every part's shape as its weight needs (the headers were checked by `group`; the tensors may be other
        tensors than those headers, e.g. one expert's slice, so again here)."""
        out, cols = packed.shape
        check_shape(packed, "scale", tuple(parts["scale"].shape), self._scale_shape(g, out, cols))

    def quantize(self, weight: torch.Tensor, name: str, config: Mapping) -> dict[str, torch.Tensor]:
        """The stored tensors of `name` (`X.weight`) as llm-compressor writes them: qparams from the weight's
        min/max per strategy (llm-compressor's memoryless min-max observer: `observers/helpers.py`
        `_flatten_weight` and `observers/min_max.py` `_get_min_max`; NVFP4's global scale from the absmax,
        `observers/base.py` `get_global_scale`), `calculate_qparams`, then the format's own `compress`. The scale
        is kept in the weight's dtype, as llm-compressor registers it (compressed-tensors `initialize_qparams`)."""
        import torch

        _package()  # the one-line refusal without the extra, before importing its helpers
        from compressed_tensors.quantization.utils.helpers import (
            calculate_qparams,
            generate_gparam,
            maybe_pad_tensor_for_block_quant,
        )

        if not name.endswith(".weight") or weight.dim() != 2:
            raise RecycleError(f"{name}: compressed-tensors stores 2-D `.weight` tensors, not {list(weight.shape)}")
        module = name[: -len(".weight")]
        g, scheme, compressor = self._scheme(module, config, tuple(weight.shape))
        args = scheme.weights
        w = weight if weight.dtype in (torch.float16, torch.bfloat16, torch.float32) else weight.float()
        if not torch.isfinite(w).all():
            raise RecycleError(f"{name}: NaN or infinite values cannot be quantized")
        rows, cols = w.shape
        if g.strategy in ("group", "tensor_group") and cols % g.group_size:
            raise RecycleError(f"{name}: {cols} inputs do not split into groups of {g.group_size}")
        if g.strategy == "tensor":
            flat = w.reshape(1, 1, -1)
        elif g.strategy == "channel":
            flat = w.unsqueeze(-2).unsqueeze(0)
        elif g.strategy in ("group", "tensor_group"):
            flat = w.unflatten(-1, (-1, g.group_size)).unsqueeze(0)
        elif g.strategy == "block":
            padded = maybe_pad_tensor_for_block_quant(w, list(g.block))
            br, bc = padded.shape[0] // g.block[0], padded.shape[1] // g.block[1]
            flat = padded.reshape(br, g.block[0], bc, g.block[1]).transpose(1, 2).flatten(-2, -1).unsqueeze(0)
        else:
            raise RecycleError(f"{name}: recycle does not write compressed-tensors' {g.strategy} strategy")
        lo, hi = torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))
        glob = None
        if g.strategy == "tensor_group":
            absmax = torch.max(-lo.min(), hi.max())
            glob = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        scale, zero = calculate_qparams(lo, hi, args, global_scale=glob)
        state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}
        if glob is not None:
            state["weight_global_scale"] = glob
        try:
            out = compressor.compress(state, scheme)
        except (ValueError, RuntimeError, AssertionError) as e:
            raise RecycleError(f"{name}: compressed-tensors cannot compress it as {g.format} "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return {f"{module}.{k}": v.contiguous() for k, v in out.items()}


class PackQuantized(CompressedTensors):
    """`pack-quantized`: int codes packed densely into int32 words (int4/int8 W4A16)."""

    name, tag, bits = "ct_pack", "INT4", 4.0
    formats = ("pack-quantized",)
    suffix = "weight_packed"

    def bits_of(self, tag: str) -> float:
        return float(tag.removeprefix("INT"))

    def _packed(self, module: str, g: Group, stored: Mapping[str, Any]) -> Packed | None:
        codes, scale = stored[module + ".weight_packed"], stored[module + ".weight_scale"]
        shape_part = stored.get(module + ".weight_shape")
        if g.type != "int" or not 1 <= g.num_bits <= 8:
            raise RecycleError(f"{module}.weight_packed: pack-quantized holds int codes of 1-8 bits, but its config "
                               f"group {g.key!r} says {g.type} {g.num_bits}-bit")
        if shape_part is None or len(codes.shape) != 2:
            return None  # incomplete: its stored tensors stay visible under their own names
        out, words = codes.shape
        b = g.num_bits
        if 32 % b == 0:
            cols = words * 32 // b  # exact where `in` fills its words (every LLM width); weight_shape checks it
        elif g.strategy == "group" and len(scale.shape) == 2:
            cols = scale.shape[1] * g.group_size
        else:
            raise RecycleError(f"{module}.weight_packed: a {b}-bit {g.strategy} pack-quantized weight's width is "
                               "in its weight_shape tensor, which recycle does not read from headers")
        parts = {"packed": module + ".weight_packed", "scale": module + ".weight_scale",
                 "shape": module + ".weight_shape"}
        zp = stored.get(module + ".weight_zero_point")
        with_zp = not g.symmetric and g.strategy in ("group", "channel")
        if with_zp:
            if zp is None:
                return None
            parts["zero_point"] = module + ".weight_zero_point"
        if module + ".weight_g_idx" in stored:
            parts["g_idx"] = module + ".weight_g_idx"
        p = Packed(module + ".weight", self.name, f"INT{b}", (out, cols), parts)
        self._expect(p, "packed", codes, (out, _divides(cols * b, 32)), "I32")
        self._expect(p, "scale", scale, self._scale_shape(g, out, cols), FLOAT_DTYPES)
        self._expect(p, "shape", shape_part, (2,), frozenset({"I64", "I32"}))
        if with_zp:
            groups = self._scale_shape(g, out, cols)[-1]
            self._expect(p, "zero_point", zp, (_divides(out * b, 32), groups), "I32")
        if "g_idx" in parts:
            self._expect(p, "g_idx", stored[parts["g_idx"]], (cols,), frozenset({"I32", "I64"}))
        return p

    def _check(self, parts: Mapping[str, torch.Tensor], packed: Packed, g: Group) -> None:
        out, cols = packed.shape
        check_shape(packed, "packed", tuple(parts["packed"].shape), (out, _divides(cols * g.num_bits, 32)))
        super()._check(parts, packed, g)
        shape = parts["shape"]
        if shape.numel() != 2 or tuple(int(x) for x in shape.reshape(-1)) != (out, cols):
            raise RecycleError(f"{packed.parts['shape']}: says {shape.reshape(-1).tolist()}, but its headers give "
                               f"[{out}, {cols}] (corrupt, or a width recycle cannot read from headers)")
        if "zero_point" in parts:
            check_shape(packed, "zero_point", tuple(parts["zero_point"].shape),
                        (_divides(out * g.num_bits, 32), self._scale_shape(g, out, cols)[-1]))
        if "g_idx" in parts:
            check_shape(packed, "g_idx", tuple(parts["g_idx"].shape), (cols,))


class NVFP4Packed(CompressedTensors):
    """`nvfp4-pack-quantized`: e2m1 pairs in uint8, an FP8 scale per 16 inputs, one float32 global scale."""

    name, tag, bits = "ct_nvfp4", "NVFP4", 4.0
    formats = ("nvfp4-pack-quantized",)
    suffix = "weight_packed"

    def _packed(self, module: str, g: Group, stored: Mapping[str, Any]) -> Packed | None:
        codes, scale = stored[module + ".weight_packed"], stored[module + ".weight_scale"]
        glob = stored.get(module + ".weight_global_scale")
        if glob is None or len(codes.shape) != 2:
            return None
        if g.type != "float" or g.num_bits != 4:
            raise RecycleError(f"{module}.weight_packed: nvfp4-pack-quantized holds FP4 codes, but its config group "
                               f"{g.key!r} says {g.type} {g.num_bits}-bit")
        out, half = codes.shape
        parts = {"packed": module + ".weight_packed", "scale": module + ".weight_scale",
                 "global_scale": module + ".weight_global_scale"}
        p = Packed(module + ".weight", self.name, self.tag, (out, 2 * half), parts)
        self._expect(p, "packed", codes, (out, half), "U8")
        self._expect(p, "scale", scale, self._scale_shape(g, out, 2 * half), frozenset({"F8_E4M3"}) | FLOAT_DTYPES)
        self._expect(p, "global_scale", glob, (1,), "F32")
        return p

    def _check(self, parts: Mapping[str, torch.Tensor], packed: Packed, g: Group) -> None:
        out, cols = packed.shape
        check_shape(packed, "packed", tuple(parts["packed"].shape), (out, cols // 2))
        check_shape(packed, "global_scale", tuple(parts["global_scale"].shape), (1,))
        super()._check(parts, packed, g)


class _Unpacked(CompressedTensors):
    """Formats whose codes are the `weight` tensor itself, one element per value (FP8, int8)."""

    suffix = "weight"
    code_dtypes: Mapping[str, str] = {"float": "F8_E4M3", "int": "I8"}

    def _packed(self, module: str, g: Group, stored: Mapping[str, Any]) -> Packed | None:
        codes, scale = stored[module + ".weight"], stored[module + ".weight_scale"]
        if len(codes.shape) != 2 or g.num_bits > 8:
            return None
        if codes.dtype in FLOAT_DTYPES:
            return None  # stored unquantized (the audit's business), not this storage
        out, cols = codes.shape
        parts = {"codes": module + ".weight", "scale": module + ".weight_scale"}
        zp = stored.get(module + ".weight_zero_point")
        if not g.symmetric:
            if zp is None:
                return None
            parts["zero_point"] = module + ".weight_zero_point"
        tag = "FP8" if g.type == "float" else f"INT{g.num_bits}"
        p = Packed(module + ".weight", self.name, tag, (out, cols), parts)
        self._expect(p, "codes", codes, (out, cols), self.code_dtypes.get(g.type, "I8"))
        self._expect(p, "scale", scale, self._scale_shape(g, out, cols), FLOAT_DTYPES)
        if "zero_point" in parts:
            self._expect(p, "zero_point", zp, self._scale_shape(g, out, cols),
                         frozenset({"I8", "I32", "F8_E4M3"}) | FLOAT_DTYPES)
        return p

    def _check(self, parts: Mapping[str, torch.Tensor], packed: Packed, g: Group) -> None:
        check_shape(packed, "codes", tuple(parts["codes"].shape), tuple(packed.shape))
        super()._check(parts, packed, g)
        if "zero_point" in parts:
            check_shape(packed, "zero_point", tuple(parts["zero_point"].shape), tuple(parts["scale"].shape))


class FloatQuantized(_Unpacked):
    """`float-quantized`: FP8 e4m3 weights with a float scale per tensor, channel, group or block."""

    name, tag, bits = "ct_float", "FP8", 8.0
    formats = ("float-quantized",)


class NaiveQuantized(_Unpacked):
    """`naive-quantized` and `int-quantized` (its alias for W8A8 int): int8 (or FP8) weights, scale, zero point."""

    name, tag, bits = "ct_naive", "INT8", 8.0
    formats = ("naive-quantized", "int-quantized")


for _codec in (PackQuantized(), NVFP4Packed(), FloatQuantized(), NaiveQuantized()):
    CODECS.add(_codec.name, _codec)
