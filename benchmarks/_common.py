"""What every script under benchmarks/ shares: the repository's paths, the date and machine stamp a BENCHMARKS.md
entry carries, the JSON result writer, the argument parser with the options the scripts have in common, and an
in-process RSS sampler (`Sampler`).

A script runs as `python benchmarks/NAME.py`, so this folder is `sys.path[0]` and `import _common` finds this file.
`recycle` is installed (editable) and imports as it is; the repository's own `fixtures` and `tests` folders are not
installed, so importing this module puts the repository root on `sys.path` (after this folder) once, here, for the
scripts that build fixtures or reuse the engine checks' helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
CONFIGS = BENCHMARKS / "configs"  # the full-size configs (DeepSeek-V3) the scale benchmarks read
FIXTURES = ROOT / "fixtures"
FIXTURE = FIXTURES / "deepseek_v3_mtp"  # the trained DeepSeek-V3-layout fixture
POSTTRAINED = FIXTURES / "deepseek_v3_mtp_posttrained"  # its trunk trained further: the MTP modules are stale
GLM_FIXTURE = FIXTURES / "glm4_moe_mtp"  # the second trained family (GLM-4.5's layout)

if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))


def date() -> str:
    """Now, as the results record it: `2026-11-27 06:31 UTC`."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def machine() -> str:
    """The machine as a BENCHMARKS.md entry names it: cores, CPU model, memory, and the GPU when torch (already
    imported by the script) sees one, e.g. `2-core AMD EPYC, 24 GiB, no GPU`."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    parts = [f"{os.cpu_count() or 1}-core {model or platform.processor() or platform.machine()}"]
    try:
        parts.append(f"{round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB")
    except (ValueError, OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")  # not imported here: a script that never needed torch stays without it
    if torch is not None and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    elif torch is not None:
        parts.append("no GPU")
    return ", ".join(parts)


def stamp() -> dict[str, str]:
    """`{"date": ..., "machine": ...}`: what a result file carries so that its BENCHMARKS.md entry can be written."""
    return {"date": date(), "machine": machine()}


def write_json(path: str | os.PathLike, obj, indent: int = 1) -> Path:
    """Write a result as JSON (and a final newline), its folder made first; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent) + "\n")
    return path


def sampled(cmd: list[str], capture: bool = False):
    """(wall seconds, the child's peak VmRSS / RssAnon / RssFile in bytes, sampled from /proc every 0.2 s), and with
    `capture` its standard output as a third item."""
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else subprocess.DEVNULL, text=True)
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                key = line.split(":")[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.2)
    out = proc.stdout.read() if capture else None
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode})")
    return (time.perf_counter() - t0, peak, out) if capture else (time.perf_counter() - t0, peak)


def parser(doc: str | None, *, first_line: bool = False, json: bool = False, out: str | Path | None | bool = False,
           work: str | None | bool = False, target: str | Path | None = None, repeats: int | None = None,
           threads: int | None | bool = False, prompts: int | None = None,
           max_new_tokens: int | None = None) -> argparse.ArgumentParser:
    """The parser every script starts from: its docstring as the description (`first_line`: only its first line),
    and the options the scripts share, each added only when asked for, with the script's own default:

    - `json=True`: `--json FILE`, also write the result there (a string; `write_json` writes it);
    - `out=DEFAULT`: `--out DIR` (a Path when the default is one, else a string; `out=None`: no default);
    - `work=DEFAULT`: `--work DIR`, where a run keeps what it builds (`work=None`: no default);
    - `target=PATH`: `--target`, the checkpoint measured (a string);
    - `repeats=N`: `--repeats N`; `prompts=N`: `--prompts N`; `max_new_tokens=N`: `--max-new-tokens N`;
    - `threads=N` (or `None`: torch's default): `--threads N`, torch's CPU threads.
    """
    text = (doc or "").strip().splitlines()[0] if first_line and doc else doc
    ap = argparse.ArgumentParser(description=text, formatter_class=argparse.RawDescriptionHelpFormatter)
    if target is not None:
        ap.add_argument("--target", default=str(target))
    if work is not False:
        ap.add_argument("--work", default=work)
    if out is not False:
        ap.add_argument("--out", type=Path if isinstance(out, Path) else str, default=out)
    if prompts is not None:
        ap.add_argument("--prompts", type=int, default=prompts)
    if max_new_tokens is not None:
        ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats)
    if threads is not False:
        ap.add_argument("--threads", type=int, default=threads)
    if json:
        ap.add_argument("--json", default=None, metavar="FILE", help="also write the result here (JSON)")
    return ap


class Sampler:
    """This process's RSS every `every` seconds; `mark(phase)` closes a phase with its peak."""

    def __init__(self, every: float = 0.02) -> None:
        import psutil  # made here: the scripts that sample nothing need not have it

        self.proc, self.every, self.peak, self.phases = psutil.Process(), every, 0, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.every)

    def mark(self, phase: str) -> None:
        now = self.proc.memory_info().rss
        self.phases[phase] = {"peak_gib": round(max(self.peak, now) / 2**30, 3), "after_gib": round(now / 2**30, 3)}
        self.peak = now
