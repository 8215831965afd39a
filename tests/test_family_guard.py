"""Detection cannot silently pick the wrong row: tensor names of one row under a config.json that names another row
(or none) are an error-level inspect finding and a one-line refusal from convert, until `--family` names the row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import match

from tests.cli_helpers import assert_bad_input, run_cli


def _renamed(src: Path, dst: Path, **config) -> Path:
    """A copy of `src` whose config.json says `config` instead (the tensors are untouched)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mislabelled(family_dir, tmp_path_factory) -> dict[str, Path]:
    """DeepSeek-V3 tensors under Qwen3-Next's config names (another row's, whose tensor names differ), and under names
    no row lists. (Under GLM-4.5's, which stores DeepSeek's names, the config decides: that is the glm4_moe row.)"""
    root = tmp_path_factory.mktemp("guard")
    src = family_dir("deepseek_v3")
    return {
        "other_row": _renamed(src, root / "other", model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]),
        "no_row": _renamed(src, root / "none", model_type="acme_moe", architectures=["AcmeMoeForCausalLM"]),
    }


@pytest.mark.parametrize("case, says", [("other_row", "the qwen3_next row's"), ("no_row", "no row of recycle's")])
def test_match_refuses_a_config_of_another_row(mislabelled, case, says):
    ckpt = Checkpoint(mislabelled[case])
    with pytest.raises(RecycleError, match="pass --family deepseek_v3") as e:
        match(ckpt)
    assert says in str(e.value) and "\n" not in str(e.value)
    m = match(ckpt, strict=False)  # inspect's reading: the row the tensors fit, with the conflict
    assert m.family.name == "deepseek_v3" and not m.config_match and m.conflict == str(e.value)
    named = match(ckpt, "deepseek_v3")  # the user's choice: taken, no conflict
    assert named.family.name == "deepseek_v3" and named.conflict is None and len(named.modules) == 1


def test_a_config_that_names_the_row_has_no_conflict(family_dir):
    assert match(Checkpoint(family_dir("deepseek_v3"))).conflict is None


def test_inspect_reports_the_conflict_as_an_error(mislabelled):
    res = run_cli("inspect", str(mislabelled["other_row"]), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    found = [f for f in data["findings"] if f["code"] == "family_conflict"]
    assert len(found) == 1 and found[0]["severity"] == "error", data["findings"]
    assert data["family"] == "deepseek_v3" and data["worst"] == "error"
    assert run_cli("inspect", str(mislabelled["other_row"]), "--strict").exit_code == 1
    named = json.loads(run_cli("inspect", str(mislabelled["other_row"]), "--json", "--family", "deepseek_v3").stdout)
    assert not [f for f in named["findings"] if f["code"] == "family_conflict"]


def test_convert_refuses_until_the_family_is_named(mislabelled, tmp_path):
    out = tmp_path / "eagle"
    res = run_cli("convert", str(mislabelled["no_row"]), "--to", "eagle", "-o", str(out))
    assert_bad_input(res, "pass --family deepseek_v3")
    assert not out.exists()  # nothing half-written
    res = run_cli("convert", str(mislabelled["no_row"]), "--to", "eagle", "-o", str(out), "--family", "deepseek_v3",
                  "--json")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "recycle.json").read_text())["source"]["family"] == "deepseek_v3"


def test_an_unknown_family_name_is_one_line(mislabelled, tmp_path):
    res = run_cli("convert", str(mislabelled["no_row"]), "--to", "eagle", "-o", str(tmp_path / "x"), "--family", "nope")
    assert_bad_input(res, "unknown family 'nope'")


def test_tensors_that_fit_the_named_rows_templates_but_not_its_block_are_refused(family_dir, tmp_path):
    """Step-3.7's tensors under a config that says DeepSeek-V3: DeepSeek's templates find enorm/hnorm/eh_proj, so the
    config and the tensors seem to agree; the block (Step's, with `transformer.shared_head.*` left in it) does not
    fit DeepSeek's decoder layer, and convert refuses before writing."""
    src = _renamed(family_dir("step3p7"), tmp_path / "step_as_ds", model_type="deepseek_v3",
                   architectures=["DeepseekV3ForCausalLM"])
    assert match(Checkpoint(src)).family.name == "deepseek_v3"  # what the names and the config alone say
    out = tmp_path / "e3"
    res = run_cli("convert", str(src), "--to", "eagle3", "-o", str(out))
    assert_bad_input(res, "")
    assert "deepseek_v3" in res.stderr and not out.exists()


def test_a_block_missing_a_parameter_is_refused_before_writing(family_dir, tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "short"
    shutil.copytree(family_dir("deepseek_v3"), src)
    ck = Checkpoint(src)
    gone = next(n for n in ck.tensors if n.startswith("model.layers.2.self_attn.q_a_layernorm"))
    kept = {n: ck.raw(n) for n in ck.tensors if n != gone}
    for f in src.glob("*.safetensors*"):
        f.unlink()
    save_file(kept, str(src / "model.safetensors"))
    out = tmp_path / "e"
    assert_bad_input(run_cli("convert", str(src), "--to", "eagle", "-o", str(out)), "missing: self_attn.q_a_layernorm")
    assert not out.exists()
