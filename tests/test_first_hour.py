"""What a new user hit in the first hour (issue 17): loading failures as one line, bad input failing before
the heavy imports, no stray blank line on stderr, option names, help text, resume, and pickle refused."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eagle(converted) -> Path:
    return converted("eagle", layouts="recycle")


def _corrupt_target(tmp_path: Path, case: str) -> Path:
    d = tmp_path / case
    shutil.copytree(FIXTURE, d)
    cfg = json.loads((d / "config.json").read_text())
    weights = d / "model.safetensors"
    if case == "vocab_mismatch":  # config says one vocabulary, the weights hold another
        cfg["vocab_size"] = cfg["vocab_size"] + 64
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "no_weights":
        weights.unlink()
    elif case == "unknown_model_type":
        cfg["model_type"] = "no_such_model"
    elif case == "bad_json":
        (d / "config.json").write_text("{not json")
        return d
    elif case == "garbage_weights":
        weights.write_bytes(b"\x00" * 64)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


CORRUPT = ["vocab_mismatch", "truncated", "no_weights", "unknown_model_type", "bad_json", "garbage_weights"]


@pytest.mark.parametrize("case", CORRUPT)
def test_a_target_transformers_cannot_load_is_one_line(eagle: Path, tmp_path: Path, case: str) -> None:
    target = _corrupt_target(tmp_path, case)
    res = run_cli("bench", str(eagle), "--target", str(target), "--quick", "--max-new-tokens", "2")
    assert_bad_input(res, "recycle: error:")
    res = run_cli("distill", str(eagle), "--target", str(target), "--tokens", "100", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "recycle: error:")
    assert not (tmp_path / "o").exists()


def test_a_corrupt_drafter_is_one_line(eagle: Path, tmp_path: Path) -> None:
    d = tmp_path / "d"
    shutil.copytree(eagle, d)
    (d / "model.safetensors").write_bytes(b"\x01" * 100)
    assert_bad_input(run_cli("bench", str(d), "--target", str(FIXTURE), "--quick"), "corrupt")


FAST = [
    ("distill", "DRAFTER", "--target", "TARGET", "--tokens", "abc"),
    ("distill", "MISSING", "--target", str(FIXTURE), "--tokens", "1k"),
    ("push", "NOREC", "--repo", "me/x", "--dry-run"),
    ("bench", "MISSING", "--target", str(FIXTURE)),
    ("bench", "--target", "MISSING"),
    ("inspect", "MISSING"),
    ("convert", "MISSING", "--to", "eagle", "-o", "OUT"),
    ("convert", str(FIXTURE), "--to", "eagle", "-o", str(FIXTURE / "inside")),
    ("stitch", "MISSING", str(FIXTURE), "-o", "OUT"),
    ("harvest", "MISSING", "--tokens", "1k", "-o", "OUT"),
    ("harvest", str(FIXTURE), "--tokens", "abc", "-o", "OUT"),
    ("harvest", str(FIXTURE), "--tokens", "1k", "-o", str(FIXTURE / "inside")),
]


@pytest.mark.parametrize("args", FAST, ids=[" ".join(a[:1] + a[-2:]) for a in FAST])
def test_bad_input_fails_before_torch_is_imported(args: tuple[str, ...], tmp_path: Path) -> None:
    (tmp_path / "NOREC").mkdir()
    argv = [str(tmp_path / a) if a.isupper() else a for a in args]
    code = ("import sys\nfrom recycle.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stdout)\n")
    res = helpers.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.stdout.strip() == "exit 2 False False", (res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("recycle: error:"), res.stderr  # no blank line before it


def test_no_blank_line_on_stderr_when_it_is_not_a_terminal(tmp_path: Path) -> None:
    res = helpers.run([sys.executable, "-m", "recycle.cli", "convert", str(FIXTURE), "--to", "medusa", "-o",
                       str(tmp_path / "m")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    assert "\n\n" not in "\n" + res.stderr and all(ln.startswith("recycle: ") for ln in res.stderr.splitlines())


def test_help_has_conventional_usage_and_examples() -> None:
    for cmd, usage in (("inspect", "CKPT_DIR"), ("convert", "CKPT_DIR"), ("stitch", "OVERLAY_DIR"),
                       ("bench", "[DRAFTER_DIR]"), ("push", "DRAFTER_DIR"), ("distill", "DRAFTER_DIR"),
                       ("harvest", "")):
        res = run_cli(cmd, "--help")
        assert res.exit_code == 0
        text = res.stdout
        assert f"{cmd} [OPTIONS] {usage}" in " ".join(text.split()), text[:300]
        assert "Example:" in text and "<bool>" not in text and "{" not in text.split("Usage:")[1].splitlines()[0]


def test_output_is_one_name_everywhere(eagle: Path, tmp_path: Path) -> None:
    """-o/--output for convert, stitch and distill; distill's old --out still works, unlisted."""
    res = run_cli("distill", "--help")
    assert "--output" in res.stdout and "--out " not in res.stdout
    res = run_cli("distill", str(eagle), "--target", str(FIXTURE), "--tokens", "64", "--seq-len", "16", "--batch", "1",
                  "--out", str(tmp_path / "old-name"), "--json")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "old-name" / "model.safetensors").is_file()


def test_inspect_stats_summarises_by_role() -> None:
    short = run_cli("inspect", str(FIXTURE), "--stats")
    full = run_cli("inspect", str(FIXTURE), "--stats", "--all")
    assert short.exit_code == 0 and full.exit_code == 0
    assert len(short.stdout.splitlines()) < 60 < len(full.stdout.splitlines())
    assert "by role" in short.stdout and "eh_proj" in full.stdout


def test_resume_refuses_a_pickled_object(eagle: Path, tmp_path: Path) -> None:
    """A checkpoint planted in OUT.distill/ that would run code when unpickled is refused, and runs none."""
    marker = tmp_path / "ran"
    state = tmp_path / "o.distill"
    state.mkdir()

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"fingerprint": {}, "payload": Planted()}, state / "checkpoint.pt")
    res = run_cli("distill", str(eagle), "--target", str(FIXTURE), "--tokens", "64", "--seq-len", "16", "--batch",
                  "1", "-o", str(tmp_path / "o"), "--resume")
    assert_bad_input(res, "unsafe checkpoint")
    assert not marker.exists() and not (tmp_path / "o").exists()
