"""Audit of a checkpoint's MTP weights: layout, shapes, dtypes, FP8 scales and (optionally) health.

Everything but `--stats` works on safetensors headers alone (plus a 64-row sample of each stored
embedding/head copy and its trunk original), so auditing a 690 GB checkpoint reads a few megabytes. Findings carry a severity and a stable code that scripts can match on:

  mtp_declared_missing  config declares MTP modules that are not stored (MiniMax-M2, merged fine-tunes)
  mtp_undeclared        MTP modules are stored but the config does not declare them
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
  mtp_quant_differs     the MTP layer is stored in another scheme than the trunk (BF16 under an FP8 trunk: info
                        when the ignore list says so; FP8 tensors without an FP8 config: an error)
  quant_unsupported     a quantization method recycle reads but cannot write MTP tensors into (info)

`recycle inspect --strict` exits 1 when a finding is an error (`Report.worst`), so CI can gate on it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import SHARED_ROLES, MTPMatch, MTPModule, eval_shape, match
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
MTP_WORDS = r"(?:mtp|nextn|eh_proj|enorm|hnorm|shared_head|extra_heads)"
# tensor names that look like MTP (a word starting the name or after a dot), found in a newline-joined name list in
# one scan (a full checkpoint has 92k–145k names)
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
        "concat_order": m.family.concat_order,
        "norm": m.family.norm,
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
    elif found > m.declared and fam.kind != "drafter":
        rep.add("warning", "mtp_undeclared",
                f"{found} MTP module(s) stored but config declares {m.declared} "
                f"({'/'.join(fam.depth_keys) or 'no depth key'}); engines will ignore them")
    if fam.kind == "drafter":
        rep.add("info", "already_drafter", f"{fam.title}: already a drafter, with no MTP modules to extract; bench "
                "and distill use it as it is, and convert --to eagle3|medusa --target TARGET_DIR rewrites it")

    # A role is required when the family names it and the trunk cannot stand in for it; a trunk entry of () says the
    # module may go without it (Inkling's chain norm, present only with mtp_config.chain_hidden_post_norm).
    required = [r for r in fam.roles if r not in fam.trunk] + ["block"]
    for mod in m.modules:
        for role in required:
            if role not in mod.roles:
                rep.add("error", "role_missing", f"module {mod.index} has no '{role}' tensor")
        for role in SHARED_ROLES:
            if role in mod.roles or not fam.trunk.get(role):
                continue
            trunk = mod.shared.get(role)
            if trunk is None:
                rep.add("error", "shared_copy_absent",
                        f"module {mod.index} stores no {role} and the trunk has none either "
                        f"(looked for {', '.join(fam.trunk[role])})")
            elif role in fam.stores_copies:
                rep.add("warning", "shared_copy_absent",
                        f"module {mod.index} stores no {role} copy; engines must take the trunk's {trunk}")
        # role shapes
        for role, spec in fam.shapes.items():
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
            for suffix, spec in fam.block_shapes.items():
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
            elif len(info.shape) >= 2 and tuple(scale.shape) != expected_scale_shape(info.shape, block_size):
                rep.add("error", "fp8_scale_shape",
                        f"{scale.name}: shape {list(scale.shape)}, expected "
                        f"{list(expected_scale_shape(info.shape, block_size))} for {list(info.shape)} "
                        f"in {block_size[0]}x{block_size[1]} blocks", scale.name)

    _check_copies(ckpt, m, rep)
    _check_quantization(ckpt, m, rep)
    claimed = set(m.mtp_names)
    stray = [mt.group(0) for mt in MTP_LOOKING_LINES.finditer("\n".join(ckpt.tensors)) if mt.group(0) not in claimed]
    if stray:
        rep.add("warning", "unknown_layout",
                f"{len(stray)} MTP-looking tensor(s) fit no role of {fam.name}: {', '.join(stray[:3])}"
                + (" ..." if len(stray) > 3 else ""), stray[0])


def _check_quantization(ckpt: Checkpoint, m: MTPMatch, rep: Report) -> None:
    """The layouts that load silently wrong in an FP8 engine (recycle.quant says what an engine builds as FP8)."""
    from recycle.quant import engine_fp8, ignore_entries, scheme

    try:
        fp8 = scheme(ckpt.config, str(ckpt.path))
    except RecycleError as e:
        rep.add("info", "quant_unsupported", str(e).split(": ", 1)[-1])
        return
    for name in ckpt.tensors:
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
    unscaled = [n for n, i in ckpt.tensors.items() if not i.is_fp8 and engine_fp8(n, i.shape)
                and not set(ignore_entries([n])) <= ignored]
    for n in unscaled[:3]:
        rep.add("error", "fp8_unscaled_weight", f"{n}: {ckpt.tensors[n].dtype} under the FP8 config, not in its ignore "
                "list: the engine casts it to e4m3 without a scale", n)
    if len(unscaled) > 3:
        rep.add("error", "fp8_unscaled_weight", f"... and {len(unscaled) - 3} more such weights", unscaled[3])
    kept = [n for n in linears if not ckpt.tensors[n].is_fp8 and set(ignore_entries([n])) <= ignored]
    if kept:
        rep.add("info", "mtp_quant_differs", f"the MTP layer's {len(kept)} linear weights are BF16 under the FP8 trunk, "
                "named in the ignore list", kept[0])


STALE_TOLERANCE = 1e-3  # relative difference of sampled rows above which a copy is not the trunk's tensor


def _check_copies(ckpt: Checkpoint, m: MTPMatch, rep: Report) -> None:
    """Stored embedding/head copies against the trunk's own tensors, on sampled rows."""
    fam = m.family
    for mod in m.modules:
        for role in ("embed", "head"):
            own = mod.tensor(role) if role in mod.roles else None
            trunk = next((n for n in fam.trunk.get(role, ()) if n in ckpt.tensors), None)
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
            st = _tensor_stats(ckpt, name, role, m.family.norm)
            rep.stats.append(st)
            if not st.finite:
                rep.add("error", "nan_or_inf", f"{name} holds NaN or inf values", name)
            elif st.all_zero and not name.endswith("bias") and not (st.norm and m.family.norm == "1+w"):
                rep.add("warning", "all_zero", f"{name} is all zeros (untrained or wiped weights?)", name)
            if progress:
                progress(i + 1, len(todo))
    return rep
