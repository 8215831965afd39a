"""Running the CLI in-process and checking the bad-input contract (exit 2, one stderr line, no traceback)."""

from __future__ import annotations

from typer.testing import CliRunner

from recycle.cli import app

runner = CliRunner()


def run_cli(*args: str):
    return runner.invoke(app, list(args))


def assert_bad_input(res, needle: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.output + res.stderr
    assert needle in lines[0], lines[0]
