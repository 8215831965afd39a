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


if __name__ == "__main__":
    app()
