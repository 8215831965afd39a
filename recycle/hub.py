"""Publishing a drafter directory to the Hugging Face Hub: validate it, write its model card, upload it.

Why each step is here:
  * validation runs before any network call, because a bad drafter on the Hub is served by other
    people's engines: the layout must be the one recycle.json declares (the drafter class loads it
    strictly, every safetensors header equals the mapping table convert wrote), weights finite;
  * the card is generated from recycle.json (provenance, mapping), bench.json (measured τ and
    speedup) and the format's serving commands, so what is published says how it was made;
  * the upload is one `create_commit` after `create_repo`/`create_branch`: files are pre-uploaded
    first and the commit call is the only step that changes the repository, so a failure at any
    earlier point leaves nothing. (`upload_folder` in huggingface_hub ≥ 1.x with hf_xet splits a
    large folder into several "(part N)" commits, and it cannot add the generated README.md without
    writing into the input directory, so it is not used.)
The token is resolved by huggingface_hub (HF_TOKEN, then the saved login) and only ever handed to
HfApi; nothing here prints, logs or writes it. The endpoint follows HF_ENDPOINT at call time.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from recycle import __version__
from recycle.checkpoint import Checkpoint, load_json
from recycle.drafters import FORMATS, config_format, load_drafter
from recycle.errors import RecycleError
from recycle.preflight import drafter_record

DEFAULT_ENDPOINT = "https://huggingface.co"
CARD = "README.md"
BENCH = "bench.json"
PROVENANCE = "recycle.json"
LIBRARY = "recycle"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
ATTEMPTS_ENV, BACKOFF_ENV = "RECYCLE_HUB_ATTEMPTS", "RECYCLE_HUB_BACKOFF"
DEFAULT_ATTEMPTS, DEFAULT_BACKOFF = 3, 2.0
TRANSIENT_STATUS = (500, 502, 503, 504)
MAPPING_ROWS_SHOWN = 40
Progress = Callable[[int, int], None]


@dataclass
class Drafter:
    """A validated drafter directory: what the card is written from and what would be uploaded."""

    path: Path
    format: str
    record: dict  # recycle.json
    config: dict  # config.json
    files: dict[str, int]  # relative path -> bytes, every file that goes up (the card excluded)
    tensors: int  # tensors checked for NaN/Inf
    bench: dict | None  # bench.json (`recycle bench --json`), when present
    notes: list[str] = field(default_factory=list)


# -- validation -----------------------------------------------------------------------------------


def _hidden(rel: PurePosixPath) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _listing(d: Path) -> dict[str, int]:
    """Every non-hidden file under d (relative POSIX path -> bytes), sorted."""
    files = {}
    for p in sorted(d.rglob("*")):
        rel = PurePosixPath(p.relative_to(d).as_posix())
        if p.is_file() and not _hidden(rel):
            files[str(rel)] = p.stat().st_size
    return files


def _check_module(d: Path) -> None:
    """Build the format's drafter module strictly from config.json + model.safetensors on the meta device:
    the drafter classes own each format's key set and shapes, so a missing, extra or misshapen tensor
    fails here without allocating the module's memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "copying into a meta parameter is a no-op": intended
        with torch.device("meta"):
            load_drafter(d)


def _check_mapping(d: Path, record: dict, ckpts: dict[str, Checkpoint], st_files: list[str]) -> list[str]:
    """Every safetensors header must hold exactly the tensors (names, shapes, dtypes) recycle.json maps to it."""
    rows = record.get("mapping")
    if rows is None:
        return ["recycle.json has no mapping table: the layout was checked against the drafter class only"]
    planned: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    try:
        for row in rows:
            planned.setdefault(row["file"], {})[row["tensor"]] = (tuple(int(n) for n in row["shape"]), row["dtype"])
    except (KeyError, TypeError, ValueError):
        raise RecycleError(f"{d / PROVENANCE}: malformed mapping table (rows need file, tensor, shape, dtype)") from None
    notes = []
    for sub in sorted(_dropped_layouts(d, record, planned)):
        planned = {f: v for f, v in planned.items() if not f.startswith(sub)}
        notes.append(f"{sub} is not here: distillation dropped it (recycle.json still maps the converted layout)")
    for f in sorted(set(planned) - set(st_files)):
        raise RecycleError(f"{d / f}: missing, but recycle.json maps {len(planned[f])} tensors to it")
    for f in st_files:
        if f not in planned:
            raise RecycleError(f"{d / f}: not in recycle.json's mapping table; remove it or re-run recycle convert")
        sub, name = str(PurePosixPath(f).parent), PurePosixPath(f).name
        stored = {i.name: (i.shape, i.dtype) for i in ckpts[sub].tensors.values() if i.file == name}
        want = planned[f]
        missing, extra = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
        if missing:
            raise RecycleError(f"{d / f}: lacks {len(missing)} tensor(s) recycle.json maps to it (first: {missing[0]})")
        if extra:
            raise RecycleError(f"{d / f}: holds {len(extra)} tensor(s) recycle.json does not map (first: {extra[0]})")
        for t, (shape, dtype) in want.items():
            if stored[t] != (shape, dtype):
                raise RecycleError(f"{d / f}: {t} is {stored[t][1]} {list(stored[t][0])}, "
                                   f"recycle.json says {dtype} {list(shape)}")
    return notes


def _dropped_layouts(d: Path, record: dict, planned: dict) -> set[str]:
    """Subfolder layouts a distilled drafter no longer has as a whole (distill drops nextn/ or mtp_overlay/
    when it cannot rebuild them exactly); a folder that is present but incomplete is still an error."""
    if not _distillation(record):
        return set()
    subs = {f.split("/")[0] + "/" for f in planned if "/" in f}
    subs |= {k for k in (record.get("target") or {}).get("layouts") or {} if k.endswith("/")}
    return {sub for sub in subs if not (d / sub).exists()}


def _read_bench(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = load_json(path, "bench report")
    spec = (data.get("overall") or {}).get("spec")
    if not isinstance(spec, dict) or "tau" not in spec:
        raise RecycleError(f"{path}: not a `recycle bench --json` report (no overall.spec.tau)")
    return data


def validate_drafter(path: str | os.PathLike, progress: Progress | None = None) -> Drafter:
    """Refuse (RecycleError) a directory whose layout, config or weights do not match the format it declares."""
    record = drafter_record(path)
    d = Path(path).expanduser().resolve()
    fmt = (record.get("target") or {}).get("format")
    if fmt not in FORMATS:
        raise RecycleError(f"{d / PROVENANCE}: target.format is {fmt!r}, expected one of {', '.join(FORMATS)}")
    config = load_json(d / "config.json", "config.json")
    described = config_format(config)
    if described != fmt:
        raise RecycleError(f"{d / 'config.json'}: describes {described or 'no known drafter format'}, "
                           f"but recycle.json declares {fmt}")
    _check_module(d)
    files = _listing(d)
    st_files = [f for f in files if f.endswith(".safetensors")]
    ckpts = {sub: Checkpoint(d / sub) for sub in sorted({str(PurePosixPath(f).parent) for f in st_files})}
    notes = _check_mapping(d, record, ckpts, st_files)
    dropped = _dropped_layouts(d, record, {})
    for rel in (record.get("target") or {}).get("layouts") or {}:
        if not (d / rel).exists() and rel not in dropped:
            raise RecycleError(f"{d / rel}: missing, but recycle.json lists it as a layout of this drafter")
    total = sum(len(c.tensors) for c in ckpts.values())
    done = 0
    for ckpt in ckpts.values():
        for name, info in ckpt.tensors.items():
            for chunk in ckpt.iter_chunks(name):
                if not bool(torch.isfinite(chunk).all()):
                    raise RecycleError(f"{ckpt.path / info.file}: tensor {name} holds NaN or Inf values; "
                                       "refusing to publish corrupt weights")
            done += 1
            if progress:
                progress(done, total)
    if CARD in files:
        notes.append(f"the directory's own {CARD} is replaced by the generated model card")
        del files[CARD]
    return Drafter(d, fmt, record, config, files, total, _read_bench(d / BENCH), notes)


# -- model card -----------------------------------------------------------------------------------


def _name_or_path(config_path: Path) -> str | None:
    try:
        name = json.loads(config_path.read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def base_model_name(drafter: Drafter, override: str | None = None) -> str:
    """The source checkpoint's Hub name: --base-model, a Hub id recycle.json names, else its config's
    `_name_or_path`, else the source directory's name (a local path means nothing on the Hub; the card's
    `base_model` field is written only when this is an OWNER/NAME id)."""
    if override:
        return override
    src = str((drafter.record.get("source") or {}).get("path") or "")
    if HUB_ID.match(src) and not Path(src).exists():
        return src
    configs = [Path(src) / "config.json"] if src else []
    for cfg in configs + [drafter.path / "mtp_overlay" / "config.json", drafter.path / "config.json"]:
        name = _name_or_path(cfg)
        if name and HUB_ID.match(name):
            return name
    return Path(src).name or "unknown"


LICENSE_FILES = {"apache-2.0": ("Apache License", "Version 2.0"), "mit": ("MIT License",),
                 "bsd-3-clause": ("Redistribution and use in source and binary forms", "Neither the name"),
                 "gpl-3.0": ("GNU GENERAL PUBLIC LICENSE", "Version 3"), "llama3.1": ("LLAMA 3.1 COMMUNITY LICENSE",),
                 "gemma": ("Gemma Terms of Use",)}


def _front_matter_license(readme: Path) -> str | None:
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    m = re.match(r"---\n(.*?)\n---", text, re.S)
    lic = re.search(r"^license:\s*(\S+)\s*$", m.group(1), re.M) if m else None
    return lic.group(1).strip("'\"") if lic else None


def license_name(drafter: Drafter, override: str | None = None) -> tuple[str | None, str]:
    """(Hub license id, where it came from): --license, else the source's config (`license`), its
    README front matter, or its LICENSE file's wording; (None, why) when none says."""
    if override:
        return override, "--license"
    src = Path(str((drafter.record.get("source") or {}).get("path") or ""))
    dirs = [d for d in (src, drafter.path / "mtp_overlay", drafter.path) if str(d) and d.is_dir()]
    for d in dirs:
        try:
            lic = json.loads((d / "config.json").read_text(encoding="utf-8")).get("license")
        except (OSError, ValueError, AttributeError):
            lic = None
        if isinstance(lic, str) and lic:
            return lic, "the source's config.json"
        lic = _front_matter_license(d / "README.md") if d != drafter.path else None
        if lic:
            return lic, "the source's README.md"
        for name in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
            try:
                head = (d / name).read_text(encoding="utf-8", errors="ignore")[:4000]
            except OSError:
                continue
            for hub_id, words in LICENSE_FILES.items():
                if all(w.lower() in head.lower() for w in words):
                    return hub_id, f"the source's {name}"
            return "other", f"the source's {name} (not a license the Hub names)"
    return None, "no license found in the source's config, README front matter or LICENSE; pass --license"


def _public(value: object) -> str:
    """A path as the card may show it: Hub ids and corpus names as they are, local paths by their last part."""
    text = str(value)
    if HUB_ID.match(text) and not Path(text).exists():
        return text
    if text.startswith(("py:", "stdlib")) or "/" not in text:
        return text
    return Path(text).name


def _pattern(name: str) -> str:
    """A tensor name with its indices folded (`layers.1.block.mlp.experts.7.w` → `layers.N.block.mlp.experts.N.w`)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "N", name)


def _mapping_table(rows: list[dict]) -> list[str]:
    """Per-file kind counts, then the main weights file's tensors grouped by name pattern (the other files
    re-lay out the same sources; recycle.json keeps every row)."""
    lines = ["| file | tensors | exact | approx | fresh |", "|---|---:|---:|---:|---:|"]
    per_file: dict[str, list[dict]] = {}
    for r in rows:
        per_file.setdefault(r["file"], []).append(r)
    for file, rs in per_file.items():
        counts = [sum(r["kind"] == k for r in rs) for k in ("exact", "approx", "fresh")]
        lines.append(f"| `{file}` | {len(rs)} | " + " | ".join(map(str, counts)) + " |")
    main = per_file.get("model.safetensors") or next(iter(per_file.values()), [])
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in main:
        groups.setdefault((_pattern(r["tensor"]), r["kind"]), []).append(r)
    if not groups:
        return lines
    lines += ["", f"`{main[0]['file']}` by tensor (N = any index):", "",
              "| tensor | kind | count | from (first) | note |", "|---|---|---:|---|---|"]
    for (pat, kind), rs in list(groups.items())[:MAPPING_ROWS_SHOWN]:
        src = ", ".join(f"`{s}`" for s in rs[0].get("from", [])[:2]) or "-"
        note = str(rs[0].get("note", "")).replace("|", "/")
        lines.append(f"| `{pat}` | {kind} | {len(rs)} | {src} | {note} |")
    if len(groups) > MAPPING_ROWS_SHOWN:
        lines.append(f"| … {len(groups) - MAPPING_ROWS_SHOWN} more | | | | |")
    return lines


def _bench_section(b: dict) -> list[str]:
    o = b["overall"]
    sp, ar = o["spec"], o.get("ar") or {}
    hw = b.get("hardware") or b.get("device_name") or b.get("device", "?")
    setup = (f"{hw}, {b.get('dtype', '?')}, {b.get('threads', '?')} thread(s); {len(b.get('prompts') or [])} prompts, "
             f"≤{b.get('max_new_tokens', '?')} new tokens, "
             f"{'greedy' if not b.get('temperature') else 'T=' + str(b['temperature'])}; tree `{b.get('tree', '?')}`")
    lines = ["## Benchmark", "", f"`recycle bench` against `{Path(str(b.get('target', '?'))).name}` ({setup}):", "",
             "| τ (tokens/step) | speedup | predicted speedup | AR tok/s | speculative tok/s | target forwards "
             "(AR → spec) | greedy = AR |", "|---:|---:|---:|---:|---:|---:|---|"]
    pred = (o.get("predicted") or {}).get("speedup")
    speedup = o.get("speedup")
    lines.append(f"| {sp['tau']:.2f} | {f'{speedup:.2f}×' if speedup else '-'} | {f'{pred:.2f}×' if pred else '-'} | "
                 f"{ar.get('tokens_per_s', 0):.1f} | {sp.get('tokens_per_s', 0):.1f} | "
                 f"{ar.get('target_forwards', '-')} → {sp.get('target_forwards', '-')} | {o.get('greedy_match') or '-'} |")
    acc = sp.get("acceptance") or []
    if acc:
        lines += ["", "Acceptance rate by draft position:", "",
                  "| " + " | ".join(f"pos {i + 1}" for i in range(len(acc))) + " |",
                  "|" + "---:|" * len(acc), "| " + " | ".join(f"{a:.2f}" for a in acc) + " |"]
    bw = b.get("bandwidth")
    if bw:
        lines += ["", f"Memory bandwidth: AR {bw['ar_gbs']:.0f} GB/s, speculative {bw['spec_gbs']:.0f} GB/s "
                      f"(peak {bw['peak_gbs']:.0f} GB/s)."]
    lines += ["", "τ is the mean number of tokens per speculative step (bonus token included); speedup is measured "
                  "tokens/s over plain autoregressive decoding with the same loop and KV-cache code.", ""]
    return lines


def _distillation(record: dict) -> list[dict]:
    """recycle.json's `distillation` runs (distill appends one record per run; a lone dict is one run)."""
    runs = record.get("distillation")
    if isinstance(runs, dict):
        return [runs]
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def _cell(v: object) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return " ".join(str(text).replace("|", "/").split())[:300]


def _distill_rows(r: dict) -> list[tuple[str, str]]:
    """The figures a reader needs from one run record (distill/train.py's schema); other keys as they are."""
    data, final, opt = r.get("data") or {}, r.get("final") or {}, r.get("optimizer") or {}
    rows = []
    if "tokens" in r:
        rows.append(("target tokens read (budget)", f"{r['tokens']:,} ({r.get('budget_tokens', r['tokens']):,})"))
    if "steps" in r:
        rows.append(("optimizer steps", str(r["steps"])))
    if r.get("target"):
        rows.append(("target", f"`{_public(r['target'])}`"))
    if data:
        src = _public(data.get("source", "?") if isinstance(data, dict) else data)
        shape = (f"; sequences of {data.get('seq_len')} tokens × {data.get('batch_per_rank')} per rank × "
                 f"{data.get('world_size', 1)} rank(s), seed {data.get('seed')}") if isinstance(data, dict) else ""
        sd = "; self-distilled (the target regenerated each sequence)" if isinstance(data, dict) and \
            data.get("self_distill") else ""
        rows.append(("data", f"{src}{shape}{sd}"))
    if r.get("init"):
        rows.append(("initialisation", "the converted (recycled) weights" if r["init"] == "recycled" else r["init"]))
    if (r.get("losses") or {}).get("objective"):
        rows.append(("objective", r["losses"]["objective"]))
    if opt:
        rows.append(("optimizer", f"{opt.get('name', '?')}, lr {opt.get('lr', '?')} ({opt.get('schedule', '')})"))
    if final.get("loss") is not None:
        rows.append(("final loss", f"{final['loss']:.4f}"))
    before, after = final.get("heldout_agreement_before") or [], final.get("heldout_agreement_after") or []
    if before and after:
        held = r.get("heldout") or {}
        where = f" on {_public(held['source'])}, {held.get('continuation', '')}" if held.get("source") else ""
        rows.append((f"held-out top-1 agreement with the target by draft step{where} (before → after)",
                     ", ".join(f"{x:.3f} → {y:.3f}" for x, y in zip(before, after))))
    if final.get("heldout_estimate_before") is not None:
        rows.append(("held-out estimate of τ for the chain (before → after)",
                     f"{final['heldout_estimate_before']:.3f} → {final['heldout_estimate_after']:.3f}"))
    if (r.get("selected") or {}).get("why"):
        rows.append(("weights written", r["selected"]["why"]))
    for role, d in (r.get("target_io") or {}).items():
        if isinstance(d, dict) and d.get("replaced_by_target"):
            rows.append((f"{role}", f"the target's own (the source's copy differed by {d['relative_difference']:.1%})"))
    if r.get("device") or r.get("wall_s") is not None:
        rows.append(("hardware", f"{r.get('device', '?')}, {r.get('precision', '?')}, "
                                 f"{r.get('wall_s', 0):.1f} s at {r.get('tokens_per_s', 0):.0f} tokens/s"))
    for note in r.get("notes") or []:
        rows.append(("note", str(note)))
    known = {"tokens", "budget_tokens", "steps", "data", "init", "losses", "optimizer", "final", "device", "precision",
             "wall_s", "tokens_per_s", "notes", "timing", "target_forward_share", "overhead_share", "resumed",
             "cache_hits", "from", "out", "state_dir", "recycle_version", "target", "heldout", "selected",
             "target_io", "created", "snapshot_tokens", "heldout_agree", "heldout_estimate"}
    rows += [(k, _cell(v)) for k, v in r.items() if k not in known]
    return rows


def _distill_section(runs: list[dict]) -> list[str]:
    lines = ["## Distillation", "", "After conversion, `recycle distill` trained the drafter against the frozen "
             "target (the mapping above describes the initialisation, not the final values):", ""]
    for i, r in enumerate(runs, 1):
        if len(runs) > 1:
            lines += [f"Run {i}:", ""]
        lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in _distill_rows(r)] + [""]
    return lines


def _serving(drafter: Drafter, repo: str, base: str) -> list[str]:
    """The engine commands that fit this format (README's convert section), with the repo in place of paths."""
    d, fmt = drafter.path, drafter.format
    target = base if HUB_ID.match(base) else f"/models/{base}"
    local = PurePosixPath(repo).name
    lines = ["## Serving", "", "```bash"]
    if fmt == "eagle3":
        steps = 3
        lines += [
            "# vLLM",
            f"vllm serve {target} --speculative-config "
            f"'{{\"model\": \"{repo}\", \"method\": \"eagle3\", \"num_speculative_tokens\": {steps}}}'",
        ]
        verifier = ((drafter.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", "")
        if HUB_ID.match(str(verifier)):
            lines.append(f"vllm serve {repo}   # speculators config names the verifier {verifier}")
        lines += [
            "# SGLang",
            f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 \\",
            f"  --speculative-draft-model-path {repo} --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4",
            "# llama.cpp: convert the draft with the target beside it, then draft-eagle3",
            f"hf download {repo} --local-dir {local}",
            f"python convert_hf_to_gguf.py {local} --target-model-dir {target}",
            f"llama-server -m target.gguf -md {local}.gguf --spec-type draft-eagle3",
        ]
    elif fmt == "medusa":
        heads = drafter.config.get("num_heads") or drafter.config.get("medusa_num_heads") or 3
        lines += [
            "# vLLM (chain drafting)",
            f"vllm serve {target} --speculative-config "
            f"'{{\"model\": \"{repo}\", \"method\": \"medusa\", \"num_speculative_tokens\": {heads}}}'",
            "# TGI / TensorRT-LLM read medusa_lm_head.safetensors (FasterDecoding layout)",
        ]
    else:
        lines += [f"hf download {repo} --local-dir {local}",
                  "# recycle's own tree decoder (top-level model.safetensors)",
                  f"recycle bench {local} --target {target}"]
        if (d / "nextn").is_dir():
            lines += ["# SGLang NextN (nextn/)",
                      f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE \\",
                      f"  --speculative-draft-model-path {local}/nextn --speculative-num-steps 3 "
                      "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"]
        if (d / "mtp_overlay").is_dir():
            lines += ["# MTP overlay (mtp_overlay/): stitch into a local copy of the target, then vLLM / llama.cpp",
                      f"recycle stitch {local}/mtp_overlay {target} -o {local}-stitched",
                      f"vllm serve {local}-stitched --speculative-config "
                      "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'",
                      f"llama-server -m {local}-stitched.gguf --spec-type draft-mtp   # after convert_hf_to_gguf.py"]
    lines += ["```", ""]
    if fmt == "medusa":
        lines += ["SGLang and llama.cpp have no Medusa support.", ""]
    return lines


def build_card(drafter: Drafter, repo: str, base_model: str | None = None, license: str | None = None):
    """The model card (huggingface_hub ModelCard): Hub metadata plus what, how made, measured, how to serve."""
    from huggingface_hub import ModelCard, ModelCardData

    rec, fmt = drafter.record, drafter.format
    src, tgt = rec.get("source") or {}, rec.get("target") or {}
    summary = rec.get("summary") or {}
    runs = _distillation(rec)
    base = base_model_name(drafter, base_model)
    lic, _ = license_name(drafter, license)
    tags = ["speculative-decoding", fmt, *(["mtp"] if fmt == "eagle" else []), "recycled-mtp",
            *([src["family"]] if src.get("family") else []), *(["distilled"] if runs else [])]
    data = [r.get("data") for r in runs]
    data_sets = sorted({x for x in (d.get("source") if isinstance(d, dict) else d for d in data)
                        if isinstance(x, str) and HUB_ID.match(x) and not Path(x).exists()})
    # No pipeline_tag: a drafter cannot generate on its own, and the Hub's EAGLE-3 / Medusa drafter
    # repositories (speculators', SpecForge's) carry tags, not a text-generation widget that would fail.
    meta = ModelCardData(base_model=base if HUB_ID.match(base) else None, library_name=LIBRARY, tags=tags,
                         datasets=data_sets or None, license=lic)
    base_ref = f"[{base}](https://huggingface.co/{base})" if HUB_ID.match(base) else f"`{base}`"
    kinds = {"eagle": "an EAGLE-style feature-chained drafter (the MTP modules themselves, lossless)",
             "eagle3": "an EAGLE-3 drafter (one Llama layer over fused target features)",
             "medusa": f"{drafter.config.get('num_heads', 'K')} Medusa heads"}
    body = [
        f"# {PurePosixPath(repo).name}", "",
        f"A speculative-decoding drafter for {base_ref}: {kinds[fmt]}, made by "
        f"recycle {rec.get('recycle_version', '')} from the Multi-Token-Prediction (MTP) modules "
        f"the checkpoint ships with, so it starts from weights trained with the model instead of from scratch.", "",
        "| | |", "|---|---|",
        f"| format | `{fmt}` ({tgt.get('dtype', '?')}) |",
        f"| source | {base_ref}, family `{src.get('family', '?')}` ({src.get('family_title', '')}) |",
        f"| MTP modules | {src.get('modules', '?')} stored / {src.get('declared', '?')} declared"
        f"{', FP8 (dequantized)' if src.get('fp8') else ''} |",
        f"| made with | recycle {rec.get('recycle_version', '?')}, {rec.get('created', '?')} |", "",
    ]
    layouts = {k: v for k, v in (tgt.get("layouts") or {}).items() if (drafter.path / k).exists()}
    if layouts:
        body += ["Layouts in this repository:", ""] + [f"- `{k}`: {v}" for k, v in layouts.items()] + [""]
    body += ["## How it was made", "",
             f"`recycle convert --to {fmt}` mapped {summary.get('tensors', '?')} tensors: "
             f"**{summary.get('exact', '?')} exact** (copied from an MTP tensor), "
             f"**{summary.get('approx', '?')} approx** (derived from MTP tensors, not equal to any), "
             f"**{summary.get('fresh', '?')} fresh** (initialised). The full per-tensor mapping is in "
             f"[`{PROVENANCE}`]({PROVENANCE}); grouped:", ""]
    body += _mapping_table(rec.get("mapping") or []) + [""]
    notes = rec.get("notes") or []
    if notes:
        body += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    if runs:
        body += _distill_section(runs)
    elif (summary.get("approx") or summary.get("fresh")) and fmt != "eagle":
        body += ["This drafter was not distilled after conversion: its approx/fresh tensors start near, not at, "
                 "the MTP module, so acceptance improves after `recycle distill`.", ""]
    if drafter.bench:
        body += _bench_section(drafter.bench)
    body += _serving(drafter, repo, base)
    return ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(body))


# -- upload ---------------------------------------------------------------------------------------


def hub_endpoint() -> str:
    """HF_ENDPOINT read at call time (huggingface_hub freezes it at import)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _env_number(name: str, default: float, cast: type) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise RecycleError(f"{name}={raw!r}: not a number") from None
    if value < 0 or (cast is int and value < 1):
        raise RecycleError(f"{name}={raw!r}: out of range")
    return value


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures of whichever HTTP client this huggingface_hub uses (httpx2 in 2.x,
    httpx in 1.x, requests before)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                       ("requests", ("ConnectionError", "Timeout"))):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        errors += [getattr(m, n) for n in names if isinstance(getattr(m, n, None), type)]
    return tuple(errors)


def _server_message(e: BaseException, secret: str | None) -> str:
    """First line of the Hub's message, the token masked should a server ever echo it."""
    msg = getattr(e, "server_message", None) or (str(e).splitlines() or [type(e).__name__])[0]
    msg = " ".join(str(msg).split())[:200]
    return msg.replace(secret, "***") if secret else msg


def _with_retries(call: Callable[[], dict], endpoint: str, attempts: int, backoff: float,
                  secret: str | None) -> dict:
    """Run the whole create → branch → commit sequence, retrying connection failures and 5xx with
    exponential backoff. Safe to repeat: create_repo/create_branch are idempotent with exist_ok, and the
    commit is one POST after the pre-upload, so a failed attempt has committed nothing."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    transport = _transport_errors()
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except OfflineModeIsEnabled:
            raise RecycleError("HF_HUB_OFFLINE is set: unset it to push") from None
        except HfHubHTTPError as e:
            status = e.response.status_code if getattr(e, "response", None) is not None else None
            if status in (401, 403):
                raise RecycleError(f"the Hub rejected the token (HTTP {status}): run `hf auth login` or set HF_TOKEN"
                                   ) from None
            if status in TRANSIENT_STATUS and attempt < attempts:
                time.sleep(backoff * 2 ** (attempt - 1))
                continue
            msg = _server_message(e, secret)
            tail = f" after {attempts} attempts" if status in TRANSIENT_STATUS else ""
            raise RecycleError(f"the Hub answered HTTP {status}{tail}: {msg}") from None
        except ValueError as e:  # huggingface_hub's own check of the card metadata (validate-yaml)
            raise RecycleError(f"the Hub refused the upload: {_server_message(e, secret)}") from None
        except transport as e:
            if attempt < attempts:
                time.sleep(backoff * 2 ** (attempt - 1))
                continue
            raise RecycleError(f"could not reach {endpoint} after {attempts} attempts ({type(e).__name__})") from None
    raise AssertionError("unreachable")


def push_drafter(path: str | os.PathLike, repo: str, *, private: bool = False, revision: str | None = None,
                 commit_message: str | None = None, base_model: str | None = None, dry_run: bool = False,
                 card_out: str | os.PathLike | None = None, license: str | None = None, attempts: int | None = None,
                 backoff: float | None = None, progress: Progress | None = None) -> dict:
    """Validate a drafter directory, write its model card and (unless dry_run) upload it in one commit.

    The input directory is never modified: the card goes up as README.md from memory, and locally
    only to `card_out` (which must lie outside the directory). Returns a summary dict.
    """
    if not HUB_ID.match(repo):
        raise RecycleError(f"--repo {repo!r}: expected OWNER/NAME")
    if revision is not None and (not revision.strip() or revision.startswith("refs/")):
        raise RecycleError(f"--revision {revision!r}: give a branch name")
    endpoint = hub_endpoint()
    attempts = max(1, int(attempts if attempts is not None else _env_number(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, int)))
    backoff = float(backoff if backoff is not None else _env_number(BACKOFF_ENV, DEFAULT_BACKOFF, float))
    token = None
    if not dry_run:  # before the slow checks: a missing login is the commonest failure
        from huggingface_hub import get_token

        token = get_token()
        if not token:
            raise RecycleError("no Hugging Face token: run `hf auth login` or set HF_TOKEN")
    src = Path(path).expanduser()
    if card_out is not None:
        out = Path(card_out).expanduser().resolve()
        if src.is_dir() and (out == src.resolve() or src.resolve() in out.parents):
            raise RecycleError(f"--card-out {out}: inside the drafter directory; push never writes there")
    drafter = validate_drafter(src, progress=progress)
    card = build_card(drafter, repo, base_model, license)
    card_text = card.content
    card_bytes = card_text.encode("utf-8")
    uploads = {**drafter.files, CARD: len(card_bytes)}
    base = base_model_name(drafter, base_model)
    notes = list(drafter.notes)
    if not HUB_ID.match(base):
        notes.append(f"base_model '{base}' is not a Hub id (OWNER/NAME), so the card has no base_model field: "
                     "pass --base-model to link the target")
    lic, why = license_name(drafter, license)
    if lic is None:
        notes.append(f"the card has no license field: {why}")
    if card_out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(card_bytes)
    message = commit_message or f"Upload {drafter.format} drafter recycled from {base} (recycle {__version__})"
    result = {
        "repo": repo, "endpoint": endpoint, "revision": revision or "main", "private": private, "dry_run": dry_run,
        "drafter": str(drafter.path), "format": drafter.format, "base_model": base, "license": lic,
        "files": dict(sorted(uploads.items())), "bytes": sum(uploads.values()), "tensors_checked": drafter.tensors,
        "bench": drafter.bench is not None, "card_path": str(out) if card_out is not None else None,
        "card_metadata": card.data.to_dict(), "commit_message": message, "commit": None, "notes": notes,
    }
    if dry_run:
        if card_out is None:
            result["card"] = card_text
        return result

    from huggingface_hub import CommitOperationAdd, HfApi

    def attempt() -> dict:
        api = HfApi(endpoint=endpoint, token=token, library_name=LIBRARY, library_version=__version__)
        url = api.create_repo(repo, private=True if private else None, repo_type="model", exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(drafter.path / rel)) for rel in drafter.files]
        ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card_bytes))
        info = api.create_commit(repo, ops, commit_message=message, revision=revision, repo_type="model")
        return {"url": str(url), "commit_url": info.commit_url, "oid": info.oid}

    result["commit"] = _with_retries(attempt, endpoint, attempts, backoff, token)
    return result


__all__ = ["Drafter", "validate_drafter", "base_model_name", "build_card", "push_drafter", "hub_endpoint"]
