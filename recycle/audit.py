"""Audit of a checkpoint's MTP weights: layout, shapes, dtypes, FP8 scales and (optionally) health.

Everything but `--stats` works on safetensors headers alone (plus a 64-row sample of each stored
embedding/head copy and its trunk original), so auditing a 690 GB checkpoint reads a few megabytes. Findings carry a severity and a stable code that scripts can match on:

  mtp_declared_missing  config declares MTP modules that are not stored (MiniMax-M2, merged fine-tunes; in a
                        quantized build, its quantizer dropped them: the message says so, and what vLLM does)
  mtp_undeclared        MTP modules are stored but the config does not declare them
  mtp_absent            (info) the family's layout with no MTP module stored or declared (a release that ships
                        none, DeepSeek-V4-Flash-0731; an export that dropped them): `recycle stitch` puts one in
  role_missing          a module lacks a tensor its family requires
  shared_copy_absent    the module stores no embedding/head copy (it must come from the trunk, or is missing)
  shape_mismatch        a tensor's shape disagrees with config (hidden size, vocab, experts)
  fp8_scale_shape       an FP8 weight has no `weight_scale_inv`, or one of the wrong shape
  nan_or_inf            (--stats) a tensor holds NaN or ±inf
  all_zero              (--stats) a weight is entirely zero
  mtp_stale_copy        a module's stored embedding/head copy differs from the trunk's: the trunk moved
                        after the modules were trained (post-training, fine-tune, merge); judged on a
                        sample of 64 rows of each, so it costs a few hundred kB of reading
  unknown_layout        MTP-looking tensors that fit no role of the family
  already_drafter       the checkpoint is a drafter already (Gemma 4 assistant): it drafts as it is, and
                        `convert --to eagle3|medusa --target TARGET_DIR` rewrites it for other engines
  fp8_unscaled_weight   under a block-FP8 quantization_config, a BF16/F32 weight the engine builds as FP8 and
                        no ignore entry (`ignored_layers`/`modules_to_not_convert`) keeps BF16: the engine casts
                        it to e4m3 without a scale (silently wrong drafts, or worse in the trunk)
  fp8_orphan_scale      a `weight_scale_inv` with no weight, or beside a weight that is not FP8
  mtp_quant_differs     the MTP layer is stored in another scheme than the config claims: BF16 (or another
                        codec, vllm#54126's FP8-block MTP under NVFP4) where the engine's ignore rule builds the
                        layer quantized (error; info where the ignore entries keep it BF16, as the config says);
                        quantized tensors with no quantization config to read them by (error)
  mtp_quant_unexpected  an MTP weight stored quantized where the engine builds its module unquantized (an ignore
                        entry, the scheme's always-unquantized modules, or an MTP model's plain `eh_proj`/`fc`)
  quant_scale_shape     a packed weight (any codec but block FP8, which has `fp8_scale_shape`) whose parts its
                        codec refuses when decoding (wrong shape, dtype, byte length), or quantized codes stored
                        without the scale a codec needs to read them
  quant_orphan_scale    a packed weight's part (scale, zero point, global scale, `_scales`) beside no weight a
                        codec reads (the weight went, or was rewritten unquantized)
  mtp_quant_stats       a quantized MTP weight that decodes to NaN/inf (error), or whose RMS is over 4x from the
                        trunk's last layer's same-named weight (warning), on the first rows of each (run when the
                        MTP is quantized under a scheme recycle reads other than block FP8, or with --stats)
  quant_unsupported     a quantization scheme recycle names but does not read (or does not know): the scheme
                        record's own line says what cannot be checked (info)

`recycle inspect --strict` exits 1 when a finding is an error (`Report.worst`), so CI can gate on it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import SHARED_ROLES, MTPMatch, MTPModule, eval_shape, match
from recycle.fused import scale_fits
from recycle.quant import SCALE_SUFFIX, expected_scale_shape

SEVERITIES = ("error", "warning", "info")
# What a family kind (families.Family.kind) holds and what recycle does with it, in words for the report: the
# three kinds are read differently (a chain of modules, heads over one state, a drafter already), and a count
# of "modules found / declared" means something else in each.
KINDS = {
    "mtp": {"unit": "MTP modules", "what": "sequential: each reads the previous depth's state and the next token's "
            "embedding",
            "use": "convert --to eagle|eagle3|medusa makes a drafter of them; bench --native-mtp drafts with them as "
                   "they are"},
    "parallel_heads": {"unit": "prediction heads", "what": "parallel: each reads the trunk's last state, no "
                       "embedding input",
                       "use": "bench --native-mtp drafts with them as they are (one Medusa-style tree per step); "
                              "convert --to medusa makes Medusa heads of them"},
    "drafter": {"unit": "drafter", "what": "no MTP modules of its own: it is a drafter already",
                "use": "bench and distill use it as it is (--target: the model it drafts for); convert --to "
                       "eagle3|medusa --target TARGET_DIR rewrites it for the engines that read those formats"},
}
NORM_ROLES = ("embed_norm", "hidden_norm", "final_norm")
MTP_WORD_LIST = ("mtp", "nextn", "eh_proj", "enorm", "hnorm", "shared_head", "extra_heads")
MTP_WORDS = "(?:" + "|".join(MTP_WORD_LIST) + ")"
# tensor names that look like MTP (a word starting the name or after a dot), as one pattern over the newline-joined
# names: the rule, which `_mtp_looking` applies by `str.find` (a full checkpoint has 92k–145k names)
MTP_LOOKING_LINES = re.compile(r"(?m)^(?:[^\n]*\.)?" + MTP_WORDS + r"[^\n]*$")


@dataclass
class Finding:
    severity: str  # "error" | "warning" | "info"
    code: str
    message: str
    tensor: str | None = None


@dataclass
class TensorStats:
    """Health of one tensor, on dequantized values for FP8."""

    name: str
    role: str
    dtype: str
    shape: list[int]
    finite: bool
    all_zero: bool
    rms: float
    norm: dict | None = None  # norm weights: mean/std/min/max of the effective scale


@dataclass
class Report:
    path: str
    family: str | None
    family_title: str | None
    kind: str | None
    architecture: str | None
    model_type: str | None
    declared: int
    modules: list[dict]
    params_total: int
    params_mtp: int
    bytes_mtp: int
    shards_count: int
    shards_bytes_total: int
    tensors_total: int
    fp8_tensors: int
    findings: list[Finding] = field(default_factory=list)
    stats: list[TensorStats] | None = None

    def add(self, severity: str, code: str, message: str, tensor: str | None = None) -> None:
        self.findings.append(Finding(severity, code, message, tensor))

    @property
    def worst(self) -> str | None:
        levels = {f.severity for f in self.findings}
        return next((s for s in SEVERITIES if s in levels), None)

    def to_json(self) -> dict:
        """The `recycle inspect --json` object (schema documented in README.md)."""
        return {
            "path": self.path,
            "family": self.family,
            "family_title": self.family_title,
            "kind": self.kind,
            "architecture": self.architecture,
            "model_type": self.model_type,
            "holds": KINDS.get(self.kind or ""),
            "worst": self.worst,
            "mtp": {"declared": self.declared, "found": len(self.modules), "modules": self.modules},
            "params": {"total": self.params_total, "mtp": self.params_mtp},
            "bytes": {"mtp": self.bytes_mtp},
            "tensors": {"total": self.tensors_total, "fp8": self.fp8_tensors},
            "shards": {"count": self.shards_count, "bytes_total": self.shards_bytes_total},
            "findings": [asdict(f) for f in self.findings],
            "stats": None if self.stats is None else [asdict(s) for s in self.stats],
        }


def _role_of(module: MTPModule, name: str) -> str:
    return next((r for r, ns in module.roles.items() if name in ns), "block")


def _module_summary(ckpt: Checkpoint, m: MTPMatch, mod: MTPModule) -> dict:
    names = mod.names
    return {
        "index": mod.index,
        "prefix": mod.prefix,
        "roles": {r: list(ns) for r, ns in mod.roles.items()},
        "shared": dict(mod.shared),
        "tensors": len(names),
        "params": ckpt.params(names),
        "bytes": ckpt.nbytes(names),
        "dtypes": dict(Counter(ckpt.tensors[n].dtype for n in names)),
        "fp8": sum(ckpt.tensors[n].is_fp8 for n in names),
        "concat_order": m.family.run.concat_order,
        "norm": m.family.run.norm,
    }


def _check_modules(ckpt: Checkpoint, m: MTPMatch, rep: Report) -> None:
    fam = m.family
    dims = m.dims()
    found = len(m.modules)
    if m.declared and not found:
        rep.add("error", "mtp_declared_missing",
                f"config declares {m.declared} MTP module(s) but no MTP tensors are stored")
    elif found < m.declared:
        rep.add("warning", "mtp_declared_missing", f"config declares {m.declared} MTP module(s), {found} stored")
    elif not found and fam.kind == "mtp":
        rep.add("info", "mtp_absent", f"{fam.title} layout with no MTP module stored or declared: a release that "
                "ships none, or an export that dropped them; `recycle stitch OVERLAY --target THIS` puts one in from "
                "a checkpoint of the same family (convert it --to eagle, distill against this one: docs/stale-mtp.md)")
    elif found > m.declared and fam.kind != "drafter":
        rep.add("warning", "mtp_undeclared",
                f"{found} MTP module(s) stored but config declares {m.declared} "
                f"({'/'.join(fam.keys.depth_keys) or 'no depth key'}); engines will ignore them")
    if fam.kind == "drafter":
        rep.add("info", "already_drafter", f"{fam.title}: already a drafter, with no MTP modules to extract; bench "
                "and distill use it as it is, and convert --to eagle3|medusa --target TARGET_DIR rewrites it")

    # A role is required when the family names it and the trunk cannot stand in for it; a trunk entry of () says the
    # module may go without it (Inkling's chain norm, present only with mtp_config.chain_hidden_post_norm).
    required = [r for r in fam.layout.roles if r not in fam.layout.trunk] + ["block"]
    for mod in m.modules:
        for role in required:
            if role not in mod.roles:
                rep.add("error", "role_missing", f"module {mod.index} has no '{role}' tensor")
        for role in SHARED_ROLES:
            if role in mod.roles or not fam.layout.trunk.get(role):
                continue
            trunk = mod.shared.get(role)
            if trunk is None:
                rep.add("error", "shared_copy_absent",
                        f"module {mod.index} stores no {role} and the trunk has none either "
                        f"(looked for {', '.join(fam.layout.trunk[role])})")
            elif role in fam.layout.stores_copies:
                rep.add("warning", "shared_copy_absent",
                        f"module {mod.index} stores no {role} copy; engines must take the trunk's {trunk}")
        # role shapes
        for role, spec in fam.layout.shapes.items():
            name = mod.tensor(role)
            if name is None or name not in ckpt.tensors:
                continue
            want = eval_shape(spec, dims)
            got = ckpt.tensors[name].shape
            if want is not None and tuple(got) != want:
                rep.add("error", "shape_mismatch",
                        f"{name}: shape {list(got)}, expected {list(want)} ({role}: {' x '.join(spec)} from config)", name)
        # block shapes and expert count
        block = mod.block_names()
        for rel, name in block.items():
            for suffix, spec in fam.layout.block_shapes.items():
                if rel == suffix or rel.endswith("." + suffix):
                    want = eval_shape(spec, dims)
                    got = ckpt.tensors[name].shape
                    if want is not None and tuple(got) != want:
                        rep.add("error", "shape_mismatch",
                                f"{name}: shape {list(got)}, expected {list(want)} from config", name)
        experts = {int(x) for rel in block for x in re.findall(r"experts\.(\d+)\.", rel)}
        if experts and "E" in dims and len(experts) != dims["E"]:
            rep.add("error", "shape_mismatch",
                    f"module {mod.index} stores {len(experts)} routed experts, config says {dims['E']}")
        # FP8 scales
        block_size = ckpt.block_size()
        for name in mod.names:
            info = ckpt.tensors[name]
            if not info.is_fp8:
                continue
            scale = ckpt.scale_for(name)
            if scale is None:
                rep.add("error", "fp8_scale_shape", f"{name}: FP8 weight without {name}_scale_inv", name)
            elif len(info.shape) >= 2 and not scale_fits(name, info.shape, scale.shape, fam.layout.fused, m.config,
                                                         block_size):
                rep.add("error", "fp8_scale_shape",
                        f"{scale.name}: shape {list(scale.shape)}, expected "
                        f"{list(expected_scale_shape(info.shape, block_size))} for {list(info.shape)} "
                        f"in {block_size[0]}x{block_size[1]} blocks", scale.name)

    _check_copies(ckpt, m, rep)
    _check_quantization(ckpt, m, rep)
    claimed = set(m.mtp_names)
    stray = [name for name in _mtp_looking(ckpt.tensors) if name not in claimed]
    if stray:
        rep.add("warning", "unknown_layout",
                f"{len(stray)} MTP-looking tensor(s) fit no role of {fam.name}: {', '.join(stray[:3])}"
                + (" ..." if len(stray) > 3 else ""), stray[0])


def _mtp_looking(names: Iterable[str]) -> list[str]:
    """The names that look like MTP (`MTP_LOOKING_LINES`: an MTP word starting the name or after a dot), in order:
    each word found in the joined names by `str.find`, so the cost is the few names that hold one, not a regular
    expression tried at every character of 145k names (DeepSeek-V4-Pro)."""
    text = "\n" + "\n".join(names) + "\n"
    starts: set[int] = set()
    for word in MTP_WORD_LIST:
        at = text.find(word)
        while at != -1:
            if text[at - 1] in "\n.":
                starts.add(text.rfind("\n", 0, at) + 1)
            at = text.find(word, at + 1)
    return [text[s:text.index("\n", s)] for s in sorted(starts)]


def _check_block_fp8(ckpt: Checkpoint, m: MTPMatch, rep: Report) -> None:
    """The layouts that load silently wrong in an FP8 engine (recycle.quant says what an engine builds as FP8)."""
    from recycle.quant import engine_fp8, ignore_entries, scheme
    from recycle.quant.fp8 import any_engine_fp8_part

    try:
        fp8 = scheme(ckpt.config, str(ckpt.path))
    except RecycleError as e:
        rep.add("info", "quant_unsupported", str(e).split(": ", 1)[-1])
        return
    text = "\n".join(ckpt.tensors) + "\n"  # whether any name ends with a scale's suffix: one search, not 145k calls
    for name in ckpt.tensors if SCALE_SUFFIX + "\n" in text else ():
        if name.endswith(SCALE_SUFFIX):  # TensorInfo.is_scale, without a property call a tensor
            weight = ckpt.tensors.get(name[: -len(SCALE_SUFFIX)])
            if weight is None or not weight.is_fp8:
                what = "no weight" if weight is None else f"a {weight.dtype} weight"
                rep.add("error", "fp8_orphan_scale", f"{name}: a scale beside {what} (a stale scale)", name)
    mtp = set(m.mtp_names)
    linears = [n for n in mtp if engine_fp8(n, ckpt.tensors[n].shape)]
    if fp8 is None:
        stored = [n for n in linears if ckpt.tensors[n].is_fp8]
        if stored:
            rep.add("error", "mtp_quant_differs", f"{len(stored)} MTP weight(s) stored FP8 with no FP8 "
                    f"quantization_config to read them by (first: {stored[0]})", stored[0])
        return
    ignored = set(fp8.ignored)
    linear_parts = any_engine_fp8_part(ckpt.tensors)  # else no name is one an engine builds FP8
    unscaled = [n for n, i in (ckpt.tensors.items() if linear_parts else ()) if not i.is_fp8
                and engine_fp8(n, i.shape) and not set(ignore_entries([n])) <= ignored]
    for n in unscaled[:3]:
        rep.add("error", "fp8_unscaled_weight", f"{n}: {ckpt.tensors[n].dtype} under the FP8 config, not in its ignore "
                "list: the engine casts it to e4m3 without a scale", n)
    if len(unscaled) > 3:
        rep.add("error", "fp8_unscaled_weight", f"... and {len(unscaled) - 3} more such weights", unscaled[3])
    kept = [n for n in linears if not ckpt.tensors[n].is_fp8 and set(ignore_entries([n])) <= ignored]
    if kept:
        rep.add("info", "mtp_quant_differs", f"the MTP layer's {len(kept)} linear weights are BF16 under the FP8 trunk, "
                "named in the ignore list", kept[0])


# -- quantized builds: the MTP against the scheme its config declares (recycle.quant.schemes' records) -------------

BLOCK_FP8_SCHEMES = ("fp8_block", "deepseek_v4")  # read by `_check_block_fp8`, as before the scheme records
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# stored dtypes of packed codes (int or u8 words, FP4), and the names a quantized weight's codes go by
CODE_DTYPES = frozenset({"U8", "I8", "I16", "I32", "U32", "F4"})
CODE_NAMES = (".weight", ".qweight", ".weight_packed", "_blocks")
EXPERT_INDEX = re.compile(r"experts\.\d+\.")
# `mtp_quant_stats`: how many MTP weights (one per name, experts collapsed), how many decoded elements of each (its
# first rows), the most elements read whole where a codec's parts cannot be cut by rows, and the RMS ratio flagged
QUANT_STATS_WEIGHTS = 12
QUANT_STATS_ELEMENTS = 1 << 16
QUANT_STATS_WHOLE = 1 << 24
RMS_RATIO = 4.0
# transformers loads a release into a class without MTP modules and drops their tensors on load (5.23:
# DeepseekV3ForCausalLM `_keys_to_ignore_on_load_unexpected = [r"model\.layers\.61.*"]`, modeling_deepseek_v3.py:551;
# Glm4Moe 460, Qwen3-Next/Qwen3.5 `^mtp.*`); a quantizer that loads through it (llm-compressor, ModelOpt's HF
# export) saves the state dict it has, without them
DROPPED = ("this {title} build's quantizer dropped them (llm-compressor and ModelOpt load the release through "
           "transformers, whose model class drops the MTP tensors on load: `_keys_to_ignore_on_load_unexpected`, e.g. "
           "modeling_deepseek_v3.py:551, so the quantized save has none); vLLM 0.32: {missing}")


def _check_quantization(ckpt: Checkpoint, m: MTPMatch, rep: Report) -> None:
    """The MTP against the scheme the config declares (`recycle.quant.schemes.detect`): block FP8 as it always was
    (`_check_block_fp8`); every other scheme by its record: what vLLM builds quantized (the scheme's ignore rule,
    its always-unquantized modules, the MTP model's plain projection) against how each MTP weight is stored, each
    mismatch with the engine behaviour the record cites. Headers only."""
    from recycle.quant.schemes import BY_NAME, detect

    sch = detect(ckpt.config, ckpt.path)
    if sch is None or (sch.known and sch.codecs):  # under a scheme recycle does not read, no codec claims anything
        _check_parts(ckpt, rep)
    if sch is not None:
        missing = sch.engine_behaviour.get("missing")
        for f in rep.findings:
            if f.code == "mtp_declared_missing" and f.severity == "error" and missing:
                f.message += "; " + DROPPED.format(title=sch.title, missing=missing)
    if sch is None or sch.name in BLOCK_FP8_SCHEMES:
        _check_block_fp8(ckpt, m, rep)
        if sch is None:
            packed = [n for n in m.mtp_names if n in ckpt.packed]
            if packed:
                rep.add("error", "mtp_quant_differs", f"{len(packed)} MTP weight(s) stored "
                        f"{ckpt.packed[packed[0]].tag} ({ckpt.packed[packed[0]].codec}) with no quantization config "
                        f"to read them by (first: {packed[0]}): engines load the packed codes as plain weights, or "
                        "refuse their scales", packed[0])
        return
    if not sch.known or not sch.codecs:
        engine = "" if sch.name in BY_NAME else f"; vLLM 0.32: {sch.engine_behaviour.get('missing', '')}"
        rep.add("info", "quant_unsupported", f"quantized with {sch.title}: {sch.why}{engine}")
        return
    _check_scheme(ckpt, m, rep, sch)


def _storage(ckpt: Checkpoint, name: str) -> str | None:
    """How a weight is stored: its codec's name, "fp8_block" (an FP8 weight with its block scale), "fp8" (FP8
    with a scale no codec reads), "codes" (packed codes no codec reads), None (float: unquantized)."""
    p = ckpt.packed.get(name)
    if p is not None:
        return p.codec
    info = ckpt.tensors[name]
    if info.is_fp8:
        return "fp8_block" if ckpt.scale_for(name) is not None else "fp8"
    return None if info.dtype in FLOAT_DTYPES else "codes"


def _expected_codecs(sch, config: Mapping) -> tuple[str, ...]:
    """The storages vLLM creates a quantized layer of this scheme in: the record's codecs; ModelOpt by its
    quant_algo (NVFP4 → nvfp4, FP8 → FP8 weights, ModelOpt's `modelopt_fp8` among them; MIXED_PRECISION: per
    layer, any of the record's)."""
    from recycle.quant.schemes import vllm_quant_name

    if sch.name == "modelopt":
        name = vllm_quant_name(sch, config)
        if name == "modelopt_fp4":
            return ("nvfp4",)
        if name == "modelopt":
            return ("modelopt_fp8", "fp8_block", "fp8")
        return (*sch.codecs, "fp8")
    return tuple(sch.codecs)


def _module_codecs(sch, config: Mapping, module: str, info, expected: tuple[str, ...]) -> tuple[str, ...]:
    """A compressed-tensors module's own storage: the codec of its config group's format (`ctensors.config_group`,
    as the codecs resolve it); a ModelOpt MIXED_PRECISION layer's, by its `quantized_layers` algo (its FP8 forms
    all read as `modelopt_fp8`); every other scheme's, `expected`."""
    if sch.name == "modelopt":
        from recycle.quant.schemes import MODELOPT_ALGOS, modelopt_layer_algo

        algo = modelopt_layer_algo(module, config)
        codec = MODELOPT_ALGOS.get(algo)
        if codec == "nvfp4":
            return ("nvfp4",)
        return ("modelopt_fp8", "fp8_block", "fp8") if algo.startswith("FP8") else expected
    if sch.name != "compressed_tensors" or not sch.formats:
        return expected
    from recycle.quant.ctensors import config_group

    g = config_group(module, config, len(info.shape) == 2)
    return (sch.formats[g.format],) if g is not None and g.format in sch.formats else expected


def _check_scheme(ckpt: Checkpoint, m: MTPMatch, rep: Report, sch) -> None:
    """Each MTP linear weight (`proj` and the block's) against what vLLM builds for its module under `sch`."""
    from recycle.quant import module_of
    from recycle.quant.schemes import MTP_PLAIN_ROLES, engine_ignores, scheme_config, vllm_quant_name

    config = scheme_config(ckpt.config, ckpt.path)
    plain_roles = MTP_PLAIN_ROLES.get(m.family.name, {})
    plain_roles = set(plain_roles.get("*", ())) | set(plain_roles.get(vllm_quant_name(sch, config), ()))
    expected = _expected_codecs(sch, config)
    keys = "/".join(sch.ignore_keys) or "no ignore key"
    # awq: with modules_to_not_convert empty vLLM builds unquantized whatever is stored unquantized
    # (auto_awq.py:370-388, the record's bf16_where_quantized line)
    by_dtype = sch.name == "awq" and not config.get("modules_to_not_convert")
    groups: dict[tuple[str, str], list[str]] = {}
    why_plain: dict[str, str] = {}
    for mod in m.modules:
        for role in ("proj", "block"):
            for name in mod.roles.get(role, []):
                info = ckpt.tensors[name]
                if name not in ckpt.packed and (len(info.shape) < 2 or not name.endswith(".weight") or info.is_scale):
                    continue
                stored = _storage(ckpt, name)
                if stored == "codes":
                    continue  # no codec reads it: `_check_parts` says so
                module = module_of(name)
                try:
                    if role in plain_roles:
                        why = (f"vLLM's {m.family.name} MTP model builds its {role} as a plain Linear without the "
                               "quant config")
                    elif any(f".{u}." in f".{module}." for u in sch.unquantized):
                        why = f"the {sch.title} scheme builds it unquantized"
                    elif engine_ignores(sch, module, config):
                        why = f"named by the ignore rule ({keys})"
                    else:
                        why = None
                except RecycleError as e:
                    rep.add("error", "mtp_quant_differs", f"{name}: {e}", name)
                    continue
                want = expected if why is not None or stored is None else _module_codecs(sch, config, module, info,
                                                                                         expected)
                if why is None and stored is None and not by_dtype:
                    kind = "bf16"
                elif why is None and stored is not None and stored not in want:
                    kind = f"other:{stored}:{'/'.join(want)}"
                elif why is not None and stored is not None:
                    kind = "unexpected:" + stored
                    why_plain.setdefault(kind, why)
                elif why is not None and stored is None and role == "block" and why.startswith("named"):
                    kind = "ignored"
                else:
                    continue
                groups.setdefault((kind, role), []).append(name)
    behaviour = sch.engine_behaviour
    for (kind, role), names in groups.items():
        first = names[0]
        what = f"{len(names)} MTP {role} weight(s)"
        if kind == "bf16":
            rep.add("error", "mtp_quant_differs", f"{what} stored {ckpt.tensors[first].dtype} under the {sch.title} "
                    f"config, not excluded by its ignore rule ({keys}) (first: {first}): in vLLM 0.32, "
                    f"{behaviour.get('bf16_where_quantized', 'creates the layer quantized')}; drafts from such a "
                    "layer are garbage (acceptance near 0)", first)
        elif kind.startswith("other:"):
            p = ckpt.packed.get(first)
            tag = p.tag if p else ckpt.tensors[first].dtype
            _, stored, want = kind.split(":")
            rep.add("error", "mtp_quant_differs", f"{what} stored as {stored} ({tag}) under the {sch.title} config, "
                    f"whose layers vLLM creates as {want} (first: {first}): vLLM 0.32 creates the layer "
                    "in the config's scheme and the stored parts do not fit it (vllm#54126: FP8-block MTP experts "
                    f"under an NVFP4 config fail to load); {behaviour.get('bf16_where_quantized', '')}", first)
        elif kind.startswith("unexpected:"):
            rep.add("error", "mtp_quant_unexpected", f"{what} stored as {kind[11:]} where vLLM builds the module "
                    f"unquantized ({why_plain[kind]}) (first: {first}): in vLLM 0.32, "
                    f"{behaviour.get('quantized_where_unquantized', 'creates it in the model dtype')}", first)
        else:
            rep.add("info", "mtp_quant_differs", f"{what} kept {ckpt.tensors[first].dtype} under the {sch.title} "
                    f"config, named by its ignore entries ({keys}): engines build them unquantized", first)


def _check_parts(ckpt: Checkpoint, rep: Report) -> None:
    """A packed weight's parts without their weight, and quantized codes without the scale a codec needs: what no
    codec claimed stays in `Checkpoint.tensors` under its stored name. The parts' names are learnt from the packed
    weights this checkpoint has (`qzeros`, `weight_scale_2`, `_scales`, ...). One pass over the names."""
    suffixes: set[str] = set()
    for i, (logical, p) in enumerate(ckpt.packed.items()):
        if i >= 256:
            break
        base = logical[: -len(".weight")] if logical.endswith(".weight") else logical
        suffixes.update(part[len(base):] for role, part in p.parts.items()
                        if role != "codes" and part.startswith(base) and part[len(base):len(base) + 1] in (".", "_"))
    ends = tuple(sorted(suffixes))
    orphans: list[str] = []
    unread: list[str] = []
    for name, info in ckpt.tensors.items():
        if ends and name.endswith(ends):
            end = next(e for e in ends if name.endswith(e))
            base = name[: -len(end)]
            owners = (base + ".weight", base)
            if not any(o in ckpt.packed or (o in ckpt.tensors and ckpt.tensors[o].is_fp8) for o in owners):
                orphans.append(name)
                continue
        if info.dtype in CODE_DTYPES and len(info.shape) >= 2 and name.endswith(CODE_NAMES) and name not in ckpt.packed:
            unread.append(name)
    for name in orphans[:3]:
        info = ckpt.tensors[name]
        rep.add("error", "quant_orphan_scale", f"{name}: a packed weight's part ({info.dtype} {list(info.shape)}) "
                "beside no weight a codec reads: its weight went, or was rewritten unquantized (a stale part)", name)
    if len(orphans) > 3:
        rep.add("error", "quant_orphan_scale", f"... and {len(orphans) - 3} more such parts", orphans[3])
    for name in unread[:3]:
        info = ckpt.tensors[name]
        rep.add("error", "quant_scale_shape", f"{name}: {info.dtype} {list(info.shape)} codes that no codec reads: "
                "a quantized weight without its scale (or in a storage recycle does not know); engines cannot "
                "dequantize it", name)
    if len(unread) > 3:
        rep.add("error", "quant_scale_shape", f"... and {len(unread) - 3} more such weights", unread[3])


def _check_quant_stats(ckpt: Checkpoint, m: MTPMatch, rep: Report, stats: bool) -> None:
    """`mtp_quant_stats`: the MTP's quantized weights decoded (their first rows) against the same-named weights of
    the trunk's last layer: NaN/inf, or an RMS over RMS_RATIO apart, says the bytes do not decode to sane weights (a
    wrong scale convention, mislabelled codes). A codec that refuses the parts is a `quant_scale_shape` finding.
    Runs with --stats, or when the MTP holds quantized weights under a scheme recycle reads other than block FP8."""
    quantized = {n for n in m.mtp_names if ckpt.tensors[n].quantized and not ckpt.tensors[n].is_scale}
    if not quantized:
        return
    if not stats:
        from recycle.quant.schemes import detect

        sch = detect(ckpt.config, ckpt.path)
        if sch is None or sch.name in BLOCK_FP8_SCHEMES or not sch.known:
            return  # unquantized configs and block FP8 stay on headers, as they always were
    picks: dict[str, tuple[str, str]] = {}
    for mod in m.modules:
        for rel, name in mod.block_names().items():
            if name in quantized:
                picks.setdefault(EXPERT_INDEX.sub("experts.*.", rel), (rel, name))
    chosen = list(picks.values())[:QUANT_STATS_WEIGHTS]
    twins = _trunk_twins(ckpt, m, [rel for rel, _ in chosen])
    failed = {f.tensor for f in rep.findings if f.code in ("quant_scale_shape", "fp8_scale_shape")}
    for rel, name in chosen:
        twin = twins.get(rel)
        if name in failed or twin is None or ckpt.tensors[twin].shape != ckpt.tensors[name].shape:
            continue
        got = []
        for n in (name, twin):
            try:
                got.append(_head_values(ckpt, n))
            except RecycleError as e:
                rep.add("error", "quant_scale_shape", f"{n}: its stored parts do not decode: {e}", n)
                break
        if len(got) < 2 or got[0] is None or got[1] is None:
            continue
        (ra, fa), (rb, fb) = got
        if not fa:
            rep.add("error", "mtp_quant_stats", f"{name}: decodes to NaN or inf values (its first rows): corrupt "
                    "codes or scales; the engine drafts garbage from it", name)
        elif max(ra, rb) > RMS_RATIO * max(min(ra, rb), 1e-30) and max(ra, rb) > 0:
            rep.add("warning", "mtp_quant_stats", f"{name}: RMS {ra:.3g} against {rb:.3g} for the trunk's {twin} "
                    f"(over {RMS_RATIO:g}x apart, on the first rows of each): its bytes may not decode to the weights "
                    "they were (a wrong scale or codec)", name)


def _trunk_twins(ckpt: Checkpoint, m: MTPMatch, rels: list[str]) -> dict[str, str]:
    """rel → the trunk's last decoder layer's tensor of that name (`model.layers.{L-1}.` + rel, `layers.{L-1}.`
    + rel, ...): the highest-numbered non-MTP layer that stores it. One pass over the names."""
    if not rels:
        return {}
    mtp = set(m.mtp_names)
    ends = tuple("." + r for r in rels)
    best: dict[str, tuple[int, str]] = {}
    for name in ckpt.tensors:
        if not name.endswith(ends) or name in mtp:
            continue
        rel = next(r for r in rels if name.endswith("." + r))
        head = name[: -len(rel)]
        idx = re.search(r"(\d+)\.$", head)
        if idx and int(idx.group(1)) >= best.get(rel, (-1, ""))[0]:
            best[rel] = (int(idx.group(1)), name)
    return {rel: name for rel, (_, name) in best.items()}


def _head_values(ckpt: Checkpoint, name: str) -> tuple[float, bool] | None:
    """(RMS of the finite values, all finite) of a weight's first rows (about QUANT_STATS_ELEMENTS values),
    decoded; None where that would mean reading more than QUANT_STATS_WHOLE values whole. RecycleError when the
    codec refuses the stored parts (a corrupt or mislabelled packed tensor)."""
    try:
        t = _head(ckpt, name)
    except (ValueError, RuntimeError, IndexError) as e:
        raise RecycleError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if t is None:
        return None
    a = np.asarray(t.detach().contiguous().numpy(), dtype=np.float64)  # numpy: torch's small ops wait on threads
    ok = np.isfinite(a)
    vals = a[ok]
    return (float(np.sqrt(np.mean(vals * vals))) if vals.size else 0.0), bool(ok.all())


def _head(ckpt: Checkpoint, name: str):
    """A weight's first rows as float32: a row chunk of a float or FP8 weight; for a packed weight, the first rows
    of each part that is cut by the weight's rows (its scalars whole), decoded by its codec; whole where the parts
    are not cut by rows (AWQ/GPTQ's transposed words), or where the cut parts do not decode (then the whole tells)."""
    import torch  # made here: headers alone need no torch

    from recycle.quant import CODECS

    p = ckpt.packed.get(name)
    if p is None:
        return next(iter(ckpt.iter_chunks(name, QUANT_STATS_ELEMENTS)))
    lead = p.shape[0]
    rows = max(1, min(lead, QUANT_STATS_ELEMENTS // max(1, math.prod(p.shape[1:]))))
    infos = {role: ckpt.stored[part] for role, part in p.parts.items()}
    cut = len(p.shape) >= 2 and rows < lead and all(
        (i.shape and i.shape[0] == lead) or math.prod(i.shape) <= 1 for i in infos.values())
    codec = CODECS.get(p.codec)
    if cut:
        parts = {role: ckpt.head(i.name, rows) if i.shape and i.shape[0] == lead else ckpt.raw(i.name)
                 for role, i in infos.items()}
        try:
            return codec.dequantize(parts, p._replace(shape=(rows, *p.shape[1:])), ckpt.quant_config, torch.float32)
        except (RecycleError, ValueError, RuntimeError, IndexError):
            pass  # decided on the whole weight below
    if math.prod(p.shape) > QUANT_STATS_WHOLE:
        return None
    return ckpt.get(name, torch.float32)


STALE_TOLERANCE = 1e-3  # relative difference of sampled rows above which a copy is not the trunk's tensor


def _check_copies(ckpt: Checkpoint, m: MTPMatch, rep: Report) -> None:
    """Stored embedding/head copies against the trunk's own tensors, on sampled rows."""
    fam = m.family
    for mod in m.modules:
        for role in ("embed", "head"):
            own = mod.tensor(role) if role in mod.roles else None
            trunk = next((n for n in fam.layout.trunk.get(role, ()) if n in ckpt.tensors), None)
            if own is None or trunk is None or ckpt.tensors[own].shape != ckpt.tensors[trunk].shape:
                continue
            a, b = ckpt.sample_rows(own), ckpt.sample_rows(trunk)
            if a is None or b is None:
                continue
            diff = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-12))
            if diff > STALE_TOLERANCE:
                rep.add("warning", "mtp_stale_copy",
                        f"module {mod.index}'s {role} copy differs from the trunk's {trunk} (relative difference "
                        f"{diff:.2f} on sampled rows): the trunk moved after the MTP modules were trained, and "
                        "engines that read the copies draft with stale ones (`recycle stitch` writes the trunk's; "
                        "`recycle distill` re-aligns the module)", own)


def _tensor_stats(ckpt: Checkpoint, name: str, role: str, norm_style: str) -> TensorStats:
    info = ckpt.tensors[name]
    n = 0
    sq = 0.0
    finite = True
    zero = True
    mn = mx = None
    s1 = s2 = 0.0
    is_norm = role in NORM_ROLES or (len(info.shape) == 1 and name.endswith("norm.weight"))
    for chunk in ckpt.iter_chunks(name):
        chunk = chunk.float()
        ok = chunk.isfinite()
        finite = finite and bool(ok.all())
        zero = zero and bool((chunk == 0).all())
        vals = chunk[ok].double()
        n += vals.numel()
        sq += float((vals * vals).sum())
        if is_norm and vals.numel():
            eff = vals + 1 if norm_style == "1+w" else vals
            s1 += float(eff.sum())
            s2 += float((eff * eff).sum())
            mn = float(eff.min()) if mn is None else min(mn, float(eff.min()))
            mx = float(eff.max()) if mx is None else max(mx, float(eff.max()))
    rms = math.sqrt(sq / n) if n else float("nan")
    norm = None
    if is_norm and n:
        mean = s1 / n
        norm = {"mean": mean, "std": math.sqrt(max(0.0, s2 / n - mean * mean)), "min": mn, "max": mx,
                "convention": norm_style}
    return TensorStats(name, role, info.dtype, list(info.shape), finite, zero, rms, norm)


def inspect_checkpoint(
    path: str | Path, stats: bool = False, progress: Callable[[int, int], None] | None = None,
    family: str | None = None,
) -> Report:
    """Audit a checkpoint directory. Reads headers only unless `stats` is set (then only MTP tensors)."""
    ckpt = Checkpoint(path, family)
    m = match(ckpt, strict=False)
    archs = ckpt.config.get("architectures") or []
    rep = Report(
        path=str(ckpt.path),
        family=m.family.name,
        family_title=m.family.title,
        kind=m.family.kind,
        architecture=archs[0] if archs else None,
        model_type=ckpt.config.get("model_type"),
        declared=m.declared,
        modules=[_module_summary(ckpt, m, mod) for mod in m.modules],
        params_total=ckpt.params(),
        params_mtp=ckpt.params(m.mtp_names),
        bytes_mtp=ckpt.nbytes(m.mtp_names),
        shards_count=len(ckpt.files),
        shards_bytes_total=ckpt.bytes_total,
        tensors_total=len(ckpt.tensors),
        fp8_tensors=sum(i.is_fp8 for i in ckpt.tensors.values()),
    )
    if m.conflict:  # the tensors say one row, config.json another (or none): not taken without --family
        rep.add("error", "family_conflict", m.conflict.split(": ", 1)[1])
    _check_modules(ckpt, m, rep)
    _check_quant_stats(ckpt, m, rep, stats)
    if stats:
        rep.stats = []
        todo = [(mod, n) for mod in m.modules for n in mod.names if not ckpt.tensors[n].is_scale]
        seen: set[str] = set()
        todo = [(mod, n) for mod, n in todo if not (n in seen or seen.add(n))]
        bad_scales = {f.tensor for f in rep.findings if f.code == "fp8_scale_shape"}
        # an FP8 weight whose scale is missing or misshapen cannot be dequantized: already reported
        todo = [(mod, n) for mod, n in todo if n not in bad_scales and n + "_scale_inv" not in bad_scales]
        for i, (mod, name) in enumerate(todo):
            role = _role_of(mod, name)
            try:
                st = _tensor_stats(ckpt, name, role, m.family.run.norm)
            except (ValueError, RuntimeError, IndexError) as e:  # a codec's arithmetic on corrupt parts: one line
                raise RecycleError(f"{name}: its stored parts do not decode ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''})") from None
            rep.stats.append(st)
            if not st.finite:
                rep.add("error", "nan_or_inf", f"{name} holds NaN or inf values", name)
            elif st.all_zero and not name.endswith("bias") and not (st.norm and m.family.run.norm == "1+w"):
                rep.add("warning", "all_zero", f"{name} is all zeros (untrained or wiped weights?)", name)
            if progress:
                progress(i + 1, len(todo))
    return rep
