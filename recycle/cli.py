"""The `recycle` command line: parse, call the library, render (rich or --json), map user errors to exit 2."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from recycle import __version__
from recycle.errors import RecycleError


def _conventional_help() -> None:
    """typer ≥ 0.2x writes a required argument as `{NAME}` in usage lines and every parameter's type
    as `<type>` (flags as `<bool>`); show click's `NAME` / `[NAME]` and our metavars instead, and no
    placeholder for flags. Guarded: older typers already render this way."""
    from typer import core

    arg, opt = getattr(core, "TyperArgument", None), getattr(core, "TyperOption", None)
    if arg is not None and hasattr(arg, "_usage_display_name"):
        def usage_name(self) -> str:
            name = self.display_name_raw
            return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")

        arg._usage_display_name = usage_name
        arg.display_type_rich = lambda self, ctx: None  # the name column already shows the metavar
    if opt is not None and hasattr(opt, "display_type_rich"):
        shown = opt.display_type_rich

        def option_type(self, ctx) -> str | None:
            if self.is_flag or self.count:
                return None
            return self.metavar if self.metavar is not None else (shown(self, ctx) or "").strip("<>").upper() or None

        opt.display_type_rich = option_type


_conventional_help()
app = typer.Typer(
    help="Turn the Multi-Token-Prediction modules of open checkpoints into speculative-decoding drafters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
out = Console()
err = Console(stderr=True)

EXIT_BAD_INPUT = 2
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def user_errors(fn: Callable) -> Callable:
    """Turn RecycleError (and unreadable files) into one stderr line and exit status 2."""

    @wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RecycleError as e:
            print(f"recycle: error: {e}", file=sys.stderr)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except (OSError, MemoryError) as e:
            if os.environ.get("RECYCLE_DEBUG"):
                raise
            print(f"recycle: error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return run


def table(title: str) -> Table:
    """A compact table (no vertical rules) that fits 80 columns: the house style of every report."""
    from rich import box

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def print_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def fmt_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


class Reporter:
    """Progress for people: a transient rich bar on a terminal; elsewhere (a CI log, a file) a plain
    `recycle: ...` line on stderr per item (a prompt, an evaluation) or, once the work has taken a few
    seconds, every few seconds; never a stray blank line."""

    EVERY_S = 5.0

    def __init__(self, label: str, columns: tuple = (), **fields) -> None:
        self.label, self.fields = label, fields
        self.bar: Progress | None = None
        if err.is_terminal:
            self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                MofNCompleteColumn(), *columns, TimeElapsedColumn(), console=err, transient=True)
        self.last = 0.0

    def __enter__(self) -> Reporter:
        import time

        self.t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=None, **self.fields)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, completed: int, total: int | None = None, description: str | None = None, line: str = "",
               force: bool = False, **fields) -> None:
        """Advance; `line` is what a non-terminal gets (default: description and count), at most every
        few seconds unless `force` (one line per prompt, per evaluation)."""
        import time

        if self.bar is not None:
            self.bar.update(self.task, completed=completed, total=total, description=description or self.label,
                            **fields)
            return
        now = time.perf_counter()
        # Quick work prints nothing; longer work a line every few seconds, and items asked for always.
        if force or (now - self.t0 >= self.EVERY_S and (now - self.last >= self.EVERY_S or completed == total)):
            self.last = now
            text = line or f"{description or self.label} {completed}" + (f"/{total}" if total else "")
            print(f"recycle: {text} ({now - self.t0:.0f} s)", file=sys.stderr, flush=True)


@app.callback(invoke_without_command=True)
def main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


def _stat_row(sts: list[dict]) -> tuple[str, str, str, str, str]:
    """finite, all-zero, rms range, norm summary of a group of tensor stats."""
    bad = sum(not st["finite"] for st in sts)
    zero = sum(st["all_zero"] for st in sts)
    rms = [st["rms"] for st in sts if st["finite"]]
    norms = [st["norm"] for st in sts if st["norm"]]
    rng = (f"{min(rms):.3g}" if len(set(rms)) == 1 else f"{min(rms):.3g}–{max(rms):.3g}") if rms else "-"
    norm = "" if not norms else (f"{norms[0]['mean']:.3f}±{norms[0]['std']:.3f}" if len(norms) == 1 else
                                 f"{min(n['mean'] for n in norms):.3f}–{max(n['mean'] for n in norms):.3f}")
    return ("yes" if not bad else f"[red]{bad} NO[/red]", f"[yellow]{zero}[/yellow]" if zero else "0", rng, norm, "")


def render_stats(data: dict, every: bool = False) -> None:
    """Tensor health: one row per module and role (`every`: one per tensor)."""
    prefixes = [(m["index"], m["prefix"]) for m in data["mtp"]["modules"]]

    def module_of(name: str) -> tuple[str, str]:
        return next(((str(i), name[len(p):]) for i, p in prefixes if name.startswith(p)), ("-", name))

    if every:
        s = table("tensor health (every MTP tensor, dequantized)")
        for col in ("#", "tensor", "dtype", "shape", "finite", "zero", "rms", "norm mean±std"):
            s.add_column(col, overflow="fold", no_wrap=col in ("rms", "norm mean±std"))
        for st in data["stats"]:
            k, rel = module_of(st["name"])
            fin, zero, rms, norm, _ = _stat_row([st])
            s.add_row(k, rel, st["dtype"], "x".join(map(str, st["shape"])), fin, zero, rms, norm)
        out.print(s)
        return
    groups: dict[tuple[str, str], list[dict]] = {}
    for st in data["stats"]:
        groups.setdefault((module_of(st["name"])[0], st["role"]), []).append(st)
    s = table("tensor health by role (MTP tensors, dequantized; --all lists each)")
    for col in ("#", "role", "n", "dtypes", "finite", "zero", "rms", "norm mean±std"):
        s.add_column(col, no_wrap=col in ("role", "rms", "norm mean±std"))
    for (k, role), sts in groups.items():
        dtypes = " ".join(sorted({st["dtype"] for st in sts}))
        fin, zero, rms, norm, _ = _stat_row(sts)
        s.add_row(k, role, str(len(sts)), dtypes, fin, zero, rms, norm)
    out.print(s)


def render_inspect(data: dict, show_all: bool = False) -> None:
    """Rich report for people: overview, modules, roles, findings, stats."""
    mtp = data["mtp"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("family", f"{data['family']}  [dim]({data['family_title']})[/dim]")
    head.add_row("architecture", f"{data['architecture']}  [dim]model_type={data['model_type']}[/dim]")
    head.add_row("MTP modules", f"{mtp['found']} found / {mtp['declared']} declared  [dim]({data['kind']})[/dim]")
    head.add_row("parameters", f"{fmt_count(data['params']['total'])} total, {fmt_count(data['params']['mtp'])} in MTP "
                 f"({fmt_bytes(data['bytes']['mtp'])})")
    head.add_row("shards", f"{data['shards']['count']} file(s), {fmt_bytes(data['shards']['bytes_total'])}; "
                 f"{data['tensors']['total']} tensors, {data['tensors']['fp8']} FP8")
    out.print(Panel(head, title=f"recycle inspect  {data['path']}", expand=False))

    if mtp["modules"]:
        t = table("MTP modules")
        for col in ("#", "prefix", "tensors", "params", "dtypes", "concat/norm", "from the trunk"):
            t.add_column(col, overflow="fold", no_wrap=col in ("prefix", "concat/norm"))
        for m in mtp["modules"]:
            shared = ", ".join(f"{r}: {n}" if n else f"{r}: MISSING" for r, n in m["shared"].items()) or "-"
            t.add_row(str(m["index"]), m["prefix"], str(m["tensors"]), fmt_count(m["params"]),
                      " ".join(f"{d}:{c}" for d, c in m["dtypes"].items()), f"{m['concat_order']}/{m['norm']}", shared)
        out.print(t)
        first = mtp["modules"][0]
        r = table(f"roles of module 0 (names after {first['prefix']})")
        r.add_column("role", no_wrap=True)
        r.add_column("tensors", overflow="fold")
        for role, names in first["roles"].items():
            rel = [n[len(first["prefix"]):] if n.startswith(first["prefix"]) else n for n in names]
            r.add_row(role, ", ".join(rel) if len(rel) <= 3 else f"{', '.join(rel[:2])}, ... ({len(rel)} tensors)")
        out.print(r)

    if data.get("stats"):
        render_stats(data, every=show_all)

    if data["findings"]:
        f = table("findings")
        for col in ("severity", "code", "message"):
            f.add_column(col, overflow="fold")
        for fd in data["findings"]:
            style = SEVERITY_STYLE.get(fd["severity"], "")
            f.add_row(f"[{style}]{fd['severity']}[/{style}]", fd["code"], fd["message"])
        out.print(f)
    else:
        out.print("[green]no findings[/green]")


@app.command()
@user_errors
def inspect(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint directory (config.json + *.safetensors).",
                                         metavar="CKPT_DIR")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema in README.md).")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Also read the MTP tensors: finite, all-zero, RMS, norms "
                                        "(summarised by role).")] = False,
    show_all: Annotated[bool, typer.Option("--all", help="With --stats: one row per tensor.")] = False,
) -> None:
    """Audit the MTP weights of a checkpoint: family, layout, shapes, dtypes, FP8 scales, health.

    Reads safetensors headers (and a 64-row sample of stored embedding/head copies) unless --stats
    is given; never writes. Stale copies (the trunk moved after its MTP modules were trained) and
    declared-but-missing modules are findings.

    Example: `recycle inspect fixtures/deepseek_v3_mtp --stats`
    """
    from recycle.preflight import checkpoint_dir

    checkpoint_dir(ckpt)
    from recycle.audit import inspect_checkpoint

    if stats and not json_out:
        with Reporter("reading MTP tensors") as bar:
            report = inspect_checkpoint(ckpt, stats=True, progress=lambda i, n: bar.update(i, n))
    else:
        report = inspect_checkpoint(ckpt, stats=stats)
    data = report.to_json()
    if json_out:
        print_json(data)
    else:
        render_inspect(data, show_all)


def render_convert(data: dict) -> None:
    """Rich summary for people: where it went, what it holds, how much was exact."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("format", f"{data['format']}  [dim]({data['dtype']})[/dim]")
    head.add_row("source", f"{data['family']}, {data['modules']} MTP module(s)")
    s = data["summary"]
    head.add_row("tensors", f"{s['tensors']}: [green]{s['exact']} exact[/green], [yellow]{s['approx']} approx[/yellow], "
                 f"[cyan]{s['fresh']} fresh[/cyan]  [dim](mapping in recycle.json)[/dim]")
    head.add_row("written", f"{fmt_bytes(data['bytes'])} in {len(data['files'])} files, {data['seconds']:.2f} s")
    out.print(Panel(head, title=f"recycle convert → {data['out']}", expand=False))
    t = table("files")
    t.add_column("file")
    t.add_column("size", justify="right")
    for name, size in data["files"].items():
        t.add_row(name, fmt_bytes(size))
    out.print(t)
    for note in data["notes"]:
        out.print(f"[yellow]note:[/yellow] {note}")


def _with_progress(json_out: bool, label: str, fn: Callable) -> dict:
    if json_out:
        return fn(None)
    with Reporter(label) as bar:
        return fn(lambda i, n: bar.update(i, n))


@app.command()
@user_errors
def convert(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint directory (config.json + *.safetensors).",
                                         metavar="CKPT_DIR")],
    to: Annotated[str, typer.Option("--to", help="Drafter format: eagle, eagle3 or medusa.", metavar="FORMAT")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory (must not exist, see --overwrite).",
                                         metavar="OUT_DIR")],
    heads: Annotated[int | None, typer.Option("--heads", help="Medusa heads (default 3).")] = None,
    draft_vocab: Annotated[int | None, typer.Option("--draft-vocab", help="EAGLE-3 draft vocabulary size "
                                                    "(top-N corpus tokens; default: the full vocabulary).")] = None,
    vocab_corpus: Annotated[Path | None, typer.Option("--vocab-corpus", help="Text file to count tokens in "
                                                      "(default: recycle's stdlib corpus).")] = None,
    eagle3_attention: Annotated[str | None, typer.Option("--eagle3-attention", help="--to eagle3: llama (default; "
                                                         "every engine) or mla (MLA sources: vLLM's DeepSeek EAGLE-3, "
                                                         "which pairs with MLA targets on vLLM's CPU backend).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Output dtype: bf16, fp16 or fp32.")] = "bf16",
    layouts: Annotated[str | None, typer.Option("--layouts", help="--to eagle: comma list of recycle, nextn, "
                                                "overlay (default: all three).")] = None,
    calibrate: Annotated[str | None, typer.Option("--calibrate", help="--to medusa: fit each ResBlock to the source "
                                                  "head on this many tokens (e.g. 64k) instead of the identity.",
                                                  metavar="TOKENS")] = None,
    target: Annotated[Path | None, typer.Option("--target", help="With --calibrate: the model whose hidden states "
                                                "the heads read (default: the checkpoint itself). From a Gemma 4 "
                                                "assistant (--to eagle3, or medusa with --calibrate): the Gemma 4 "
                                                "model it drafts for.", metavar="TARGET_DIR")] = None,
    data: Annotated[str | None, typer.Option("--data", help="With --calibrate: calibration text, as distill's "
                                             "--data (default: the stdlib train split).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Turn a checkpoint's MTP modules into a speculative-decoding drafter directory.

    Reads only the MTP tensors (and the trunk's embedding/head when a module stores none), writes
    atomically (nothing appears unless everything was written), never touches the source.

    Example: `recycle convert fixtures/deepseek_v3_mtp --to eagle -o /tmp/ds-eagle`

    A Gemma 4 assistant: `recycle convert fixtures/gemma4_assistant --to eagle3 --target fixtures/gemma4_target
    -o /tmp/g4-eagle3`
    """
    from recycle.options import ConvertOptions
    from recycle.preflight import checkpoint_dir, output_dir, parse_tokens

    checkpoint_dir(ckpt)
    output_dir(output, overwrite, (ckpt,))
    if target is not None:
        checkpoint_dir(target)
    opts = ConvertOptions(source=str(ckpt), to=to, out=str(output), heads=heads, draft_vocab=draft_vocab,
                          vocab_corpus=str(vocab_corpus) if vocab_corpus else None, dtype=dtype, overwrite=overwrite,
                          layouts=layouts, calibrate=parse_tokens(calibrate, "--calibrate") if calibrate else None,
                          target=str(target) if target else None, data=data, eagle3_attention=eagle3_attention)
    from recycle.converters.api import convert as run_convert

    data = _with_progress(json_out, "writing tensors", lambda progress: run_convert(opts, progress))
    if json_out:
        print_json(data)
    else:
        render_convert(data)


@app.command()
@user_errors
def stitch(
    overlay: Annotated[Path, typer.Argument(help="An MTP overlay directory (OUT/mtp_overlay from convert --to eagle "
                                            "or distill).", metavar="OVERLAY_DIR")],
    target: Annotated[Path, typer.Argument(help="The target checkpoint: the one the modules came from, or its "
                                           "post-trained, fine-tuned or MTP-less build.", metavar="TARGET_DIR")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory for the stitched copy of the target.",
                                         metavar="OUT_DIR")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Write a copy of TARGET whose MTP tensors are the overlay's (for vLLM method "mtp", llama.cpp draft-mtp).

    Untouched shards are hard-linked (same filesystem; copied otherwise), shards holding MTP tensors are
    rewritten, and the modules' embedding/head copies are the target's own; the target is never
    modified. An overlay whose hidden size, vocabulary or tokenizer differs from the target's is refused.

    Example: `recycle stitch /tmp/ds-eagle/mtp_overlay fixtures/deepseek_v3_mtp -o /tmp/ds-stitched`
    """
    from recycle.preflight import checkpoint_dir, output_dir

    checkpoint_dir(overlay)
    checkpoint_dir(target)
    output_dir(output, overwrite, (overlay, target))
    from recycle.converters.api import stitch_overlay

    data = _with_progress(json_out, "stitching", lambda progress: stitch_overlay(
        overlay, target, output, overwrite=overwrite, progress=progress))
    if json_out:
        print_json(data)
    else:
        out.print(f"stitched {data['overlay_tensors']} MTP tensors into [bold]{data['out']}[/bold] "
                  f"({len(data['linked'])} shard(s) linked, {len(data['rewritten'])} rewritten, +{data['file']})")
        if data["copies_from_target"]:
            out.print(f"[dim]{len(data['copies_from_target'])} embedding/head copies are the target's own "
                      f"({', '.join(sorted(set(data['copies_from_target'].values())))})[/dim]")


def render_bench(data: dict) -> None:
    """Rich report: configuration, per-prompt rows, the overall comparison and the HF peers."""
    o = data["overall"]
    ar, sp, pr = o["ar"], o["spec"], o["predicted"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("target", data["target"])
    head.add_row("drafter", f"{data['drafter'] or '(the target’s own MTP modules)'}  [dim]{data['tree']}[/dim]")
    head.add_row("decoding", f"{'greedy' if data['temperature'] <= 0 else 'sampling T=' + str(data['temperature'])}, "
                 f"≤{data['max_new_tokens']} new tokens, {len(data['prompts'])} prompts, {data['device']} "
                 f"{data['dtype']}, {data['threads']} thread(s)")
    out.print(Panel(head, title="recycle bench", expand=False))
    t = table("per prompt")
    for col in ("#", "set", "prompt tok", "new tok", "τ", "AR tok/s", "spec tok/s", "speedup", "= AR"):
        t.add_column(col, justify="right" if col not in ("set", "= AR") else "left")
    for i, r in enumerate(data["prompts"]):
        a, s = r["ar"]["tokens_per_s"], r["spec"]["tokens_per_s"]
        same = "" if r["greedy_match"] is None else ("yes" if r["greedy_match"] else "[red]NO[/red]")
        t.add_row(str(i), r["set"], str(r["prompt_tokens"]), str(r["spec"]["new_tokens"]), f"{r['spec']['tau']:.2f}",
                  f"{a:.1f}", f"{s:.1f}", f"{s / a:.2f}×" if a else "-", same)
    out.print(t)
    s = table("overall")
    s.add_column("")
    s.add_column("autoregressive", justify="right")
    s.add_column(data["tree"], justify="right")
    s.add_column("[dim]cost model[/dim]", justify="right")
    bw = data.get("bandwidth")
    gbs = (lambda k: f" ({bw[k]:.0f}/{bw['peak_gbs']:.0f} GB/s)") if bw else (lambda k: "")
    s.add_row("tokens/s", f"{ar['tokens_per_s']:.1f}{gbs('ar_gbs')}", f"{sp['tokens_per_s']:.1f}{gbs('spec_gbs')}", "")
    s.add_row("speedup", "1.00×", f"{o['speedup']:.2f}×", f"[dim]{pr['speedup']:.2f}×[/dim]")
    s.add_row("τ (tokens/step)", "1.00", f"{sp['tau']:.2f}", f"[dim]{pr['tau']:.2f}[/dim]")
    s.add_row("target forwards", str(ar["target_forwards"]), str(sp["target_forwards"]), "")
    s.add_row("acceptance by depth", "", " ".join(f"{a:.2f}" for a in sp["acceptance"]), "")
    s.add_row("draft / verify s", f"- / {ar['verify_s']:.2f}", f"{sp['draft_s']:.2f} / {sp['verify_s']:.2f}",
              f"[dim]{pr['c_draft']:.2f} / {pr['c_verify']:.2f} AR steps[/dim]")
    if o["greedy_match"]:
        s.add_row("greedy = AR", "", o["greedy_match"], "")
    out.print(s)
    if data.get("hf"):
        h = table("transformers' generate on the same prompts")
        for col in ("method", "tok/s", "vs our AR", "= ours"):
            h.add_column(col, justify="left" if col in ("method", "= ours") else "right")
        for r in data["hf"]:
            if r["error"]:
                h.add_row(r["method"], "[red]failed[/red]", r["error"][:40], "")
            else:
                h.add_row(r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_our_ar']:.2f}×", r["greedy_match"] or "")
        out.print(h)
    out.print("[dim]speedup = tok/s ÷ our AR tok/s (same loop and KV-cache code); cost model = τ_pred / "
              "(c_draft + c_verify), costs per step in AR steps[/dim]")


@app.command()
@user_errors
def bench(
    drafter: Annotated[Path | None, typer.Argument(help="Drafter directory (from `recycle convert`), or the target "
                                                   "directory itself to draft with its native MTP modules.",
                                                   metavar="DRAFTER_DIR")] = None,
    target: Annotated[Path, typer.Option("--target", help="Target model directory (loaded with transformers).",
                                         metavar="TARGET_DIR")] = ...,
    prompts: Annotated[str | None, typer.Option("--prompts", help='JSONL, one {"prompt": "..."} per line; or a '
                                                "corpus: stdlib (held-out code + English, the default) or "
                                                "py:PACKAGE (code from an installed package's held-out files).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help="New tokens per prompt "
                                                       "(default 128; 64 with --quick).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="The first 4 prompts, 64 new tokens: a look in about a "
                                        "minute on a laptop CPU.")] = False,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; > 0: lossless speculative sampling.")] = 0.0,
    tree: Annotated[str | None, typer.Option("--tree", help="chain[:N], dynamic[:DEPTH,TOPK,TOTAL], or a JSON list of "
                                             "Medusa-style paths (or a file holding one).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when available).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16.")] = "fp32",
    native_mtp: Annotated[bool, typer.Option("--native-mtp", help="Draft with the target's own MTP modules.")] = False,
    compare_hf: Annotated[bool, typer.Option("--compare-hf", help="Also time transformers' generate: plain, "
                                             "use_mtp (where supported), assistant_model= (a Gemma 4 assistant) "
                                             "and prompt lookup.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling.")] = 0,
    repeats: Annotated[int, typer.Option("--repeats", help="Time each prompt N times per decoder, keep the fastest.")] = 1,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema in README.md).")] = False,
) -> None:
    """Measure speculative decoding with a drafter against plain autoregressive decoding of the target.

    Greedy output is checked token for token against AR decoding; τ, acceptance by depth, target
    forwards, draft/verify time, tokens/s, measured and cost-model speedup are reported.

    Example: `recycle bench /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --quick`
    """
    from recycle.preflight import drafter_dir, model_dir

    if drafter is not None:
        drafter_dir(drafter)
    model_dir(target)
    from recycle.prompts import default_prompts, prompt_set

    limit = 4 if quick else None
    chosen = prompt_set(prompts, limit) if prompts is not None else (default_prompts()[:limit] if quick else None)
    from recycle.bench import BenchOptions, check_options, run_bench, set_threads

    set_threads(threads)
    opts = BenchOptions(
        drafter=str(drafter) if drafter is not None else None, target=str(target), prompts=chosen,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else (64 if quick else 128),
        temperature=temperature, tree=tree, device=device, dtype=dtype, native=native_mtp, compare_hf=compare_hf,
        seed=seed, repeats=repeats,
    )
    check_options(opts)
    with Reporter("loading") as bar:
        data = run_bench(opts, progress=lambda i, n, label: bar.update(i, n, description=label, force=True,
                                                                      line=f"{label}: prompt {i}/{n}"))
    if json_out:
        print_json(data)
    else:
        render_bench(data)


# -- plan (issue 18) -------------------------------------------------------------------------------


def render_plan(data: dict) -> None:
    """Rich report: per prompt set the candidates (predicted and, where run, measured) and the pick;
    then the roofline per GPU: the best shape per batch size and each shape's crossover batch."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("target", data["target"])
    head.add_row("drafter", f"{data['drafter'] or '(the target’s own MTP modules)'}  [dim]{data['drafter_kind']}[/dim]")
    head.add_row("measured on", f"{data['device']} {data['dtype']}, {data['threads']} thread(s), "
                 f"≤{data['max_new_tokens']} new tokens, verify cost at context {data['context_measured']}")
    vs = data["verify_s"]
    head.add_row("verify n tokens", "  ".join(f"n={n}: {vs[n - 1] * 1e3:.1f} ms" for n in (1, 2, 4, 8, 16, len(vs))
                                              if n <= len(vs)))
    out.print(Panel(head, title="recycle plan", expand=False))
    for name, st in data["sets"].items():
        t = table(f"{name} ({st['prompts']} prompts): acceptance by depth "
                  + " ".join(f"{a:.2f}" for a in st["acceptance_by_depth"]))
        for col in ("shape", "τ", "draft", "verify", "AR steps", "predicted", "measured"):
            t.add_column(col, justify="left" if col == "shape" else "right")
        pick = st["recommended"]["shape"]
        for r in st["candidates"]:
            mark = "[bold green]" if r["shape"] == pick else ""
            t.add_row(f"{mark}{r['shape']}", f"{r['tau']:.2f}", f"{r['c_draft']:.2f}", f"{r['c_verify']:.2f}",
                      f"{r['cost']:.2f}", f"{mark}{r['predicted']:.2f}×",
                      f"{r['measured']:.2f}×" if r["measured"] is not None else "")
        out.print(t)
        out.print(f"[bold]recommended for {name}:[/bold] {st['recommended']['reason']}")
    rf = data["roofline"]
    tg = rf["target"]
    out.print(f"[dim]roofline of {rf['config']}: {fmt_count(tg['active_params'])} active / "
              f"{fmt_count(tg['stored_params'])} stored params, {tg['weight_bytes']:g} B/weight, "
              f"{fmt_bytes(int(tg['kv_bytes_per_token']))} KV per token, context {rf['context']}, "
              f"η_mem {rf['eta_mem']}, η_flops {rf['eta_flops']}; drafter: {rf['drafter']['source']}[/dim]")
    for g in rf["gpus"]:
        for name, st in g["sets"].items():
            batches = list(st["best"])
            many = "" if g["count"] == 1 else f" ×{g['count']}"
            t = table(f"{g['title']}{many} · {name}: speedup by batch size")
            t.add_column("shape")
            for b in batches:
                t.add_column(f"B={b}", justify="right")
            t.add_column("< 1× from B", justify="right")
            for c in st["candidates"]:
                t.add_row(c["shape"], *[("[bold]" if st["best"][b] == c["shape"] else "") + f"{c['speedup'][b]:.2f}"
                                        for b in batches],
                          str(c["crossover_batch"]) if c["crossover_batch"] else "> 4096")
            out.print(t)
    if data.get("plot"):
        out.print(f"plot: {data['plot']}")


@app.command()
@user_errors
def plan(
    drafter: Annotated[Path | None, typer.Argument(help="Drafter directory (from `recycle convert`), or the target "
                                                   "directory itself for its native MTP modules.",
                                                   metavar="DRAFTER_DIR")] = None,
    target: Annotated[Path, typer.Option("--target", help="Target model directory.", metavar="TARGET_DIR")] = ...,
    prompts: Annotated[str | None, typer.Option("--prompts", help="As bench: JSONL or a corpus name; one "
                                                "recommendation per prompt set (default: stdlib code and text).")] = None,
    gpus: Annotated[str, typer.Option("--gpu", help="GPUs for the roofline, comma-separated (H100, H200, H100-PCIe, "
                                      "A100, A100-40GB, L40S, L4, RTX4090).")] = ",".join(
        ("H100", "H200", "A100", "L40S", "RTX4090")),
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes for the roofline table, e.g. 1,8,32,128.")] = "1,8,32,128",
    context: Annotated[int, typer.Option("--context", help="Tokens cached per sequence in the roofline.")] = 2048,
    model_config: Annotated[str | None, typer.Option("--model-config", help="Roofline this config.json instead of "
                                                     "the target's (e.g. the full-size model a small stand-in "
                                                     "was measured for).")] = None,
    max_chain: Annotated[int, typer.Option("--max-chain", help="Longest chain measured (every shorter chain is "
                                           "derived from it).")] = 8,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="New tokens per prompt.")] = 64,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when available).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16.")] = "fp32",
    native_mtp: Annotated[bool, typer.Option("--native-mtp", help="Draft with the target's own MTP modules.")] = False,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="Write speedup against batch size (PNG).",
                                                  metavar="OUT.png")] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Choose the number of speculative tokens and the tree from measured acceptance, and predict the
    speedup across batch sizes and GPUs (roofline of the target's config).

    Measures per prompt set the drafter's per-depth acceptance along its longest chain and a few trees,
    the draft cost per step and the verification cost of 1 … 32 tokens; predicts τ and speedup for
    chain:1 … 8 and the trees, recommends one per set with the reason, and tables (and plots) the
    speedup per GPU and batch size with the batch size where speculation stops paying.

    Example: `recycle plan /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --gpu H100,L40S --plot plan.png`
    """
    from recycle.preflight import drafter_dir, model_dir

    if drafter is not None:
        drafter_dir(drafter)
    model_dir(target)
    from recycle.bench import BenchOptions, set_threads
    from recycle.plan import PlanOptions, check_options, parse_batches, run_plan
    from recycle.prompts import prompt_set

    set_threads(threads)
    opts = PlanOptions(
        bench=BenchOptions(drafter=str(drafter) if drafter is not None else None, target=str(target),
                           prompts=prompt_set(prompts) if prompts is not None else None,
                           max_new_tokens=max_new_tokens, device=device, dtype=dtype, native=native_mtp),
        gpus=[g for g in gpus.split(",") if g.strip()], batches=parse_batches(batch), context=context,
        max_chain=max_chain, model_config=model_config, plot=str(plot_out) if plot_out is not None else None,
    )
    check_options(opts)
    with Reporter("measuring") as bar:
        data = run_plan(opts, progress=lambda i, n, label: bar.update(i, n, description=label, force=True,
                                                                     line=f"plan: {label} ({i}/{n})"))
    if json_out:
        print_json(data)
    else:
        render_plan(data)


# -- push (issue 7) -------------------------------------------------------------------------------


def render_push(data: dict) -> None:
    """Rich summary: where it goes (or would go), the checks passed, every file with its size, the card."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("repository", f"{data['repo']}  [dim]({data['revision']}, "
                 f"{'private' if data['private'] else 'default visibility'}, {data['endpoint']})[/dim]")
    head.add_row("drafter", f"{data['drafter']}  [dim]({data['format']})[/dim]")
    head.add_row("checked", f"layout, config and {data['tensors_checked']} tensors finite  "
                 f"[dim](bench.json: {'yes' if data['bench'] else 'no'})[/dim]")
    head.add_row("base_model", data["base_model"])
    if data["commit"]:
        head.add_row("commit", data["commit"]["commit_url"])
    title = "recycle push --dry-run (nothing uploaded)" if data["dry_run"] else "recycle push"
    out.print(Panel(head, title=title, expand=False))
    t = table(f"files {'that would go up' if data['dry_run'] else 'uploaded'} in one commit")
    t.add_column("file")
    t.add_column("bytes", justify="right")
    t.add_column("size", justify="right")
    for name, size in data["files"].items():
        t.add_row(name + ("  [dim](generated model card)[/dim]" if name == "README.md" else ""), str(size),
                  fmt_bytes(size))
    t.add_row("[bold]total[/bold]", str(data["bytes"]), fmt_bytes(data["bytes"]))
    out.print(t)
    for note in data["notes"]:
        out.print(f"[yellow]note:[/yellow] {note}")
    if data["card_path"]:
        out.print(f"model card written to [bold]{data['card_path']}[/bold]")
    elif data.get("card") is not None:
        out.rule("README.md (model card)")
        sys.stdout.write(data["card"])  # verbatim: rich would wrap long lines


@app.command()
@user_errors
def push(
    drafter: Annotated[Path, typer.Argument(help="Drafter directory (from `recycle convert` or `recycle distill`).",
                                            metavar="DRAFTER_DIR")],
    repo: Annotated[str, typer.Option("--repo", help="Hub repository, OWNER/NAME (created if missing).",
                                      metavar="OWNER/NAME")],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[str | None, typer.Option("--revision", help="Branch to commit to (created if "
                                                 "missing; default main).")] = None,
    commit_message: Annotated[str | None, typer.Option("--commit-message", help="Commit summary.")] = None,
    base_model: Annotated[str | None, typer.Option("--base-model", help="Hub id of the target model for the "
                                                   "card's base_model (default: from recycle.json).")] = None,
    license: Annotated[str | None, typer.Option("--license", help="Hub license id for the card (default: from the "
                                                "source's config, README or LICENSE).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate, write the card and list the files; "
                                          "upload nothing.")] = False,
    card_out: Annotated[Path | None, typer.Option("--card-out", help="Also write the model card here (outside "
                                                  "the drafter directory); --dry-run prints it otherwise.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Validate a drafter directory, write its model card and upload both to the Hub in one commit.

    The layout must match the format recycle.json declares and every weight must be finite, or nothing
    is sent. The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT picks the Hub. The drafter
    directory is never modified.

    Example: `recycle push /tmp/ds-eagle --repo me/ds-eagle --dry-run --card-out /tmp/README.md`
    """
    from recycle.preflight import drafter_record

    drafter_record(drafter)
    from recycle.hub import push_drafter

    def run(progress):
        if json_out:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        return push_drafter(drafter, repo, private=private, revision=revision, commit_message=commit_message,
                            base_model=base_model, dry_run=dry_run, card_out=card_out, license=license,
                            progress=progress)

    data = _with_progress(json_out, "checking tensors", run)
    if json_out:
        print_json(data)
    else:
        render_push(data)


# -- distill (issue 6) ----------------------------------------------------------------------------

def render_distill(data: dict) -> None:
    t = table(f"recycle distill → {data['out']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("tokens (budget)", f"{fmt_count(data['tokens'])} ({fmt_count(data['budget_tokens'])})")
    t.add_row("steps", str(data["steps"]))
    t.add_row("final loss", f"{data['final']['loss']:.4f}" if data["final"]["loss"] is not None else "-")
    before, after = data["final"]["heldout_agreement_before"], data["final"]["heldout_agreement_after"]
    t.add_row("held-out agreement by step", "  ".join(f"{b:.3f}→{a:.3f}" for b, a in zip(before, after)))
    t.add_row("held-out estimate (τ of the chain)", f"{data['final']['heldout_estimate_before']:.3f} → "
              f"{data['final']['heldout_estimate_after']:.3f}")
    t.add_row("written", data["selected"]["why"])
    for role, d in (data.get("target_io") or {}).items():
        if d["replaced_by_target"]:
            t.add_row(f"{role} (was {d['relative_difference']:.0%} off)", "the target's")
    t.add_row("tokens/s", f"{data['tokens_per_s']:.0f}")
    t.add_row("target forward / loop overhead", f"{100 * (data['target_forward_share'] or 0):.1f}% / "
              f"{100 * (data['overhead_share'] or 0):.1f}%")
    t.add_row("wall time", f"{data['wall_s']:.1f} s" + (" (resumed)" if data["resumed"] else ""))
    out.print(t)


@app.command()
@user_errors
def distill(
    drafter: Annotated[Path, typer.Argument(help="Drafter directory (from `recycle convert`, or a Gemma 4 assistant: "
                                            "re-aligned in its own layout).", metavar="DRAFTER_DIR")],
    target: Annotated[Path, typer.Option("--target", help="Target model directory (frozen teacher): the source, or "
                                         "its post-trained / fine-tuned build.", metavar="TARGET_DIR")] = ...,
    tokens: Annotated[str, typer.Option("--tokens", help="Budget in target tokens read: 300k, 2M, 1.5B ...")] = "2M",
    data: Annotated[str | None, typer.Option("--data", help="Text file, JSONL ('text' field), directory of text "
                                             "files, or a saved `datasets` dataset (its tail is held out); or a "
                                             "corpus: stdlib (the default) or py:PACKAGE (an installed package's "
                                             "source).")] = None,
    self_distill: Annotated[bool, typer.Option("--self-distill", help="Let the target regenerate each sequence "
                                               "after a prompt (its own distribution).")] = False,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Self-distillation prompt tokens per sequence.")] = 64,
    sd_temperature: Annotated[float, typer.Option("--sd-temperature", help="Self-distillation sampling "
                                                  "temperature (0: greedy).")] = 0.0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Output drafter directory "
                                                "(default: DRAFTER-distilled).", metavar="OUT_DIR")] = None,
    output_alias: Annotated[Path | None, typer.Option("--out", hidden=True, help="Old name of --output.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint in OUT.distill/.")] = False,
    cache_hidden: Annotated[Path | None, typer.Option("--cache-hidden", help="Store/reuse the target's features "
                                                      "per batch (safetensors) here; a `recycle harvest` "
                                                      "cache is read without loading the target.")] = None,
    online: Annotated[int | None, typer.Option("--online", help="Harvest in vLLM while training, at most N steps' "
                                               "windows ahead in --cache-hidden; consumed windows are deleted "
                                               "(disk stays flat). The target is never loaded here.",
                                               metavar="N")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per packed sequence.")] = 256,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per step (per rank).")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="Peak AdamW learning rate.")] = 5e-4,
    draft_steps: Annotated[int | None, typer.Option("--draft-steps", help="Unrolled draft steps (default: 3; "
                                                    "Medusa: its heads).")] = None,
    ce_weight: Annotated[float, typer.Option("--ce-weight", help="Weight of CE to the data label.")] = 0.1,
    kl_weight: Annotated[float, typer.Option("--kl-weight", help="β: weight of KL(P_target ‖ P_draft).")] = 1.0,
    feature_weight: Annotated[float, typer.Option("--feature-weight", help="Smooth-L1 feature regression "
                                                  "(EAGLE drafter).")] = 0.0,
    step_decay: Annotated[float, typer.Option("--step-decay", help="Weight of draft step k ∝ decay^k.")] = 0.8,
    init: Annotated[str, typer.Option("--init", help="recycled (the converted weights) or scratch "
                                      "(re-initialised, same architecture).")] = "recycled",
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Steps between checkpoints.")] = 50,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Steps between held-out agreement checks.")] = 25,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when available).")] = None,
    precision: Annotated[str | None, typer.Option("--precision", help="bf16 (autocast) or fp32 (default: bf16 on "
                                                  "CUDA and CPUs with native bf16, else fp32).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for data order and initialisation.")] = 0,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT and any earlier run's checkpoint.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the distillation record as one JSON object.")] = False,
) -> None:
    """Distill a drafter against its frozen target to an exact token budget; writes the same format.

    A drafter converted from a base checkpoint re-aligns to a post-trained or fine-tuned build of it:
    it takes that target's embedding and LM head, learns on --data, is judged on held-out text of
    the same data, and the best held-out snapshot is written (never one worse than the input).

    Example: `recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 2M`
    """
    from recycle.preflight import data_name, drafter_dir, model_dir, parse_tokens

    budget = parse_tokens(tokens)
    drafter_dir(drafter)
    model_dir(target)
    data_name(data)
    output = output or output_alias
    from recycle.distill.train import distill as run_distill
    from recycle.options import DistillOptions, LossConfig

    opts = DistillOptions(
        drafter=str(drafter), target=str(target), tokens=budget, out=str(output) if output else None,
        data=data, self_distill=self_distill, prompt_len=prompt_len,
        sd_temperature=sd_temperature, seq_len=seq_len, batch=batch, lr=lr, draft_steps=draft_steps,
        loss=LossConfig(ce_weight, kl_weight, feature_weight, step_decay), init=init,
        checkpoint_every=checkpoint_every, eval_every=eval_every, resume=resume,
        cache_hidden=str(cache_hidden) if cache_hidden else None, device=device, precision=precision, seed=seed,
        threads=threads, overwrite=overwrite, online=online,
    )
    log = lambda msg: print(f"recycle: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports and writes
        run_distill(opts, log=log)
        return
    fields = {"tps": "-", "loss": "-", "agree": "-"}
    columns = (TextColumn("{task.fields[tps]} tok/s  loss {task.fields[loss]}  held-out agree {task.fields[agree]}"),)
    with Reporter("distilling", columns, **fields) as bar:

        def update(row: dict) -> None:
            fields.update(tps=f"{row['tokens_per_s']:.0f}", loss=f"{row['loss']:.3f}")
            if "heldout_agree" in row:
                fields["agree"] = "/".join(f"{a:.2f}" for a in row["heldout_agree"])
            bar.update(row["tokens"], opts.tokens, description=f"{fmt_count(row['tokens'])} tokens",
                       force="heldout_agree" in row, line=f"distill: {fmt_count(row['tokens'])}/{fmt_count(opts.tokens)} "
                       f"tokens, {fields['tps']} tok/s, loss {fields['loss']}, held-out agree {fields['agree']}",
                       **fields)

        data_out = run_distill(opts, progress=update, log=log)
    if json_out:
        print_json(data_out)
    else:
        render_distill(data_out)


@app.command()
@user_errors
def harvest(
    target: Annotated[Path, typer.Argument(help="Target model directory (vLLM runs it).", metavar="TARGET_DIR")],
    tokens: Annotated[str, typer.Option("--tokens", help="Budget in target tokens, as distill's: 300k, 2M ...")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Cache directory (give it to distill "
                                         "--cache-hidden).", metavar="CACHE_DIR")],
    drafter: Annotated[Path | None, typer.Option("--drafter", help="The drafter the cache is for: an EAGLE-3 "
                                                 "directory's aux layers are harvested too.",
                                                 metavar="DRAFTER_DIR")] = None,
    data: Annotated[str | None, typer.Option("--data", help="As distill's --data (default: the stdlib corpus).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="As distill's --seq-len.")] = 256,
    batch: Annotated[int, typer.Option("--batch", help="As distill's --batch.")] = 8,
    seed: Annotated[int, typer.Option("--seed", help="As distill's --seed (the data order).")] = 0,
    self_distill: Annotated[bool, typer.Option("--self-distill", help="As distill's: vLLM writes each window after "
                                               "its first --prompt-len tokens; distill --self-distill reads them.")] = False,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="As distill's --prompt-len.")] = 64,
    sd_temperature: Annotated[float, typer.Option("--sd-temperature", help="As distill's --sd-temperature "
                                                  "(0: greedy).")] = 0.0,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", help="vLLM's own.")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option("--pipeline-parallel-size", help="vLLM's own.")] = 1,
    data_parallel_size: Annotated[int, typer.Option("--data-parallel-size", help="vLLM's own.")] = 1,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing cache directory.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Compute the target's features for a distillation in vLLM, ahead of it, for targets no training
    process holds: vLLM's parallelism spreads the target; distill then reads the cache.

    The windows are exactly those `recycle distill` with the same --tokens/--data/--seq-len/--batch/--seed
    reads; vLLM runs in the environment recycle manages (built on first use).

    Example: `recycle harvest fixtures/deepseek_v3_mtp --tokens 64k -o /tmp/ds-cache`, then
    `recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 64k --cache-hidden /tmp/ds-cache`
    """
    from recycle.preflight import (
        data_name,
        drafter_dir,
        model_dir,
        output_dir,
        parse_tokens,
    )

    budget = parse_tokens(tokens)
    model_dir(target, "TARGET_DIR")
    output_dir(output, overwrite, (target,))
    data_name(data)
    if seq_len < 8 or batch < 1:
        raise RecycleError("--seq-len must be at least 8 and --batch at least 1")
    aux: tuple[int, ...] = ()
    if drafter is not None:
        drafter_dir(drafter)
        from recycle.checkpoint import load_json
        from recycle.formats import of_directory

        reads = of_directory(drafter).reads(load_json(drafter / "config.json", "drafter config.json"),
                                            load_json(target / "config.json", "target config.json"))
        aux = tuple(reads.aux_layers or ())
    from recycle.distill.harvest import harvest as run_harvest
    from recycle.options import HarvestOptions

    parallel = {k: v for k, v in (("tensor_parallel_size", tensor_parallel_size),
                                  ("pipeline_parallel_size", pipeline_parallel_size),
                                  ("data_parallel_size", data_parallel_size)) if v != 1}
    opts = HarvestOptions(target=str(target), out=str(output), tokens=budget, data=data, seq_len=seq_len, batch=batch,
                          seed=seed, aux_layers=aux, overwrite=overwrite, parallel=parallel, self_distill=self_distill,
                          prompt_len=prompt_len, sd_temperature=sd_temperature)
    if json_out:
        print_json(run_harvest(opts))
        return
    print("recycle: harvest: running the target in vLLM (engine start: about a minute on a CPU)", file=sys.stderr)
    with Reporter("writing cache") as bar:
        count = [0]

        def update(_key: str) -> None:
            count[0] += 1
            bar.update(count[0], line=f"harvest: {count[0]} cache files written")

        data_out = run_harvest(opts, progress=update)
    out.print(f"[bold]recycle harvest[/bold] → {data_out['out']}: {fmt_count(data_out['tokens'])} tokens, "
              f"{data_out['files']} files, {fmt_bytes(data_out['bytes'])} ({data_out['bytes_per_token']} B/token); "
              f"vLLM {data_out['vllm_tokens_per_s']} tokens/s")


if __name__ == "__main__":
    app()
