"""`--to eagle`: the MTP modules as a lossless EAGLE-style drafter, in up to three layouts
(`--layouts`, default all: serving on one engine needs only its own).

1. recycle's own layout (top of OUT, loaded by `recycle.drafters.load_drafter`): see
   `recycle/drafters/eagle.py` for names. Every tensor is the source tensor itself, in canonical
   form (norms as plain `w`, projection columns [e; h]); nothing is approximated or fresh.
2. `nextn/`: module 0 as a stand-alone NextN checkpoint in SGLang's export layout
   (`scripts/export_deepseek_nextn.py`): the family's own tensor names with the module renumbered
   to layer 0, embedding and head left out (SGLang takes the target's), `num_hidden_layers: 1`,
   `architectures: [family.exports.nextn_architecture]`, weights in the output dtype (no FP8). Written only
   for families whose table row names a NextN class.
3. `mtp_overlay/`: every stored MTP tensor under its original name, byte for byte (FP8 weights
   keep their `_scale_inv`; `--dtype` does not apply, so the tensors match the target's
   quantization), the index fragment `mtp.safetensors.index.json` and the source's config.json
   as stored; `recycle.converters.overlay.stitch` puts them back
   into a copy of the target for vLLM `method: "mtp"` / llama.cpp `draft-mtp`.

    mapping (per module k)                          kind
    embed.weight          ← module 0 embed (copy or trunk's)   exact
    head.weight           ← module 0 head  (copy or trunk's)   exact
    layers.k.embed_norm   ← enorm / pre_fc_norm_embedding / …  exact (1+w written as 1 + w)
    layers.k.hidden_norm  ← hnorm / pre_fc_norm_hidden / …     exact (1+w written as 1 + w)
    layers.k.proj         ← eh_proj / fc / input_proj          exact ([h; e] halves swapped)
    layers.k.final_norm   ← shared_head.norm / mtp.norm / …    exact (1+w written as 1 + w)
    layers.k.block.*      ← the module's decoder block         exact (FP8 dequantized)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from recycle.checkpoint import STORAGE_KEYS
from recycle.converters.registry import CONVERTERS, REWRITERS
from recycle.converters.roles import Plan, RoleWeights, raw, require_sequential, same_values
from recycle.errors import RecycleError, did_you_mean
from recycle.formats.eagle import MODEL_TYPE
from recycle.io.writer import Lazy
from recycle.mtp import RUNTIMES

ARCHITECTURE = "RecycleEagleDrafter"
WEIGHTS = "model.safetensors"
NEXTN_WEIGHTS = "nextn_layer_parameters.safetensors"  # SGLang's export file name
OVERLAY_WEIGHTS = "mtp.safetensors"
OVERLAY_INDEX = "mtp.safetensors.index.json"
DROP_KEYS = (*STORAGE_KEYS, "text_config", "vision_config")
LAYOUT_NAMES = ("recycle", "nextn", "overlay")  # the three layouts above, in order


def model_config(w: RoleWeights) -> dict:
    """The source's (text) model config without storage keys: what the block classes are built from."""
    return {k: v for k, v in w.config.items() if k not in DROP_KEYS}


# role → the drafter's parameter name within module k (`layers.{k}.`), for the common layout; a family with a
# runtime of its own names its own (`leaves` of its class in recycle.mtp.RUNTIMES: DeepSeek-V4's e/h projections
# and hc_head)
LEAVES = {role: f"{role}.weight" for role in ("embed_norm", "hidden_norm", "proj", "final_norm")}


def _leaves(w: RoleWeights) -> dict[str, str]:
    if w.family.run.runtime is None:
        return LEAVES
    own = RUNTIMES.get(w.family.run.runtime, w.family.title).leaves
    return {role: param for role, param in own.items() if role not in ("head", "embed")}


def _as_stored(w: RoleWeights, lazy: Lazy) -> Lazy:
    """A runtime row's tensor the release stores in float32 (DeepSeek-V4's hyper-connection mixing, sinks,
    compressor biases) stays float32 whatever --dtype says, as the release keeps it; others as given."""
    if w.family.run.runtime is None or lazy.dtype is not None or len(lazy.sources) != 1:
        return lazy
    info = w.ckpt.tensors.get(lazy.sources[0])
    if info is None or info.dtype != "F32":
        return lazy
    return dataclasses.replace(lazy, dtype=torch.float32)


def drafter_tensors(w: RoleWeights) -> dict[str, Lazy]:
    m0 = w.modules[0]
    out: dict[str, Lazy] = {"embed.weight": m0.leaves["embed"], "head.weight": m0.leaves["head"]}
    leaves = _leaves(w)
    for k, mod in enumerate(w.modules):
        for role, param in leaves.items():
            if role in mod.leaves:
                out[f"layers.{k}.{param}"] = _as_stored(w, mod.leaves[role])
        if k > 0:  # a module with its own, different head/embedding keeps it (fine-tuned copies)
            for role in ("head", "embed"):
                a, b = mod.leaves[role].sources[0], m0.leaves[role].sources[0]
                if not same_values(w.ckpt, a, b):
                    out[f"layers.{k}.{role}.weight"] = mod.leaves[role]
        for rel, lazy in mod.block.items():
            out[f"layers.{k}.block.{rel}"] = _as_stored(w, lazy)
    return out


def drafter_config(w: RoleWeights, dtype_name: str) -> dict:
    """The source's model config under recycle's own model type (which no plain model class loads: see
    `recycle.formats.eagle`), the source's model type kept in the `recycle` block for the block classes."""
    fam = w.family
    cfg = model_config(w)
    return {
        **cfg,
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "torch_dtype": dtype_name,
        "recycle": {
            "format": "eagle",
            "model_type": cfg.get("model_type"),
            "family": fam.name,
            "depth": len(w.modules),
            "chained_state": fam.run.chained_state,
            "zero_embed_at_pos0": fam.run.zero_embed_at_pos0,
            "block_class": fam.run.block_class,
            "norm": "w",
            "concat_order": "eh",
            "source_num_hidden_layers": w.num_hidden_layers,
        },
    }


def nextn(w: RoleWeights, dtype_name: str) -> tuple[dict[str, Lazy], dict] | None:
    """Module 0 in SGLang's NextN export layout, or None when the family has no NextN class."""
    fam = w.family
    if fam.exports.nextn_architecture is None:
        return None
    ctx = {"k": 0, "layer": 0, "first": 0, "last": 0, "s": 0}
    m0 = w.modules[0]
    tensors: dict[str, Lazy] = {}
    for role in ("embed_norm", "hidden_norm", "proj", "final_norm"):
        if role in m0.stored_leaves and role in fam.layout.roles:
            tensors[fam.layout.roles[role][0].format(**ctx)] = m0.stored_leaves[role]
    prefix = fam.layout.block[0].format(**ctx)
    for rel, lazy in m0.block.items():
        tensors[prefix + rel] = lazy
    config = {**model_config(w), "architectures": [fam.exports.nextn_architecture], "num_hidden_layers": 1,
              "torch_dtype": dtype_name}
    for key in fam.keys.depth_keys[:1]:
        config[key] = 1
    return tensors, config


def overlay(w: RoleWeights) -> tuple[dict[str, Lazy], dict]:
    """Every stored MTP tensor under its original name, raw, and the index fragment naming them. A packed weight
    (DeepSeek-V4's FP4 experts: codes and an e8m0 `.scale`) is every one of its stored parts."""
    packed = w.ckpt.packed
    names = sorted({part for n in w.match.mtp_names for part in (packed[n].parts.values() if n in packed else (n,))})
    tensors = {n: raw(w.ckpt, n) for n in names}
    total = sum(w.ckpt.stored[n].nbytes for n in names)
    index = {
        "metadata": {"total_size": total, "format": "recycle-mtp-overlay", "family": w.family.name,
                     "modules": len(w.modules), "depth_key": (w.family.keys.depth_keys or (None,))[0],
                     "source": str(w.ckpt.path)},
        "weight_map": {n: OVERLAY_WEIGHTS for n in names},
    }
    return tensors, index


def chosen_layouts(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """`--layouts recycle,nextn` → ("recycle", "nextn") in canonical order; None → all three."""
    if value is None:
        return LAYOUT_NAMES
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    choices = f"a comma list of {', '.join(LAYOUT_NAMES)}"
    if not names:
        raise RecycleError(f"--layouts is empty ({choices})")
    bad = [n for n in names if n not in LAYOUT_NAMES]
    if bad:
        raise RecycleError(f"unknown layout '{bad[0]}' in --layouts ({choices}){did_you_mean(bad[0], LAYOUT_NAMES)}")
    return tuple(n for n in LAYOUT_NAMES if n in names)


@CONVERTERS.register("eagle")
def convert(w: RoleWeights, req) -> Plan:
    """Role weights → the layouts `--layouts` chose (`req`: converters.registry.ConvertRequest)."""
    require_sequential(w, "eagle")
    layouts, dtype_name = chosen_layouts(req.options.layouts), req.dtype_name
    plan = Plan(tensors={}, jsons={}, tokenizer_dirs=(), layouts=layouts)
    if "recycle" in layouts:
        plan.tensors[WEIGHTS] = drafter_tensors(w)
        plan.jsons["config.json"] = drafter_config(w, dtype_name)
        plan.tokenizer_dirs += ("",)
    if "nextn" in layouts:
        _add_nextn(plan, w, dtype_name)
    if "overlay" in layouts:
        tensors, index = overlay(w)
        plan.tensors[f"mtp_overlay/{OVERLAY_WEIGHTS}"] = tensors
        plan.jsons[f"mtp_overlay/{OVERLAY_INDEX}"] = index
        plan.jsons["mtp_overlay/config.json"] = dict(w.ckpt.config)  # the target's config, as stored
        runs = w.family.exports.vllm_modules
        if runs is not None and len(w.modules) > runs:
            first = "module 0" if runs == 1 else f"modules 0-{runs - 1}"
            plan.notes.append(f"mtp_overlay/ holds all {len(w.modules)} modules, but vLLM's MTP model for "
                              f"'{w.family.name}' runs {first} only, at every draft step; recycle bench and the "
                              f"EAGLE layout chain each module at its own depth")
        if w.family.exports.vllm_note:
            plan.notes.append(w.family.exports.vllm_note)
    return plan


def _add_nextn(plan: Plan, w: RoleWeights, dtype_name: str) -> None:
    nx = nextn(w, dtype_name)
    if nx is None:
        plan.notes.append(f"no nextn/: SGLang has no stand-alone NextN class for family '{w.family.name}'")
        return
    tensors, config = nx
    plan.tensors[f"nextn/{NEXTN_WEIGHTS}"] = tensors
    plan.jsons["nextn/config.json"] = config
    plan.jsons["nextn/model.safetensors.index.json"] = {
        "metadata": {"total_size": 0}, "weight_map": {n: NEXTN_WEIGHTS for n in sorted(tensors)}}
    plan.tokenizer_dirs += ("nextn/",)
    if len(w.modules) > 1:
        plan.notes.append(f"nextn/ holds module 0 only (SGLang's NextN loader takes exactly one of the "
                          f"{len(w.modules)} modules)")


@REWRITERS.register("eagle")
def rewrite(src, main: dict, model) -> tuple[dict, list[str], list[str]]:
    """EAGLE's layout rewriter: `nextn/` and `mtp_overlay/` from the trained modules, in their stored names,
    shapes and dtypes; an overlay stored in block FP8 (a DeepSeek-V3/R1 release's) stays FP8: each trained weight is
    re-quantized in the source's blocks with fresh scales, so `recycle stitch` takes it straight back. A layout
    whose key set cannot be rebuilt exactly (a family whose stored norms or concatenation are not canonical, a
    quantization recycle cannot write) is dropped with a note rather than shipped stale."""
    from recycle.converters.rewrite import canonical_concat, overlay_layouts
    from recycle.fused import scale_chunks
    from recycle.quant import CODECS, NATIVE_SCALE_SUFFIX, SCALE_SUFFIX, requantize

    files: dict[str, dict] = {}
    dropped, notes = [], []
    canonical = canonical_concat(src)
    for lay in overlay_layouts(src):
        named = model.checkpoint_tensors(num_hidden_layers=lay.base) if canonical else {}
        out, why = {}, None
        for k in lay.head:
            how = lay.rebuilt_as(k, tuple(named[k].shape) if k in named else None, canonical)
            if how == "fp8":  # a pre-sharded fused weight chunk by chunk, its scales tiled as stored (recycle.fused)
                chunks = scale_chunks(k, model.family.layout.fused, model.config)
                out[k], out[k + SCALE_SUFFIX], _ = requantize(named[k], lay.fp8.block, row_chunks=chunks)
            elif how == "fp8_native":  # DeepSeek-V4's linears: e8m0 `.scale`, power-of-two scales
                scale = k[: -len(".weight")] + NATIVE_SCALE_SUFFIX
                out[k], s, _ = requantize(named[k], lay.fp8.block, pow2=True)
                out[scale] = s.reshape(lay.head[scale][0]).to(torch.float8_e8m0fnu)
            elif how == "codec":  # a packed weight (V4's FP4 experts): every part from its storage codec, once
                logical, codec = lay.packed[k]
                if k not in out and logical in named:
                    out.update(CODECS.get(codec).quantize(named[logical].float(), logical, lay.quant))
                elif k not in out:
                    why = f"{logical} is not a trained weight"
            elif how == "plain":
                out[k] = named[k]
            elif how != "scale":
                why = how
        if why is None:  # back into the files (shards) they came from
            files.update({f"{lay.sub}/{name}": {k: out[k] for k in part} for name, part in lay.parts.items()})
        else:
            dropped.append(lay.sub)
            notes.append(lay.dropped(why))
    return files, dropped, notes
