"""The quantization schemes of published releases, one `Scheme` record per method, read from the engines' loaders.

A record is data, like a `Family` row or a `DrafterFormat`: how a release declares the scheme (`methods`, in which
`config_files`), the storage codecs its weights use (names in `recycle.quant.codec.CODECS`), the config keys the
engines read for modules they build unquantized (`ignore_keys`, with who reads each), what the engines build
unquantized whatever the config says (`unquantized`, `mtp_unquantized`), what vLLM does with a tensor stored in
the wrong precision or missing (`engine_behaviour`), the vLLM 0.32 lines all that was read from (`cites`), and
what `stitch --mtp-dtype auto` writes into a target of the scheme (`writes`, None = refuse, `why`).

The one piece of code a record needs, the engine's ignore rule (does vLLM build this checkpoint module
unquantized under this config?), differs per scheme. Each rule is a function `engine_ignores(module, config)`
registered here in `IGNORE_RULES` under the scheme's name; a record names it in `hooks` ("ignore_rule") and
`tests/test_registries.py` resolves it. `detect(config, files)` finds the record of a checkpoint: config.json's
`quantization_config` (or its `text_config`'s), and `hf_quant_config.json` where ModelOpt wrote one. A method recycle
does not know gives a record marked `known=False` named after the method, so inspect can say what it cannot check.

A rule takes the module name as the checkpoint stores it (`model.layers.61.self_attn.q_a_proj`,
`model.layers.61.mlp.experts.7.down_proj`) and answers for the vLLM layer that holds it: a shard of a fused
layer (`q_proj` in `qkv_proj`) is answered for the fused layer, as vLLM asks; a routed expert for its
`...experts` container. vLLM's models may rename modules first (`apply_vllm_mapper`, per model, e.g. a multimodal
wrapper's `model.language_model.`): the rules do not, they work on the names as stored, which is what DeepSeek's MTP
loader builds its block under (`models/deepseek_mtp.py:103-106`, prefix `model.layers.{idx}`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Protocol

from recycle.errors import RecycleError
from recycle.quant.fp8 import modelopt_section
from recycle.registry import Registry

V = "vllm 0.32 model_executor/"  # every cite below is a file of vLLM 0.32's installed CPU build
Q = V + "layers/quantization/"
M = V + "models/"

BF16_IGNORE = "bf16+ignore"  # `writes`: the MTP in BF16, its modules named in the scheme's ignore key(s)
HOOKS = ("ignore_rule",)

# The fused layers vLLM builds from the checkpoint's shards (`packed_modules_mapping`: deepseek_v2.py:1880-1912,
# qwen3_5.py:307-315); a rule asked about a shard answers for the fused layer.
FUSED: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
}
_SHARD_OF = {shard: fused for fused, shards in FUSED.items() for shard in shards}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # RoutedExperts' ckpt names (`compressed_tensors_moe.py:36-43`)


@dataclass(frozen=True)
class Scheme:
    """One quantization method as the engines load it (data only; its ignore rule is in `IGNORE_RULES`)."""

    name: str  # the record's key; `IGNORE_RULES` files its rule under it
    title: str  # for people: reports, refusals
    methods: tuple[str, ...]  # the `quant_method` / `quant_algo` values (lower case) that name it
    config_files: tuple[str, ...] = ("config.json: quantization_config",)  # where a release declares it
    codecs: tuple[str, ...] = ()  # names in CODECS of the storages its releases use
    formats: Mapping[str, str] = field(default_factory=dict)  # compressed-tensors `format` → its codec
    ignore_keys: Mapping[str, str] = field(default_factory=dict)  # config key → which engine reads it, how
    unquantized: tuple[str, ...] = ()  # module-name suffixes vLLM builds unquantized whatever the config says
    mtp_unquantized: Mapping[str, str] = field(default_factory=dict)  # vLLM MTP model → what it builds unquantized
    engine_behaviour: Mapping[str, str] = field(default_factory=dict)  # BEHAVIOURS → what vLLM 0.32 does
    cites: tuple[str, ...] = ()  # file:line in vLLM 0.32 the record was read from
    writes: tuple[str, ...] | None = None  # what stitch --mtp-dtype auto writes: codec names or BF16_IGNORE
    why: str = ""  # why it writes that, or why it refuses
    hooks: frozenset[str] = frozenset()  # which of HOOKS it has (registered under `name`)
    known: bool = True  # False: recycle names the method but reads none of it (inspect says what it cannot check)
    cannot_check: str = ""  # what of the scheme recycle cannot read (no codec), for inspect to say

    def __post_init__(self) -> None:
        if unknown := set(self.hooks) - set(HOOKS):
            raise ValueError(f"scheme {self.name}: unknown hooks {sorted(unknown)}")


BEHAVIOURS = ("bf16_where_quantized", "quantized_where_unquantized", "missing")

# What every MTP model of vLLM 0.32 builds unquantized, whatever the scheme (read from each model file).
MTP_COMMON: Mapping[str, str] = {
    "deepseek_mtp": "eh_proj (nn.Linear, no quant_config: deepseek_mtp.py:87); enorm/hnorm; mtp_block and "
                    "shared_head.head take the target's quant_config (deepseek_mtp.py:103-106, 65-69)",
    "glm4_moe_mtp": "eh_proj (nn.Linear: glm4_moe_mtp.py:92); mtp_block and shared_head take the quant_config "
                    "(glm4_moe_mtp.py:93-103)",
    "qwen3_5_mtp": "fc only under modelopt_fp4 (quant_config=None, qwen3_5_mtp.py:89-105); every MTP layer when a "
                   "GPTQ `dynamic` key starts '-:' and names 'mtp' (qwen3_5_mtp.py:108-126)",
    "qwen3_next_mtp": "fc only under modelopt_fp4 (qwen3_next_mtp.py:74-86); the layers take the quant_config",
    "mimo_v2_mtp": "eh_proj (ReplicatedLinear without quant_config: mimo_v2_mtp.py:75-77); attention and MLP "
                   "take the quant_config (mimo_v2_mtp.py:105, 116)",
    "step3p5_mtp": "eh_proj (nn.Linear: step3p5_mtp.py:68); the draft's own quant config, not the target's "
                   "(get_draft_quant_config, step3p5_mtp.py:167-171, models/utils.py:985-1007)",
}
ROUTER = ("mlp.gate",)  # GateLinear without quant_config (deepseek_v2.py:321-326); Qwen3-Next's
# shared_expert_gate is a ReplicatedLinear with quant_config=None (qwen3_next.py:197-202)
MISSING_MTP = ("deepseek_mtp (and bailing_moe_mtp, bailing_moe_v3_mtp): ValueError \"MTP speculative decoding layer "
               "{idx} weights missing from checkpoint. The checkpoint may have been quantized without including the "
               "MTP layers. Use a checkpoint that includes MTP layer weights, or disable speculative decoding.\" "
               "(deepseek_mtp.py:515-531); the other MTP models load without it, leaving the parameters as created")
UNKNOWN_METHOD = ("ValueError \"Unknown quantization method: {method}. Must be one of [...]\" "
                  "(config/model.py:1452-1456): the model does not load")


# -- the engines' ignore rules ---------------------------------------------------------------------------------


class IgnoreRule(Protocol):
    def __call__(self, module: str, config: Mapping) -> bool:
        """Whether vLLM builds the layer holding checkpoint module `module` unquantized under quantization
        config `config` (the dict the release stores); a RecycleError where vLLM would refuse to load."""


IGNORE_RULES: Registry[IgnoreRule] = Registry("engine ignore rule")


def vllm_prefix(module: str) -> str:
    """The vLLM layer a checkpoint module belongs to: a routed expert's container, a shard's fused layer."""
    if (i := module.find(".experts.")) >= 0:  # `...experts.7.down_proj`, gpt-oss's fused `...experts.down_proj`
        return module[: i + len(".experts")]
    head, _, proj = module.rpartition(".")
    if proj in _SHARD_OF:
        return f"{head}.{_SHARD_OF[proj]}" if head else _SHARD_OF[proj]
    return module


def layer_skipped(prefix: str, ignored: list[str], mode: str = "exact") -> bool:
    """vLLM's `is_layer_skipped` (quant_utils.py:617-691), with FUSED as the fused mapping: a fused layer is
    skipped when its own name matches, else when all its shards do (some but not all: vLLM refuses to load);
    in exact mode a layer with "experts" in its name is skipped when an ignore entry naming experts contains it."""
    if mode == "exact":
        def match(name: str) -> bool:
            return name in ignored
    elif mode == "substring":
        def match(name: str) -> bool:
            return any(entry in name for entry in ignored)
    else:  # programming error
        raise ValueError(mode)
    proj = prefix.split(".")[-1]
    if proj in FUSED:
        if match(prefix):
            return True
        shards = [match(prefix.replace(proj, shard)) for shard in FUSED[proj]]
        if any(shards) and not all(shards):
            raise RecycleError(f"{prefix}: some but not all of its shards are in the ignore list; vLLM refuses "
                               f"(\"Detected some but not all shards of {prefix} are quantized\", quant_utils.py:676-681)")
        return all(shards)
    if "experts" in prefix and mode == "exact":
        return any(prefix in entry for entry in ignored if "experts" in entry)
    return match(prefix)


def _fp8_ignored(config: Mapping) -> list[str]:
    """Fp8Config.from_config (fp8.py:158-175): `ignored_layers`, else (when empty) `modules_to_not_convert`."""
    return list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])


@IGNORE_RULES.register("fp8_block", "fp8_tensor", "deepseek_v4")
def fp8_ignores(module: str, config: Mapping) -> bool:
    """Fp8Config.get_quant_method (fp8.py:177-199; DeepseekV4FP8Config for experts, deepseek_v4/quant_config.py
    :178-199): a Linear or the routed experts are unquantized only when `is_layer_skipped` (exact mode) says so."""
    return layer_skipped(vllm_prefix(module), _fp8_ignored(config))


def _modelopt_excludes(config: Mapping) -> list[str]:
    """ModelOptQuantConfigBase.from_config (modelopt.py:320-356: `quantization.exclude_modules` in
    hf_quant_config.json, else config.json's `ignore`), then apply_vllm_mapper's rewrite (modelopt.py:263-281):
    `path*` becomes `path` and `path.*`."""
    raw = config["quantization"].get("exclude_modules", []) if isinstance(config.get("quantization"), Mapping) \
        else config.get("ignore", [])
    if not isinstance(raw, list):
        raise RecycleError(f"ModelOpt exclude_modules must be a list, got {type(raw).__name__} (vLLM refuses, "
                           f"modelopt.py:375-378)")
    out: list[str] = []
    for entry in raw:
        entry = str(entry)
        if len(entry) >= 2 and entry[-1] == "*" and entry[-2] != ".":
            out += [entry[:-1], entry[:-1] + ".*"]
        else:
            out.append(entry)
    return out


def _modelopt_excluded(prefix: str, excludes: list[str]) -> bool:
    """ModelOptQuantConfigBase.is_layer_excluded (modelopt.py:187-221): exact (with fused shards), then any entry
    contained in the name (also past a `language_model.` head), then fnmatch wildcards."""
    if not excludes:
        return False
    if layer_skipped(prefix, excludes):
        return True
    bare = prefix.removeprefix("language_model.") if prefix.startswith("language_model.") else None
    if any(e != prefix and (e in prefix or (bare is not None and e in bare)) for e in excludes):
        return True
    return any(fnmatch(prefix, e) for e in excludes)


def _modelopt_algo(prefix: str, layers: Mapping[str, Mapping]) -> str | None:
    """ModelOptMixedPrecisionConfig._resolve_quant_algo (modelopt.py:1717-1793), for names as stored: the layer's
    own entry, its fused shards' (all one algo), a child entry, the experts' parent's; None = not quantized."""
    def algo(key: str) -> str:
        return str(layers[key].get("quant_algo", "")).upper()

    if prefix in layers:
        return algo(prefix)
    base, _, proj = prefix.rpartition(".")
    if proj in FUSED:
        found = {algo(f"{base}.{s}") for s in FUSED[proj] if f"{base}.{s}" in layers}
        if len(found) > 1:
            raise RecycleError(f"{prefix}: its shards have different quant_algo {sorted(found)} in quantized_layers; "
                               f"vLLM refuses (\"Mixed quant_algo within fused layer\", modelopt.py:1748-1752)")
        if found:
            return found.pop()
    for key in layers:
        if key.startswith(prefix + "."):
            return algo(key)
    if prefix.endswith(".experts"):
        parent = prefix.rsplit(".experts", 1)[0] + "."
        for key in layers:
            if key.startswith(parent):
                return algo(key)
    return None


@IGNORE_RULES.register("modelopt")
def modelopt_ignores(module: str, config: Mapping) -> bool:
    """ModelOpt (modelopt.py:223-261; MIXED_PRECISION 1813-1883): excluded by `exclude_modules`/`ignore`; vision
    towers always; under MIXED_PRECISION also any Linear or experts with no `quantized_layers` entry."""
    prefix = vllm_prefix(module)
    if _modelopt_excluded(prefix, _modelopt_excludes(config)):
        return True
    if any(tower in prefix for tower in ("vision_tower", "vision_model", "vit_large_projector")):
        return True
    section = modelopt_section(config)
    if str(section.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        return _modelopt_algo(prefix, section.get("quantized_layers") or {}) is None
    return False


def _ct_match(value: str, target: str) -> bool:
    """is_equal_or_regex_match (utils/config_utils.py:392-412): `re:` entries by re.match (anchored at the
    start only), others by equality."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target == value


def _ct_ignored(prefix: str, ignore: list[str]) -> bool:
    """should_ignore_layer (compressed_tensors/utils.py:53-70) over find_matching_patterns (config_utils.py
    :344-380): the fused layer's own name, else every shard; some but not all shards: vLLM refuses."""
    if any(_ct_match(prefix, p) for p in ignore):
        return True
    proj = prefix.split(".")[-1]
    if proj not in FUSED:
        return False
    shards = [any(_ct_match(prefix.replace(proj, s), p) for p in ignore) for s in FUSED[proj]]
    if any(shards) and not all(shards):
        raise RecycleError(f"{prefix}: some but not all of its shards are in compressed-tensors' ignore; vLLM refuses "
                           f"(\"Found different quantization schemes for the shards\", compressed_tensors/utils.py:64-69)")
    return all(shards)


LINEAR_CLASSES = ("ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "QKVParallelLinear",
                  "MergedColumnParallelLinear")  # vLLM's Linear layers: a class-name target matches by containment


def _ct_targeted(prefix: str, targets: list[str], experts: bool) -> bool:
    """find_matched_target (compressed_tensors/utils.py:73-111): the name (or every shard of a fused layer)
    matches a target, or a target is contained in the layer's class name; the experts match what `Linear`
    matches (compressed_tensors.py:221-232)."""
    if any(_ct_match(prefix, t) for t in targets):
        return True
    proj = prefix.split(".")[-1]
    if proj in FUSED and all(any(_ct_match(prefix.replace(proj, s), t) for t in targets) for s in FUSED[proj]):
        return True
    classes = ("RoutedExperts",) if experts else LINEAR_CLASSES
    names = [t for t in targets if not t.startswith("re:")]
    if experts and "Linear" in names:
        return True
    return any(t.lower() in c.lower() for t in names for c in classes)


def _ct_unquantized(name: str, config: Mapping, experts: bool = False) -> bool:
    """get_scheme_dict (compressed_tensors.py:998-1030): ignored, or matched by no config group's target."""
    if _ct_ignored(name, list(config.get("ignore") or [])):
        return True
    targets = [t for group in (config.get("config_groups") or {}).values() for t in (group.get("targets") or [])]
    return not _ct_targeted(name, targets, experts)


@IGNORE_RULES.register("compressed_tensors")
def compressed_tensors_ignores(module: str, config: Mapping) -> bool:
    """CompressedTensorsConfig.get_quant_method (compressed_tensors.py:159-232): a Linear is unquantized when
    ignored or targeted by no group; routed experts are decided by expert 0's three projections, which must agree
    (compressed_tensors_moe.py:26-58)."""
    prefix = vllm_prefix(module)
    if prefix.endswith(".experts"):
        answers = {_ct_unquantized(f"{prefix}.0.{p}", config, experts=True) for p in EXPERT_PROJS}
        if len(answers) > 1:
            raise RecycleError(f"{prefix}: its expert 0 projections are not all in one scheme; vLLM refuses "
                               f"(\"All MoE projections need to have same quantization scheme\", "
                               f"compressed_tensors_moe.py:50-55)")
        return answers.pop()
    return _ct_unquantized(prefix, config)


@IGNORE_RULES.register("mxfp4")
def mxfp4_ignores(module: str, config: Mapping) -> bool:
    """Mxfp4Config (mxfp4.py:62-113): from_config keeps no ignore list, every Linear is built unquantized, the
    routed experts always MXFP4; `modules_to_not_convert` is read by transformers only."""
    return not vllm_prefix(module).endswith(".experts")


@IGNORE_RULES.register("awq")
def awq_ignores(module: str, config: Mapping) -> bool:
    """AutoAWQConfig.get_quant_method (auto_awq.py:288-300): `modules_to_not_convert`, substring match. With the
    list empty vLLM fills it from the checkpoint's dtypes (maybe_update_config, auto_awq.py:370-388): a module
    stored in BF16 is then unquantized, which a config alone cannot say (this rule answers False)."""
    return layer_skipped(vllm_prefix(module), list(config.get("modules_to_not_convert") or []), mode="substring")


def _flatten(items: Iterable) -> list[str]:
    out: list[str] = []
    for item in items:
        out += _flatten(item) if isinstance(item, list | tuple) else [str(item)]
    return out


@IGNORE_RULES.register("gptq")
def gptq_ignores(module: str, config: Mapping) -> bool:
    """get_linear_quant_method (utils/gptq_utils.py:172-201): unquantized when a `dynamic` key `-:REGEX` re.matches
    the layer (before any positive key that matches first, gptq_utils.py:85-103), or when
    `modules_in_block_to_quantize` is non-empty and names none of it (substring; is_layer_gptq_quantized
    :120-169)."""
    prefix = vllm_prefix(module)
    for pattern in (config.get("dynamic") or {}):
        if pattern.startswith("-:"):
            if re.match(pattern[2:], prefix):
                return True
        elif re.match(pattern.removeprefix("+:"), prefix):
            break
    listed = _flatten(config.get("modules_in_block_to_quantize") or [])
    if not listed:
        return False
    proj = prefix.split(".")[-1]
    names = [prefix.replace(proj, s) for s in FUSED[proj]] if proj in FUSED else [prefix]
    quantized = [any(entry in n for entry in listed) for n in names]
    if any(quantized) and not all(quantized):
        raise RecycleError(f"{prefix}: some but not all of its shards are in modules_in_block_to_quantize; vLLM "
                           f"refuses (\"Detected some but not all shards\", gptq_utils.py:158-163)")
    return not all(quantized)


# -- the records ---------------------------------------------------------------------------------------------------

_FP8_KEYS = {
    "ignored_layers": "vLLM Fp8Config (read first; exact module names, fused shards, experts by containment: "
                      "fp8.py:158-199, quant_utils.py:617-691); transformers FineGrainedFP8Config (second)",
    "modules_to_not_convert": "vLLM Fp8Config when ignored_layers is empty; transformers FineGrainedFP8Config (first)",
}
_FP8_BEHAVIOUR = {
    "bf16_where_quantized": "the layer is created FP8 (an e4m3 weight and its scale); the BF16 tensor passes the "
                            "shape check and is cast into it without a scale: the draft is garbage, acceptance ~0",
    "quantized_where_unquantized": "the layer is created in the model dtype; the FP8 codes load as numbers without "
                                   "their scale and the `weight_scale_inv` finds no parameter",
    "missing": MISSING_MTP,
}
_FP8_CITES = (Q + "fp8.py:92-199", Q + "utils/quant_utils.py:617-691", M + "deepseek_mtp.py:76-106",
              M + "deepseek_mtp.py:515-531")

SCHEMES: tuple[Scheme, ...] = (
    Scheme(
        name="fp8_block", title="block FP8 (DeepSeek's 128×128 weight_scale_inv)", methods=("fp8",),
        codecs=("fp8_block",), ignore_keys=_FP8_KEYS, unquantized=ROUTER + ("eh_proj",),
        mtp_unquantized=MTP_COMMON, engine_behaviour=_FP8_BEHAVIOUR, cites=_FP8_CITES, writes=("fp8_block",),
        why="re-quantized in the target's own blocks (fresh scales, error recorded); or BF16 with ignored_layers and "
            "modules_to_not_convert entries (recycle.quant.fp8.with_ignored)",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="fp8_tensor", title="per-tensor/per-channel FP8 (fp8 without weight_block_size)", methods=("fp8",),
        ignore_keys=_FP8_KEYS, unquantized=ROUTER + ("eh_proj",), mtp_unquantized=MTP_COMMON,
        engine_behaviour=_FP8_BEHAVIOUR, cites=_FP8_CITES, writes=None,
        cannot_check="per-tensor and per-channel `weight_scale` FP8 weights: no codec reads them",
        why="recycle writes only block FP8 (recycle.quant.fp8.scheme refuses a config without a 2-D "
            "weight_block_size) and no codec reads per-tensor scales; stitch into the BF16 release",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="deepseek_v4", title="DeepSeek-V4 native (FP8 e4m3 linears with ue8m0 block scales, MXFP4 experts)",
        methods=("fp8", "deepseek_v4_fp8"),
        config_files=("config.json: quantization_config {quant_method: fp8, fmt: e4m3, scale_fmt: ue8m0, "
                      "weight_block_size: [128, 128]} and top-level expert_dtype (fp4 by default, fp8 for -Base); "
                      "vLLM picks it by model_type deepseek_v4",),
        codecs=("fp8_block", "mxfp4_native"), ignore_keys=_FP8_KEYS, unquantized=ROUTER,
        mtp_unquantized=MTP_COMMON,
        engine_behaviour={
            "bf16_where_quantized": "linears as block FP8 (see fp8_block); routed experts with expert_dtype fp4 are "
                                    "created MXFP4 (Mxfp4MoEMethod, or NVFP4 when moe_quant_algo says so): a BF16 "
                                    "expert has no MXFP4 parameter of its shape",
            "quantized_where_unquantized": "an expert named in ignored_layers is created unquantized "
                                           "(UnquantizedFusedMoEMethod) and its packed codes do not fit",
            "missing": MISSING_MTP},
        cites=(M.replace("model_executor/", "") + "deepseek_v4/quant_config.py:29-199",) + _FP8_CITES[:2],
        writes=("fp8_block", "mxfp4_native"),
        why="the release's own scheme: linears re-quantized to block FP8, routed experts to MXFP4 as DeepSeek stores "
            "them (expert_dtype fp8, the -Base builds: block FP8 too); vLLM builds experts unquantized only when an "
            "ignore entry names them",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="modelopt", title="NVIDIA ModelOpt (NVFP4, FP8, MIXED_PRECISION)",
        methods=("modelopt", "modelopt_fp4", "modelopt_mixed", "nvfp4", "w4a16_nvfp4", "fp8_per_channel_per_token",
                 "fp8_pb_wo", "fp8_block_scales", "mixed_precision"),
        config_files=("hf_quant_config.json: quantization.quant_algo, .exclude_modules, .quantized_layers",
                      "config.json: quantization_config {quant_method: modelopt, quant_algo, ignore, quantized_layers}"),
        codecs=("nvfp4", "modelopt_fp8"),
        cannot_check="ModelOpt's MXFP8 (e4m3 weights with an e8m0 scale per 32) and FP8 stored 3-D (fused "
                     "experts): no codec reads them",
        ignore_keys={
            "exclude_modules": "vLLM (hf_quant_config.json `quantization`): exact with fused shards, then substring, "
                               "then fnmatch; `path*` also matches `path` (modelopt.py:187-221, 263-281)",
            "ignore": "vLLM, config.json's form of exclude_modules (modelopt.py:340-356)",
            "quantized_layers": "vLLM under MIXED_PRECISION: a Linear without an entry is unquantized "
                                "(modelopt.py:1717-1793, 1813-1883)"},
        unquantized=ROUTER + ("vision_tower", "vision_model", "vit_large_projector"),
        mtp_unquantized=MTP_COMMON,
        engine_behaviour={
            "bf16_where_quantized": "the layer is created NVFP4 (uint8 weight [out, in/2], e4m3 weight_scale per "
                                    "16, weight_scale_2, input_scale); the BF16 [out, in] weight fails the loader's "
                                    "shape assert (parameter.py:91-95, 145-151); "
                                    "Qwen3.5/Qwen3-Next's mtp.fc is forced unquantized for modelopt_fp4 only",
            "quantized_where_unquantized": "an excluded layer is created in the model dtype [out, in]; the packed "
                                           "uint8 [out, in/2] fails the same shape assert",
            "missing": MISSING_MTP},
        cites=(V + "parameter.py:91-151", Q + "modelopt.py:130-156", Q + "modelopt.py:171-406", Q + "modelopt.py:1543-1883",
               Q + "modelopt.py:2104-2269",
               M + "qwen3_5_mtp.py:89-105", M + "qwen3_next_mtp.py:74-86"),
        writes=(BF16_IGNORE,),
        why="BF16 MTP with exclude_modules (and config.json ignore) entries, as Nemotron 3's and Step's NVFP4 recipes "
            "keep it; FP8-block where the release stored its MTP so (MIXED_PRECISION quantized_layers FP8_PB_WO)",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="compressed_tensors", title="compressed-tensors (llm-compressor)", methods=("compressed-tensors",),
        codecs=("ct_float", "ct_nvfp4", "ct_pack", "ct_naive"),
        cannot_check="formats other than these four (marlin-24, sparse-bitmask, mixed-precision, mxfp4-pack): "
                     "no codec reads them",
        formats={"float-quantized": "ct_float", "nvfp4-pack-quantized": "ct_nvfp4", "pack-quantized": "ct_pack",
                 "naive-quantized": "ct_naive", "int-quantized": "ct_naive"},
        ignore_keys={
            "ignore": "vLLM: exact names and `re:` regexes (re.match), a fused layer by all its shards "
                      "(compressed_tensors/utils.py:53-70, config_utils.py:344-412); transformers "
                      "CompressedTensorsHfQuantizer passes it to compressed-tensors",
            "config_groups.*.targets": "vLLM: a layer matched by no group's target is unquantized "
                                       "(compressed_tensors.py:998-1030, utils.py:73-111)"},
        unquantized=ROUTER, mtp_unquantized=MTP_COMMON,
        engine_behaviour={
            "bf16_where_quantized": "the layer is created in its group's scheme (weight_packed/weight_scale, or an "
                                    "FP8 weight); a BF16 `weight` is cast into an FP8 one without its scale, or finds "
                                    "no packed parameter",
            "quantized_where_unquantized": "an ignored layer is created in the model dtype; weight_packed and "
                                           "weight_scale find no parameter",
            "missing": MISSING_MTP},
        cites=(Q + "compressed_tensors/compressed_tensors.py:159-266", Q + "compressed_tensors/compressed_tensors.py"
               ":951-1030", Q + "compressed_tensors/utils.py:53-176", Q + "utils/config_utils.py:344-412",
               Q + "compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py:26-58"),
        writes=(BF16_IGNORE,),
        why="BF16 MTP named in `ignore`, as llm-compressor's MTP-keeping recipes (#3118) do",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="mxfp4", title="MXFP4 (gpt-oss: e2m1 _blocks + e8m0 _scales)", methods=("mxfp4", "gpt_oss_mxfp4"),
        codecs=("mxfp4",),
        ignore_keys={"modules_to_not_convert": "transformers Mxfp4HfQuantizer only; vLLM's Mxfp4Config.from_config "
                                               "keeps no ignore list (mxfp4.py:66-68)"},
        unquantized=("self_attn", "mlp.router", "embed_tokens", "lm_head"), mtp_unquantized=MTP_COMMON,
        engine_behaviour={
            "bf16_where_quantized": "routed experts are always created MXFP4 (GptOssMxfp4MoEMethod): BF16 experts "
                                    "find no parameter of their shape",
            "quantized_where_unquantized": "every Linear is created unquantized (mxfp4.py:91-108): packed linear "
                                           "weights do not fit",
            "missing": MISSING_MTP},
        cites=(Q + "mxfp4.py:55-149",), writes=("mxfp4",),
        why="routed experts in MXFP4 (vLLM builds no other), every other Linear BF16 with no entry needed",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="awq", title="AWQ (qweight/qzeros/scales, 4-bit)", methods=("awq", "awq_marlin", "auto_awq"),
        config_files=("config.json: quantization_config", "quant_config.json", "quantize_config.json"),
        codecs=("awq",),
        ignore_keys={"modules_to_not_convert": "vLLM AutoAWQConfig, substring match (auto_awq.py:241-300); when "
                                               "empty vLLM fills it with every module stored unquantized "
                                               "(auto_awq.py:370-388); transformers AwqQuantizer"},
        unquantized=ROUTER, mtp_unquantized=MTP_COMMON,
        engine_behaviour={
            "bf16_where_quantized": "with modules_to_not_convert empty vLLM sees the BF16 dtype and builds it "
                                    "unquantized; with the list set the layer is created with qweight/qzeros/scales "
                                    "and the BF16 `weight` finds no parameter",
            "quantized_where_unquantized": "a listed module is created in the model dtype; qweight/qzeros/scales "
                                           "find no parameter",
            "missing": MISSING_MTP},
        cites=(Q + "auto_awq.py:174-300", Q + "auto_awq.py:370-388"), writes=(BF16_IGNORE,),
        why="BF16 MTP named in modules_to_not_convert",
        hooks=frozenset({"ignore_rule"})),
    Scheme(
        name="gptq", title="GPTQ (qweight/qzeros/scales/g_idx)", methods=("gptq", "gptq_marlin", "auto_gptq"),
        config_files=("config.json: quantization_config", "quantize_config.json"), codecs=("gptq",),
        ignore_keys={
            "dynamic": "vLLM: a `-:REGEX` key re.matched against the layer name builds it unquantized "
                       "(gptq_utils.py:85-103); Qwen3.5's MTP drops quantization for all MTP layers when such a key "
                       "names 'mtp' (qwen3_5_mtp.py:108-126); GPTQModel writes it",
            "modules_in_block_to_quantize": "vLLM: when set, a layer not named (substring) is unquantized "
                                            "(gptq_utils.py:120-169, 172-201)"},
        unquantized=ROUTER, mtp_unquantized=MTP_COMMON,
        engine_behaviour={
            "bf16_where_quantized": "the layer is created with qweight/qzeros/scales/g_idx; the BF16 `weight` finds "
                                    "no parameter",
            "quantized_where_unquantized": "the layer is created in the model dtype; the packed parts find no "
                                           "parameter",
            "missing": MISSING_MTP},
        cites=(Q + "auto_gptq.py:95-265", Q + "utils/gptq_utils.py:55-201", M + "qwen3_5_mtp.py:108-126"),
        writes=(BF16_IGNORE,), why="BF16 MTP named by a `dynamic` '-:' regex entry",
        hooks=frozenset({"ignore_rule"})),
)

# Methods recycle names but reads nothing of: inspect says what it cannot check, stitch refuses.
KNOWN_UNREAD = {
    "bitsandbytes": "bitsandbytes (4/8-bit, transformers)", "gguf": "GGUF quantization (llama.cpp)",
    "hqq": "HQQ", "quark": "AMD Quark", "torchao": "torchao", "fbgemm_fp8": "FBGEMM FP8", "fp_quant": "FP-Quant",
    "experts_int8": "experts INT8", "moe_wna16": "MoE WNA16", "inc": "Intel Neural Compressor", "eetq": "EETQ",
    "aqlm": "AQLM", "exl2": "ExLlamaV2", "exl3": "ExLlamaV3", "higgs": "HIGGS", "spqr": "SpQR", "vptq": "VPTQ",
    "bitnet": "BitNet", "hqq_mixed": "HQQ mixed", "mxfp8": "MXFP8", "modelopt_mxfp8": "ModelOpt MXFP8",
    "humming": "Humming",
}
SCHEMES += tuple(
    Scheme(name=method, title=title, methods=(method,), known=False, writes=None,
           why="recycle reads no tensor of this scheme: it cannot say which modules the engines build quantized",
           cannot_check="every tensor: recycle reads none of this scheme", engine_behaviour={"missing": MISSING_MTP})
    for method, title in KNOWN_UNREAD.items())

BY_NAME: Mapping[str, Scheme] = {s.name: s for s in SCHEMES}


# -- detection -------------------------------------------------------------------------------------------------------


def quant_config(config: Mapping) -> Mapping | None:
    """config.json's quantization_config, or its text_config's (multimodal wrappers)."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return q if isinstance(q, Mapping) and q else None


def _read_files(files: Iterable[str] | str | Path | None) -> Mapping | None:
    """hf_quant_config.json's content: from a directory, or a list of paths that may hold it."""
    if files is None:
        return None
    paths = [Path(files) / "hf_quant_config.json"] if isinstance(files, str | Path) else \
        [Path(f) for f in files if Path(f).name == "hf_quant_config.json"]
    for path in paths:
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise RecycleError(f"{path}: not readable JSON ({e})") from None
            if not isinstance(data, Mapping):
                raise RecycleError(f"{path}: not a JSON object")
            return data
    return None


def _unknown(method: str) -> Scheme:
    return Scheme(name=method, title=f"unknown quantization method {method!r}", methods=(method,), known=False,
                  why="recycle does not know this method: it cannot check what the engines build quantized",
                  cannot_check="every tensor: recycle does not know the method",
                  engine_behaviour={"missing": UNKNOWN_METHOD})


def detect(config: Mapping, files: Iterable[str] | str | Path | None = None) -> Scheme | None:
    """The scheme a checkpoint declares: None when unquantized, a `known=False` record for a method recycle does
    not know (named after it), else its record. `files`: the checkpoint directory, or its file paths (where
    hf_quant_config.json is looked for)."""
    q = quant_config(config)
    hf = _read_files(files)
    if hf is not None and isinstance(hf.get("quantization"), Mapping):
        if hf["quantization"].get("quant_algo"):
            return BY_NAME["modelopt"]
    if q is None:
        return None
    method = str(q.get("quant_method", "")).strip().lower()
    producer = q.get("producer") if isinstance(q.get("producer"), Mapping) else {}
    if method.startswith("modelopt") or (not method and "modelopt" in (q.get("quant_library"), producer.get("name"))):
        return BY_NAME["modelopt"]
    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    if method == "deepseek_v4_fp8" or (method == "fp8" and model_type == "deepseek_v4"):
        return BY_NAME["deepseek_v4"]
    if method == "fp8":
        return BY_NAME["fp8_block" if q.get("weight_block_size") else "fp8_tensor"]
    if not method:
        return _unknown("?")
    for scheme in SCHEMES:
        if scheme.name not in ("fp8_block", "fp8_tensor", "deepseek_v4") and method in scheme.methods:
            return scheme
    return _unknown(method)


def scheme_config(config: Mapping, files: Iterable[str] | str | Path | None = None) -> Mapping:
    """The config a scheme's rule reads: hf_quant_config.json where ModelOpt wrote one, else quantization_config."""
    hf = _read_files(files)
    if hf is not None and isinstance(hf.get("quantization"), Mapping):
        return hf
    return quant_config(config) or {}


def engine_ignores(scheme: Scheme, module: str, config: Mapping) -> bool:
    """Whether vLLM builds `module` unquantized in a `scheme` checkpoint; one line where recycle has no rule."""
    rule: Callable[[str, Mapping], bool] = IGNORE_RULES.get(scheme.name, scheme.title)
    return rule(module, config)


# (added for inspect's MTP audit, issue 48 part 2) MTP_COMMON as data: per recycle family (`recycle.families`
# row name), the MTP roles its vLLM 0.32 MTP model builds without the quant_config, keyed by the vLLM quant config
# name (`get_name()`) under which it does so ("*": under every scheme).
MTP_PLAIN_ROLES: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "deepseek_v3": {"*": ("proj",)},  # eh_proj = nn.Linear (deepseek_mtp.py:87)
    "deepseek_v32": {"*": ("proj",)},  # DeepseekV32MTPModel (config/speculative.py:663-691): nn.Linear,
    "glm_moe_dsa": {"*": ("proj",)},  # vllm 0.32 models/deepseek_v32/nvidia/mtp.py:74
    "glm5_next": {"*": ("proj",)},  # vllm 0.32 models/glm5next/common/mtp.py:53
    "glm4_moe": {"*": ("proj",)},  # glm4_moe_mtp.py:92
    "mimo_v2_flash": {"*": ("proj",)},  # ReplicatedLinear without quant_config (mimo_v2_mtp.py:75-77)
    "step3p7": {"*": ("proj",)},  # step3p5_mtp.py:68
    "qwen3_next": {"modelopt_fp4": ("proj",)},  # fc unquantized under modelopt_fp4 only (qwen3_5_mtp.py:89-105)
}


def vllm_quant_name(scheme: Scheme, config: Mapping) -> str:
    """(added for the audit) The name vLLM 0.32 gives the quant config (`get_name()`), where the MTP models branch
    on it: ModelOpt with a quant_algo holding "FP4" is `modelopt_fp4` (modelopt.py:775-777); else the record's."""
    if scheme.name == "modelopt":
        algo = str(modelopt_section(config).get("quant_algo", "")).upper()
        return "modelopt_fp4" if "FP4" in algo else "modelopt_mixed" if algo == "MIXED_PRECISION" else "modelopt"
    return scheme.name


# ModelOpt's quant_algo (the whole model's, or a MIXED_PRECISION layer's in `quantized_layers`) → the storage it
# writes that layer in: the codec stitch writes ("fp8_block": FP8 weights in 128×128 blocks under ModelOpt's scale
# name, `weight_scale`), or a description where recycle writes none (vllm 0.32 modelopt.py:139-156 LINEAR_ALGOS,
# 1813-1883 the MIXED_PRECISION layer lookup; 2104-2269 the FP8 parameters per algo).
MODELOPT_ALGOS: Mapping[str, str] = {
    "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8_PB_WO": "fp8_block", "FP8_BLOCK_SCALES": "fp8_block",
    "FP8": "modelopt FP8 per-tensor", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt FP8 per-channel",
}


def modelopt_layer_algo(module: str, config: Mapping) -> str:
    """The quant_algo ModelOpt gives one checkpoint module: the config's own, or under MIXED_PRECISION the layer's
    `quantized_layers` entry (by its name, else its vLLM layer's: a shard's fused layer, an expert's container);
    "" where the config names none for it."""
    section = modelopt_section(config)
    algo = str(section.get("quant_algo", "")).upper()
    if algo == "MIXED_PRECISION":
        layers = section.get("quantized_layers") or {}
        entry = layers.get(module) or layers.get(vllm_prefix(module)) or {}
        algo = str(entry.get("quant_algo", "")).upper() if isinstance(entry, Mapping) else ""
    return algo

