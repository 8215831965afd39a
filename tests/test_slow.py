"""Slow suites (`python -m pytest -q -m slow`): the fixture builds and the benchmark scripts, end to end
on tiny budgets, so a change that breaks a figure's command shows before someone reruns it for hours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recycle.checkpoint import Checkpoint
from recycle.families import match

from tests import helpers
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(*args: str, timeout: int = 1800) -> str:
    res = helpers.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def test_posttrained_build_keeps_the_mtp_bytes(tmp_path: Path) -> None:
    out = tmp_path / "pt"
    _run("fixtures/build_posttrained.py", "--out", str(out), "--steps", "2", "--batch", "2", "--seq", "64",
         "--no-compile", "--eval-windows", "4")
    base, pt = Checkpoint(FIXTURE), Checkpoint(out)
    assert all(torch.equal(base.raw(n), pt.raw(n)) for n in match(base).mtp_names)
    assert not torch.equal(base.raw("lm_head.weight"), pt.raw("lm_head.weight"))
    report = json.loads((out / "build_report.json").read_text())
    assert report["steps"] == 2 and set(report["after"]) == {"stdlib_heldout", "transformers_heldout"}


def test_stale_recycling_experiment_runs(tmp_path: Path) -> None:
    out = _run("benchmarks/recycling_experiment.py", "--stale", "--formats", "eagle", "--work", str(tmp_path / "w"),
               "--tokens", "1k", "--marks", "0,1k", "--scratch-tokens", "2k", "--scratch-marks", "0,2k", "--prompts",
               "2", "--max-new-tokens", "8", "--seq-len", "64", "--batch", "2", "--threads", "2", "--plot",
               str(tmp_path / "p.png"))
    result = json.loads((tmp_path / "w" / "experiment.json").read_text())
    assert set(result["runs"]) == {"eagle-recycled", "eagle-scratch", "eagle-scratch-long"}
    assert result["reference"]["tree"].endswith("chain:2") and (tmp_path / "p.png").stat().st_size > 10_000
    assert "estimate vs bench" in out


def test_deeper_than_stored_runs(tmp_path: Path) -> None:
    out = _run("benchmarks/deeper_than_stored.py", "--cases", "aligned", "--tokens", "aligned=4k", "--chains", "3",
               "--prompts", "1", "--max-new-tokens", "8", "--repeats", "1", "--work", str(tmp_path), "--json",
               str(tmp_path / "d.json"))
    rows = json.loads((tmp_path / "d.json").read_text())["cases"]["aligned"]["rows"]
    assert {r["drafter"] for r in rows} == {"native module reused", "eagle distilled"} and "| aligned |" in out


def test_aligned_headroom_runs(tmp_path: Path) -> None:
    out = _run("benchmarks/aligned_headroom.py", "--tokens", "4k", "--variants", "default,kl only", "--prompts", "1",
               "--max-new-tokens", "8", "--work", str(tmp_path), "--json", str(tmp_path / "h.json"))
    assert set(json.loads((tmp_path / "h.json").read_text())["runs"]) == {"default", "kl only"} and "| kl only |" in out


@pytest.mark.parametrize("family,modules", [("deepseek_v3", 2), ("glm4_moe", 1)])
def test_trained_fixture_build_runs(tmp_path: Path, family: str, modules: int) -> None:
    """Two eager steps of a bundled fixture's recipe: tokenizer, model, loop, evaluation, the family's layout."""
    out = tmp_path / "ft"
    _run("fixtures/build_trained.py", "--family", family, "--out", str(out), "--steps", "2", "--batch", "2",
         "--seq", "64", "--no-compile", "--eval-every", "100")
    m = match(Checkpoint(out))
    assert m.family.name == family and len(m.modules) == modules
    assert json.loads((out / "build_report.json").read_text())["steps"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ft"]  # the build directory was renamed, not left


def test_interrupted_fixture_build_leaves_nothing(tmp_path: Path) -> None:
    """A build killed mid-way leaves no output directory (it is built beside it and renamed at the end)."""
    out = tmp_path / "ft"
    with helpers.popen([sys.executable, "fixtures/build_trained.py", "--family", "glm4_moe", "--out", str(out),
                        "--steps", "500", "--batch", "2", "--seq", "64", "--no-compile"], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        building = tmp_path / ".ft.building" / "tokenizer.json"
        deadline = time.time() + 300
        while not building.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        helpers.kill(proc)
    assert building.exists() and not out.exists()


def test_gemma4_fixture_build_runs(tmp_path: Path) -> None:
    """Two steps of each Gemma 4 phase: the three directories, stored in the committed fixtures' layouts."""
    from safetensors import safe_open

    from recycle.drafters import load_drafter

    _run("fixtures/build_gemma4.py", "--out", str(tmp_path), "--target-steps", "2", "--assistant-steps", "2",
         "--post-steps", "2", "--batch", "2", "--seq", "64")

    def keys(d: Path) -> set[str]:
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return set(f.keys())

    for name in ("gemma4_target", "gemma4_assistant", "gemma4_target_posttrained"):
        assert keys(tmp_path / name) == keys(ROOT / "fixtures" / name), name
        assert json.loads((tmp_path / name / "build_report.json").read_text())["steps"] == 2
    load_drafter(tmp_path / "gemma4_assistant")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma4_assistant", "gemma4_target",
                                                          "gemma4_target_posttrained"]


def test_chat_build_keeps_the_mtp_bytes_and_reserves_its_specials(tmp_path: Path) -> None:
    out = tmp_path / "chat"
    _run("fixtures/build_chat.py", "--out", str(out), "--steps", "2", "--batch", "2", "--seq", "64", "--no-compile",
         "--eval-windows", "2")
    base, chat = Checkpoint(FIXTURE), Checkpoint(out)
    assert all(torch.equal(base.raw(n), chat.raw(n)) for n in match(base).mtp_names)
    report = json.loads((out / "build_report.json").read_text())
    assert report["steps"] == 2 and len(report["reserved"]) == 5 and (out / "chat_heldout.jsonl").is_file()
    assert "{% generation %}" in json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


def test_chat_realign_runs(tmp_path: Path) -> None:
    out = _run("benchmarks/chat_realign.py", "--variants", "native,plain,chat", "--tokens", "2k", "--seq-len", "64",
               "--prompts", "2", "--max-new-tokens", "8", "--work", str(tmp_path), "--json", str(tmp_path / "c.json"))
    result = json.loads((tmp_path / "c.json").read_text())
    assert set(result["variants"]) == {"native@0", "plain@2000", "chat@2000"}
    assert result["variants"]["chat@2000"]["distill"]["counted"] == "assistant tokens" and "| chat |" in out


def test_gguf_scale_runs(tmp_path: Path) -> None:
    out = _run("benchmarks/gguf_scale.py", "--hidden", "512", "--vocab", "8192", "--experts", "4", "--dir",
               str(tmp_path / "g"))
    assert "gguf / safetensors wall" in out and "side file at 256 experts" in out


def test_llama_cpp_benchmark_runs(tmp_path: Path) -> None:
    out = _run("benchmarks/llama_cpp_mtp.py", "--prompts", "1", "--max-new-tokens", "8", "--depths", "1",
               "--distill-tokens", "4k", "--work", str(tmp_path), "--json", str(tmp_path / "l.json"))
    result = json.loads((tmp_path / "l.json").read_text())
    assert set(result["agreement"]) == {"DeepSeek-V3", "GLM-4.5"} and set(result["stale"]) >= {"stale", "realigned"}
    assert "| post-trained | realigned | 1 |" in out
