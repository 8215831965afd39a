"""`recycle inspect` on quantized builds: where the MTP went against the scheme the config declares (issue 48).

The builds are the committed tool-made ones (`fixtures/quant/`, `fixtures/build_quantized.py`) and their broken copies
as the trackers describe them (`fixtures/quant_broken.py`); the packed-MTP layouts are the ModelOpt NVFP4 build with
its MTP written in NVFP4 by recycle's own codec (`recycle.quant.fp4`), the layout the config declares, then edited.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recycle.audit import inspect_checkpoint
from recycle.quant import CODECS
from recycle.quant.schemes import BY_NAME

from fixtures.quant_broken import INDEX_FILE, MTP_SHARD, builds, make
from tests.cli_helpers import app, assert_bad_input, run_cli, runner

# the finding codes about quantization (the rest, e.g. the posttrained source's mtp_stale_copy, are not this file's)
QUANT_CODES = {"mtp_quant_differs", "mtp_quant_unexpected", "quant_scale_shape", "quant_orphan_scale",
               "mtp_quant_stats", "quant_unsupported", "fp8_unscaled_weight", "fp8_orphan_scale", "fp8_scale_shape"}
MODELOPT = "ds_v3_nvfp4_modelopt"
CT_NVFP4 = "ds_v3_nvfp4a16_llmc"
MTP = "model.layers.10."  # the DeepSeek-V3 fixture's first MTP module (10 trunk layers)
SECOND = "model.layers.11."


def findings(path: Path, stats: bool = False) -> list[tuple[str, str, str]]:
    return [(f.severity, f.code, f.message) for f in inspect_checkpoint(path, stats=stats).findings]


def quant(path: Path, stats: bool = False) -> dict[str, str]:
    """code -> worst severity among the quantization findings"""
    out: dict[str, str] = {}
    for sev, code, _ in findings(path, stats):
        if code in QUANT_CODES and (code not in out or sev == "error"):
            out[code] = sev
    return out


def cli_findings(path: Path, *extra: str) -> list[dict]:
    res = run_cli("inspect", str(path), "--json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["findings"]


def engine_linear(name: str, t: torch.Tensor) -> bool:
    """the MTP block's Linear weights vLLM builds NVFP4 under the ModelOpt config (not the router, not eh_proj)"""
    return (t.dim() == 2 and name.endswith(".weight") and (".self_attn." in name or ".mlp." in name)
            and not name.endswith("mlp.gate.weight"))


def rewrite_mtp(d: Path, edit) -> None:
    """`edit(state)` on the MTP shard's tensors, the index kept in step"""
    state = load_file(str(d / MTP_SHARD))
    edit(state)
    save_file(state, str(d / MTP_SHARD), metadata={"format": "pt"})
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != MTP_SHARD} | dict.fromkeys(state,
                                                                                                          MTP_SHARD)
    (d / INDEX_FILE).write_text(json.dumps(index))


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ModelOpt NVFP4 build with its first MTP module in NVFP4 (recycle's `nvfp4` codec), as the config declares
    it; the second (BF16) excluded by ModelOpt's own entry (quantizing it too would only double the set-up time)."""
    d = make(MODELOPT, "mtp_bf16_no_ignore", tmp_path_factory.mktemp("q") / "packed")
    codec = CODECS.get("nvfp4")

    def to_nvfp4(state: dict) -> None:
        for name in [n for n, t in state.items() if n.startswith(MTP) and engine_linear(n, t)]:
            state.update(codec.quantize(state.pop(name), name, {}))

    rewrite_mtp(d, to_nvfp4)
    hf = json.loads((d / "hf_quant_config.json").read_text())
    hf["quantization"]["exclude_modules"].append(SECOND.rstrip(".") + "*")
    (d / "hf_quant_config.json").write_text(json.dumps(hf))
    return d


def variant(packed: Path, tmp_path: Path, edit) -> Path:
    d = tmp_path / "v"
    shutil.copytree(packed, d)
    rewrite_mtp(d, edit)
    return d


# -- 1. the quantizer dropped the MTP -----------------------------------------------------------------------------


def test_a_dropped_mtp_names_the_quantizer_and_what_vllm_does(tmp_path: Path) -> None:
    d = make(CT_NVFP4, "mtp_dropped", tmp_path / "dropped")
    found = [f for f in cli_findings(d) if f["code"] == "mtp_declared_missing"]
    assert [f["severity"] for f in found] == ["error"], found
    msg = found[0]["message"]
    assert "quantizer dropped them" in msg and "_keys_to_ignore_on_load_unexpected" in msg, msg
    assert "weights missing from checkpoint" in msg, msg  # vLLM 0.32 deepseek_mtp.py:515-531, as the record cites
    # an unquantized release missing its MTP says nothing about a quantizer
    src = json.loads((Path("fixtures/quant") / CT_NVFP4 / "build.json").read_text())["source"]
    assert "quantizer" not in " ".join(m for _, c, m in findings(Path(src)) if c == "mtp_declared_missing")


# -- 2. another scheme than the config claims, no ignore entry ------------------------------------------------------


@pytest.mark.parametrize("build", builds())
def test_bf16_mtp_without_ignore_is_an_error_and_with_it_clean(build: str, tmp_path: Path) -> None:
    bad = make(build, "mtp_bf16_no_ignore", tmp_path / "bad")
    errors = [f for f in cli_findings(bad) if f["code"] == "mtp_quant_differs" and f["severity"] == "error"]
    assert errors and all("not excluded by its ignore rule" in f["message"] for f in errors), errors
    good = make(build, "mtp_bf16_ignored", tmp_path / "good")
    assert quant(good) == {"mtp_quant_differs": "info"}, findings(good)


def test_every_build_is_listed() -> None:
    assert {MODELOPT, CT_NVFP4} <= set(builds())


def test_fp8_block_mtp_under_an_nvfp4_config_is_an_error(tmp_path: Path) -> None:
    """vllm#54126's layout. (The compressed-tensors NVFP4 build gives the same finding; its decode check imports
    compressed-tensors, seconds, so the ModelOpt build stands for both here.)"""
    d = make(MODELOPT, "mtp_wrong_scheme", tmp_path / "wrong")
    errors = [m for sev, c, m in findings(d) if c == "mtp_quant_differs" and sev == "error"]
    assert errors and "fp8_block" in errors[0] and "vllm#54126" in errors[0], errors


# -- 3. quantized where the engine builds it unquantized --------------------------------------------------------------


def test_the_packed_mtp_in_the_configs_scheme_is_clean(packed: Path) -> None:
    rep = inspect_checkpoint(packed)
    quant_findings = [(f.severity, f.code, f.tensor) for f in rep.findings if f.code in QUANT_CODES]
    assert [(sev, code) for sev, code, _ in quant_findings] == [("info", "mtp_quant_differs")], quant_findings
    assert quant_findings[0][2].startswith(SECOND)  # the excluded BF16 module, as the config says
    ckpt_tags = {d for mod in rep.modules for d in mod["dtypes"]}
    assert "NVFP4" in ckpt_tags, ckpt_tags  # the MTP is read packed, not as stray U8 tensors


def test_the_rich_report_keeps_the_shapes_in_messages(tmp_path: Path) -> None:
    """The records' engine lines quote shapes ("uint8 weight [out, in/2]"), which rich would take for markup."""
    d = make(MODELOPT, "mtp_bf16_no_ignore", tmp_path / "bad")
    message = next(f["message"] for f in cli_findings(d) if f["code"] == "mtp_quant_differs")
    shapes = re.findall(r"\[[a-z][^\]]*\]", message)
    assert shapes, message
    res = runner.invoke(app, ["inspect", str(d)], env={"COLUMNS": "2000"})
    assert res.exit_code == 0 and all(sh in res.output for sh in shapes), (shapes, res.output)


def test_a_quantized_eh_proj_is_unexpected(packed: Path, tmp_path: Path) -> None:
    """deepseek_mtp builds eh_proj as a plain nn.Linear (vllm 0.32 deepseek_mtp.py:87) whatever the scheme."""
    name = MTP + "eh_proj.weight"

    def quantize_proj(state: dict) -> None:
        state.update(CODECS.get("nvfp4").quantize(state.pop(name), name, {}))

    found = findings(variant(packed, tmp_path, quantize_proj))
    unexpected = [m for sev, c, m in found if c == "mtp_quant_unexpected" and sev == "error"]
    assert unexpected and "plain Linear" in unexpected[0], found


def test_an_excluded_module_stored_packed_is_unexpected(packed: Path, tmp_path: Path) -> None:
    d = tmp_path / "excluded"
    shutil.copytree(packed, d)
    hf = json.loads((d / "hf_quant_config.json").read_text())
    hf["quantization"]["exclude_modules"].append(MTP.rstrip(".") + "*")  # ModelOpt's own MTP exclusion form
    (d / "hf_quant_config.json").write_text(json.dumps(hf))
    unexpected = [m for sev, c, m in findings(d) if c == "mtp_quant_unexpected" and sev == "error"]
    assert unexpected and "ignore rule" in unexpected[0], unexpected
    assert "model dtype" in unexpected[0]  # the record's quantized_where_unquantized line


# -- 4. scales missing, orphaned, corrupt -------------------------------------------------------------------------


def test_a_part_without_its_weight_and_codes_without_their_scale(packed: Path, tmp_path: Path) -> None:
    weight = MTP + "self_attn.o_proj.weight"
    other = MTP + "self_attn.q_a_proj.weight"

    def break_parts(state: dict) -> None:
        del state[weight]  # its weight_scale / weight_scale_2 stay: orphans
        del state[other + "_scale"]  # its U8 codes stay: no codec reads them

    found = findings(variant(packed, tmp_path, break_parts))
    orphans = {m.split(":")[0] for sev, c, m in found if c == "quant_orphan_scale" and sev == "error"}
    # the unread codes' own weight_scale_2 is beside no weight a codec reads either
    assert orphans == {weight + "_scale", weight + "_scale_2", other + "_scale_2"}, found
    unread = [m for sev, c, m in found if c == "quant_scale_shape" and sev == "error"]
    assert len(unread) == 1 and unread[0].startswith(other + ":"), found


def test_a_corrupt_packed_scale_is_a_finding_and_exit_2_when_stats_read_it(packed: Path, tmp_path: Path) -> None:
    name = MTP + "self_attn.o_proj.weight"

    def nan_scale(state: dict) -> None:
        state[name + "_scale_2"] = torch.tensor(float("nan"))

    d = variant(packed, tmp_path, nan_scale)
    corrupt = [f for f in cli_findings(d) if f["code"] == "quant_scale_shape"]
    assert [f["tensor"] for f in corrupt] == [name] and "NaN" in corrupt[0]["message"], corrupt
    assert_bad_input(run_cli("inspect", str(d), "--stats", "--json"), "NaN")


# -- 5. the decoded MTP against the trunk's last layer ----------------------------------------------------------------


def test_a_wrong_global_scale_shows_in_the_rms(packed: Path, tmp_path: Path) -> None:
    name = MTP + "mlp.shared_experts.down_proj.weight"

    def scale_up(state: dict) -> None:
        state[name + "_scale_2"] = state[name + "_scale_2"] * 100  # compressed-tensors' reciprocal read as ModelOpt's

    found = findings(variant(packed, tmp_path, scale_up))
    stats = [(sev, m) for sev, c, m in found if c == "mtp_quant_stats"]
    assert [sev for sev, _ in stats] == ["warning"] and stats[0][1].startswith(name), found


def test_quant_stats_compare_sane_rms_on_the_clean_layout(packed: Path) -> None:
    """The check has something to compare: the MTP's NVFP4 weights decode within 4x of the trunk's last layer."""
    from recycle.audit import _head_values, _trunk_twins
    from recycle.checkpoint import Checkpoint
    from recycle.families import match

    ckpt = Checkpoint(packed)
    m = match(ckpt, strict=False)
    rels = [rel for rel, n in m.modules[0].block_names().items() if n in ckpt.packed]
    twins = _trunk_twins(ckpt, m, rels)
    assert twins and all(t.startswith("model.layers.9.") for t in twins.values()), twins
    for rel, twin in twins.items():
        (ra, fa), (rb, fb) = _head_values(ckpt, MTP + rel), _head_values(ckpt, twin)
        assert fa and fb and 0 < ra < 4 * rb and rb < 4 * ra and math.isfinite(ra), (rel, ra, rb)


# -- 6. schemes recycle does not read ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["bitsandbytes", "quantum_foo"])
def test_an_unread_scheme_says_what_cannot_be_checked(tmp_path: Path, method: str) -> None:
    d = tmp_path / "t"
    shutil.copytree(Path("fixtures/quant") / CT_NVFP4, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "load_in_4bit": True}
    (d / "config.json").write_text(json.dumps(cfg))
    info = [m for sev, c, m in findings(d) if c == "quant_unsupported" and sev == "info"]
    assert len(info) == 1, findings(d)
    if method in BY_NAME:
        assert BY_NAME[method].why in info[0]
    else:
        assert repr(method) in info[0] and "Unknown quantization method" in info[0], info
