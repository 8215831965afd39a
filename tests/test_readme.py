"""README.md and docs/*.md stay true by construction: every ```bash block in them runs, as written, on the fixtures.

Blocks preceded by an `<!-- not run: why -->` line are skipped (the quick start, which CI's install
runs; the test suite itself; engines, uploads and hour-long experiments). Each markdown file is its own
test, run in its own temporary directory (paths under /tmp/ are moved there), its blocks in order, so
files are independent of each other and run in parallel under pytest-xdist; everything else is the
command as a reader would paste it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?```bash\n(.*?)```", re.S | re.M)
FENCE = re.compile(r"^```(\S*)", re.M)
README_MAX_LINES = 200
# A docs file's blocks take seconds to a minute or two here; a hang fails the test instead of stalling the suite.
BLOCK_TIMEOUT_S = 300


def blocks(path: Path) -> list[tuple[str | None, str]]:
    """(skip marker or None, commands) per bash block of one markdown file, in order."""
    text = path.read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def readme_blocks() -> list[tuple[str | None, str]]:
    return blocks(README)


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_readme_names_what_it_skips() -> None:
    every = [b for path in (README, *DOCS) for b in blocks(path)]
    skipped = [m for m, _ in every if m]
    assert all(m.startswith("<!-- not run:") for m in skipped), skipped
    assert len(every) - len(skipped) >= 5 and len(every) - len(skipped) > len(skipped)  # most of the docs run
    readme = readme_blocks()
    first = readme[0][1]
    assert "pip install -c constraints.txt" in first and "recycle convert fixtures/" in first  # installs, then the main job
    assert "recycle bench " in first
    assert "python -m pytest -q" in readme[1][1]  # the second block runs the tests (.ci/run calls the same)
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_short_and_links_every_doc() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < README_MAX_LINES
    assert DOCS, "docs/ holds the deep material"
    for doc in DOCS:
        assert f"({_name(doc)}" in text, f"README.md does not link {_name(doc)}"


@pytest.mark.parametrize("path", (README, *DOCS), ids=_name)
def test_every_docs_block_runs_or_says_why_not(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    shells = [lang for lang in FENCE.findall(text) if lang in ("sh", "shell", "console", "zsh")]
    assert not shells, f"{_name(path)}: shell blocks must be ```bash (the test runs those): {shells}"
    for marker, commands in blocks(path):
        if marker is not None:
            why = marker.removeprefix("<!-- not run:").removesuffix("-->").strip()
            assert marker.startswith("<!-- not run:") and why, f"{_name(path)}: {marker!r} before\n{commands}"


def _threads() -> str:
    """CPU threads for the commands (bench's RECYCLE_THREADS; torch's OMP_NUM_THREADS for the rest): one. The models
    are tiny, and OpenMP threads spin-wait for each other when the cores are oversubscribed: on this 2-core VM at load
    7-13 (2026-11-27), the README's `bench --quick` on the post-trained fixture ran over 32 min with two threads and
    130 s with one (two workers with two threads each on two cores had made a short distillation 6× slower before).
    RECYCLE_TEST_THREADS overrides."""
    return os.environ.get("RECYCLE_TEST_THREADS") or "1"


# The scenario pages whose blocks train on their own fixtures (40-90 s each here) run in the slow suite, so that
# the default run stays near ten minutes on two cores; the README and the per-command pages run every time.
SLOW_PAGES = {"docs/gemma4.md", "docs/parallel-heads.md", "docs/quantized.md", "docs/stale-mtp.md"}


def _page(p: Path):
    marks = [pytest.mark.xdist_group(f"docs:{_name(p)}")] + ([pytest.mark.slow] if _name(p) in SLOW_PAGES else [])
    return pytest.param(p, marks=marks, id=_name(p))


@pytest.mark.parametrize("path", [_page(p) for p in (README, *DOCS)])
def test_every_readme_command_runs(path: Path, tmp_path: Path) -> None:
    script = ["set -euo pipefail"]
    for marker, commands in blocks(path):
        if marker is None:
            script.append(commands.replace("/tmp/", f"{tmp_path}/"))
    if len(script) == 1:
        return  # nothing here runs on this machine (each block says why)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "RECYCLE_THREADS": _threads(), "OMP_NUM_THREADS": _threads(), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_TOKEN", None)
    before = {p.name for p in ROOT.iterdir()}
    try:  # the block's commands run in one process group, stopped with everything in it when the test ends
        res = helpers.run(["bash", "-c", "\n".join(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.output, e.stderr))
        pytest.fail(f"{_name(path)}: over {BLOCK_TIMEOUT_S} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    assert res.returncode == 0, f"{_name(path)}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr
    # the commands run in the checkout: an output left to its default (./NAME-distilled, ./TARGET-cache) lands there
    wrote = sorted(n for n in {p.name for p in ROOT.iterdir()} - before if not n.startswith((".", "__")))
    assert not wrote, f"{_name(path)}: its commands wrote {wrote} into the checkout (give -o under /tmp/)"
