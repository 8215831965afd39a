"""Stitch into a quantized target of any scheme but block FP8 (issue 48): what each MTP weight is written as, and the
ignore entries that keep the rest BF16 in the engines.

`plan_scheme` is `recycle.converters.overlay.plan_tensors` for a target whose scheme has a record in
`recycle.quant.schemes`: each MTP weight the engine builds quantized is written in the storage `_choose` picks
(`--mtp-dtype auto`: the target's own MTP storage where its config agrees, through the codec's `quantize`, or FP8
blocks; else the record's `writes`) or BF16 named in the scheme's own ignore key (`--mtp-dtype bf16`, or where auto
picks it), every BF16 module checked with the scheme's ignore rule; `_Configs` holds the configs (config.json,
ModelOpt's hf_quant_config.json) with their new entries. The block-FP8 pieces both paths use (`Requant`,
`trunk_dtype`) live here too.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping

import torch

from recycle.checkpoint import DTYPES, QUANT_CONFIG_FILE, ST_NAMES, Checkpoint
from recycle.converters.roles import EXACT, raw
from recycle.errors import RecycleError
from recycle.families import MTPMatch
from recycle.io.writer import Lazy
from recycle.quant import CODECS, expected_scale_shape, module_of, requantize
from recycle.quant.fp8 import modelopt_section
from recycle.quant.schemes import (
    BF16_IGNORE,
    MODELOPT_ALGOS,
    Scheme,
    engine_ignores,
    modelopt_layer_algo,
    vllm_prefix,
)


def as_float(ov: Checkpoint, n: str, want: torch.dtype, row_chunks: int = 1) -> tuple[Lazy, dict]:
    """Overlay tensor `n` written in float dtype `want`: its stored bytes where they already are that, else
    dequantized (`row_chunks`: a pre-sharded fused weight's, `recycle.fused`) or cast; and its record entry."""
    info = ov.tensors[n]
    if not info.quantized and DTYPES[info.dtype][1] == want:
        return raw(ov, n), {"stored": info.dtype, "how": "stored bytes"}
    how = "dequantized" if info.quantized else "cast"
    return Lazy(info.shape, lambda: ov.get(n, row_chunks=row_chunks).to(want), (n,), EXACT, how, dtype=want), \
        {"stored": ST_NAMES[want], "how": how}


def trunk_dtype(tgt: Checkpoint, name: str, fallback: torch.dtype) -> torch.dtype:
    """The float dtype the target stores for MTP tensor `name` itself (its own module, stale), else for the trunk's
    tensor of the same kind (the same name after its first index: norms, router weights, biases; DeepSeek-V4's
    float32 hyper-connection mixing `mtp.0.hc_attn_fn` as `layers.3.hc_attn_fn`), else `fallback` (the target's
    embedding dtype)."""
    own = tgt.tensors.get(name)
    if own is not None and not own.quantized and not own.is_scale:
        dt = DTYPES[own.dtype][1]
        if dt is not None and dt.is_floating_point:
            return dt
    parts = name.split(".")
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    suffix = ".".join(parts[first + 1:]) if first is not None and first + 1 < len(parts) else name
    for other, info in tgt.tensors.items():
        if other.endswith(suffix) and other != name and not info.quantized and not info.is_scale:
            dt = DTYPES[info.dtype][1]
            if dt is not None and dt.is_floating_point:
                return dt
    return fallback


class Requant:
    """One weight re-quantized to the target's FP8 block once, read by two Lazies (the weight and its scale).
    `pow2`: scales rounded up to a power of two (`scale_fmt: ue8m0`, DeepSeek-V4's linears)."""

    def __init__(self, make, block: tuple[int, int], pow2: bool = False, row_chunks: int = 1) -> None:
        self.make, self.block, self.pow2, self.row_chunks, self.done = make, block, pow2, row_chunks, None

    def get(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if self.done is None:
            self.done = requantize(self.make(), self.block, self.pow2, self.row_chunks)
        return self.done


# -- every other scheme (issue 48): the scheme records of `recycle.quant.schemes`, the storage codecs of `CODECS` --

# The ignore keys that hold module names (the rest of a record's keys, `config_groups.*.targets`,
# `quantized_layers`, `modules_in_block_to_quantize`, say what is quantized and are never widened by stitch).
NAME_KEYS = ("ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")
DYNAMIC = "dynamic"  # GPTQ's per-module overrides: a `-:REGEX` key builds the matching layers unquantized
HEADS = ("embed_tokens", "embed", "head", "lm_head")  # vocabulary matrices: the target's own (`_target_copies`)


def _method(tgt: Checkpoint) -> str:
    """The method name a release's config gives, for messages ('awq', 'modelopt', ...)."""
    q = tgt.quant_config
    return str(q.get("quant_method") or modelopt_section(q).get("quant_algo") or "?")


def refuse_scheme(rec: Scheme, tgt: Checkpoint, tm: MTPMatch, mode: str, where: str) -> None:
    """One line, before anything is written, for a target stitch cannot write into safely: a method recycle does
    not know (or names but reads nothing of), a config that does not say what the engine builds, a release whose
    trunk is not stored in the scheme its config declares, and (auto) a scheme whose record writes nothing."""
    method = _method(tgt)
    if not rec.known:
        raise RecycleError(f"{where}: quantized with {method!r} ({rec.title}): {rec.why}; nothing written (never BF16 "
                           "where the engine may quantize). Stitch into the unquantized (BF16) release instead")
    if rec.name == "modelopt":
        if not modelopt_section(tgt.quant_config).get("quant_algo"):
            raise RecycleError(f"{where}: quantized with {method!r} but its ModelOpt config names no quant_algo (vLLM "
                               "refuses it: \"Missing 'quant_algo' in quantization config\", modelopt.py); nothing "
                               "written")
    if rec.codecs:
        mtp = set(tm.mtp_names)
        # asked of the codecs themselves (headers only), whether or not the reader folds their weights
        if not any(any(n not in mtp for n in CODECS.get(c).group(tgt.stored, tgt.quant_config))
                   for c in rec.codecs):
            raise RecycleError(f"{where}: its config declares {method!r} ({rec.title}), but none of its trunk's "
                               f"weights is stored in it (no {', '.join(rec.codecs)} tensors): recycle cannot tell "
                               "what an engine would build; nothing written")
    if mode == "auto" and rec.writes is None:
        fix = "--mtp-dtype bf16 (BF16 with the scheme's ignore entries)" if set(rec.ignore_keys) & {
            *NAME_KEYS, DYNAMIC} else "the unquantized (BF16) release"
        raise RecycleError(f"{where}: quantized with {method!r} ({rec.title}), which --mtp-dtype auto does not write: "
                           f"{rec.why}; use {fix}")


def _plain(tgt: Checkpoint, rec: Scheme, om: MTPMatch) -> set[str]:
    """MTP weights the engine's MTP model builds as plain layers whatever the scheme (eh_proj, ...)."""
    from recycle.quant.schemes import MTP_PLAIN_ROLES, vllm_quant_name

    by_scheme = MTP_PLAIN_ROLES.get(om.family.name, {})
    roles = set(by_scheme.get("*", ())) | set(by_scheme.get(vllm_quant_name(rec, tgt.quant_config), ()))
    return {n for mod in om.modules for r in roles for n in mod.roles.get(r, [])}


def _linear(rec: Scheme, name: str, shape: tuple[int, ...], plain: set[str]) -> bool:
    """Whether an engine builds this weight's layer with the scheme's quant method (before ignore entries): a
    Linear weight (`.weight`, 2-D or fused experts), not a router or other module the record says engines build
    unquantized whatever the config, not a plain layer of the MTP model, not a vocabulary matrix."""
    if not name.endswith(".weight") or len(shape) < 2 or name in plain:
        return False
    module = module_of(name)
    if module.rsplit(".", 1)[-1] in HEADS:
        return False
    return not any(module == u or module.endswith("." + u) or f".{u}." in f"{module}." for u in rec.unquantized)


class _Configs:
    """The target's quantization configs as stitch rewrites them: config.json's `quantization_config` (or its
    text_config's) and ModelOpt's hf_quant_config.json; every form an engine may read is checked by the rule."""

    def __init__(self, rec: Scheme, tgt: Checkpoint) -> None:
        self.rec = rec
        self.config: dict = copy.deepcopy(tgt.config)
        path = tgt.path / QUANT_CONFIG_FILE
        self.hf: dict | None = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        if self.hf is not None and not isinstance(self.hf.get("quantization"), dict):
            self.hf = None
        self.added: dict[str, list[str]] = {}  # "file: key" → the entries stitch added

    def _qc(self) -> dict | None:
        for scope in (self.config, self.config.get("text_config")):
            if isinstance(scope, dict) and isinstance(scope.get("quantization_config"), dict) \
                    and scope["quantization_config"]:
                return scope["quantization_config"]
        return None

    def views(self) -> list[Mapping]:
        """Each config an engine may read (vLLM reads config.json's first, else hf_quant_config.json:
        model_loader/weight_utils.py `get_quant_config`); the rule must say "unquantized" under all of them."""
        qc = self._qc()
        return [v for v in (self.hf, qc) if v is not None]

    def ignored(self, module: str) -> bool:
        return all(engine_ignores(self.rec, module, view) for view in self.views())

    def targets(self) -> list[tuple[str, dict, str]]:
        """(label, the dict holding the key, key) for each ignore key stitch writes for this scheme."""
        keys = [k for k in self.rec.ignore_keys if k in NAME_KEYS or k == DYNAMIC]
        out = []
        qc = self._qc()
        if self.rec.name == "modelopt":  # the legacy file's exclude_modules; config.json's `ignore` (modelopt.py)
            if self.hf is not None:
                out.append((QUANT_CONFIG_FILE, self.hf["quantization"], "exclude_modules"))
            if qc is not None:
                out += [("config.json", qc, k) for k in ("ignore", "exclude_modules") if k == "ignore" or k in qc]
            return out
        return [("config.json", qc, k) for k in keys] if qc is not None else []

    def add(self, entries: list[str]) -> None:
        """`entries` (module names; GPTQ: as anchored `-:` regexes) into every ignore key, existing ones kept."""
        for label, holder, key in self.targets():
            if key == DYNAMIC:
                old = holder.get(DYNAMIC) or {}
                new = [f"-:{re.escape(e)}$" for e in entries if f"-:{re.escape(e)}$" not in old]
                holder[DYNAMIC] = {**dict.fromkeys(new, {}), **old}  # first: a positive key matching first wins
            else:
                old_list = list(holder.get(key) or [])
                new = [e for e in entries if e not in old_list]
                holder[key] = sorted(set(old_list) | set(entries))
            if new:
                self.added.setdefault(f"{label}: {key}", []).extend(new)

    def snapshot(self) -> tuple:
        return copy.deepcopy((self.config, self.hf, self.added))

    def restore(self, snap: tuple) -> None:
        self.config, self.hf, self.added = snap


def _all_ignored(cfg: _Configs, modules: list[str]) -> bool:
    """Whether the rule says every module is built unquantized (a partial fused layer counts as not)."""
    try:
        return all(cfg.ignored(m) for m in modules)
    except RecycleError:
        return False


def _add_ignores(cfg: _Configs, tgt: Checkpoint, modules: list[str], mtp: set[str], where: str) -> list[str]:
    """Ignore entries for the modules written BF16, minimal and exact: per vLLM layer (a fused layer, a routed
    experts' container, else the module), the exact module names, else that layer's own name; then every module
    checked with the scheme's rule. Refuses (nothing written) where the engine would still build one quantized."""
    if not cfg.targets():
        raise RecycleError(f"{where}: {cfg.rec.title} has no ignore key an engine reads for the modules stitch writes "
                           f"BF16 ({', '.join(modules[:3])}...); nothing written")
    if cfg.rec.name == "awq" and not (cfg._qc() or {}).get("modules_to_not_convert"):
        # an empty list makes vLLM infer it from the stored dtypes (auto_awq.py maybe_update_config): once stitch
        # writes entries it no longer does, so the trunk's own unquantized Linears are named too
        kept = sorted({module_of(n) for n, i in tgt.tensors.items()
                       if n not in mtp and n.endswith(".weight") and len(i.shape) == 2 and not i.quantized
                       and module_of(n).rsplit(".", 1)[-1] not in HEADS and "norm" not in n
                       and not any(module_of(n).endswith("." + u) for u in cfg.rec.unquantized)})
        if kept:
            cfg.add(kept)
    layers: dict[str, list[str]] = {}
    for m in sorted(set(modules)):
        layers.setdefault(vllm_prefix(m), []).append(m)
    for layer, members in layers.items():
        if _all_ignored(cfg, members):
            continue
        for entries in (members, [layer]):
            snap = cfg.snapshot()
            cfg.add(entries)
            if _all_ignored(cfg, members):
                break
            cfg.restore(snap)
    for m in modules:
        if not cfg.ignored(m):  # the rule's own one line where vLLM would refuse the layer
            raise RecycleError(f"{where}: with every ignore entry stitch can write ({', '.join(sorted(cfg.added)) or 'none'}"
                               f"), vLLM would still build {m} as {cfg.rec.title} while its weight is written BF16; "
                               "nothing written")
    return sorted({e for v in cfg.added.values() for e in v})


def _declared(rec: Scheme, module: str, q: Mapping) -> str | None:
    """The codec the config itself declares for a module, where it says (None: it does not say)."""
    if rec.name == "compressed_tensors":
        from recycle.quant.ctensors import config_group

        g = config_group(module, q)
        return rec.formats.get(g.format) if g is not None else None
    if rec.name == "modelopt":
        return MODELOPT_ALGOS.get(modelopt_layer_algo(module, q))
    return rec.codecs[0] if len(rec.codecs) == 1 else None


FP8_SCALES = ("weight_scale_inv", "scale", "weight_scale")  # DeepSeek's HF and native names; ModelOpt FP8_PB_WO's


def _fp8_scale(t: Checkpoint, name: str) -> str | None:
    """The local name (after the module) of an FP8 weight's block scale: a scale of 2 dims (or ModelOpt's
    [ob, 1, ib, 1]) beside it, under DeepSeek's or ModelOpt's name. A per-tensor or per-channel scale is none."""
    module = module_of(name)
    for local in FP8_SCALES:
        info = t.stored.get(f"{module}.{local}")
        if info is None or info.dtype not in ("F32", "BF16", "F16", "F8_E8M0"):
            continue
        shape = tuple(info.shape)
        if len(shape) == 4 and shape[1] == shape[3] == 1:
            shape = (shape[0], shape[2])
        if len(shape) == 2 and min(shape) >= 1 and not (shape[0] == t.tensors[name].shape[0] and shape[1] == 1):
            return local
    return None


def _storage(t: Checkpoint, name: str) -> tuple[str, str | None] | None:
    """How a checkpoint stores a weight: ("codec", NAME), ("fp8_block", its scale's local name: DeepSeek's, or a
    `modelopt_fp8` weight's block `weight_scale`), ("float", None), ("other", what) for FP8 scaled in a way recycle
    does not write (ModelOpt's per-tensor and per-channel FP8), or None when it holds no such weight."""
    info = t.tensors.get(name)
    if info is None:
        return None
    if name in t.packed and t.packed[name].codec != "modelopt_fp8":
        return "codec", t.packed[name].codec
    if info.is_fp8 or name in t.packed:  # ModelOpt's FP8 (folded): with a block scale, the FP8 blocks stitch writes
        local = _fp8_scale(t, name)
        return ("fp8_block", local) if local is not None else ("other", "FP8 without a block scale")
    if info.quantized or info.dtype not in ("BF16", "F16", "F32"):
        return "other", info.dtype
    return "float", None


def _suffix(name: str) -> str:
    return name.split(".", 3)[-1] if name.count(".") >= 3 else name


def _fp8_block(t: Checkpoint, weight: str, local: str, where: str) -> tuple[tuple[int, int], tuple[int, ...]]:
    """The FP8 block and the scale's stored shape of a block-FP8 weight `weight` of checkpoint `t` (scale under
    `local`): the config's weight_block_size, else 128×128 (ModelOpt FP8_PB_WO's, modelopt.py:2220-2255), which
    must agree with the stored scale."""
    scale = f"{module_of(weight)}.{local}"
    info = t.stored[scale]
    if info.dtype not in ("F32", "BF16", "F16", "F8_E8M0"):
        raise RecycleError(f"{where}: {scale} is {info.dtype}: recycle writes FP8 block scales as float32 or e8m0; "
                           "use --mtp-dtype bf16")
    b = t.quant_config.get("weight_block_size") or (128, 128)
    block = (int(b[0]), int(b[1]))
    want = expected_scale_shape(t.tensors[weight].shape, block)
    if tuple(info.shape) not in (want, (want[0], 1, want[1], 1)):
        raise RecycleError(f"{where}: {scale} has shape {list(info.shape)}, not the {list(block)} blocks recycle "
                           f"would write for {list(t.tensors[weight].shape)}; nothing written")
    return block, tuple(info.shape)


def _choose(rec: Scheme, tgt: Checkpoint, name: str, kinds: Mapping[str, str], q: Mapping,
            where: str) -> tuple[str, str | None, str]:
    """What --mtp-dtype auto writes for a weight the engine builds quantized: the target's own storage of it where
    it has one the config agrees with (stale MTP included; BF16 gets its ignore entry), else the scheme record's
    `writes` (the trunk's codec for the same kind of weight where the record lists several). Returns (kind,
    detail, why): ("codec", NAME), ("fp8_block", the weight whose scale to copy the form of), ("ignore", None)."""
    declared = _declared(rec, module_of(name), q)
    own = _storage(tgt, name)
    why = ""
    if own is not None:
        kind, detail = own
        if kind == "float":
            return "ignore", None, "the target stores it BF16"
        codec = detail if kind == "codec" else kind
        if kind != "other" and (declared is None or declared == codec):
            return kind, (detail if kind == "codec" else name), "the target's own storage"
        why = (f"the target stored it {codec}, which its config does not declare ({declared}); " if kind != "other"
               else f"the target stored it as {detail}, which recycle does not write; ")
    writes = rec.writes or ()
    codecs = [w for w in writes if w != BF16_IGNORE]
    trunk = kinds.get(_suffix(name))  # the trunk's weight of the same kind
    trunk_st = _storage(tgt, trunk) if trunk is not None else None
    trunk_codec = None if trunk_st is None else trunk_st[1] if trunk_st[0] == "codec" else \
        "fp8_block" if trunk_st[0] == "fp8_block" else None
    pick = next((c for c in (declared, trunk_codec) if c is not None and c in codecs), None)
    if pick is None and len(codecs) == 1 and BF16_IGNORE not in writes:
        pick = codecs[0]
    if pick == "fp8_block":
        if trunk_codec != "fp8_block":
            raise RecycleError(f"{where}: {name}: block FP8 with no stored FP8 weight of its kind to take the block "
                               "from; use --mtp-dtype bf16")
        return "fp8_block", trunk, why + "the scheme's storage for it (the trunk's block FP8)"
    if pick is not None:
        return "codec", pick, why + f"the scheme's storage for it ({pick})"
    if BF16_IGNORE in writes:
        return "ignore", None, why + "the scheme keeps MTP BF16 with an ignore entry"
    raise RecycleError(f"{where}: {name}: {rec.title} has no storage recycle writes for it ({rec.why}); use "
                       "--mtp-dtype bf16")


def _infos(parts: Mapping[str, torch.Tensor]) -> dict:
    """Header facts of tensors made here, for a codec's `group` (name → .dtype, .shape)."""
    from recycle.checkpoint import TensorInfo

    names = {**ST_NAMES, torch.float8_e8m0fnu: "F8_E8M0"}
    return {n: TensorInfo(n, "", names[t.dtype], tuple(t.shape)) for n, t in parts.items()}


def _row_error(back: torch.Tensor, w: torch.Tensor) -> dict:
    """max / mean of |ŵ − w| / max|w| over the weight's row (its last dimension), for the record."""
    amax = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    rel = (back - w).abs() / amax
    return {"max_rel_error": round(float(rel.max()), 6), "mean_rel_error": round(float(rel.mean()), 7)}


class _Encode:
    """One weight written by a codec once (its `quantize`: the scheme's own library where there is one), read by
    the Lazies of its stored parts; read back through the codec's own reader for the error (and to prove the
    reader finds what was written)."""

    def __init__(self, make, name: str, codec: str, config: Mapping) -> None:
        self.make, self.name, self.codec, self.config = make, name, CODECS.get(codec), config
        self.done: dict[str, torch.Tensor] | None = None
        self.error: dict = {}

    def parts(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.codec.quantize(weight, self.name, self.config)

    def get(self) -> dict[str, torch.Tensor]:
        if self.done is None:
            w = self.make().float()
            parts = self.parts(w)
            found = self.codec.group(_infos(parts), self.config).get(self.name)
            if found is None:
                raise RecycleError(f"{self.name}: the {self.codec.name} codec's reader does not find the parts its "
                                   "writer made; nothing written")
            back = self.codec.dequantize({r: parts[s] for r, s in found.parts.items()}, found, self.config,
                                         torch.float32)
            self.error = _row_error(back, w)
            self.done = parts
        return self.done


def _shapes(job: _Encode, shape: tuple[int, ...], cache: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored parts' names, shapes and dtypes a codec writes for a weight of this shape (a probe of ones: the
    header needs them before any tensor is made), keyed by the part's name."""
    key = (job.codec.name, shape, module_of(job.name) if job.codec.name.startswith("ct_") else "")
    if key not in cache:
        cache[key] = {n[len(job.name) - len("weight"):] if n.startswith(job.name[: -len("weight")]) else n:
                      (tuple(t.shape), t.dtype) for n, t in job.parts(torch.ones(shape)).items()}
    base = job.name[: -len("weight")]
    return {base + local: sd for local, sd in cache[key].items()}


def _copy_parts(tgt: Checkpoint, own: str, trunk: str) -> dict[str, Lazy]:
    """The target's packed trunk weight `trunk` stored again under MTP weight `own`: its parts renamed."""
    src, dst = module_of(trunk), module_of(own)
    out = {}
    for part in tgt.packed[trunk].parts.values():
        if not part.startswith(src + "."):
            raise RecycleError(f"{tgt.path}: {part}, a part of {trunk}, is not named under {src}: cannot store it "
                               f"for {own}")
        out[dst + part[len(src):]] = raw(tgt, part)
    return out


def plan_scheme(ov: Checkpoint, tgt: Checkpoint, om: MTPMatch, tm: MTPMatch, rec: Scheme, names: list[str],
                copies: dict[str, str], mode: str, where: str) -> tuple[dict[str, Lazy], dict, _Configs, list[str]]:
    """`plan_tensors` for a target in any other scheme (a `recycle.quant.schemes` record): each MTP weight the
    engine builds quantized is written in the storage `_choose` picks (auto) or BF16 with an ignore entry (bf16,
    or where auto picks it); everything else in the trunk's float dtype. Returns the tensors, the record, the
    configs with their new ignore entries, and the entries added."""
    q = tgt.quant_config
    emb = next((i for n, i in tgt.tensors.items() if "embed" in n and not i.quantized and not i.is_scale), None)
    floats = DTYPES[emb.dtype][1] if emb is not None and DTYPES[emb.dtype][1] is not None else torch.bfloat16
    mtp = set(tm.mtp_names)
    kinds = {_suffix(n): n for n in tgt.tensors if n not in mtp and not tgt.tensors[n].is_scale}  # a trunk weight
    plain = _plain(tgt, rec, om)
    views = _Configs(rec, tgt).views()
    out: dict[str, Lazy] = {}
    record: dict[str, dict] = {}
    bf16: list[str] = []
    probes: dict = {}
    for n in names:
        if n in copies:
            trunk = copies[n]
            if trunk in tgt.packed:
                out.update(_copy_parts(tgt, n, trunk))
            else:
                out[n] = raw(tgt, trunk)
            record[n] = {"stored": tgt.tensors[trunk].dtype, "how": f"the target's {trunk}"}
            continue
        info = ov.tensors[n]
        quantized = _linear(rec, n, info.shape, plain) and not all(engine_ignores(rec, module_of(n), v)
                                                                  for v in views)
        kind, detail, why = ("float", None, "") if not quantized else ("ignore", None, "--mtp-dtype bf16") \
            if mode == "bf16" else _choose(rec, tgt, n, kinds, q, where)
        if kind == "codec":
            job = _Encode(lambda n=n: ov.get(n, torch.float32), n, detail, q)
            for part, (shape, dt) in _shapes(job, tuple(info.shape), probes).items():
                out[part] = Lazy(shape, lambda job=job, part=part: job.get()[part], (n,), EXACT,
                                 f"quantized ({detail})", dtype=dt)
            packed = tgt.packed.get(n)
            for role, part in (packed.parts.items() if packed is not None and packed.codec == detail else ()):
                if part not in out and role.startswith("input"):
                    out[part] = raw(tgt, part)  # the activations' calibration (input_scale): the weight gives none
            record[n] = {"stored": CODECS.get(detail).tag, "how": f"quantized ({detail}): {why}", "error": job}
        elif kind == "fp8_block":  # in the form `detail` (the target's MTP weight, or the trunk's) is stored
            local = _fp8_scale(tgt, detail)
            block, scale_shape = _fp8_block(tgt, detail, local, where)
            if tgt.tensors[detail].shape != info.shape:
                scale_shape = expected_scale_shape(info.shape, block) if len(scale_shape) == 2 else \
                    (expected_scale_shape(info.shape, block)[0], 1, expected_scale_shape(info.shape, block)[1], 1)
            e8m0 = tgt.stored[f"{module_of(detail)}.{local}"].dtype == "F8_E8M0"
            pow2 = e8m0 or str(q.get("scale_fmt", "")).lower() == "ue8m0"  # scales an engine holds as e8m0
            sdt = torch.float8_e8m0fnu if e8m0 else torch.float32
            rq = Requant(lambda n=n: ov.get(n), block, pow2)
            out[n] = Lazy(info.shape, lambda rq=rq: rq.get()[0], (n,), EXACT, "re-quantized to FP8 blocks",
                          dtype=torch.float8_e4m3fn)
            out[f"{module_of(n)}.{local}"] = Lazy(scale_shape, lambda rq=rq, sh=scale_shape, sdt=sdt:
                                                  rq.get()[1].reshape(sh).to(sdt), (n,), EXACT,
                                                  "fresh FP8 block scale", dtype=sdt)
            record[n] = {"stored": "F8_E4M3", "how": f"re-quantized to {block[0]}x{block[1]} FP8 blocks"
                         f"{' (power-of-two scales)' if pow2 else ''}: {why}", "error": rq}
        else:
            want = floats if quantized else trunk_dtype(tgt, n, floats)
            if quantized:
                bf16.append(module_of(n))
            out[n], record[n] = as_float(ov, n, want)
            if quantized:
                record[n]["how"] += f", ignore entry ({why})"
    cfg = _Configs(rec, tgt)
    added = _add_ignores(cfg, tgt, bf16, mtp, where) if bf16 else []
    return out, record, cfg, added
