"""`convert --to eagle3 --calibrate`: the folded midlayer fitted to its MTP module (distill/calibrate/eagle3.py).

What is checked: only the tensors the fold marked approx are fitted (exact copies stay byte for byte), the fit
brings the EAGLE-3 drafter closer to the module on held-out windows, the record says what was done, the wide MLP
starts from the shared expert and the most-picked routed experts, and bad input is refused before any model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recycle.converters.api import convert_checkpoint
from recycle.distill.calibrate import convert_calibrated
from recycle.drafters import load_drafter

from tests.cli_helpers import assert_bad_input, run_cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GLM = FIXTURES / "glm4_moe_mtp"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("cal")
    plain, cal = base / "fold", base / "calibrated"
    convert_checkpoint(GLM, "eagle3", plain, dtype="fp32")
    convert_calibrated(GLM, "eagle3", cal, dtype="fp32", calibrate=2048, calibrate_steps=30)
    return plain, cal


def test_only_approximated_tensors_are_fitted(pair):
    plain, cal = pair
    rec = json.loads((cal / "recycle.json").read_text())
    kinds = {r["tensor"]: r["kind"] for r in rec["mapping"]}
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(cal / "model.safetensors"))
    fitted = set(rec["calibration"]["fitted"])
    assert fitted == {n for n, k in kinds.items() if k != "exact"}
    assert {"fc.weight", "midlayer.mlp.gate_proj.weight", "midlayer.self_attn.q_proj.weight"} <= fitted
    for name in a:
        if name in fitted:
            assert not torch.equal(a[name], b[name]), name
        else:
            assert torch.equal(a[name], b[name]), name
    notes = {r["tensor"]: r.get("note", "") for r in rec["mapping"]}
    assert all("calibrated on" in notes[n] for n in fitted)


def test_the_fit_moves_the_drafter_toward_its_module(pair):
    _, cal = pair
    c = json.loads((cal / "recycle.json").read_text())["calibration"]
    before, after = c["report"]["folded"], c["report"]["calibrated"]
    assert len(after["kl"]) == c["draft_steps"] == 3
    for k in range(3):
        assert after["kl"][k] < before["kl"][k]
    assert after["top1_agreement"][0] > before["top1_agreement"][0]
    assert c["tokens"] >= 2048 and c["report"]["heldout_windows"] >= 1


def test_wide_mlp_starts_from_the_shared_and_most_picked_experts(tmp_path):
    out = tmp_path / "wide"
    convert_calibrated(GLM, "eagle3", out, dtype="fp32", calibrate=2048, calibrate_steps=1, eagle3_mlp="wide")
    cfg = json.loads((out / "config.json").read_text())
    rec = json.loads((out / "recycle.json").read_text())["calibration"]["mlp"]
    src = json.loads((GLM / "config.json").read_text())
    shared, expert = src["moe_intermediate_size"] * src["n_shared_experts"], src["moe_intermediate_size"]
    assert cfg["intermediate_size"] == rec["width"] == shared + expert * len(rec["routed_experts"])
    assert rec["width"] <= src["intermediate_size"] < rec["width"] + expert
    use = rec["expert_use"]
    picked = sorted(use, key=lambda e: -use[e][0])[:len(rec["routed_experts"])]
    assert sorted(map(int, picked)) == sorted(rec["routed_experts"])
    d = load_drafter(out)
    assert d.midlayer.mlp.gate_proj.weight.shape[0] == rec["width"]


@pytest.mark.parametrize("args,needle", [
    (("--eagle3-mlp", "wide"), "needs --calibrate"),
    (("--data", "stdlib"), "--data needs --calibrate"),
    (("--eagle3-mlp", "huge", "--calibrate", "1k"), "--eagle3-mlp 'huge'"),
    (("--calibrate", "1k", "--target", str(FIXTURES / "nowhere")), "nowhere"),
    (("--calibrate", "1k", "--data", str(FIXTURES / "nowhere.jsonl")), "nowhere.jsonl"),
])
def test_bad_calibration_input_is_refused_before_loading(tmp_path, args, needle):
    assert_bad_input(run_cli("convert", str(GLM), "--to", "eagle3", *args, "-o", str(tmp_path / "out")), needle)
    assert not (tmp_path / "out").exists()


def test_a_source_without_a_trunk_needs_a_target(tmp_path):
    """An MTP overlay (only the module's tensors) cannot run as its own target: one line, before any model."""
    overlay = tmp_path / "ov"
    convert_checkpoint(GLM, "eagle", overlay)
    res = run_cli("convert", str(overlay / "mtp_overlay"), "--to", "eagle3", "--calibrate", "1k",
                  "-o", str(tmp_path / "out"))
    assert_bad_input(res, "a target is the whole model")


def test_a_reduced_draft_vocabulary_is_fitted_over_its_own_rows(tmp_path):
    """With --draft-vocab the module's distribution is compared over the draft ids only, and the head stays its rows."""
    out = tmp_path / "dv"
    convert_calibrated(GLM, "eagle3", out, dtype="fp32", draft_vocab=512, calibrate=2048, calibrate_steps=2,
                       eagle3_mlp="shared")
    d = load_drafter(out)
    assert d.draft_vocab_size == 512 and d.lm_head.weight.shape[0] == 512
    rec = json.loads((out / "recycle.json").read_text())
    assert "lm_head.weight" not in rec["calibration"]["fitted"]
    after = rec["calibration"]["report"]["calibrated"]["kl"]
    assert all(0 <= x < float("inf") for x in after)


@pytest.mark.parametrize("to", ["eagle3", "medusa"])
def test_target_without_calibrate_is_refused_for_mtp_sources(tmp_path, to):
    res = run_cli("convert", str(GLM), "--to", to, "--target", str(GLM), "-o", str(tmp_path / "out"))
    assert_bad_input(res, "--target needs --calibrate TOKENS")
    assert not (tmp_path / "out").exists()
