"""README.md stays true by construction: every ```bash block in it runs, as written, on the fixtures.

Blocks preceded by an `<!-- not run: why -->` line are skipped (the quick start, which CI's install
runs; the test suite itself; engines, uploads and hour-long experiments). Paths under /tmp/ are moved
into a temporary directory; everything else is the command as a reader would paste it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?```bash\n(.*?)```", re.S | re.M)


def readme_blocks() -> list[tuple[str | None, str]]:
    """(skip marker or None, commands) per bash block, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def test_the_readme_names_what_it_skips() -> None:
    blocks = readme_blocks()
    skipped = [m for m, _ in blocks if m]
    assert all(m.startswith("<!-- not run:") for m in skipped), skipped
    assert len(blocks) - len(skipped) >= 5  # most of the README runs
    first = blocks[0][1]
    assert "pip install -c constraints.txt" in first and "recycle convert fixtures/" in first  # installs, then the main job
    assert "python -m pytest -q" in blocks[1][1]  # the second block runs the tests (.ci/run calls the same)
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_every_readme_command_runs(tmp_path: Path) -> None:
    script = ["set -euo pipefail"]
    for marker, commands in readme_blocks():
        if marker is None:
            script.append(commands.replace("/tmp/", f"{tmp_path}/"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "RECYCLE_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    env.pop("HF_TOKEN", None)
    res = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr
