"""The model card of a drafter: Hub metadata, then what it is, how to get it and which engines read it, how it
measured (bench.json, from `recycle bench --save`), how it was made (recycle.json's provenance; the tensor mapping
folded away) and how engines serve it (its format record's serving lines).

What the card claims is only what recycle knows: `base_model` is the Hub id the user gave (`--base-model`), never a
guess from a config's `_name_or_path`, since the Hub links the drafter under that model; the source row names the
checkpoint it was converted from; an engine gets serving lines only where it reads the layout; and recycle's
internal record fields are put in words or left out."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

from recycle.bench_result import BenchResult
from recycle.families import BY_NAME
from recycle.formats import get
from recycle.hub.validate import PROVENANCE, Drafter, distillation_runs
from recycle.io.weights import whole_file
from recycle.options import HUB_ID
from recycle.texts import plural

LIBRARY = "recycle"
MAPPING_ROWS_SHOWN = 40


def _name_or_path(config_path: Path) -> str | None:
    try:
        name = json.loads(config_path.read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def base_model_name(drafter: Drafter, override: str | None = None) -> str:
    """The model the serving commands name as the target: --base-model; else, for a drafter converted from a Gemma 4
    assistant (not from its target), the model its config names as verifier; else a Hub id recycle.json names, the
    source config's `_name_or_path`, or the source directory's name. A best guess for commands: the card's
    `base_model` metadata is --base-model alone."""
    if override:
        return override
    src = str((drafter.record.get("source") or {}).get("path") or "")
    if _source_kind(drafter) == "drafter":
        named = _verifier(drafter.config) or str(drafter.config.get("base_model_name_or_path") or "")
        src = named or src
    if HUB_ID.match(src) and not Path(src).exists():
        return src
    configs = [Path(src) / "config.json"] if src else []
    for cfg in configs + [drafter.path / "mtp_overlay" / "config.json", drafter.path / "config.json"]:
        name = _name_or_path(cfg)
        if name and HUB_ID.match(name):
            return name
    return Path(src).name or "unknown"


def source_name(drafter: Drafter) -> str:
    """The checkpoint the drafter was converted from, as the card names it: its Hub id if that is what it was,
    else its directory's name (a local path means nothing to a reader, and says where it lived)."""
    src = str((drafter.record.get("source") or {}).get("path") or "")
    if HUB_ID.match(src) and not Path(src).exists():
        return src
    return Path(src).name or "unknown"


def _source_kind(drafter: Drafter) -> str:
    """The source family's kind (`mtp`, `parallel_heads`, `drafter`): what the drafter was made from."""
    fam = BY_NAME.get(str((drafter.record.get("source") or {}).get("family") or ""))
    return fam.kind if fam is not None else "mtp"


def _verifier(config: dict) -> str:
    return str(((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "")


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
    main = [r for r in rows if whole_file(r["file"]) == "model.safetensors"] or next(iter(per_file.values()), [])
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in main:
        groups.setdefault((_pattern(r["tensor"]), r["kind"]), []).append(r)
    if not groups:
        return lines
    lines += ["", f"`{whole_file(main[0]['file'])}` by tensor (N = any index):", "",
              "| tensor | kind | count | from (first) | note |", "|---|---|---:|---|---|"]
    for (pat, kind), rs in list(groups.items())[:MAPPING_ROWS_SHOWN]:
        src = ", ".join(f"`{s}`" for s in rs[0].get("from", [])[:2]) or "-"
        note = str(rs[0].get("note", "")).replace("|", "/")
        lines.append(f"| `{pat}` | {kind} | {len(rs)} | {src} | {note} |")
    if len(groups) > MAPPING_ROWS_SHOWN:
        lines.append(f"| … {len(groups) - MAPPING_ROWS_SHOWN} more | | | | |")
    return lines


def _bench_section(b: BenchResult) -> list[str]:
    """A short table from bench.json: τ, the speedup with its per-prompt spread, the cost model's prediction,
    tokens/s; acceptance by position; and bench's own notes (a loaded machine, a good τ that still loses)."""
    o = b.overall
    sp, ar = o.spec, o.ar
    said = lambda v: "?" if v is None else v  # a setting an older report lacks
    rep = o.spread.repeats if o.spread else None
    setup = (f"{said(b.device)}, {said(b.dtype)}, {said(b.threads)} thread(s); {plural(len(b.prompts), 'prompt')}, "
             f"≤{said(b.max_new_tokens)} new tokens, "
             f"{'greedy' if not b.temperature else 'T=' + str(b.temperature)}; tree `{said(b.tree)}`"
             + (f"; best of {rep.n} repeats" if rep else ""))
    lines = ["## Benchmark", "", f"`recycle bench` against `{Path(str(said(b.target))).name}` ({setup}):", "",
             "| τ (tokens/step) | speedup | speedup per prompt (IQR) | predicted speedup | AR tok/s "
             "| speculative tok/s | greedy = AR |", "|---:|---:|---:|---:|---:|---:|---|"]
    pred = o.predicted.speedup
    speedup = o.speedup
    iqr = o.spread.prompts.speedup if o.spread else None  # reports before bench had spreads: none
    iqr_text = f"{iqr.q1:.2f}–{iqr.q3:.2f}×" if iqr else "-"
    lines.append(f"| {sp.tau:.2f} | {f'{speedup:.2f}×' if speedup else '-'} | {iqr_text} | "
                 f"{f'{pred:.2f}×' if pred else '-'} | {ar.tokens_per_s:.1f} | "
                 f"{sp.tokens_per_s:.1f} | {o.greedy_match or '-'} |")
    acc = sp.acceptance
    if acc:
        lines += ["", "Acceptance rate by draft position:", "",
                  "| " + " | ".join(f"pos {i + 1}" for i in range(len(acc))) + " |",
                  "|" + "---:|" * len(acc), "| " + " | ".join(f"{a:.2f}" for a in acc) + " |"]
    if b.sweep:
        lines += _sweep_table(b.sweep)
    bw = b.bandwidth
    if bw:
        lines += ["", f"Memory bandwidth: AR {bw.ar_gbs:.0f} GB/s, speculative {bw.spec_gbs:.0f} GB/s "
                      f"(peak {bw.peak_gbs:.0f} GB/s)."]
    notes = b.notes
    lines += [""] + [f"- Note: {n.rstrip('.')}." for n in notes] + [""] * bool(notes)
    lines += ["τ is the mean number of tokens per speculative step (bonus token included); speedup is measured "
              "tokens/s over plain autoregressive decoding with the same loop and KV-cache code.", ""]
    return lines


def _sweep_table(rows: tuple) -> list[str]:
    """bench's --temperature × --draft-sample rows: acceptance per draft position and τ at each temperature served."""
    depth = max((len(r.acceptance) for r in rows), default=0)
    lines = ["", "By temperature and draft-sampling rule (greedy: the draft's top-k; probabilistic: drafts sampled "
             "from the drafter's distribution; 95% interval over prompts in brackets):", "",
             "| temperature | rule | " + " | ".join(f"α pos {d + 1}" for d in range(depth)) + " | τ |",
             "|---:|---|" + "---:|" * depth + "---:|"]
    for r in rows:
        alphas = [f"{a:.2f} [{iv.low:.2f}–{iv.high:.2f}]" for a, iv in zip(r.acceptance, r.acceptance_interval)]
        alphas += ["-"] * (depth - len(alphas))
        lines.append(f"| {r.temperature:g} | {r.draft_sample} | " + " | ".join(alphas) +
                     f" | {r.tau:.2f} [{r.tau_interval.low:.2f}–{r.tau_interval.high:.2f}] |")
    return lines


def _cell(v: object) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return " ".join(str(text).replace("|", "/").split())[:300]


def _distill_rows(r: dict) -> list[tuple[str, str]]:
    """The figures a reader needs from one run record (distill/train.py's schema), in words."""
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
    if r.get("online"):
        rows.append(("target features", "computed by the target in vLLM while training (`recycle distill --online`)"))
    elif r.get("trunk_loaded") is False:
        rows.append(("target features", "read from a `recycle harvest` cache (the target ran in vLLM beforehand)"))
    # the record holds the training's seconds (`train_s`); the command's wall time is known only after it is written
    seconds = r.get("train_s", r.get("wall_s"))
    if r.get("device") or seconds is not None:
        took = f"{seconds:.1f} s of training at " if seconds is not None else ""
        rows.append(("hardware", f"{r.get('device', '?')}, {r.get('precision', '?')}, "
                                 f"{took}{r.get('tokens_per_s', 0):.0f} tokens/s"))
    for note in r.get("notes") or []:
        rows.append(("note", str(note)))
    # Nothing else: the record's other fields (timings, cache counters, paths, the resume flag) are recycle's own
    # bookkeeping, kept in recycle.json for whoever needs them, and mean nothing to a reader of the card as they are.
    return rows


def _distill_section(runs: list[dict]) -> list[str]:
    lines = ["## Distillation", "", "After conversion, `recycle distill` trained the drafter against the frozen "
             "target (the mapping above describes the initialisation, not the final values):", ""]
    for i, r in enumerate(runs, 1):
        if len(runs) > 1:
            lines += [f"Run {i}:", ""]
        lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in _distill_rows(r)] + [""]
    return lines


def _layouts(drafter: Drafter):
    """The format's layouts this directory holds (distillation may have dropped one), in the record's order."""
    return [(rel, layout) for rel, layout in get(drafter.format).layouts.items() if (drafter.path / rel).exists()]


def _serving(drafter: Drafter, repo: str, target: str) -> list[str]:
    """The engine commands of the format's record, for the layouts this directory holds, with the repo in place
    of paths; a group of lines under a `# ENGINE` comment goes when the layout says that engine refuses this
    directory's variant."""
    fmt = get(drafter.format)
    verifier = _verifier(drafter.config)
    hub_target = HUB_ID.match(target) and not Path(target).exists()
    values = {"repo": repo, "local": PurePosixPath(repo).name, "target": target if hub_target else f"/models/{target}",
              "target_dir": f"/models/{PurePosixPath(target).name}", "verifier": verifier,
              "heads": drafter.config.get("num_heads") or drafter.config.get("medusa_num_heads") or 3}
    lines = ["## Serving", "", "```bash"]
    for _, layout in _layouts(drafter):
        refused = layout.refused_by(drafter.config) if layout.refused_by is not None else ()
        skip = False
        for line in layout.serving:
            if line.startswith("# "):
                skip = any(line[2:].startswith(engine) for engine in refused)
            if not skip and ("{verifier}" not in line or HUB_ID.match(verifier)):
                lines.append(line.format(**values))
    lines += ["```", ""]
    if fmt.serving_note:
        lines += [fmt.serving_note, ""]
    return lines


def _getting_it(drafter: Drafter, repo: str) -> list[str]:
    """How to get the drafter (recycle itself is not on PyPI, and serving needs only the files) and, per layout
    this directory holds, which engines at which version read it; then why it is not a standalone model."""
    fmt = get(drafter.format)
    lines = ["## Getting it", "", "The files are all a serving engine needs:", "", "```bash",
             f"hf download {repo} --local-dir {PurePosixPath(repo).name}", "```", ""]
    here = _layouts(drafter)
    if here:
        lines += ["What is in it, and what reads each part:", ""]
        lines += [f"- `{rel}`: {layout.what}" + (f". Read by {layout.readers}." if layout.readers else ".")
                  for rel, layout in here] + [""]
    if fmt.loading_note:
        lines += [fmt.loading_note, ""]
    lines += ["`recycle bench` and `recycle distill` need recycle itself, which is not on PyPI: install it from its "
              "source repository (`pip install -e .` in a checkout).", ""]
    return lines


def build_card(drafter: Drafter, repo: str, base_model: str | None = None, license: str | None = None):
    """The model card (huggingface_hub ModelCard): Hub metadata plus what, how to get it, measured, how made, how
    to serve. `base_model` is --base-model's Hub id (None: no such field)."""
    from huggingface_hub import ModelCard, ModelCardData

    rec, fmt = drafter.record, drafter.format
    src, tgt = rec.get("source") or {}, rec.get("target") or {}
    summary = rec.get("summary") or {}
    runs = distillation_runs(rec)
    source, kind = source_name(drafter), _source_kind(drafter)
    serving_target = base_model_name(drafter, base_model)
    lic, _ = license_name(drafter, license)
    tags = ["speculative-decoding", fmt, *get(fmt).tags, "recycled-mtp",
            *([src["family"]] if src.get("family") else []), *(["distilled"] if runs else [])]
    data = [r.get("data") for r in runs]
    data_sets = sorted({x for x in (d.get("source") if isinstance(d, dict) else d for d in data)
                        if isinstance(x, str) and HUB_ID.match(x) and not Path(x).exists()})
    # No pipeline_tag: a drafter cannot generate on its own, and the Hub's EAGLE-3 / Medusa drafter
    # repositories (speculators', SpecForge's) carry tags, not a text-generation widget that would fail.
    meta = ModelCardData(base_model=base_model, library_name=LIBRARY, tags=tags, datasets=data_sets or None,
                         license=lic)
    source_ref = f"[{source}](https://huggingface.co/{source})" if HUB_ID.match(source) else f"`{source}`"
    made = f"made by recycle {rec.get('recycle_version', '')} from " + {
        "mtp": f"the Multi-Token-Prediction (MTP) modules of {source_ref}, so it starts from weights trained with that "
               "model instead of from scratch",
        "parallel_heads": f"the parallel prediction heads of {source_ref}, trained with that model",
        "drafter": f"{source_ref}, a {src.get('family_title') or 'drafter'} rewritten in this format",
    }.get(kind, source_ref)
    if base_model:
        intro = f"A speculative-decoding drafter for [{base_model}](https://huggingface.co/{base_model}): it drafts " \
                f"tokens that model verifies. It is {get(fmt).summary}, {made}."
    else:
        intro = f"A speculative-decoding drafter: {get(fmt).summary}, {made}."
    body = [
        f"# {PurePosixPath(repo).name}", "", intro, "",
        "| | |", "|---|---|",
        f"| format | `{fmt}` ({tgt.get('dtype', '?')}) |",
    ]
    if base_model:
        body.append(f"| drafts for | [{base_model}](https://huggingface.co/{base_model}) |")
    body.append(f"| source | {source_ref}, family `{src.get('family', '?')}` ({src.get('family_title', '')}) |")
    if kind != "drafter":
        unit = "prediction heads" if kind == "parallel_heads" else "MTP modules"
        body.append(f"| {unit} | {src.get('modules', '?')} stored / {src.get('declared', '?')} declared"
                    f"{', FP8 (dequantized)' if src.get('fp8') else ''}"
                    f"{''.join(f', {tag} (dequantized)' for tag in src.get('packed') or ())} |")
    body += [f"| made with | recycle {rec.get('recycle_version', '?')}, {rec.get('created', '?')} |", ""]
    body += _getting_it(drafter, repo)
    if drafter.bench:
        body += _bench_section(drafter.bench)
    body += ["## How it was made", "",
             f"`recycle convert --to {fmt}` mapped {summary.get('tensors', '?')} tensors: "
             f"**{summary.get('exact', '?')} exact** (copied from a source tensor), "
             f"**{summary.get('approx', '?')} approx** (derived from source tensors, not equal to any), "
             f"**{summary.get('fresh', '?')} fresh** (initialised). The full per-tensor mapping is in "
             f"[`{PROVENANCE}`]({PROVENANCE}).", "",
             "<details>", "<summary>The mapping, grouped by file and tensor name</summary>", ""]
    body += _mapping_table(rec.get("mapping") or []) + ["", "</details>", ""]
    notes = rec.get("notes") or []
    if notes:
        body += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    if runs:
        body += _distill_section(runs)
    elif summary.get("approx") or summary.get("fresh"):
        body += ["This drafter was not distilled after conversion: its approx/fresh tensors start near, not at, "
                 "the source's, so acceptance improves after `recycle distill`.", ""]
    body += _serving(drafter, repo, serving_target)
    return ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(body))
