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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from recycle import __version__
from recycle.errors import RecycleError

app = typer.Typer(
    help="Turn the Multi-Token-Prediction modules of open checkpoints into speculative-decoding drafters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
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


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


@app.callback(invoke_without_command=True)
def main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(__version__)
        raise typer.Exit()


def render_inspect(data: dict) -> None:
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
        t = Table(title="MTP modules", title_justify="left")
        for col in ("#", "prefix", "tensors", "params", "bytes", "dtypes", "concat", "norm", "shared from trunk"):
            t.add_column(col, overflow="fold")
        for m in mtp["modules"]:
            shared = ", ".join(f"{r}←{n}" if n else f"{r}: MISSING" for r, n in m["shared"].items()) or "-"
            t.add_row(str(m["index"]), m["prefix"], str(m["tensors"]), fmt_count(m["params"]), fmt_bytes(m["bytes"]),
                      " ".join(f"{d}:{c}" for d, c in m["dtypes"].items()), str(m["concat_order"]), m["norm"], shared)
        out.print(t)
        r = Table(title="roles (module 0)", title_justify="left")
        r.add_column("role")
        r.add_column("tensors")
        for role, names in mtp["modules"][0]["roles"].items():
            shown = names if len(names) <= 3 else names[:2] + [f"... ({len(names)} tensors)"]
            r.add_row(role, "\n".join(shown))
        out.print(r)

    if data.get("stats"):
        s = Table(title="tensor health (MTP tensors, dequantized)", title_justify="left")
        for col in ("tensor", "dtype", "shape", "finite", "zero", "rms", "norm mean±std [min,max]"):
            s.add_column(col, overflow="fold")
        prefixes = [(m["index"], m["prefix"]) for m in mtp["modules"]]
        for st in data["stats"]:
            label = next((f"[{i}] {st['name'][len(p):]}" for i, p in prefixes if st["name"].startswith(p)), st["name"])
            n = st["norm"]
            norm = f"{n['mean']:.3f}±{n['std']:.3f} [{n['min']:.3f},{n['max']:.3f}]" if n else ""
            s.add_row(label, st["dtype"], "x".join(map(str, st["shape"])),
                      "yes" if st["finite"] else "[red]NO[/red]", "[yellow]yes[/yellow]" if st["all_zero"] else "no",
                      f"{st['rms']:.4g}", norm)
        out.print(s)

    if data["findings"]:
        f = Table(title="findings", title_justify="left")
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
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint directory (config.json + *.safetensors).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema in README.md).")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Also read the MTP tensors: finite, all-zero, RMS, norms.")] = False,
) -> None:
    """Audit the MTP weights of a checkpoint: family, layout, shapes, dtypes, FP8 scales, health.

    Reads safetensors headers only (no tensor data) unless --stats is given; never writes.

    Example: [bold]recycle inspect fixtures/deepseek_v3_mtp --stats[/bold]
    """
    from recycle.audit import inspect_checkpoint

    if stats and not json_out:
        with progress_bar() as bar:
            task = bar.add_task("reading MTP tensors", total=None)
            report = inspect_checkpoint(ckpt, stats=True, progress=lambda i, n: bar.update(task, completed=i, total=n))
    else:
        report = inspect_checkpoint(ckpt, stats=stats)
    data = report.to_json()
    if json_out:
        print_json(data)
    else:
        render_inspect(data)


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
    t = Table(title="files", title_justify="left")
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
    with progress_bar() as bar:
        task = bar.add_task(label, total=None)
        return fn(lambda i, n: bar.update(task, completed=i, total=n))


@app.command()
@user_errors
def convert(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint directory (config.json + *.safetensors).")],
    to: Annotated[str, typer.Option("--to", help="Drafter format: eagle, eagle3 or medusa.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory (must not exist, see --overwrite).")],
    heads: Annotated[int | None, typer.Option("--heads", help="Medusa heads (default 3).")] = None,
    draft_vocab: Annotated[int | None, typer.Option("--draft-vocab", help="EAGLE-3 draft vocabulary size "
                                                    "(top-N corpus tokens; default: the full vocabulary).")] = None,
    vocab_corpus: Annotated[Path | None, typer.Option("--vocab-corpus", help="Text file to count tokens in "
                                                      "(default: recycle's stdlib corpus).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Output dtype: bf16, fp16 or fp32.")] = "bf16",
    layouts: Annotated[str | None, typer.Option("--layouts", help="--to eagle: comma list of recycle, nextn, "
                                                "overlay (default: all three).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Turn a checkpoint's MTP modules into a speculative-decoding drafter directory.

    Reads only the MTP tensors (and the trunk's embedding/head when a module stores none), writes
    atomically (nothing appears unless everything was written), never touches the source.

    Example: [bold]recycle convert fixtures/deepseek_v3_mtp --to eagle -o /tmp/ds-eagle[/bold]
    """
    from converters.api import convert_checkpoint

    data = _with_progress(json_out, "writing tensors", lambda progress: convert_checkpoint(
        ckpt, to, output, heads=heads, draft_vocab=draft_vocab, vocab_corpus=vocab_corpus, dtype=dtype,
        overwrite=overwrite, progress=progress, layouts=layouts))
    if json_out:
        print_json(data)
    else:
        render_convert(data)


@app.command()
@user_errors
def stitch(
    overlay: Annotated[Path, typer.Argument(help="An MTP overlay directory (OUT/mtp_overlay from convert --to eagle).")],
    target: Annotated[Path, typer.Argument(help="The target checkpoint directory the overlay came from.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory for the stitched copy of the target.")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Write a copy of TARGET whose MTP tensors are the overlay's (for vLLM method "mtp", llama.cpp draft-mtp).

    Untouched shards are hard-linked (same filesystem; copied otherwise), shards holding MTP tensors are
    rewritten; the target is never modified.

    Example: [bold]recycle stitch /tmp/ds-eagle/mtp_overlay fixtures/deepseek_v3_mtp -o /tmp/ds-stitched[/bold]
    """
    from converters.api import stitch_overlay

    data = _with_progress(json_out, "stitching", lambda progress: stitch_overlay(
        overlay, target, output, overwrite=overwrite, progress=progress))
    if json_out:
        print_json(data)
    else:
        out.print(f"stitched {data['overlay_tensors']} MTP tensors into [bold]{data['out']}[/bold] "
                  f"({len(data['linked'])} shard(s) linked, {len(data['rewritten'])} rewritten, +{data['file']})")


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
    t = Table(title="per prompt", title_justify="left")
    for col in ("#", "set", "prompt tok", "new tok", "τ", "AR tok/s", "spec tok/s", "speedup", "= AR"):
        t.add_column(col, justify="right" if col not in ("set", "= AR") else "left")
    for i, r in enumerate(data["prompts"]):
        a, s = r["ar"]["tokens_per_s"], r["spec"]["tokens_per_s"]
        same = "" if r["greedy_match"] is None else ("yes" if r["greedy_match"] else "[red]NO[/red]")
        t.add_row(str(i), r["set"], str(r["prompt_tokens"]), str(r["spec"]["new_tokens"]), f"{r['spec']['tau']:.2f}",
                  f"{a:.1f}", f"{s:.1f}", f"{s / a:.2f}×" if a else "-", same)
    out.print(t)
    s = Table(title="overall", title_justify="left")
    for col in ("decoder", "tok/s", "speedup", "τ", "target fwd", "accept rate by depth", "draft / verify s", "= ours"):
        s.add_column(col, justify="left" if col in ("decoder", "accept rate by depth", "= ours") else "right")
    bw = data.get("bandwidth")
    extra = (lambda k: f" ({bw[k]:.0f}/{bw['peak_gbs']:.0f} GB/s)") if bw else (lambda k: "")
    s.add_row("autoregressive (ours)", f"{ar['tokens_per_s']:.1f}{extra('ar_gbs')}", "1.00×", "1.00",
              str(ar["target_forwards"]), "", f"- / {ar['verify_s']:.2f}", "")
    s.add_row(data["tree"], f"{sp['tokens_per_s']:.1f}{extra('spec_gbs')}",
              f"{o['speedup']:.2f}×", f"{sp['tau']:.2f}", str(sp["target_forwards"]),
              " ".join(f"{a:.2f}" for a in sp["acceptance"]), f"{sp['draft_s']:.2f} / {sp['verify_s']:.2f}",
              o["greedy_match"] or "")
    s.add_row("[dim]cost model[/dim]", "", f"[dim]{pr['speedup']:.2f}×[/dim]", f"[dim]{pr['tau']:.2f}[/dim]", "",
              "", f"[dim]c_draft {pr['c_draft']:.2f}, c_verify {pr['c_verify']:.2f}[/dim]", "")
    for r in data.get("hf") or []:
        if r["error"]:
            s.add_row(r["method"], "[red]failed[/red]", "", "", "", r["error"][:60], "", "")
        else:
            s.add_row(r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_our_ar']:.2f}×", "", "", "", "",
                      r["greedy_match"] or "")
    out.print(s)
    out.print("[dim]speedup = tok/s ÷ our AR tok/s (same loop, same KV-cache code); cost model = τ_pred / "
              "(c_draft + c_verify), costs per step in AR steps[/dim]")


@app.command()
@user_errors
def bench(
    drafter: Annotated[Path | None, typer.Argument(help="Drafter directory (from `recycle convert`), or the target "
                                                   "directory itself to draft with its native MTP modules.")] = None,
    target: Annotated[Path, typer.Option("--target", help="Target model directory (loaded with transformers).")] = ...,
    prompts: Annotated[Path | None, typer.Option("--prompts", help='JSONL, one {"prompt": "..."} per line '
                                                 "(default: held-out code + English prompts).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="New tokens per prompt.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; > 0: lossless speculative sampling.")] = 0.0,
    tree: Annotated[str | None, typer.Option("--tree", help="chain[:N], dynamic[:DEPTH,TOPK,TOTAL], or a JSON list of "
                                             "Medusa-style paths (or a file holding one).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when available).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16.")] = "fp32",
    native_mtp: Annotated[bool, typer.Option("--native-mtp", help="Draft with the target's own MTP modules.")] = False,
    compare_hf: Annotated[bool, typer.Option("--compare-hf", help="Also time transformers' generate: plain, "
                                             "use_mtp (where supported) and prompt lookup.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling.")] = 0,
    repeats: Annotated[int, typer.Option("--repeats", help="Time each prompt N times per decoder, keep the fastest.")] = 1,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema in README.md).")] = False,
) -> None:
    """Measure speculative decoding with a drafter against plain autoregressive decoding of the target.

    Greedy output is checked token for token against AR decoding; τ, acceptance by depth, target
    forwards, draft/verify time, tokens/s, measured and cost-model speedup are reported.

    Example: [bold]recycle bench /tmp/ds-eagle --target fixtures/deepseek_v3_mtp[/bold]
    """
    from recycle.bench import BenchOptions, check_options, run_bench, set_threads
    from recycle.prompts import read_jsonl

    set_threads(threads)
    opts = BenchOptions(
        drafter=str(drafter) if drafter is not None else None, target=str(target),
        prompts=read_jsonl(prompts) if prompts is not None else None, max_new_tokens=max_new_tokens,
        temperature=temperature, tree=tree, device=device, dtype=dtype, native=native_mtp, compare_hf=compare_hf,
        seed=seed, repeats=repeats,
    )
    check_options(opts)
    if json_out:
        data = run_bench(opts)
        print_json(data)
        return
    with progress_bar() as bar:
        task = bar.add_task("loading", total=None)
        data = run_bench(opts, progress=lambda i, n, label: bar.update(task, completed=i, total=n, description=label))
    render_bench(data)


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
    t = Table(title=f"files {'that would go up' if data['dry_run'] else 'uploaded'} in one commit", title_justify="left")
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
    drafter: Annotated[Path, typer.Argument(help="Drafter directory (from `recycle convert` or `recycle distill`).")],
    repo: Annotated[str, typer.Option("--repo", help="Hub repository, OWNER/NAME (created if missing).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[str | None, typer.Option("--revision", help="Branch to commit to (created if "
                                                 "missing; default main).")] = None,
    commit_message: Annotated[str | None, typer.Option("--commit-message", help="Commit summary.")] = None,
    base_model: Annotated[str | None, typer.Option("--base-model", help="Hub id of the target model for the "
                                                   "card's base_model (default: from recycle.json).")] = None,
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

    Example: [bold]recycle push /tmp/ds-eagle --repo me/ds-eagle --dry-run --card-out /tmp/README.md[/bold]
    """
    from recycle.hub import push_drafter

    def run(progress):
        if json_out:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        return push_drafter(drafter, repo, private=private, revision=revision, commit_message=commit_message,
                            base_model=base_model, dry_run=dry_run, card_out=card_out, progress=progress)

    data = _with_progress(json_out, "checking tensors", run)
    if json_out:
        print_json(data)
    else:
        render_push(data)


# -- distill (issue 6) ----------------------------------------------------------------------------

def render_distill(data: dict) -> None:
    t = Table(title=f"recycle distill → {data['out']}", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("tokens (budget)", f"{fmt_count(data['tokens'])} ({fmt_count(data['budget_tokens'])})")
    t.add_row("steps", str(data["steps"]))
    t.add_row("final loss", f"{data['final']['loss']:.4f}" if data["final"]["loss"] is not None else "-")
    before, after = data["final"]["heldout_agreement_before"], data["final"]["heldout_agreement_after"]
    t.add_row("held-out top-1 agreement by step (before → after)",
              "  ".join(f"{b:.3f}→{a:.3f}" for b, a in zip(before, after)))
    t.add_row("tokens/s", f"{data['tokens_per_s']:.0f}")
    t.add_row("target forward share of a step", f"{100 * (data['target_forward_share'] or 0):.1f}%")
    t.add_row("loop overhead share (data, optimizer, logging)", f"{100 * (data['overhead_share'] or 0):.1f}%")
    t.add_row("wall time", f"{data['wall_s']:.1f} s" + (" (resumed)" if data["resumed"] else ""))
    out.print(t)


@app.command()
@user_errors
def distill(
    drafter: Annotated[Path, typer.Argument(help="Drafter directory (from `recycle convert`).")],
    target: Annotated[Path, typer.Option("--target", help="Target model directory (frozen teacher).")] = ...,
    tokens: Annotated[str, typer.Option("--tokens", help="Budget in target tokens read: 300k, 2M, 1.5B ...")] = "2M",
    data: Annotated[Path | None, typer.Option("--data", help="Text file, JSONL ('text' field), directory of text "
                                              "files, or a saved `datasets` dataset (default: stdlib train split).")] = None,
    self_distill: Annotated[bool, typer.Option("--self-distill", help="Let the target regenerate each sequence "
                                               "after a prompt (its own distribution).")] = False,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Self-distillation prompt tokens per sequence.")] = 64,
    sd_temperature: Annotated[float, typer.Option("--sd-temperature", help="Self-distillation sampling "
                                                  "temperature (0: greedy).")] = 0.0,
    output: Annotated[Path | None, typer.Option("-o", "--out", help="Output drafter directory "
                                                "(default: DRAFTER-distilled).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint in OUT.distill/.")] = False,
    cache_hidden: Annotated[Path | None, typer.Option("--cache-hidden", help="Store/reuse the target's features "
                                                      "per batch (safetensors) here.")] = None,
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
    precision: Annotated[str, typer.Option("--precision", help="bf16 (autocast) or fp32.")] = "bf16",
    seed: Annotated[int, typer.Option("--seed", help="Seed for data order and initialisation.")] = 0,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT and any earlier run's checkpoint.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the distillation record as one JSON object.")] = False,
) -> None:
    """Distill a drafter against its frozen target to an exact token budget; writes the same format.

    Example: [bold]recycle distill /tmp/ds-eagle --target fixtures/deepseek_v3_mtp --tokens 2M[/bold]
    """
    from distill.losses import LossConfig
    from distill.train import DistillOptions, distill as run_distill, parse_tokens

    opts = DistillOptions(
        drafter=str(drafter), target=str(target), tokens=parse_tokens(tokens), out=str(output) if output else None,
        data=str(data) if data else None, self_distill=self_distill, prompt_len=prompt_len,
        sd_temperature=sd_temperature, seq_len=seq_len, batch=batch, lr=lr, draft_steps=draft_steps,
        loss=LossConfig(ce_weight, kl_weight, feature_weight, step_decay), init=init,
        checkpoint_every=checkpoint_every, eval_every=eval_every, resume=resume,
        cache_hidden=str(cache_hidden) if cache_hidden else None, device=device, precision=precision, seed=seed,
        threads=threads, overwrite=overwrite,
    )
    if json_out or int(os.environ.get("RANK", "0")) != 0:
        data_out = run_distill(opts)
        if json_out and int(os.environ.get("RANK", "0")) == 0:
            print_json(data_out)
        return
    from rich.progress import TaskProgressColumn

    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TaskProgressColumn(),
                   TextColumn("{task.fields[tps]} tok/s  loss {task.fields[loss]}  held-out agree {task.fields[agree]}"),
                   TimeElapsedColumn(), console=err, transient=True)
    with bar:
        task = bar.add_task("distilling", total=opts.tokens, tps="-", loss="-", agree="-")

        def update(row: dict) -> None:
            fields = {"tps": f"{row['tokens_per_s']:.0f}", "loss": f"{row['loss']:.3f}"}
            if "heldout_agree" in row:
                fields["agree"] = "/".join(f"{a:.2f}" for a in row["heldout_agree"])
            bar.update(task, completed=row["tokens"], description=f"{fmt_count(row['tokens'])} tokens", **fields)

        data_out = run_distill(opts, progress=update)
    render_distill(data_out)


if __name__ == "__main__":
    app()
