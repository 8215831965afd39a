"""`convert_checkpoint`: reader → role weights → one converter → the atomic writer → recycle.json.

The CLI and the benchmarks call this; the converters themselves stay pure (weights in, plan out).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from collections.abc import Iterable
from datetime import datetime, timezone

import torch

from recycle.converters import assistant, eagle, eagle3, medusa
from recycle.converters.calibrate import DEFAULT_STEPS as CALIBRATE_STEPS
from recycle.converters.roles import APPROX, EXACT, FRESH, Backbone, Lazy, Plan, RoleWeights, backbone, gather
from recycle.converters.writer import OutputDir, Progress, ST_DTYPES
from recycle import __version__
from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FORMATS = ("eagle", "eagle3", "medusa")
LAYOUTS = {
    "eagle": {
        "model.safetensors": "recycle EAGLE drafter (recycle.drafters.load_drafter)",
        "nextn/": "SGLang NextN export (module 0, layer 0, num_hidden_layers 1)",
        "mtp_overlay/": "MTP tensors under their original names, stored bytes; `recycle stitch` puts them back",
    },
    "eagle3": {"model.safetensors": "EAGLE-3 official/SpecForge layout (midlayer.*), speculators keys in config.json"},
    "medusa": {"model.safetensors": "vLLM Medusa layout (blocks.*, lm_heads.*)",
               "medusa_lm_head.safetensors": "FasterDecoding Medusa v1 layout ({i}.{j}.linear.*, {i}.L.weight)"},
}


def parse_layouts(to: str, layouts: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """`--layouts recycle,nextn` → ("recycle", "nextn") in canonical order; None for formats with one layout."""
    if layouts is None:
        return eagle.LAYOUT_NAMES if to == "eagle" else None
    if to != "eagle":
        raise RecycleError("--layouts applies to --to eagle only")
    names = [n.strip() for n in (layouts.split(",") if isinstance(layouts, str) else layouts) if n.strip()]
    choices = f"a comma list of {', '.join(eagle.LAYOUT_NAMES)}"
    if not names:
        raise RecycleError(f"--layouts is empty ({choices})")
    bad = [n for n in names if n not in eagle.LAYOUT_NAMES]
    if bad:
        raise RecycleError(f"unknown layout '{bad[0]}' in --layouts ({choices})")
    return tuple(n for n in eagle.LAYOUT_NAMES if n in names)


def plan_for(w: RoleWeights, to: str, *, dtype: str, heads: int | None, draft_ids: torch.Tensor | None,
             layouts: tuple[str, ...] | None = None, attention: str = "llama", bb: Backbone | None = None) -> Plan:
    name = DTYPE_NAMES[dtype]
    if w.family.kind == "drafter":  # a Gemma 4 assistant: EAGLE-3 by the fold, Medusa by calibration
        if to == "eagle":
            raise RecycleError(f"{w.ckpt.path}: a {w.family.title} has no MTP block for --to eagle; use --to eagle3 "
                               "or --to medusa")
        if bb is None:
            raise RecycleError(f"{w.ckpt.path}: a {w.family.title} reads its target's states, norm and head: pass "
                               f"--target (the model it drafts for){' with --calibrate TOKENS' if to == 'medusa' else ''}")
        from recycle.drafters.gemma4 import TARGET_TYPES

        if bb.config.get("model_type") not in TARGET_TYPES:
            raise RecycleError(f"--target {bb.path}: a Gemma 4 assistant drafts for a Gemma 4 model, not "
                               f"{bb.config.get('model_type')!r}")
        if to == "eagle3":
            if attention != "llama":
                raise RecycleError("--eagle3-attention mla needs an MLA source; an assistant folds into the llama one")
            return assistant.convert(w, bb, draft_ids=draft_ids, dtype_name=name)
        return medusa.convert(w, heads=medusa.DEFAULT_HEADS if heads is None else heads, dtype_name=name, backbone=bb)
    if to != "medusa" and w.family.kind != "mtp":
        raise RecycleError(f"{w.ckpt.path}: family '{w.family.name}' holds {w.family.kind.replace('_', ' ')}, not "
                           f"sequential MTP modules: there is no embedding input for --to {to}; use --to medusa")
    if to == "eagle":
        return eagle.convert(w, dtype_name=name, layouts=layouts or eagle.LAYOUT_NAMES)
    if to == "eagle3":
        return eagle3.convert(w, draft_ids=draft_ids, dtype_name=name, attention=attention)
    return medusa.convert(w, heads=medusa.DEFAULT_HEADS if heads is None else heads, dtype_name=name)


def mapping_rows(plan: Plan, dtype: torch.dtype) -> list[dict]:
    rows = []
    for file, tensors in plan.tensors.items():
        for name, lazy in tensors.items():
            dt = lazy.dtype or dtype
            rows.append({"file": file, "tensor": name, "shape": list(lazy.shape), "dtype": ST_DTYPES[dt],
                         "from": list(lazy.sources), "kind": lazy.kind, **({"note": lazy.note} if lazy.note else {})})
    return rows


def provenance(w: RoleWeights, to: str, dtype: str, options: dict, plan: Plan, rows: list[dict]) -> dict:
    m = w.match
    return {
        "recycle_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "path": str(w.ckpt.path.resolve()),
            "family": w.family.name,
            "family_title": w.family.title,
            "model_type": w.ckpt.config.get("model_type"),
            "architectures": w.ckpt.config.get("architectures"),
            "modules": len(w.modules),
            "declared": m.declared,
            "module_prefixes": [mod.prefix for mod in w.modules],
            "fp8": any(w.ckpt.tensors[n].is_fp8 for n in m.mtp_names),
        },
        "target": {"format": to, "dtype": DTYPE_NAMES[dtype], "options": options,
                   "layouts": {k: v for k, v in LAYOUTS[to].items()  # the ones written
                               if any(f == k or (k.endswith("/") and f.startswith(k)) for f in plan.tensors)}},
        "summary": {"tensors": len(rows), **{k: sum(r["kind"] == k for r in rows) for k in (EXACT, APPROX, FRESH)}},
        "notes": plan.notes,
        "mapping": rows,
    }


def calibrated(plan: Plan, source: str | os.PathLike, target: str | os.PathLike, heads: int, tokens: int,
               data: str | None, steps: int) -> dict:
    """Replace the plan's identity ResBlocks by ones fitted to the source's heads (recycle.converters.calibrate);
    returns the record for recycle.json."""
    from recycle.converters import calibrate
    from recycle.converters.medusa import FD_WEIGHTS, LAYERS, WEIGHTS

    feats = calibrate.collect(source, target, heads, tokens, data)
    fitted = calibrate.fit(feats, steps=steps)
    for i, f in enumerate(fitted):
        rep = f.report
        note = (f"calibrated on {feats.tokens:,} tokens: held-out KL to the source head "
                f"{rep['identity']['kl']:.3f} → {rep['calibrated']['kl']:.3f}, top-1 agreement "
                f"{rep['identity']['top1_agreement']:.3f} → {rep['calibrated']['top1_agreement']:.3f}")
        for name, t in (("weight", f.weight), ("bias", f.bias)):
            lazy = Lazy(tuple(t.shape), (lambda t=t: t), (f"calibration: source head {i}",), APPROX, note)
            plan.tensors[WEIGHTS][f"blocks.{i}.layers.{LAYERS - 1}.{name}"] = lazy
            plan.tensors[FD_WEIGHTS][f"{i}.{LAYERS - 1}.linear.{name}"] = lazy
    plan.notes.extend(feats.notes)
    return {"tokens": feats.tokens, "data": data or "stdlib", "target": str(Path(target).resolve()),
            "steps": steps, "lr": calibrate.DEFAULT_LR,
            "objective": "KL(P_source_head ‖ P_medusa_head), the head's LM head fixed, ResBlock from the identity",
            "heads": [f.report for f in fitted]}


def convert_checkpoint(source: str | os.PathLike, to: str, out: str | os.PathLike, *, heads: int | None = None,
                       draft_vocab: int | None = None, vocab_corpus: str | os.PathLike | None = None,
                       dtype: str = "bf16", overwrite: bool = False, progress: Progress | None = None,
                       layouts: str | Iterable[str] | None = None, calibrate: int | None = None,
                       target: str | os.PathLike | None = None, data: str | None = None,
                       calibrate_steps: int = CALIBRATE_STEPS, eagle3_attention: str | None = None) -> dict:
    """Convert the MTP modules of `source` into a drafter directory `out`; returns a summary dict.

    `layouts` (eagle only): which of recycle, nextn, overlay to write; default all three.
    `eagle3_attention` (eagle3 only): "llama" (portable, the default) or "mla" (vLLM's DeepSeek EAGLE-3).
    `calibrate` (medusa only): fit the ResBlocks on this many tokens of `data` run through `target`
    (default: the source itself), instead of leaving them at the identity.
    """
    started = time.perf_counter()
    if to not in FORMATS:
        raise RecycleError(f"unknown format '{to}' (choose from {', '.join(FORMATS)})")
    if dtype not in DTYPES:
        raise RecycleError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    if heads is not None and to != "medusa":
        raise RecycleError("--heads applies to --to medusa only")
    if (draft_vocab is not None or vocab_corpus is not None) and to != "eagle3":
        raise RecycleError("--draft-vocab/--vocab-corpus apply to --to eagle3 only")
    if eagle3_attention is not None and to != "eagle3":
        raise RecycleError("--eagle3-attention applies to --to eagle3 only")
    if vocab_corpus is not None and draft_vocab is None:
        raise RecycleError("--vocab-corpus needs --draft-vocab N")
    if (calibrate is not None or data is not None) and to != "medusa":
        raise RecycleError("--calibrate/--data apply to --to medusa only")
    if target is not None and to == "eagle":
        raise RecycleError("--target applies to --to medusa (with --calibrate) and --to eagle3 (from an assistant)")
    if (target is not None or data is not None) and calibrate is None and to == "medusa":
        raise RecycleError("--target/--data need --calibrate TOKENS")
    if calibrate is not None and calibrate < 1:
        raise RecycleError("--calibrate must be at least 1 token")
    chosen = parse_layouts(to, layouts)
    ckpt = Checkpoint(source)
    writer = OutputDir(out, overwrite=overwrite, protect=(ckpt.path,))  # refuses a bad OUT before any reading
    if target is not None:
        from recycle.fit import check_fit
        from recycle.preflight import checkpoint_dir

        check_fit(ckpt.config, checkpoint_dir(target), ckpt.path, target, f"--target {target}")
    w = gather(ckpt)
    drafter = w.family.kind == "drafter"
    if target is not None and to == "eagle3" and not drafter:
        raise RecycleError("--target with --to eagle3 is for a Gemma 4 assistant source (MTP modules carry their "
                           "trunk's norm and head)")
    if drafter and to == "medusa" and calibrate is None:
        raise RecycleError(f"{ckpt.path}: Medusa heads from a {w.family.title} are fitted to it: pass --calibrate "
                           "TOKENS --target TARGET")
    bb = backbone(target) if drafter and target is not None else None
    draft_ids = None
    if draft_vocab is not None:
        from recycle.converters.vocab import draft_vocab as top_tokens

        # an assistant ships no tokenizer: its target's is the one it shares
        draft_ids = top_tokens(bb.path if bb is not None else ckpt.path, draft_vocab, w.vocab_size, vocab_corpus)
    plan = plan_for(w, to, dtype=dtype, heads=heads, draft_ids=draft_ids, layouts=chosen,
                    attention=eagle3_attention or "llama", bb=bb)
    if not plan.tensors:
        raise RecycleError(f"--layouts {','.join(chosen or ())}: nothing to write ({'; '.join(plan.notes)})")
    calibration = None
    if calibrate is not None:
        calibration = calibrated(plan, ckpt.path, target or ckpt.path, heads or medusa.DEFAULT_HEADS, calibrate, data,
                                 calibrate_steps)
    rows = mapping_rows(plan, DTYPES[dtype])
    options = {"heads": heads, "draft_vocab": draft_vocab, "vocab_corpus": str(vocab_corpus) if vocab_corpus else None,
               "layouts": list(chosen) if chosen else None, "calibrate": calibrate,
               "eagle3_attention": eagle3_attention}
    record = provenance(w, to, dtype, options, plan, rows)
    if calibration is not None:
        record["calibration"] = calibration
    with writer as d:
        d.write_safetensors(plan.tensors, DTYPES[dtype], progress=progress,
                            metadata={"recycle_format": to, "recycle_source_family": w.family.name})
        for rel, obj in plan.jsons.items():
            d.write_json(rel, obj)
        copied = [f for sub in plan.tokenizer_dirs for f in d.copy_tokenizer(ckpt.path, sub)]
        d.write_json("recycle.json", record)
        files = dict(sorted(d.files.items()))
    return {
        "out": str(writer.out),
        "format": to,
        "dtype": DTYPE_NAMES[dtype],
        "family": w.family.name,
        "modules": len(w.modules),
        "files": files,
        "bytes": sum(files.values()),
        "tokenizer_files": copied,
        "summary": record["summary"],
        "notes": plan.notes,
        "seconds": round(time.perf_counter() - started, 3),
    }


def stitch_overlay(overlay: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, *,
                   overwrite: bool = False, progress: Progress | None = None) -> dict:
    from recycle.converters.overlay import stitch

    return stitch(overlay, target, out, overwrite=overwrite, progress=progress)

