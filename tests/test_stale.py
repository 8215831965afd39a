"""Stale and missing MTP (issue 13): derived targets, the transplant workflow (inspect → convert the
base → distill against the post-trained target → stitch → native MTP), the target's embedding and
head, held-out data from `--data`, the never-worse guard, native reuse past the stored depth, and
the bad-input cases."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recycle.audit import inspect_checkpoint
from recycle.bench import BenchOptions, run_bench
from recycle.bench_result import Measure
from recycle.checkpoint import Checkpoint
from recycle.distill.data import heldout_batch
from recycle.distill.record import expected_length
from recycle.distill.train import DistillOptions, distill
from recycle.families import match
from recycle.hardware import default_precision
from recycle.texts import data_source, split_tail

from fixtures.derive import derive
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE, L

POSTTRAINED = FIXTURE.parent / "deepseek_v3_mtp_posttrained"
TINY = dict(seq_len=48, batch=2, eval_rows=2, threads=1)
PROMPTS = [("code", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n"),
           ("code", "class Stack:\n    def __init__(self):\n        self.items = []\n")]


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(d).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("derived")
    return {
        "one": Path(derive(FIXTURE, root / "one", 1)["out"]),
        "pt_one": Path(derive(POSTTRAINED, root / "pt_one", 1)["out"]),
        "pt_dropped": Path(derive(POSTTRAINED, root / "pt_dropped", 0)["out"]),
    }


@pytest.fixture(scope="module")
def base_eagle(converted) -> Path:
    return converted("eagle")


def _bench(drafter: str | None, target: Path, tree: str) -> Measure:
    r = run_bench(BenchOptions(drafter=drafter, target=str(target), prompts=PROMPTS, max_new_tokens=24, tree=tree,
                               native=drafter is None, warmup=False))
    return r.overall.spec


# -- the targets ----------------------------------------------------------------------------------


def test_posttrained_fixture_keeps_the_base_mtp_bytes_and_moved_its_trunk() -> None:
    base, pt = Checkpoint(FIXTURE), Checkpoint(POSTTRAINED)
    names = match(base).mtp_names
    assert set(names) == set(match(pt).mtp_names) and len(match(pt).modules) == 2
    assert all(torch.equal(base.raw(n), pt.raw(n)) for n in names)  # byte for byte: stale by construction
    assert set(base.tensors) == set(pt.tensors)
    assert not torch.equal(base.raw("lm_head.weight"), pt.raw("lm_head.weight"))
    report = json.loads((POSTTRAINED / "build_report.json").read_text())
    dom = "transformers_heldout"
    assert report["after"][dom]["heldout_loss"] < report["before"][dom]["heldout_loss"] - 1.0
    assert report["relative_change_vs_base"]["head"] > 0.1


def test_derived_variants_are_deterministic(derived: dict[str, Path], tmp_path: Path) -> None:
    again = Path(derive(POSTTRAINED, tmp_path / "again", 0)["out"])
    assert _digest(again) == _digest(derived["pt_dropped"])
    one = Checkpoint(derived["pt_one"])
    assert one.config["num_nextn_predict_layers"] == 1 and len(match(one).modules) == 1
    assert not any(n.startswith(f"model.layers.{L + 1}.") for n in one.tensors)
    dropped = Checkpoint(derived["pt_dropped"])
    assert dropped.config["num_nextn_predict_layers"] == 2 and not match(dropped).modules
    assert all(torch.equal(dropped.raw(n), Checkpoint(POSTTRAINED).raw(n)) for n in dropped.tensors)


def test_inspect_finds_stale_and_missing_modules(derived: dict[str, Path]) -> None:
    codes = lambda p: {f.code for f in inspect_checkpoint(p).findings}
    assert "mtp_stale_copy" in codes(POSTTRAINED) and "mtp_stale_copy" not in codes(FIXTURE)
    assert "mtp_declared_missing" in codes(derived["pt_dropped"])
    assert not codes(derived["one"])


def test_derive_refuses_more_modules_than_stored(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="cannot keep 3"):
        derive(FIXTURE, tmp_path / "x", 3)
    assert not (tmp_path / "x").exists()


# -- the transplant workflow ---------------------------------------------------------------------


def test_transplant_into_a_target_without_mtp(derived: dict[str, Path], base_eagle: Path, tmp_path: Path) -> None:
    """convert the base → distill against the post-trained target → stitch into the build that dropped
    its MTP tensors → that target's native MTP drafts exactly as the distilled drafter does."""
    rec = distill(DistillOptions(drafter=str(base_eagle), target=str(derived["pt_dropped"]), tokens=600,
                                 out=str(tmp_path / "re"), data="py:transformers", **TINY))
    out = Path(rec["out"])
    assert rec["target_io"]["head"]["replaced_by_target"] and rec["target_io"]["head"]["relative_difference"] > 0.1
    state, target = load_file(str(out / "model.safetensors")), Checkpoint(POSTTRAINED)
    assert torch.equal(state["head.weight"], target.raw("lm_head.weight").to(state["head.weight"].dtype))
    assert torch.equal(state["embed.weight"], target.raw("model.embed_tokens.weight").to(state["embed.weight"].dtype))
    assert rec["heldout"]["source"].startswith("py:transformers")
    prov = json.loads((out / "recycle.json").read_text())
    assert prov["distillation"][-1]["target_io"]["embed"]["replaced_by_target"]

    res = run_cli("stitch", str(out / "mtp_overlay"), str(derived["pt_dropped"]), "-o", str(tmp_path / "st"), "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert not summary["target_had_mtp"] and len(summary["copies_from_target"]) == 4
    st = Checkpoint(tmp_path / "st")
    assert torch.equal(st.raw(f"model.layers.{L}.shared_head.head.weight"), target.raw("lm_head.weight"))
    native = _bench(None, tmp_path / "st", "chain:2")
    drafter = _bench(str(out), derived["pt_dropped"], "chain:2")
    assert native.accepted == drafter.accepted and native.tried == drafter.tried, (native, drafter)


def test_stitch_writes_the_targets_copies_over_stale_ones(base_eagle: Path, tmp_path: Path) -> None:
    res = run_cli("stitch", str(base_eagle / "mtp_overlay"), str(POSTTRAINED), "-o", str(tmp_path / "st"), "--json")
    assert res.exit_code == 0, res.output
    st, pt = Checkpoint(tmp_path / "st"), Checkpoint(POSTTRAINED)
    for k in (L, L + 1):
        assert torch.equal(st.raw(f"model.layers.{k}.embed_tokens.weight"), pt.raw("model.embed_tokens.weight"))
        assert torch.equal(st.raw(f"model.layers.{k}.eh_proj.weight"), pt.raw(f"model.layers.{k}.eh_proj.weight"))
    assert "mtp_stale_copy" not in {f.code for f in inspect_checkpoint(tmp_path / "st").findings}


# -- distillation that never hurts ---------------------------------------------------------------


def test_a_distillation_never_writes_a_worse_drafter(base_eagle: Path, tmp_path: Path) -> None:
    """A learning rate that wrecks the drafter: the output is the input, and the record says why."""
    rec = distill(DistillOptions(drafter=str(base_eagle), target=str(FIXTURE), tokens=400, out=str(tmp_path / "o"),
                                 lr=0.5, warmup=0.0, **TINY))
    assert expected_length(rec["final"]["heldout_agreement_last_step"]) < rec["final"]["heldout_estimate_before"]
    assert rec["selected"]["step"] == 0 and "input" in rec["selected"]["why"]
    assert rec["final"]["heldout_estimate_after"] == rec["final"]["heldout_estimate_before"]
    a, b = load_file(str(base_eagle / "model.safetensors")), load_file(str(tmp_path / "o" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "o.distill").glob("best-*"))  # the best snapshot lived on disk until the output was whole


def test_heldout_comes_from_the_tail_of_data(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    docs = [f"def train_{i}(x):\n    return x * {i}\n" * 20 for i in range(30)] + ["def HELDOUT(y):\n    pass\n" * 40]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    src = data_source(data)
    assert not any("HELDOUT" in t for t in src.train()) and all("HELDOUT" in t for t in src.heldout())
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    rows = heldout_batch(tok, 32, 4, data)
    assert "HELDOUT" in tok.decode(rows[0]) and "train_" not in tok.decode(rows.flatten())
    train, held = split_tail(["line\n" * 100])  # one document: its tail is cut at a line boundary
    assert train[0] + held[0] == "line\n" * 100 and held[0].startswith("line")


def test_default_precision_is_fp32_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True}, raising=False)  # torch < 2.7: absent
    assert default_precision(torch.device("cpu")) == "fp32"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True}, raising=False)
    assert default_precision(torch.device("cpu")) == "bf16"


# -- deeper than stored ----------------------------------------------------------------------------


def test_native_module_reused_past_its_depth_equals_the_eagle_chain(derived: dict[str, Path], converted) -> None:
    """One stored module, chain:3: native MTP chains module 0 again (vLLM's k mod n), exactly what the
    `--to eagle` drafter of the same checkpoint computes."""
    eagle = str(converted("eagle", source=derived["one"], layouts="recycle"))
    native = _bench(None, derived["one"], "chain:3")
    drafter = _bench(eagle, derived["one"], "chain:3")
    assert len(native.tried) == 3 and native.accepted == drafter.accepted, (native, drafter)


# -- bad input --------------------------------------------------------------------------------------


def _other_tokenizer(tmp_path: Path) -> Path:
    """A copy of the post-trained target whose tokenizer maps two tokens the other way round."""
    d = tmp_path / "other-tok"
    shutil.copytree(POSTTRAINED, d)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


def test_a_base_that_does_not_fit_is_refused(base_eagle: Path, family_dir, tmp_path: Path) -> None:
    other = _other_tokenizer(tmp_path)
    res = run_cli("distill", str(base_eagle), "--target", str(other), "--tokens", "1k", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "tokenizer")
    assert not (tmp_path / "o").exists()
    res = run_cli("stitch", str(base_eagle / "mtp_overlay"), str(other), "-o", str(tmp_path / "s"))
    assert_bad_input(res, "tokenizer")
    assert not (tmp_path / "s").exists()
    wide = family_dir("deepseek_v3")  # another hidden size and vocabulary
    res = run_cli("distill", str(base_eagle), "--target", str(wide), "--tokens", "1k", "-o", str(tmp_path / "o"))
    assert_bad_input(res, "does not fit")
    res = run_cli("stitch", str(base_eagle / "mtp_overlay"), str(wide), "-o", str(tmp_path / "s"))
    assert_bad_input(res, "does not fit")
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()
