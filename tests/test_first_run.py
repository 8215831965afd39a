"""What a new user hits first (issue 28): a directory of the wrong kind, data that is not text, a budget under
one step, Ctrl-C in a long run. Each is one line on stderr and nothing left behind, before any model is built."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--seq-len", "48", "--batch", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def drafters(converted) -> dict[str, Path]:
    return {"eagle": converted("eagle"), "medusa": converted("medusa")}


def _nothing_written(out: Path) -> bool:
    return not out.exists() and not out.with_name(out.name + ".distill").exists()


def test_distill_refuses_a_drafter_given_as_the_target_before_training(drafters, tmp_path: Path) -> None:
    out = tmp_path / "o"
    t0 = time.perf_counter()
    res = run_cli("distill", str(drafters["eagle"]), "--target", str(drafters["medusa"]), "--tokens", "1k", *SMALL,
                  "-o", str(out))
    assert_bad_input(res, "this is a drafter (medusa), not a target")
    assert _nothing_written(out) and time.perf_counter() - t0 < 30  # refused before any model was built


def test_an_overlay_is_not_a_target(drafters, tmp_path: Path) -> None:
    res = run_cli("bench", str(drafters["eagle"]), "--target", str(drafters["eagle"] / "mtp_overlay"), "--quick")
    assert_bad_input(res, "only MTP tensors")


def test_a_checkpoint_is_not_a_drafter_and_a_drafter_is_not_a_source(drafters, tmp_path: Path) -> None:
    res = run_cli("distill", str(FIXTURE / "../glm4_moe_mtp"), "--target", str(FIXTURE), "--tokens", "1k", *SMALL,
                  "-o", str(tmp_path / "o"))
    assert_bad_input(res, "not a drafter: convert its MTP modules first")
    res = run_cli("convert", str(drafters["medusa"]), "--to", "eagle", "-o", str(tmp_path / "c"))
    assert_bad_input(res, "this is a drafter (medusa) recycle wrote")
    res = run_cli("distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", "1k", *SMALL,
                  "--cache-hidden", str(FIXTURE), "-o", str(tmp_path / "o"))
    assert_bad_input(res, "not a feature cache")


@pytest.mark.parametrize("name,content,needle", [
    ("x.bin", bytes(range(256)) * 8, "not text"),
    ("chats.json", json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]).encode(), "no text documents"),
    ("rows.jsonl", b'{"messages": []}\n{broken\n', "no text documents"),
])
def test_data_that_is_not_text_is_refused_before_models_load(drafters, tmp_path: Path, name: str, content: bytes,
                                                              needle: str) -> None:
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "o"
    res = run_cli("distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", "1k", *SMALL,
                  "--data", str(data), "-o", str(out))
    assert_bad_input(res, needle)
    assert _nothing_written(out)


def test_a_budget_under_one_step_is_refused(drafters, tmp_path: Path) -> None:
    res = run_cli("distill", str(drafters["eagle"]), "--target", str(FIXTURE), "--tokens", "1", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "less than one optimizer step (8 sequences × 256 tokens = 2,048)")


def test_skipped_rows_are_counted_and_many_passes_warned(drafters, tmp_path: Path) -> None:
    from recycle.corpus import documents

    texts = [d.text[:800] for _, d in zip(range(6), documents("train"))]
    rows = [{"text": t} for t in texts] + [{"messages": []}, {"text": ""}]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    res = run_cli("distill", str(drafters["medusa"]), "--target", str(FIXTURE), "--tokens", "10k", *SMALL,
                  "--eval-every", "1000", "--data", str(data), "-o", str(tmp_path / "o"), "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["data"]["documents"] == 6
    assert rec["data"]["skipped"] == {"'messages' is not a list of turns": 1, "empty text": 1, "not valid JSON": 1}
    assert rec["data"]["rows"] == {"text": 6}
    assert rec["data"]["passes"] > 4 and "passes over the training side" in res.stderr
    assert rec["wall_s"] >= rec["train_s"]  # the command's time, setup included


def test_ctrl_c_checkpoints_and_names_the_resume_command(drafters, tmp_path: Path) -> None:
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "recycle.cli", "distill", str(drafters["medusa"]), "--target", str(FIXTURE),
           "--tokens", str(150 * 96), *SMALL, "--eval-every", "1000", "-o", str(out)]
    with helpers.popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True) as proc:
        metrics = out.with_name("o.distill") / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    line = [ln for ln in err.splitlines() if "SIGINT" in ln]
    assert len(line) == 1 and "is checkpointed in" in line[0] and line[0].endswith("--resume"), err
    assert (out.with_name("o.distill") / "checkpoint.pt").is_file() and not out.exists()
    resume = line[0].split("continue with: ", 1)[1].split()
    assert resume[0] == "recycle" and resume[-1] == "--resume"
    done = helpers.run([sys.executable, "-m", "recycle.cli", *resume[1:]], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "resuming from step" in done.stderr and out.is_dir()
