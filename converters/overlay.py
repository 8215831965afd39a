"""Stitch an MTP overlay back into a copy of its target checkpoint.

vLLM (`method: "mtp"`) and llama.cpp (`--spec-type draft-mtp`, after its own GGUF conversion)
run MTP modules only from inside the target checkpoint, under the target's own tensor names. An
overlay (`OUT/mtp_overlay/` from `recycle convert --to eagle`, or a distilled drafter's) holds
exactly those tensors, byte for byte in the target's storage dtypes (FP8 with `_scale_inv`).

`stitch(overlay, target, out)` writes a new checkpoint directory:
  * target shards holding none of the overlay's names are hard-linked (copied across filesystems);
  * shards holding some are rewritten without them;
  * the overlay's tensors go to `recycle-mtp.safetensors`, except the modules' stored copies of the
    embedding and LM head (`embed_tokens`, `shared_head.head`): those are the target's own trunk
    tensors, because engines (vLLM, SGLang) draft with the copies, and an overlay made from a base
    checkpoint carries the base's, which a post-trained target no longer has;
  * `model.safetensors.index.json` maps every tensor to its file; config.json's MTP depth key is
    raised to the overlay's module count when it is lower; every other file is copied.
The target is never modified, and an overlay whose hidden size, vocabulary or tokenizer is not the
target's is refused. It may go into a target that stores no MTP tensors at all (a build that dropped
them). CLI: `recycle stitch OUT/mtp_overlay TARGET_DIR -o STITCHED_DIR`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from recycle.checkpoint import DTYPES, INDEX_FILE, QUANT_CONFIG_FILE, ST_NAMES, Checkpoint
from recycle.converters.eagle import OVERLAY_INDEX
from recycle.converters.roles import EXACT, raw
from recycle.errors import RecycleError
from recycle.families import MTPMatch, match
from recycle.io.writer import Lazy, OutputDir, Progress, nbytes, split_plan
from recycle.preflight import DEFAULT_SHARD_SIZE
from recycle.quant import (
    CODECS,
    engine_fp8,
    expected_scale_shape,
    ignore_entries,
    module_of,
    requantize,
    scale_name,
    scheme,
    with_ignored,
)
from recycle.quant.schemes import BF16_IGNORE, Scheme, detect, engine_ignores, vllm_prefix

STITCHED_FILE = "recycle-mtp.safetensors"
RECORD = "recycle-stitch.json"  # what stitch decided, per tensor (the stitched directory is a model, not a drafter)
MTP_DTYPES = ("auto", "bf16")


def _read_index(overlay: Path) -> dict:
    import json

    try:
        return json.loads((overlay / OVERLAY_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecycleError(f"{overlay}: not an MTP overlay (no readable {OVERLAY_INDEX}: {e})") from None


def _raise_depth(config: dict, key: str | None, modules: int) -> dict:
    config = dict(config)
    if not key:
        return config
    for scope in (config, config.get("text_config")):
        if isinstance(scope, dict) and isinstance(scope.get(key), int) and scope[key] < modules:
            scope[key] = modules
    return config


def _target_copies(ov: Checkpoint, om: MTPMatch, tgt: Checkpoint) -> dict[str, str]:
    """Overlay names of the modules' embedding/head copies → the target's trunk tensor to store there."""
    out = {}
    for mod in om.modules:
        for role in ("embed", "head"):
            own = mod.tensor(role) if role in mod.roles else None
            trunk = next((n for n in om.family.trunk.get(role, ()) if n in tgt.tensors), None)
            if own is None or trunk is None:
                continue
            if tgt.tensors[trunk].shape != ov.tensors[own].shape:
                raise RecycleError(f"{ov.path}: {own} has shape {list(ov.tensors[own].shape)}, the target's "
                                   f"{trunk} {list(tgt.tensors[trunk].shape)}: the overlay does not fit this target")
            out[own] = trunk
    return out


def _tokenizer_dir(overlay: Path) -> Path:
    """Where the overlay's tokenizer is: in it, or in the drafter directory that holds it."""
    return overlay if (overlay / "tokenizer.json").is_file() else overlay.parent


def _trunk_dtype(tgt: Checkpoint, name: str, fallback: torch.dtype) -> torch.dtype:
    """The float dtype the target stores for the trunk's tensor of the same kind as MTP tensor `name` (the same
    name after its layer index: norms, router weights, biases), else `fallback` (the target's embedding dtype)."""
    suffix = name.split(".", 3)[-1] if name.count(".") >= 3 else name
    for other, info in tgt.tensors.items():
        if other.endswith(suffix) and other != name and not info.quantized and not info.is_scale:
            dt = DTYPES[info.dtype][1]
            if dt is not None and dt.is_floating_point:
                return dt
    return fallback


def _check_blocks(tgt: Checkpoint, block: tuple[int, int], mtp: set[str], where: str) -> None:
    """The target's own FP8 weights must be scaled in the block its config declares: scales written in another
    block than the engine reads would dequantize wrongly."""
    for n, info in tgt.tensors.items():
        scale = tgt.scale_for(n) if info.is_fp8 and n not in mtp else None
        if scale is not None and tuple(scale.shape) != expected_scale_shape(info.shape, block):
            raise RecycleError(f"{where}: {scale.name} has shape {list(scale.shape)}, not the {list(block)} blocks "
                               f"weight_block_size declares for {list(info.shape)}: the target's scales do not match "
                               "its config; nothing written")


class _Requant:
    """One weight re-quantized to the target's FP8 block once, read by two Lazies (the weight and its scale)."""

    def __init__(self, make, block: tuple[int, int]) -> None:
        self.make, self.block, self.done = make, block, None

    def get(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if self.done is None:
            self.done = requantize(self.make(), self.block)
        return self.done


def plan_tensors(ov: Checkpoint, tgt: Checkpoint, names: list[str], copies: dict[str, str], mode: str,
                 where: str) -> tuple[dict[str, Lazy], dict, list[str]]:
    """Every MTP tensor of the stitched file, in the target's scheme; the per-tensor record; the modules to add to
    the ignore list (mode bf16 under an FP8 target). Stored bytes are copied where they already fit; a weight the
    engine runs in FP8 is re-quantized with the target's block (fresh scales); everything else is written in the
    dtype the target stores for the trunk's same kind of tensor."""
    fp8 = scheme(tgt.config, where)
    emb = next((i for n, i in tgt.tensors.items() if "embed" in n and not i.is_scale), None)
    floats = DTYPES[emb.dtype][1] if emb is not None and DTYPES[emb.dtype][1] is not None else torch.bfloat16
    out: dict[str, Lazy] = {}
    record: dict[str, dict] = {}
    ignored: list[str] = []
    for n in names:
        if n in copies:  # the modules' embedding/head copies: the target's own trunk tensors, as stored
            out[n] = raw(tgt, copies[n])
            record[n] = {"stored": tgt.tensors[copies[n]].dtype, "how": f"the target's {copies[n]}"}
            continue
        info, scale = ov.tensors[n], ov.scale_for(n)
        as_fp8 = fp8 is not None and mode == "auto" and engine_fp8(n, info.shape)
        if as_fp8 and info.is_fp8 and scale is not None and tuple(scale.shape) == expected_scale_shape(info.shape,
                                                                                                         fp8.block):
            out[n], out[scale_name(n)] = raw(ov, n), raw(ov, scale.name)
            record[n] = {"stored": info.dtype, "how": "stored bytes (FP8 in the target's blocks)"}
        elif as_fp8:
            job = _Requant(lambda n=n: ov.get(n), fp8.block)
            out[n] = Lazy(info.shape, lambda job=job: job.get()[0], (n,), EXACT, "re-quantized to the target's FP8 "
                          "blocks", dtype=torch.float8_e4m3fn)
            out[scale_name(n)] = Lazy(expected_scale_shape(info.shape, fp8.block), lambda job=job: job.get()[1],
                                      (n,), EXACT, "fresh weight_scale_inv", dtype=torch.float32)
            record[n] = {"stored": "F8_E4M3", "how": "re-quantized", "error": job}
        else:
            want = floats if fp8 is not None and engine_fp8(n, info.shape) else _trunk_dtype(tgt, n, floats)
            if fp8 is not None and engine_fp8(n, info.shape):
                ignored.append(n)
            if not info.quantized and DTYPES[info.dtype][1] == want:
                out[n] = raw(ov, n)
                record[n] = {"stored": info.dtype, "how": "stored bytes"}
            else:
                out[n] = Lazy(info.shape, lambda n=n, want=want: ov.get(n).to(want), (n,), EXACT,
                              "dequantized" if info.quantized else "cast", dtype=want)
                record[n] = {"stored": ST_NAMES[want], "how": "dequantized" if info.quantized else "cast"}
    return out, record, ignore_entries(ignored)


def _errors(record: dict) -> dict:
    """The re-quantization errors, once the tensors were made (the writer made them)."""
    out = {}
    for n, r in record.items():
        job = r.pop("error", None)
        if job is not None and job.done is not None:
            r.update(job.done[2] if isinstance(job, _Requant) else job.error)
        out[n] = r
    return out


# -- every other scheme (issue 48): the scheme records of `recycle.quant.schemes`, the storage codecs of `CODECS` --

# The ignore keys that hold module names (the rest of a record's keys, `config_groups.*.targets`,
# `quantized_layers`, `modules_in_block_to_quantize`, say what is quantized and are never widened by stitch).
NAME_KEYS = ("ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")
DYNAMIC = "dynamic"  # GPTQ's per-module overrides: a `-:REGEX` key builds the matching layers unquantized
# ModelOpt's per-layer quant_algo (MIXED_PRECISION `quantized_layers`) → the codec that stores it
MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8_PB_WO": "fp8_block", "FP8_BLOCK_SCALES": "fp8_block",
                  "FP8": "modelopt FP8 per-tensor", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt FP8 per-channel"}
HEADS = ("embed_tokens", "embed", "head", "lm_head")  # vocabulary matrices: the target's own (`_target_copies`)


def _method(tgt: Checkpoint) -> str:
    """The method name a release's config gives, for messages ('awq', 'modelopt', ...)."""
    q = tgt.quant_config
    sec = q.get("quantization") if isinstance(q.get("quantization"), Mapping) else q
    return str(q.get("quant_method") or sec.get("quant_algo") or "?")


def _refuse_scheme(rec: Scheme, tgt: Checkpoint, tm: MTPMatch, mode: str, where: str) -> None:
    """One line, before anything is written, for a target stitch cannot write into safely: a method recycle does
    not know (or names but reads nothing of), a config that does not say what the engine builds, a release whose
    trunk is not stored in the scheme its config declares, and (auto) a scheme whose record writes nothing."""
    method = _method(tgt)
    if not rec.known:
        raise RecycleError(f"{where}: quantized with {method!r} ({rec.title}): {rec.why}; nothing written (never BF16 "
                           "where the engine may quantize). Stitch into the unquantized (BF16) release instead")
    if rec.name == "modelopt":
        sec = tgt.quant_config.get("quantization") if isinstance(tgt.quant_config.get("quantization"), Mapping) \
            else tgt.quant_config
        if not sec.get("quant_algo"):
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
        self.config: dict = json.loads(json.dumps(tgt.config))
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
        return json.dumps(self.config), json.dumps(self.hf), json.dumps(self.added)

    def restore(self, snap: tuple) -> None:
        self.config, self.hf, self.added = (json.loads(s) for s in snap)


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
        sec = q.get("quantization") if isinstance(q.get("quantization"), Mapping) else q
        algo = str(sec.get("quant_algo", "")).upper()
        if algo == "MIXED_PRECISION":
            layers = sec.get("quantized_layers") or {}
            entry = layers.get(module) or layers.get(vllm_prefix(module)) or {}
            algo = str(entry.get("quant_algo", "")).upper() if isinstance(entry, Mapping) else ""
        return MODELOPT_ALGOS.get(algo)
    return rec.codecs[0] if len(rec.codecs) == 1 else None


FP8_SCALES = ("weight_scale_inv", "scale", "weight_scale")  # DeepSeek's HF and native names; ModelOpt FP8_PB_WO's


def _fp8_scale(t: Checkpoint, name: str) -> str | None:
    """The local name (after the module) of an FP8 weight's block scale: a float scale of 2 dims (or ModelOpt's
    [ob, 1, ib, 1]) beside it, under DeepSeek's or ModelOpt's name. A per-tensor or per-channel scale is none."""
    module = module_of(name)
    for local in FP8_SCALES:
        info = t.stored.get(f"{module}.{local}")
        if info is None:
            continue
        shape = tuple(info.shape)
        if len(shape) == 4 and shape[1] == shape[3] == 1:
            shape = (shape[0], shape[2])
        if len(shape) == 2 and min(shape) >= 1 and not (shape[0] == t.tensors[name].shape[0] and shape[1] == 1):
            return local
    return None


def _storage(t: Checkpoint, name: str) -> tuple[str, str | None] | None:
    """How a checkpoint stores a weight: ("codec", NAME), ("fp8_block", its scale's local name), ("float", None),
    ("other", what) for FP8 scaled in a way recycle does not write, or None when it holds no such weight."""
    info = t.tensors.get(name)
    if info is None:
        return None
    if name in t.packed:
        return "codec", t.packed[name].codec
    if info.is_fp8:
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
    if info.dtype not in ("F32", "BF16", "F16"):
        raise RecycleError(f"{where}: {scale} is {info.dtype}: recycle writes float32 FP8 block scales, not e8m0 ones "
                           "(DeepSeek-V4's); use --mtp-dtype bf16")
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
            rq = _Requant(lambda n=n: ov.get(n), block)
            out[n] = Lazy(info.shape, lambda rq=rq: rq.get()[0], (n,), EXACT, "re-quantized to FP8 blocks",
                          dtype=torch.float8_e4m3fn)
            out[f"{module_of(n)}.{local}"] = Lazy(scale_shape, lambda rq=rq, sh=scale_shape: rq.get()[1].reshape(sh),
                                                  (n,), EXACT, "fresh FP8 block scale", dtype=torch.float32)
            record[n] = {"stored": "F8_E4M3", "how": f"re-quantized to {block[0]}x{block[1]} FP8 blocks: {why}",
                         "error": rq}
        else:
            want = floats if quantized else _trunk_dtype(tgt, n, floats)
            if quantized:
                bf16.append(module_of(n))
            if not info.quantized and DTYPES[info.dtype][1] == want:
                out[n] = raw(ov, n)
                record[n] = {"stored": info.dtype, "how": "stored bytes"}
            else:
                out[n] = Lazy(info.shape, lambda n=n, want=want: ov.get(n).to(want), (n,), EXACT,
                              "dequantized" if info.quantized else "cast", dtype=want)
                record[n] = {"stored": ST_NAMES[want], "how": "dequantized" if info.quantized else "cast"}
            if quantized:
                record[n]["how"] += f", ignore entry ({why})"
    cfg = _Configs(rec, tgt)
    added = _add_ignores(cfg, tgt, bf16, mtp, where) if bf16 else []
    return out, record, cfg, added


def stitch(overlay: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, *,
           overwrite: bool = False, progress: Progress | None = None, mtp_dtype: str = "auto",
           max_shard_size: int | str | None = DEFAULT_SHARD_SIZE) -> dict:
    """Write `out` = target with the overlay's MTP tensors in place of its own, in the target's quantization scheme
    (`mtp_dtype` "auto": FP8 where the engine runs FP8; "bf16": BF16 with the modules in the ignore list); returns a
    summary, also written as recycle-stitch.json. The MTP tensors go to `recycle-mtp.safetensors`, in shards of at
    most `max_shard_size` (the target's own files keep theirs)."""
    if mtp_dtype not in MTP_DTYPES:
        raise RecycleError(f"--mtp-dtype {mtp_dtype!r}: choose {' or '.join(MTP_DTYPES)}")
    ov_dir, tgt_dir = Path(overlay), Path(target)
    meta = _read_index(ov_dir).get("metadata", {})
    ov, tgt = Checkpoint(ov_dir), Checkpoint(tgt_dir)
    rec = detect(tgt.config, tgt_dir)  # the scheme record (None: unquantized)
    # block FP8 keeps its own path; every other scheme goes through its record (refusals before anything is written)
    fp8 = scheme(tgt.config, str(tgt_dir)) if rec is not None and rec.name == "fp8_block" else None
    # the row convert used (its --family) is the overlay's; the target's tensors must be that row's
    tm = match(tgt, strict=meta.get("family") is None)
    fam = tm.family.name
    if meta.get("family") not in (None, fam):
        raise RecycleError(f"{ov_dir}: overlay of a '{meta.get('family')}' checkpoint, target is '{fam}'")
    if rec is not None and fp8 is None:
        _refuse_scheme(rec, tgt, tm, mtp_dtype, str(tgt_dir))
    from recycle.fit import check_fit

    check_fit(ov.config, tgt.config, _tokenizer_dir(ov_dir), tgt_dir, f"{ov_dir}")
    om = match(ov, fam)
    copies = _target_copies(ov, om, tgt)
    names = sorted(n for n, i in ov.tensors.items() if not i.is_scale)
    for n in names:
        info = tgt.tensors.get(n)
        if info is not None and info.shape != ov.tensors[n].shape:
            raise RecycleError(f"{ov_dir}: {n} has shape {list(ov.tensors[n].shape)}, the target's is {list(info.shape)}")
    if fp8 is not None:
        _check_blocks(tgt, fp8.block, set(tm.mtp_names), str(tgt_dir))
    cfg = None
    if rec is None or fp8 is not None:
        tensors, record, ignored = plan_tensors(ov, tgt, names, copies, mtp_dtype, str(tgt_dir))
    else:
        tensors, record, cfg, ignored = plan_scheme(ov, tgt, om, tm, rec, names, copies, mtp_dtype, str(tgt_dir))
    drop = set(tm.mtp_names) | set(tensors)  # the target's old MTP tensors go, stale scales with them
    drop |= {part for n in drop if n in tgt.packed for part in tgt.packed[n].parts.values()}  # and packed parts
    writer = OutputDir(out, overwrite=overwrite, protect=(tgt_dir, ov_dir))
    weight_map: dict[str, str] = {}
    rewritten, linked = [], []
    with writer as d:
        rewrite: dict[str, dict] = {}
        for file in tgt.files:
            held = [n for n, i in tgt.stored.items() if i.file == file]
            keep = [n for n in held if n not in drop]
            weight_map.update(dict.fromkeys(keep, file))
            if len(keep) == len(held):
                d.copy_file(tgt.path / file, file, link=True)
                linked.append(file)
            elif keep:
                rewrite[file] = {n: raw(tgt, n) for n in sorted(keep)}
                rewritten.append(file)
        stitched, _ = split_plan({STITCHED_FILE: dict(sorted(tensors.items()))}, torch.bfloat16, max_shard_size)
        rewrite.update(stitched)
        d.write_safetensors(rewrite, dtype=torch.bfloat16, progress=progress)  # each Lazy says its own dtype
        sizes = {n: i.nbytes for n, i in tgt.stored.items()}
        total = sum(sizes[n] for n in weight_map)
        for file, part in stitched.items():
            weight_map.update(dict.fromkeys(part, file))
        total += sum(nbytes(t.shape, t.dtype or torch.bfloat16) for t in tensors.values())
        d.write_json(INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        config = _raise_depth(cfg.config if cfg is not None else tgt.config, meta.get("depth_key"),
                              int(meta.get("modules") or 0))
        if ignored and cfg is None:
            config = with_ignored(config, ignored)
        d.write_json("config.json", config)
        rewrites = {INDEX_FILE, "config.json", RECORD}
        if cfg is not None and cfg.hf is not None:
            d.write_json(QUANT_CONFIG_FILE, cfg.hf)
            rewrites.add(QUANT_CONFIG_FILE)
        for p in sorted(tgt.path.iterdir()):
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in rewrites:
                d.copy_file(p, p.name)
        target = ("fp8 block " + "x".join(map(str, fp8.block)) if fp8 else rec.title if rec is not None else "none")
        summary = {"out": str(writer.out), "family": fam, "overlay_tensors": len(names), "linked": linked,
                   "rewritten": rewritten, "file": STITCHED_FILE,
                   "files": sorted(stitched), "copies_from_target": dict(sorted(copies.items())),
                   "target_had_mtp": bool(tm.modules),
                   "quantization": {"target": target, "scheme": rec.name if rec is not None else None,
                                    "mtp_dtype": mtp_dtype, "ignored_added": sorted(ignored),
                                    "ignore_keys": {k: sorted(v) for k, v in sorted(cfg.added.items())} if cfg is not None else {},
                                    "tensors": _errors(record)}}
        q = summary["quantization"]
        errs = [r["max_rel_error"] for r in q["tensors"].values() if "max_rel_error" in r]
        q["requantized"] = len(errs)
        q["max_rel_error"] = max(errs) if errs else None
        d.write_json(RECORD, summary)
    return summary
