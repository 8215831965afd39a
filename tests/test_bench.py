"""`recycle bench`: the JSON report's schema and consistency, prompt sets, and bad inputs (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from recycle.cli import app
from recycle.prompts import code_prompts, default_prompts, text_prompts
from tests.trained import FIXTURE

runner = CliRunner()


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recycle.converters.api import convert_checkpoint

    out = tmp_path_factory.mktemp("bench") / "eagle"
    convert_checkpoint(FIXTURE, "eagle", out)
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text('{"prompt": "def add(a, b):\\n    return"}\n\n{"prompt": "import os\\nimport sys\\n"}\n')
    return p


def test_default_prompts_are_deterministic_and_held_out():
    from recycle.corpus import documents

    a, b = default_prompts(), default_prompts()
    assert a == b
    assert len(code_prompts()) == 12 and len(text_prompts()) == 6
    held = "\n".join(d.text for d in documents("heldout"))
    assert all(p in held for kind, p in a if kind == "code")  # cut from held-out files only


def test_bench_json_schema(eagle_dir: Path, prompts_file: Path):
    res = runner.invoke(app, ["bench", str(eagle_dir), "--target", str(FIXTURE), "--prompts", str(prompts_file),
                              "--max-new-tokens", "8", "--tree", "chain:2", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    for key in ("target", "drafter", "drafter_kind", "tree", "device", "dtype", "threads", "temperature",
                "max_new_tokens", "prompts", "overall", "bandwidth", "hf"):
        assert key in data
    assert data["drafter_kind"] == "eagle" and data["tree"] == "eagle chain:2" and data["device"] == "cpu"
    assert data["bandwidth"] is None and data["hf"] is None
    o = data["overall"]
    assert o["greedy_match"] == "2/2"
    sp, ar = o["spec"], o["ar"]
    assert ar["tau"] == 1.0 and ar["target_forwards"] == ar["new_tokens"]  # AR: one forward per token
    assert sp["tau"] == pytest.approx((sp["new_tokens"] - len(data["prompts"])) / sp["steps"])
    assert sp["target_forwards"] == sp["steps"] + len(data["prompts"])
    assert len(sp["acceptance"]) <= 2 and all(0 <= a <= 1 for a in sp["acceptance"])
    assert o["speedup"] == pytest.approx(sp["tokens_per_s"] / ar["tokens_per_s"])
    assert set(o["predicted"]) == {"tau", "c_draft", "c_verify", "speedup"}
    for row in data["prompts"]:
        assert row["greedy_match"] is True and row["set"] == "user"
        assert row["spec"]["new_tokens"] <= 8


def test_bench_native_mtp_rich_table(prompts_file: Path):
    """DRAFTER_DIR = the target directory: its own MTP modules draft (the baseline recycling must beat)."""
    res = runner.invoke(app, ["bench", str(FIXTURE), "--target", str(FIXTURE), "--max-new-tokens", "6",
                              "--threads", "1", "--prompts", str(prompts_file)])
    assert res.exit_code == 0, res.output
    assert "native-mtp" in res.stdout and "cost model" in res.stdout


def test_bench_rejects_a_non_jsonl_prompts_file():
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--prompts", str(FIXTURE / "config.json")])
    assert res.exit_code == 2 and res.stderr.startswith("recycle: error:")


@pytest.mark.parametrize(
    "args",
    [
        ["/nonexistent/drafter", "--target", str(FIXTURE)],
        ["--target", str(FIXTURE)],  # neither a drafter nor --native-mtp
        ["--native-mtp", "--target", "/nonexistent/target"],
        ["--native-mtp", "--target", str(FIXTURE), "--tree", "chain:x"],
        ["--native-mtp", "--target", str(FIXTURE), "--tree", "[[0, 0]]"],
        ["--native-mtp", "--target", str(FIXTURE), "--tree", "dynamic:x"],
        ["--native-mtp", "--target", str(FIXTURE), "--temperature", "-1"],
        ["--native-mtp", "--target", str(FIXTURE), "--max-new-tokens", "0"],
        ["--native-mtp", "--target", str(FIXTURE), "--device", "tpu"],
        ["--native-mtp", "--target", str(FIXTURE), "--prompts", "/nonexistent.jsonl"],
    ],
    ids=["missing-drafter", "no-drafter", "missing-target", "chain-syntax", "tree-no-parent", "tree-syntax",
         "temperature", "max-new-tokens", "device", "prompts-file"],
)
def test_bench_bad_inputs_exit_2_with_one_line(args):
    res = runner.invoke(app, ["bench", *args, "--threads", "1"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("recycle: error:"), res.stderr


def test_bench_cuda_without_cuda_is_a_user_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = runner.invoke(app, ["bench", "--native-mtp", "--target", str(FIXTURE), "--device", "cuda"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
