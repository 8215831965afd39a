"""The distribution as pip builds it: its name (PyPI's `recycle` is an unrelated 2015 utility, so `pip install
recycle` would bring that), the command and the packages it installs."""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from tests.helpers import run

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_wheel_is_mtp_recycle_with_the_recycle_command(tmp_path: Path) -> None:
    res = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
               str(ROOT)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.startswith("mtp_recycle-"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert meta["Name"] == "mtp-recycle"
    assert "recycle = recycle.cli:app" in entry
    for module in ("recycle/cli.py", "recycle/converters/api.py", "recycle/distill/train.py"):
        assert module in names, module
