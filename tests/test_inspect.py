"""`recycle inspect`: findings, JSON schema, bad input (exit 2, one stderr line), read-only behaviour."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from recycle.audit import inspect_checkpoint

from tests.cli_helpers import assert_bad_input, run_cli
from tests.helpers import run

ROOT = Path(__file__).resolve().parents[1]


def codes(path: Path, stats: bool = False) -> dict[str, str]:
    rep = inspect_checkpoint(path, stats=stats)
    return {f.code: f.severity for f in rep.findings}


def tree_digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def copy_of(family_dir, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(family_dir(name), dst)
    return dst


# -- findings -----------------------------------------------------------------------------------


def test_clean_deepseek_has_no_error_findings(family_dir):
    found = codes(family_dir("deepseek_v3"), stats=True)
    assert "error" not in found.values(), found


@pytest.mark.parametrize(
    "variant, code, severity, stats",
    [
        ("minimax_m2_declared_missing", "mtp_declared_missing", "error", False),
        ("deepseek_v3_undeclared", "mtp_undeclared", "warning", False),
        ("glm4_6", "shared_copy_absent", "warning", False),
        ("deepseek_v3_bad_shape", "shape_mismatch", "error", False),
        ("deepseek_v3_fp8_bad_scale", "fp8_scale_shape", "error", False),
        ("deepseek_v3_nan", "nan_or_inf", "error", True),
        ("deepseek_v3_zero", "all_zero", "warning", True),
        ("deepseek_v3_stray", "unknown_layout", "warning", False),
        ("gemma4_assistant", "already_drafter", "info", False),
    ],
)
def test_finding_codes(family_dir, variant, code, severity, stats):
    found = codes(family_dir(variant), stats=stats)
    assert found.get(code) == severity, found


def test_nan_and_zero_need_stats(family_dir):
    """Without --stats only headers are read, so data defects cannot be seen (and are not claimed)."""
    assert "nan_or_inf" not in codes(family_dir("deepseek_v3_nan"))
    assert "all_zero" not in codes(family_dir("deepseek_v3_zero"))


def test_zero_centred_norms_are_not_flagged(family_dir):
    rep = inspect_checkpoint(family_dir("qwen3_next"), stats=True)
    assert not [f for f in rep.findings if f.code == "all_zero"]
    norms = [s for s in rep.stats if s.role in ("embed_norm", "hidden_norm", "final_norm")]
    assert norms and all(s.norm["convention"] == "1+w" for s in norms)
    # effective scale 1+w is near 1 although the stored weights are near 0
    assert all(abs(s.norm["mean"] - 1) < 0.5 for s in norms)


def test_shared_copy_absent_everywhere_is_an_error(family_dir, tmp_path):
    """GLM-4.6 without copies only warns while the trunk has them; with no trunk head/embed either, it errors."""
    from safetensors.torch import load_file, save_file

    d = copy_of(family_dir, "glm4_6", tmp_path)
    gone = {"lm_head.weight", "model.embed_tokens.weight"}
    for f in d.glob("*.safetensors"):
        sd = load_file(f)
        if gone & set(sd):
            save_file({k: v for k, v in sd.items() if k not in gone}, f)
    index = d / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in gone}
        index.write_text(json.dumps(data))
    assert codes(d).get("shared_copy_absent") == "error"


def test_role_missing(family_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_of(family_dir, "deepseek_v3", tmp_path)
    f = next(d.glob("*.safetensors"))
    sd = load_file(f)
    victim = next(k for k in sd if k.endswith(".hnorm.weight"))
    save_file({k: v for k, v in sd.items() if k != victim}, f)
    assert codes(d).get("role_missing") == "error"


def test_fp8_stats_are_dequantized(family_dir):
    rep = inspect_checkpoint(family_dir("deepseek_v3_fp8"), stats=True)
    fp8 = [s for s in rep.stats if s.dtype == "F8_E4M3"]
    assert fp8, "the FP8 fixture must hold FP8 MTP weights"
    # raw e4m3 codes are O(1..448); dequantized weights of a small random init are O(0.01..0.1)
    assert all(0 < s.rms < 1.0 for s in fp8), [(s.name, s.rms) for s in fp8]


def test_fp8_scale_in_another_shard_is_paired(family_dir):
    rep = inspect_checkpoint(family_dir("deepseek_v3_fp8"))
    assert not [f for f in rep.findings if f.code == "fp8_scale_shape"]
    mod = rep.modules[0]
    assert mod["fp8"] > 0
    scales = [n for ns in mod["roles"].values() for n in ns if n.endswith("_scale_inv")]
    assert scales


# -- JSON schema --------------------------------------------------------------------------------


def test_json_schema(family_dir):
    res = run_cli("inspect", str(family_dir("deepseek_v3_fp8")), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    for key in ("family", "architecture", "mtp", "params", "shards", "findings"):
        assert key in data
    assert data["family"] == "deepseek_v3"
    assert data["mtp"]["declared"] == data["mtp"]["found"] == len(data["mtp"]["modules"]) >= 1
    m = data["mtp"]["modules"][0]
    for key in ("index", "prefix", "roles", "params", "bytes", "concat_order", "norm"):
        assert key in m
    assert m["concat_order"] == "eh" and m["norm"] == "w"
    assert set(m["roles"]) <= {"embed_norm", "hidden_norm", "proj", "block", "final_norm", "head", "embed"}
    assert data["params"]["total"] > data["params"]["mtp"] > 0
    assert data["shards"]["count"] > 1 and data["shards"]["bytes_total"] > 0
    for f in data["findings"]:
        assert set(f) >= {"severity", "code", "message"}


def test_rich_report_mentions_family_and_findings(family_dir):
    res = run_cli("inspect", str(family_dir("deepseek_v3_nan")), "--stats")
    assert res.exit_code == 0, res.output
    assert "deepseek_v3" in res.output and "nan_or_inf" in res.output


def test_inspect_never_writes(family_dir):
    d = family_dir("deepseek_v3_fp8")
    before = tree_digest(d)
    assert run_cli("inspect", str(d), "--stats", "--json").exit_code == 0
    assert tree_digest(d) == before


# -- bad input ----------------------------------------------------------------------------------




def test_missing_directory(tmp_path):
    assert_bad_input(run_cli("inspect", str(tmp_path / "nope")), "no such checkpoint directory")


def test_no_config(family_dir, tmp_path):
    d = copy_of(family_dir, "deepseek_v3", tmp_path)
    (d / "config.json").unlink()
    assert_bad_input(run_cli("inspect", str(d)), "config.json")


def test_truncated_safetensors(family_dir, tmp_path):
    d = copy_of(family_dir, "deepseek_v3", tmp_path)
    f = next(d.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_bad_input(run_cli("inspect", str(d)), "corrupt or unreadable safetensors")


def test_garbage_safetensors(family_dir, tmp_path):
    d = copy_of(family_dir, "deepseek_v3", tmp_path)
    next(d.glob("*.safetensors")).write_bytes(b"\x00not a safetensors file at all")
    assert_bad_input(run_cli("inspect", str(d)), "corrupt or unreadable safetensors")


def test_index_names_missing_shard(family_dir, tmp_path):
    d = copy_of(family_dir, "deepseek_v3_fp8", tmp_path)
    shards = sorted(d.glob("model-*.safetensors"))
    shards[0].unlink()
    assert_bad_input(run_cli("inspect", str(d)), "which is missing")


def test_unknown_dtype(family_dir, tmp_path):
    d = copy_of(family_dir, "deepseek_v3", tmp_path)
    f = next(d.glob("*.safetensors"))
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].replace(b'"BF16"', b'"Q4_K"', 1)
    f.write_bytes(raw[:8] + header + raw[8 + n :])
    assert_bad_input(run_cli("inspect", str(d)), "unknown dtype")


def test_unknown_layout(tmp_path):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, d / "model.safetensors")
    assert_bad_input(run_cli("inspect", str(d)), "unknown layout")


def test_config_not_json(family_dir, tmp_path):
    d = copy_of(family_dir, "deepseek_v3", tmp_path)
    (d / "config.json").write_text("{not json")
    assert_bad_input(run_cli("inspect", str(d)), "config.json")


# -- --strict, and the words for each kind of checkpoint ----------------------------------------------------------


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("variant, strict, worst, code", [
    ("minimax_m2_declared_missing", True, "error", 1),  # an error-level finding: CI fails
    ("minimax_m2_declared_missing", False, "error", 0),
    ("deepseek_v3_undeclared", True, "warning", 0),  # a warning is not an error
    ("deepseek_v3", True, None, 0),
])
def test_strict_exits_1_on_an_error_finding(family_dir, variant, strict, worst, code):
    res = run_cli("inspect", str(family_dir(variant)), "--json", *(["--strict"] if strict else []))
    assert res.exit_code == code, res.output
    assert json.loads(res.stdout)["worst"] == worst  # the report is printed either way


def test_strict_keeps_exit_2_for_bad_input(tmp_path):
    assert_bad_input(run_cli("inspect", str(tmp_path / "nope"), "--strict"), "no such checkpoint directory")


def test_assistant_is_described_as_a_drafter_that_converts():
    res = run_cli("inspect", str(FIXTURES / "gemma4_assistant"))
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "nothing to extract" not in text and "0 declared" not in text
    assert "convert --to eagle3|medusa --target TARGET_DIR" in text  # what the README's assistant section does
    data = json.loads(run_cli("inspect", str(FIXTURES / "gemma4_assistant"), "--json").stdout)
    assert data["holds"]["unit"] == "drafter" and "drafter already" in data["holds"]["what"]


def test_parallel_heads_have_no_none_cells_and_whole_tensor_names():
    res = run_cli("inspect", str(FIXTURES / "meta_mtp_parallel"))
    assert res.exit_code == 0, res.output
    assert "None" not in res.stdout
    assert "prediction heads" in res.stdout and "3 found / 3 declared" in res.stdout
    data = json.loads(run_cli("inspect", str(FIXTURES / "meta_mtp_parallel"), "--json").stdout)
    assert data["holds"]["what"].startswith("parallel: each reads the trunk's last state")
    assert data["architecture"] is None and data["mtp"]["modules"][0]["concat_order"] is None  # JSON keeps nulls
    names = {n for m in data["mtp"]["modules"] for n in m["shared"].values()}
    lines = res.stdout.splitlines()
    assert names and all(any(n in ln for ln in lines) for n in names)  # each on one line, never folded


def test_every_tensor_name_stays_whole_in_the_per_tensor_table():
    res = run_cli("inspect", str(FIXTURES / "deepseek_v3_mtp"), "--stats", "--all")
    assert res.exit_code == 0, res.output
    data = json.loads(run_cli("inspect", str(FIXTURES / "deepseek_v3_mtp"), "--stats", "--json").stdout)
    prefixes = [m["prefix"] for m in data["mtp"]["modules"]]
    rel = {next((s["name"][len(p):] for p in prefixes if s["name"].startswith(p)), s["name"]) for s in data["stats"]}
    lines = res.stdout.splitlines()
    assert all(any(n in ln for ln in lines) for n in rel), [n for n in rel if not any(n in ln for ln in lines)]


def test_inspect_reads_headers_without_torch(family_dir):
    """A header audit (the default inspect, with its sampled stale-copy rows) never imports torch: at DeepSeek-V3's
    163 shards the import alone was a third of the time (BENCHMARKS.md, inspect at scale)."""
    code = ("import sys\nfrom recycle.cli import app\ntry:\n    app(['inspect', sys.argv[1], '--json'])\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    for path in (family_dir("deepseek_v3"), ROOT / "fixtures" / "deepseek_v3_mtp"):
        res = run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        assert res.stderr.strip().splitlines()[-1] == "False False", res.stderr
        assert json.loads(res.stdout)["family"]


def test_sampled_rows_equal_torchs_values(family_dir):
    """inspect's byte-level row sample (numpy, no torch) equals the rows safetensors gives torch."""
    import torch

    from recycle.checkpoint import Checkpoint

    ckpt = Checkpoint(ROOT / "fixtures" / "deepseek_v3_mtp")
    name = next(n for n, i in ckpt.tensors.items() if len(i.shape) == 2 and i.dtype in ("BF16", "F32", "F16"))
    got = ckpt.sample_rows(name, 8)
    full = ckpt.get(name, torch.float32)
    rows = torch.linspace(0, full.shape[0] - 1, 8).long().unique()
    assert got is not None and got.shape == (len(rows), full.shape[1])
    assert torch.equal(torch.from_numpy(got), full[rows])
