"""tests/helpers.py: a subprocess a test starts dies with the test, and so does everything it started: on timeout, when
the `with` block ends or raises, once the command returns, and when pytest itself gets SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import helpers

ROOT = Path(__file__).resolve().parents[1]


def _pid(path: Path, within: float = 60.0, proc: subprocess.Popen | None = None) -> int:
    """The pid a command under test wrote to `path` (waits for it while `proc`, if given, runs)."""
    deadline = time.monotonic() + within
    while not (path.is_file() and path.read_text().strip()) and time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"exited {proc.returncode} before writing {path.name}:\n{out[-3000:]}")
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, within: float = 5.0) -> bool:
    """Killed processes outside our own children are reaped by whoever inherits them: give that a moment."""
    deadline = time.monotonic() + within
    while helpers.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not helpers.alive(pid)


def test_a_timeout_kills_the_grandchild(tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        helpers.run(["bash", "-c", f"sleep 1000 & echo $! > {pid}; wait"], timeout=3)
    assert time.monotonic() - start < 30
    assert _gone(_pid(pid))


def test_a_grandchild_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):  # bash passes the ignored SIGTERM on to what it starts
        helpers.run(["bash", "-c", f"trap '' TERM; sleep 1000 & echo $! > {pid}; wait"], timeout=3, grace=0.5)
    assert _gone(_pid(pid))


def test_a_descendant_in_a_session_of_its_own_is_killed(tmp_path: Path) -> None:
    """As torchrun starts its workers: out of the group, found through the process tree."""
    pid = tmp_path / "pid"
    with helpers.popen(["bash", "-c", f"setsid sleep 1000 >/dev/null 2>&1 & echo $! > {pid}; wait"]):
        child = _pid(pid)
        assert helpers.alive(child) and os.getsid(child) != os.getsid(os.getpid())
    assert _gone(child)


def test_an_exception_in_the_block_kills_the_tree(tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    with pytest.raises(RuntimeError, match="the test failed"):
        with helpers.popen(["bash", "-c", f"sleep 1000 & echo $! > {pid}; wait"]) as proc:
            _pid(pid)
            raise RuntimeError("the test failed")
    assert proc.returncode is not None and _gone(_pid(pid))


def test_a_background_child_does_not_outlive_its_command(tmp_path: Path) -> None:
    res = helpers.run(["bash", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"], timeout=30, capture_output=True,
                      text=True)
    assert res.returncode == 0 and _gone(int(res.stdout))


def test_sigterm_to_pytest_stops_its_workers_and_their_subprocesses(tmp_path: Path) -> None:
    """The suite under pytest-xdist, killed with SIGTERM mid-test: the controller, its worker and the worker's test
    subprocess (and what that started) are all gone."""
    pid = tmp_path / "pid"
    inner = tmp_path / "test_hangs.py"
    inner.write_text("import time\nfrom tests import helpers\n\n\ndef test_hangs():\n"
                     f"    with helpers.popen(['bash', '-c', 'sleep 1000 & echo $! > {pid}; wait']):\n"
                     "        time.sleep(1000)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
           "-p", "tests.conftest", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "1", str(inner)]
    with helpers.popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        grandchild = _pid(pid, within=240, proc=proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 3  # the worker, bash, sleep
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGTERM, proc.stdout.read().decode()[-2000:]
        assert _gone(grandchild)
        deadline = time.monotonic() + 10
        while [p for p in tree if _runs(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p.cmdline() for p in tree if _runs(p)]


def _runs(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
