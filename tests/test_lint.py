"""The lint rules live in pyproject.toml's [tool.ruff] (no scattered `noqa`), and the suite runs them, so CI does."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.helpers import ROOT


def test_ruff_finds_nothing_and_no_noqa_hides_it():
    ruff = shutil.which("ruff", path=str(ROOT / ".venv" / "bin")) or shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    # RUF100: a `noqa` that silences nothing; the repository keeps none
    out = subprocess.run([*cmd, "check", "--extend-select", "RUF100", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    noqa = subprocess.run(["git", "grep", "-n", "-i", "-E", "#[ ]*noqa", "--", "*.py"], capture_output=True, text=True, cwd=ROOT)
    assert noqa.stdout == "", "lint exceptions belong in pyproject.toml's per-file-ignores:\n" + noqa.stdout
