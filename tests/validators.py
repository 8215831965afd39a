"""Independent validators in their own cached virtualenvs, so their pins never touch ours.

speculators 0.9.0 declares transformers<=5.19 and CUDA torchvision/torchaudio; installed with
--no-deps beside our transformers 5.23 it works (environment.md §3). The venv is made with
--system-site-packages plus a .pth pointing at our venv's site-packages, so torch and
transformers are shared rather than downloaded again, and it is built once per machine.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from recycle.engines.vllm_env import run_logged

from tests import helpers

CACHE = Path(os.environ.get("RECYCLE_VALIDATORS", Path.home() / ".cache" / "recycle" / "validators"))
SPECULATORS = "speculators==0.9.0"
NO_DEPS = (SPECULATORS, "hs-connectors==0.9.0")
LIGHT_DEPS = ("loguru", "pydantic-settings", "openai", "datasets")
BROKEN = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds: importing them breaks transformers
CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


class Unreachable(RuntimeError):
    """PyPI could not be reached; the caller skips rather than fails."""


def _run(cmd: list[str], log: Path) -> None:
    if not run_logged(cmd, log):
        text = log.read_text(encoding="utf-8", errors="replace")
        offline = any(s in text for s in ("Could not find a version", "NewConnectionError", "Temporary failure in name",
                                          "No matching distribution", "Network is unreachable"))
        raise (Unreachable if offline else RuntimeError)(f"{' '.join(cmd[:4])} ... failed (log: {log})")


def speculators_python() -> Path:
    """The python of a venv where `import speculators` works; built on first call (about a minute)."""
    parent = sysconfig.get_paths()["purelib"]
    # one cached venv per parent venv: its .pth points at that venv's site-packages
    root = CACHE / f"speculators-0.9.0-{hashlib.sha1(parent.encode()).hexdigest()[:10]}"
    py = root / "bin" / "python"
    done = root / ".recycle-ready"
    if done.exists() and py.exists():
        return py
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / (root.name + ".log")
    log.write_text("", encoding="utf-8")
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], log)
    site = Path(helpers.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True, timeout=120).stdout.strip())
    (site / "recycle-parent-venv.pth").write_text(parent + "\n", encoding="utf-8")
    pip = [str(py), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS)]
    _run(pip + ["--no-deps", *NO_DEPS], log)
    _run(pip + list(LIGHT_DEPS), log)
    helpers.run([str(py), "-m", "pip", "uninstall", "-y", *BROKEN], capture_output=True, timeout=300)
    helpers.run([str(py), "-c", "import speculators"], check=True, capture_output=True, timeout=300)
    done.write_text(SPECULATORS + "\n", encoding="utf-8")
    return py
