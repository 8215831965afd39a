"""What people see: rich tables, panels and progress for each command's result (the `--json` dict is the
same data, printed as it is), and errors as one stderr line with their exit code. The CLI calls these;
nothing here computes anything."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from typer.core import TyperGroup

from recycle.errors import Interrupted, RecycleError
from recycle.flags import DEPRECATED
from recycle.preflight import duration
from recycle.texts import plural

if TYPE_CHECKING:
    from recycle.bench_result import BenchResult, ContextResult

try:  # typer ≥ 0.2x carries its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer runs on click itself
    from click.exceptions import UsageError

EXIT_BAD_INPUT = 2
EXIT_FINDINGS = 1  # inspect --strict: an error-level finding (CI gates on it)
out = Console()
err = Console(stderr=True)
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def conventional_help() -> None:
    """typer ≥ 0.2x writes a required argument as `{NAME}` in usage lines and every parameter's type as `<type>`;
    show click's `NAME` / `[NAME]` and our metavars instead, and no placeholder for flags."""
    from typer import core

    arg, opt = getattr(core, "TyperArgument", None), getattr(core, "TyperOption", None)
    if arg is not None and hasattr(arg, "_usage_display_name"):
        def usage_name(self) -> str:
            if getattr(self, "hidden", False):  # an old argument's place, kept working but not shown
                return ""
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


def user_errors(fn: Callable) -> Callable:
    """Turn RecycleError (and unreadable files) into one stderr line and exit status 2; deprecation notes for
    old flag names follow a command that succeeded. With --json (the command's `json_out`) the error is also
    `{"error": ..., "code": N}` on stdout, unless the command already printed its object there."""

    @wraps(fn)
    def run(*args, **kwargs):
        DEPRECATED.clear()
        JSON_PRINTED.clear()
        as_json = bool(kwargs.get("json_out"))
        try:
            done = fn(*args, **kwargs)
            for line in DEPRECATED:
                note(f"note: {line}")
            return done
        except RecycleError as e:
            resume = " ".join(["recycle", *sys.argv[1:]] + ([] if "--resume" in sys.argv else ["--resume"]))
            tail = f"; continue with: {resume}" if getattr(e, "resumable", False) else ""
            code = getattr(e, "exit_code", EXIT_BAD_INPUT)
            fail(f"{e}{tail}", code, as_json, "" if isinstance(e, Interrupted) else "error: ")
            raise typer.Exit(code) from None
        except KeyboardInterrupt:
            fail("interrupted; nothing was written (outputs appear whole or not at all)", 130, as_json, prefix="")
            raise typer.Exit(130) from None
        except (OSError, MemoryError) as e:
            if os.environ.get("RECYCLE_DEBUG"):
                raise
            fail(f"{type(e).__name__}: {' '.join(str(e).split())}", EXIT_BAD_INPUT, as_json)
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return run


JSON_PRINTED: list[bool] = []  # the command has printed its --json object (a second one would break a parser)


def fail(message: str, code: int, as_json: bool, prefix: str = "error: ") -> None:
    """The one stderr line of a refusal; with --json also {"error", "code"} on stdout."""
    print(f"recycle: {prefix}{message}", file=sys.stderr, flush=True)
    if as_json and not JSON_PRINTED:
        print_json({"error": message, "code": code})


class JsonErrors(TyperGroup):
    """The command group: a usage error click finds before any command runs (an unknown flag, a value of the wrong
    type, a missing argument) is printed by typer as usual, exit 2, and with --json among the arguments is also
    `{"error": ..., "code": 2}` on stdout, as every refusal of a command is."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        ctx.meta["recycle.json"] = "--json" in args[:args.index("--")] if "--" in args else "--json" in args
        try:
            return super().parse_args(ctx, args)
        except UsageError as e:
            self._report(ctx, e)
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            self._report(ctx, e)
            raise

    @staticmethod
    def _report(ctx, e: UsageError) -> None:
        if ctx.meta.get("recycle.json") and not getattr(e, "recycle_reported", False):
            e.recycle_reported = True
            print_json({"error": " ".join(e.format_message().split()), "code": e.exit_code})


def note(text: str) -> None:
    print(f"recycle: {text}", file=sys.stderr, flush=True)


def table(title: str) -> Table:
    """A compact table (no vertical rules) that fits 80 columns: the house style of every report."""
    from rich import box

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def print_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    JSON_PRINTED.append(True)


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

    def __init__(self, label: str, columns: tuple = (), quiet: bool = False, total: int | None = None,
                 **fields) -> None:
        """`quiet`: show nothing (--json output, or work that reports no progress); `total`: known from the start
        (a budget), so the bar shows it and an ETA before the first item is done."""
        self.label, self.fields, self.quiet, self.total = label, fields, quiet, total
        self.bar: Progress | None = None
        if err.is_terminal and not quiet:
            self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                                MofNCompleteColumn(), *columns, TimeElapsedColumn(), TimeRemainingColumn(),
                                console=err, transient=True)
        self.last = 0.0

    def __enter__(self) -> Reporter:
        import time

        self.t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total, **self.fields)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, completed: int, total: int | None = None, description: str | None = None, line: str = "",
               force: bool = False, **fields) -> None:
        """Advance; `line` is what a non-terminal gets (default: description and count), at most every
        few seconds unless `force` (one line per prompt, per evaluation)."""
        import time

        if self.quiet:
            return
        total = total if total is not None else self.total
        stage = description or self.label
        now = time.perf_counter()
        # A count that goes on (same total, not going back) is one run whatever its items are called (plan's steps,
        # distill's token counts): its start and the first count seen in it are what the ETA is reckoned from.
        run = getattr(self, "run", None)
        fresh = run is None or run["total"] != total or completed < run["last"]
        if fresh:
            run = self.run = {"total": total, "first": (completed, now), "last": completed}
        run["last"] = completed
        if self.bar is not None:
            if fresh:  # a new count: its own bar and ETA
                self.bar.reset(self.task, total=total, description=stage)
            self.bar.update(self.task, completed=completed, total=total, description=stage, **fields)
            return
        # Quick work prints nothing; longer work a line every few seconds, and items asked for always.
        started = run["first"][1]
        if force or (now - started >= self.EVERY_S and (now - self.last >= self.EVERY_S or completed == total)):
            self.last = now
            text = line or f"{stage} {completed}" + (f"/{total}" if total else "")
            print(f"recycle: {text} ({now - self.t0:.0f} s{eta_note(completed, total, run['first'], now)})",
                  file=sys.stderr, flush=True)

    def counter(self, line: str):
        """A callback that counts calls (items done): `line` names the count as {n}; a call may say how many there
        are in all (`total=`), which gives the bar its time left."""
        done = [0]

        def tick(*_, total: int | None = None) -> None:
            done[0] += 1
            self.update(done[0], total, line=line.format(n=done[0]))

        return tick


def eta_note(completed: int, total: int | None, first: tuple[int, float], now: float) -> str:
    """The time-left part of a progress line. `first`: (count, time) when this count was first seen. Nothing
    when there is no total or nothing left; "estimating time left" until an item has finished since then (a
    first update that already counts items done says nothing of how long they took, and a zero-length span
    would say "0 s"); then the mean time per item since `first`, times the items left."""
    if not total or completed >= total:
        return ""
    done, t0 = first
    if completed <= done or now <= t0:
        return ", estimating time left"
    return f", about {duration((now - t0) / (completed - done) * (total - completed))} left"


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
        # A heading row per module instead of an index column, and the cells beside a name in two columns that
        # wrap at their spaces (dtype and shape; rms and norm): names never wrap, and 80 columns hold them.
        s = table("tensor health (every MTP tensor, dequantized)")
        for col in ("tensor", "dtype shape", "health", "rms  norm mean±std"):
            s.add_column(col, no_wrap=col in ("tensor", "health"))
        last = None
        for st in data["stats"]:
            k, rel = module_of(st["name"])
            if k != last:
                head = next((f" [dim]{p}[/dim]" for i, p in prefixes if str(i) == k), "")
                s.add_row(f"[bold]{'module ' + k if k != '-' else 'outside the modules’ prefixes'}[/bold]{head}")
                last = k
            fin, _, rms, norm, _ = _stat_row([st])
            health = fin if not st["finite"] else "[yellow]zero[/yellow]" if st["all_zero"] else "ok"
            s.add_row(rel, f"{st['dtype']} {'x'.join(map(str, st['shape']))}", health, f"{rms}  {norm}".strip())
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


def _render_shared(modules: list[dict]) -> None:
    """What the modules take from the trunk (embedding, head, norm), one row per role and trunk tensor with the
    modules that take it: the same for every module, as a rule, so it is a table of its own."""
    rows: dict[tuple[str, str], list[str]] = {}
    for m in modules:
        for role, name in m["shared"].items():
            rows.setdefault((role, name or "[red]MISSING[/red]"), []).append(str(m["index"]))
    if not rows:
        return
    t = table("taken from the trunk")
    for col in ("#", "role", "trunk tensor"):
        t.add_column(col, no_wrap=True)
    every = [str(m["index"]) for m in modules]
    for (role, name), ks in rows.items():
        t.add_row("all" if ks == every and len(ks) > 1 else ",".join(ks), role, name)
    out.print(t)


def _named(value: object, missing: str = "(not named in config.json)") -> str:
    """A config value as a cell: never the word None."""
    return missing if value is None else str(value)


def render_inspect(data: dict, show_all: bool = False) -> None:
    """Rich report for people: overview, modules, roles, findings, stats. Tensor names are never broken
    mid-name: their columns do not wrap, and a long list puts one name per line."""
    mtp = data["mtp"]
    holds = data.get("holds") or {"unit": "MTP modules", "what": str(data["kind"]), "use": ""}
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("family", f"{data['family']}  [dim]({data['family_title']})[/dim]")
    head.add_row("architecture", f"{_named(data['architecture'])}  [dim]model_type={_named(data['model_type'], '-')}"
                 "[/dim]")
    counts = f"{mtp['found']} found / {mtp['declared']} declared" if data["kind"] != "drafter" else "the checkpoint"
    head.add_row(holds["unit"], f"{counts}  [dim]({holds['what']})[/dim]")
    if holds["use"]:
        head.add_row("use", holds["use"])
    head.add_row("parameters", f"{fmt_count(data['params']['total'])} total, {fmt_count(data['params']['mtp'])} in "
                 f"{holds['unit']} ({fmt_bytes(data['bytes']['mtp'])})")
    head.add_row("shards", f"{data['shards']['count']} file(s), {fmt_bytes(data['shards']['bytes_total'])}; "
                 f"{data['tensors']['total']} tensors, {data['tensors']['fp8']} FP8")
    out.print(Panel(head, title=f"recycle inspect  {data['path']}", expand=False))

    if mtp["modules"]:
        t = table(holds["unit"])
        for col in ("#", "prefix", "tensors", "params", "dtypes", "concat/norm"):
            t.add_column(col, no_wrap=col in ("prefix", "concat/norm"))
        for m in mtp["modules"]:
            t.add_row(str(m["index"]), m["prefix"], str(m["tensors"]), fmt_count(m["params"]),
                      " ".join(f"{d}:{c}" for d, c in m["dtypes"].items()),
                      f"{m['concat_order'] or '-'}/{m['norm'] or '-'}")
        out.print(t)
        _render_shared(mtp["modules"])
        first = mtp["modules"][0]
        noun = {"parallel_heads": "head 0", "drafter": "the drafter"}.get(data["kind"], "module 0")
        r = table(f"roles of {noun} (names after {first['prefix']})")
        r.add_column("role", no_wrap=True)
        r.add_column("tensors", no_wrap=True)
        for role, names in first["roles"].items():
            rel = [n[len(first["prefix"]):] if n.startswith(first["prefix"]) else n for n in names]
            r.add_row(role, "\n".join(rel) if len(rel) <= 3 else "\n".join(rel[:2]) + f"\n... ({len(rel)} tensors)")
        out.print(r)

    if data.get("stats"):
        render_stats(data, every=show_all)

    render_findings(data["findings"])


def render_findings(findings: list[dict]) -> None:
    if findings:
        from rich.markup import escape  # messages quote shapes ("[out, in/2]"), which rich would take for markup

        f = table("findings")
        for col in ("severity", "code", "message"):
            f.add_column(col, overflow="fold")
        for fd in findings:
            style = SEVERITY_STYLE.get(fd["severity"], "")
            f.add_row(f"[{style}]{fd['severity']}[/{style}]", fd["code"], escape(fd["message"]))
        out.print(f)
    else:
        out.print("[green]no findings[/green]")


def render_gguf(data: dict) -> None:
    """`recycle inspect FILE.gguf` for people: what the file holds, its MTP blocks and their tensor types."""
    mtp = data["mtp"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("architecture", f"{data['architecture']}  [dim]{data['name'] or ''}[/dim]")
    head.add_row("holds", f"{data['holds']}  [dim]({data['block_count']} blocks, {data['tensors']} tensors, "
                 f"{fmt_bytes(data['bytes'])})[/dim]")
    head.add_row("MTP", f"{mtp['declared']} declared (nextn_predict_layers), blocks {mtp['blocks'] or '-'}; "
                 f"nextn tensors stored for {mtp['stored'] or 'none'}; {fmt_count(mtp['params'])} parameters")
    head.add_row("vocabulary", str(data["vocab"]))
    out.print(Panel(head, title=f"recycle inspect  {data['path']}", expand=False))
    if mtp["tensor_types"]:
        t = table("MTP block tensor types")
        t.add_column("block")
        t.add_column("types")
        for block, types in mtp["tensor_types"].items():
            t.add_row(block, " ".join(f"{k}:{v}" for k, v in types.items()) or "-")
        out.print(t)
    render_findings(data["findings"])

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

def _or_dash(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def render_bench(r: BenchResult) -> None:
    """Rich report: configuration, per-prompt rows, the overall comparison and the HF peers."""
    o = r.overall
    ar, sp, pr = o.ar, o.spec, o.predicted
    head = _header(r.target, r.drafter, r.tree)
    rule = f" ({r.sweep[0].draft_sample} drafts)" if r.sweep and r.temperature else ""
    head.add_row("decoding", f"{'greedy' if r.temperature <= 0 else 'sampling T=' + str(r.temperature)}{rule}, "
                 f"≤{r.max_new_tokens} new tokens, {plural(len(r.prompts), 'prompt')}, {r.device} "
                 f"{r.dtype}, {r.threads} thread(s)")
    out.print(Panel(head, title="recycle bench", expand=False))
    t = table("per prompt")
    for col in ("#", "set", "prompt tok", "new tok", "τ", "AR tok/s", "spec tok/s", "speedup", "= AR"):
        t.add_column(col, justify="right" if col not in ("set", "= AR") else "left")
    for i, p in enumerate(r.prompts):
        a, s = p.ar.tokens_per_s, p.spec.tokens_per_s
        same = "" if p.greedy_match is None else ("yes" if p.greedy_match else "[red]NO[/red]")
        t.add_row(str(i), p.set, str(p.prompt_tokens), str(p.spec.new_tokens), f"{p.spec.tau:.2f}",
                  f"{a:.1f}", f"{s:.1f}", f"{s / a:.2f}×" if a else "-", same)
    out.print(t)
    s = table("overall")
    s.add_column("")
    s.add_column("autoregressive", justify="right")
    s.add_column(r.tree, justify="right")
    s.add_column("[dim]cost model[/dim]", justify="right")
    bw = r.bandwidth
    gbs = (lambda k: f" ({getattr(bw, k):.0f}/{bw.peak_gbs:.0f} GB/s)") if bw else (lambda k: "")
    per = o.spread.prompts if o.spread else None
    rep = o.spread.repeats if o.spread else None
    span = lambda q, unit="": f"{q.min:.1f}–{q.max:.1f}{unit}"
    s.add_row("tokens/s", f"{ar.tokens_per_s:.1f}{gbs('ar_gbs')}", f"{sp.tokens_per_s:.1f}{gbs('spec_gbs')}", "")
    if rep:
        s.add_row(f"  each of {rep.n} repeats", span(rep.ar_tokens_per_s), span(rep.spec_tokens_per_s), "")
    s.add_row("speedup", "1.00×", _or_dash(o.speedup, "{:.2f}×"), f"[dim]{pr.speedup:.2f}×[/dim]")
    if rep:
        q = rep.speedup
        s.add_row(f"  each of {rep.n} repeats", "", f"{q.min:.2f}–{q.max:.2f}×", "")
    if per and per.speedup and len(r.prompts) > 1:
        s.add_row("  per prompt (IQR)", "", f"{per.speedup.q1:.2f}–{per.speedup.q3:.2f}×", "")
    s.add_row("τ (tokens/step)", "1.00", f"{sp.tau:.2f}", f"[dim]{pr.tau:.2f}[/dim]")
    if per and per.tau and len(r.prompts) > 1:
        s.add_row("  per prompt (IQR)", "", f"{per.tau.q1:.2f}–{per.tau.q3:.2f}", "")
    s.add_row("target forwards", str(ar.target_forwards), str(sp.target_forwards), "")
    s.add_row("acceptance by depth", "", " ".join(f"{a:.2f}" for a in sp.acceptance), "")
    s.add_row("draft / verify s", f"- / {ar.verify_s:.2f}", f"{sp.draft_s:.2f} / {sp.verify_s:.2f}",
              f"[dim]{pr.c_draft:.2f} / {pr.c_verify:.2f} AR steps[/dim]")
    if o.greedy_match:
        s.add_row("greedy = AR", "", o.greedy_match, "")
    out.print(s)
    if r.sweep:
        render_sweep(r.sweep)
    if r.contexts:
        render_contexts(r.contexts)
    if r.hf:
        h = table("transformers' generate on the same prompts")
        for col in ("method", "tok/s", "vs our AR", "= ours"):
            h.add_column(col, justify="left" if col in ("method", "= ours") else "right")
        for peer in r.hf:
            if peer.error:
                h.add_row(peer.method, "[red]failed[/red]", peer.error[:40], "")
            else:
                h.add_row(peer.method, f"{peer.tokens_per_s:.1f}", f"{peer.speedup_vs_our_ar:.2f}×",
                          peer.greedy_match or "")
        out.print(h)
    out.print("[dim]speedup = tok/s ÷ our AR tok/s (same loop and KV-cache code); cost model = τ_pred / "
              "(c_draft + c_verify), costs per step in AR steps; IQR: the middle half of the prompts[/dim]")
    for note in r.notes:
        out.print(f"[yellow]note:[/yellow] {note}")
    if r.saved:
        out.print(f"report saved to [bold]{r.saved}[/bold] (`recycle push` puts it in the model card)")

def render_sweep(rows: tuple) -> None:
    """One row per temperature × draft-sampling rule: acceptance per depth and τ, each with its 95% bootstrap
    interval over prompts, and the speedup (the first row is the one measured in full above)."""
    depth = max((len(x.acceptance) for x in rows), default=0)
    t = table("by temperature and draft-sampling rule")
    for col in ("T", "drafts", *(f"α{d + 1} [95%]" for d in range(depth)), "τ [95%]", "speedup"):
        t.add_column(col, justify="left" if col == "drafts" else "right")
    for x in rows:
        alphas = [f"{a:.2f} [dim][{iv.low:.2f}–{iv.high:.2f}][/dim]" for a, iv in zip(x.acceptance, x.acceptance_interval)]
        t.add_row(f"{x.temperature:g}", x.draft_sample, *alphas, *[""] * (depth - len(alphas)),
                  f"{x.tau:.2f} [dim][{x.tau_interval.low:.2f}–{x.tau_interval.high:.2f}][/dim]",
                  _or_dash(x.speedup, "{:.2f}×"))
    out.print(t)
    out.print(f"[dim]α_d: drafts accepted at depth d; [95%]: bootstrap over the {rows[0].prompts} prompts; at T = 0 "
              "drafts are the top-k whatever the rule[/dim]")


def render_contexts(c: ContextResult) -> None:
    """--context-buckets: per temperature, each bucket's acceptance per depth, τ, prompts and tokens; then the decay
    (the slope of depth-1 acceptance per 1k positions, its 95% bootstrap interval, whether it holds 0)."""
    depth = max((len(b.acceptance) for run in c.runs for b in run.buckets), default=0)
    t = table(f"acceptance by context position ({c.prompts_per_bucket} long prompts per bucket from {c.source}, "
              f"{c.seconds:.0f} s)")
    for col in ("T", "bucket", *(f"α{d + 1}" for d in range(depth)), "τ", "prompts", "tokens"):
        t.add_column(col, justify="left" if col == "bucket" else "right")
    slopes = []
    for run in c.runs:
        for i, b in enumerate(run.buckets):
            alphas = [f"{a:.2f}" for a in b.acceptance]
            t.add_row(f"{run.temperature:g}", b.bucket, *alphas, *["-"] * (depth - len(alphas)), f"{b.tau:.2f}",
                      str(b.prompts), str(b.new_tokens), end_section=i == len(run.buckets) - 1)
        d = run.decay
        if d.slope_per_1k is None:
            slope = "no slope (fewer than two context positions)"
        elif d.low is None:
            slope = f"{d.slope_per_1k:+.3f} per 1k positions (no interval: fewer than three positions)"
        else:
            holds = "holds 0: no decay shown" if d.includes_zero else "[yellow]excludes 0: acceptance moves[/yellow]"
            slope = f"{d.slope_per_1k:+.3f} per 1k positions, 95% interval {d.low:+.3f} to {d.high:+.3f} ({holds})"
        slopes.append(f"T={run.temperature:g}: α1 slope {slope}")
    out.print(t)
    for line in slopes:
        out.print(line)
    rule = next((run.draft_sample for run in c.runs if run.temperature > 0), None)
    out.print(f"[dim]{f'{rule} drafts at T > 0' if rule else 'greedy drafts'}; a prompt's context position is its "
              "length plus half its new tokens; the interval is a bootstrap over prompts[/dim]")


def _header(target: str, drafter: str | None, what: str) -> Table:
    """The key/value grid above bench's and plan's tables, opening with the target and the drafter."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("target", target)
    head.add_row("drafter", f"{drafter or '(the target’s own MTP modules)'}  [dim]{what}[/dim]")
    return head


def render_plan(data: dict) -> None:
    """Rich report: per prompt set the candidates (predicted and, where run, measured) and the pick;
    then the roofline per GPU: the best shape per batch size and each shape's crossover batch."""
    head = _header(data["target"], data["drafter"], data["drafter_kind"])
    head.add_row("measured on", f"{data['device']} {data['dtype']}, {data['threads']} thread(s), "
                 f"≤{data['max_new_tokens']} new tokens, verify cost at context {data['context_measured']}")
    vs = data["verify_s"]
    head.add_row("verify n tokens", "  ".join(f"n={n}: {vs[n - 1] * 1e3:.1f} ms" for n in (1, 2, 4, 8, 16, len(vs))
                                              if n <= len(vs)))
    out.print(Panel(head, title="recycle plan", expand=False))
    for name, st in data["sets"].items():
        t = table(f"{name} ({plural(st['prompts'], 'prompt')}): acceptance by depth "
                  + " ".join(f"{a:.2f}" for a in st["acceptance_by_depth"]))
        for col in ("shape", "τ", "draft", "verify", "AR steps", "predicted", "measured"):
            t.add_column(col, justify="left" if col == "shape" else "right")
        pick = (st.get("recommended") or {}).get("shape")
        for r in st["candidates"]:
            mark = "[bold green]" if r["shape"] == pick else ""
            t.add_row(f"{mark}{r['shape']}", f"{r['tau']:.2f}", f"{r['c_draft']:.2f}", f"{r['c_verify']:.2f}",
                      f"{r['cost']:.2f}", f"{mark}{r['predicted']:.2f}×",
                      f"{r['measured']:.2f}×" if r["measured"] is not None else "")
        out.print(t)
        if st.get("recommended"):
            out.print(f"[bold]recommended for {name}:[/bold] {st['recommended']['reason']}")
        else:  # the plan's own timings contradict themselves: a recommendation from them would be noise
            out.print(f"[bold yellow]{name}: too noisy to recommend[/bold yellow] ({'; '.join(st['noise'])}); "
                      "re-run on an idle machine (or with --threads 1)")
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
    head.add_row("source", f"{data['source']}  [dim](what it was converted from)[/dim]")
    head.add_row("base_model", data["base_model"] or "[dim]none in the card (--base-model OWNER/NAME sets it)[/dim]")
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

def render_distill(data: dict) -> None:
    t = table(f"recycle distill → {data['out']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("tokens (budget)", f"{fmt_count(data['tokens'])} ({fmt_count(data['budget_tokens'])})")
    t.add_row("steps", str(data["steps"]))
    fr = data.get("freeze")
    if fr and fr["groups"]:
        t.add_row("trained parameters", f"{fmt_count(fr['trainable_params'])} of {fmt_count(fr['params'])} "
                                        f"(frozen: {', '.join(fr['groups'])})")
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
    t.add_row("wall time", f"{data['wall_s']:.1f} s (training {data['train_s']:.1f} s)" +
              (" (resumed)" if data["resumed"] else ""))
    out.print(t)
    out.print(f"[dim]state: {data['state_dir']}/ holds metrics.jsonl (one row per step); its checkpoint is removed "
              "once the output is whole[/dim]")


MEMORY_PARTS = {"weights": "drafter weights (trained fp32 and sharded; frozen whole, routed experts split)",
                "grads": "gradients (fp32)",
                "optimizer": "AdamW moments (fp32)", "fsdp_gathered_unit": "the largest FSDP unit gathered (weights, grads)",
                "teacher": "teacher (the target in process; a cache or a server: embedding + head)",
                "activations_features": "activations: the teacher's features",
                "activations_blocks": "activations: decoder layers, every draft step",
                "activations_expert_copies": "activations: bf16 expert copies, every draft step",
                "activations_expert_exchange": "activations: every rank's rows at a split MoE block",
                "activations_weight_copies": "activations: autocast's copies of other weights",
                "activations_loss": "activations: vocabulary-wide loss tensors",
                "activations_backward": "backward: the residual stream's gradients",
                "runtime": "runtime (cuBLAS workspaces)",
                "fsdp_reduce_scatter": "FSDP2's fp32 reduce-scatter buffer (the unit's gradients)",
                "fsdp_root_unit": "FSDP2's root unit gathered (projection, norms)",
                "heldout_features": "the held-out rows' features",
                "expert_imbalance": "the busiest expert rank's extra rows",
                "fragmentation": "allocator fragmentation (expandable segments)",
                "cuda_context": "CUDA context (outside the allocator)", "nccl_buffers": "NCCL buffers"}


def render_memory(data: dict) -> None:
    o = data["options"]
    t = table(f"distill memory plan, per rank: batch {o['batch']} × seq-len {o['seq_len']}, {o['draft_steps']} draft "
              f"steps, {o['world_size']} rank(s), {o['precision']}, teacher {o['teacher']}"
              + (f", frozen: {', '.join(o['freeze'])}" if o["freeze"] else ""))
    t.add_column("part")
    t.add_column("bytes", justify="right")
    for key, value in data["parts"].items():
        if value:
            t.add_row(MEMORY_PARTS.get(key, key), fmt_bytes(value))
    t.add_row("[bold]total per rank[/bold]", f"[bold]{fmt_bytes(data['per_rank_bytes'])}[/bold]")
    out.print(t)
    out.print(f"drafter {fmt_count(data['params'])} parameters, {fmt_count(data['trainable_params'])} trained; "
              f"target {fmt_count(data['target_params'])}; "
              + ("FSDP2 shards what trains over the ranks" if data["sharded"] else "one process holds it all"))
    for stage in o.get("curriculum") or ():  # --curriculum: each stage's total; the table is the peak's
        out.print(f"stage seq-len {stage['seq_len']}: {stage['rows_per_rank']} rows per rank, {stage['share']:.0%} of "
                  f"the budget, {fmt_bytes(stage['per_rank_bytes'])} per rank" + (" (peak)" if stage["peak"] else ""))
    if data["fits"] is not None:
        out.print(f"{'fits' if data['fits'] else 'does not fit'} the {data['device']} "
                  f"({fmt_bytes(data['device_bytes'])})")


def render_stitch(data: dict) -> None:
    out.print(f"stitched {data['overlay_tensors']} MTP tensors into [bold]{data['out']}[/bold] "
              f"({len(data['linked'])} shard(s) linked, {len(data['rewritten'])} rewritten, +{data['file']})")
    if data["copies_from_target"]:
        out.print(f"[dim]{len(data['copies_from_target'])} embedding/head copies are the target's own "
                  f"({', '.join(sorted(set(data['copies_from_target'].values())))})[/dim]")
    q = data.get("quantization")
    if q:  # the target is quantized: say what the MTP weights were written as, and what that cost
        how = (f"{q['requantized']} weights re-quantized in its scheme (max relative error {q['max_rel_error']:.1%})"
               if q.get("requantized") else "no weight re-quantized")
        keys = ", ".join(q.get("ignore_keys") or {})  # where the entries went (every scheme but block FP8 says)
        ignored = (f"; {len(q['ignored_added'])} ignore entries added" + (f" ({keys})" if keys else "")
                   if q.get("ignored_added") else "")
        out.print(f"target quantization {q['target']}, --mtp-dtype {q['mtp_dtype']}: {how}{ignored}")
    for note in data.get("notes") or ():
        out.print(f"[dim]note: {note}[/dim]")


def render_harvest(data: dict) -> None:
    out.print(f"[bold]recycle harvest[/bold] → {data['out']}: {fmt_count(data['tokens'])} tokens, "
              f"{data['files']} files, {fmt_bytes(data['bytes'])} ({data['bytes_per_token']} B/token); "
              f"{ {'vllm': 'vLLM'}.get(data['engine'], data['engine'])} {data['engine_tokens_per_s']} tokens/s"
              + (f", DeepSeek-V4's {data['streams']} hyper-connection streams stored" if data.get("streams") else ""))


def distill_progress(bar: Reporter, budget: int):
    """The distill loop's per-step callback: tokens, speed, loss and held-out agreement on the bar (or a line
    per evaluation when stderr is not a terminal)."""
    fields = {"tps": "-", "loss": "-", "agree": "-"}

    def update(row: dict) -> None:
        fields.update(tps=f"{row['tokens_per_s']:.0f}", loss=f"{row['loss']:.3f}")
        if "heldout_agree" in row:
            fields["agree"] = "/".join(f"{a:.2f}" for a in row["heldout_agree"])
        bar.update(row["tokens"], budget, description=f"{fmt_count(row['tokens'])} tokens",
                   force="heldout_agree" in row, line=f"distill: {fmt_count(row['tokens'])}/{fmt_count(budget)} "
                   f"tokens, {fields['tps']} tok/s, loss {fields['loss']}, held-out agree {fields['agree']}", **fields)

    return update, fields


DISTILL_COLUMNS = (TextColumn("{task.fields[tps]} tok/s  loss {task.fields[loss]}  held-out agree {task.fields[agree]}"),)
