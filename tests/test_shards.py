"""Sharded outputs (issue 29): every safetensors file over `--max-shard-size` is written as huggingface_hub's shards
with an index, and every command that reads a drafter or an overlay reads them as it reads one file: load_drafter
(bench, plan, distill), push's validation and card, stitch, convert from a distilled drafter. Distill keeps its
input's files, an FP8 overlay whose scales sit in other shards than their weights included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recycle.checkpoint import Checkpoint
from recycle.converters.api import convert_checkpoint
from recycle.converters.roles import EXACT
from recycle.drafters import load_drafter
from recycle.io.weights import SHARD_NAME, whole_file
from recycle.io.writer import Lazy, split_plan

from fixtures.fp8 import make_fp8
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE

POST = FIXTURE.parent / "deepseek_v3_mtp_posttrained"


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory, converted) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    return {"root": root, "whole": converted("eagle"), "sharded": converted("eagle", max_shard_size="1MB")}


def _shards(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*.safetensors"))


def test_convert_writes_shards_with_an_index_in_every_layout(drafters) -> None:
    d = drafters["sharded"]
    files = _shards(d)
    assert not (d / "model.safetensors").exists() and not (d / "mtp_overlay" / "mtp.safetensors").exists()
    for index, folder in (("model.safetensors.index.json", ""), ("mtp_overlay/mtp.safetensors.index.json", "mtp_overlay/"),
                          ("nextn/model.safetensors.index.json", "nextn/")):
        obj = json.loads((d / index).read_text())
        shards = {folder + f for f in obj["weight_map"].values()}
        assert len(shards) > 1 and all(SHARD_NAME.match(Path(f).name) for f in shards)
        assert shards == {f for f in files if f.startswith(folder) and f.count("/") == folder.count("/")}
        held = Checkpoint(d / folder.rstrip("/") if folder else d)
        assert set(obj["weight_map"]) == set(held.tensors)
        assert obj["metadata"]["total_size"] == sum(i.nbytes for i in held.tensors.values())
    assert json.loads((d / "mtp_overlay/mtp.safetensors.index.json").read_text())["metadata"]["family"] == "deepseek_v3"
    rows = json.loads((d / "recycle.json").read_text())["mapping"]
    assert {r["file"] for r in rows} == set(files)  # the mapping names the shards push checks
    # the same tensors as one file each, byte for byte
    for folder in ("", "mtp_overlay", "nextn"):
        a, b = Checkpoint(d / folder), Checkpoint(drafters["whole"] / folder)
        assert set(a.tensors) == set(b.tensors) and all(torch.equal(a.raw(k), b.raw(k)) for k in b.tensors)
    assert {whole_file(f) for f in files} == set(_shards(drafters["whole"]))


def test_every_reader_takes_a_sharded_drafter(drafters, tmp_path: Path) -> None:
    from recycle.hub.card import build_card
    from recycle.hub.validate import validate_drafter

    a, b = load_drafter(drafters["sharded"]).state_dict(), load_drafter(drafters["whole"]).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
    with torch.device("meta"):  # push's validation: headers only
        assert load_drafter(drafters["sharded"]).embed.weight.is_meta
    checked = validate_drafter(drafters["sharded"])
    assert checked.notes == [] and "`model.safetensors` by tensor" in str(build_card(checked, "me/x"))
    runs = []
    for d in (drafters["sharded"], drafters["whole"]):
        res = run_cli("bench", str(d), "--target", str(FIXTURE), "--quick", "--max-new-tokens", "12", "--json")
        assert res.exit_code == 0, res.output
        runs.append(json.loads(res.stdout)["overall"]["spec"])
    assert runs[0]["accepted"] == runs[1]["accepted"] and runs[0]["tau"] == runs[1]["tau"]
    res = run_cli("stitch", str(drafters["sharded"] / "mtp_overlay"), "--target", str(FIXTURE), "-o",
                  str(tmp_path / "st"), "--max-shard-size", "300KB", "--json")
    assert res.exit_code == 0, res.output
    files = json.loads(res.stdout)["files"]
    assert len(files) > 1 and all(SHARD_NAME.match(f) for f in files)
    res = run_cli("stitch", str(drafters["whole"] / "mtp_overlay"), "--target", str(FIXTURE), "-o",
                  str(tmp_path / "st1"), "--max-shard-size", "none", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["files"] == ["recycle-mtp.safetensors"], res.output
    x, y = Checkpoint(tmp_path / "st"), Checkpoint(tmp_path / "st1")
    assert set(x.tensors) == set(y.tensors) and all(torch.equal(x.get(n), y.get(n)) for n in y.tensors)
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {"model.safetensors", *files}


def test_split_plan_keeps_a_planned_index_and_whole_files() -> None:
    def lazy(n: int) -> Lazy:
        return Lazy((n,), lambda n=n: torch.zeros(n), ("x",), EXACT, dtype=torch.float32)

    tensors = {f"t{i}": lazy(100) for i in range(5)}  # 400 bytes each
    jsons = {"sub/model.safetensors.index.json": {"metadata": {"total_size": 0},
                                                 "weight_map": {k: "w.safetensors" for k in tensors}}}
    files, out = split_plan({"sub/w.safetensors": tensors, "keep.safetensors": tensors}, None, 1000, jsons,
                            frozenset({"keep.safetensors"}))
    assert sorted(files) == ["keep.safetensors", "sub/w-00001-of-00003.safetensors",
                             "sub/w-00002-of-00003.safetensors", "sub/w-00003-of-00003.safetensors"]
    assert list(out) == ["sub/model.safetensors.index.json"]  # the planned index, remapped; no second one
    idx = out["sub/model.safetensors.index.json"]
    assert set(idx["weight_map"].values()) == {f"w-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert idx["metadata"]["total_size"] == 2000 and jsons["sub/model.safetensors.index.json"]["metadata"] == \
        {"total_size": 0}  # the caller's plan is not edited in place
    files, out = split_plan({"w.safetensors": tensors}, None, None, {})
    assert list(files) == ["w.safetensors"] and out == {}


def test_medusa_keeps_the_faster_decoding_file_whole(tmp_path: Path) -> None:
    out = convert_checkpoint(FIXTURE, "medusa", tmp_path / "m", max_shard_size="200KB")
    assert "medusa_lm_head.safetensors" in out["files"]  # TGI and TensorRT-LLM open it by name
    assert "model.safetensors.index.json" in out["files"] and "model.safetensors" not in out["files"]
    assert load_drafter(tmp_path / "m").num_heads == 3


def test_distill_keeps_its_inputs_shards_fp8_scales_apart_included(tmp_path: Path) -> None:
    """An FP8 overlay cut so that weights and their scales sit in different shards: the distilled overlay is the
    same files, still FP8 (before, each shard was rebuilt alone, a weight without its scale, and the overlay was
dropped), and it stitches back into the FP8 target."""
    base, post = make_fp8(FIXTURE, tmp_path / "base8"), make_fp8(POST, tmp_path / "post8")
    src = Path(convert_checkpoint(base, "eagle", tmp_path / "e8", layouts="recycle,overlay",
                                  max_shard_size="60KB")["out"])
    ov = Checkpoint(src / "mtp_overlay")
    apart = [n for n, i in ov.tensors.items() if i.is_scale and ov.tensors[n[: -len("_scale_inv")]].file != i.file]
    assert apart, "the cut should separate at least one scale from its weight"
    out = tmp_path / "d"
    res = run_cli("distill", str(src), "--target", str(post), "--tokens", "1k", "--seq-len", "48", "--batch", "2",
                  "--eval-every", "1", "--lr", "1e-2", "--threads", "1", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    assert _shards(out) == _shards(src)
    after = Checkpoint(out / "mtp_overlay")
    assert {n: (i.dtype, i.shape, i.file) for n, i in after.tensors.items()} == \
        {n: (i.dtype, i.shape, i.file) for n, i in ov.tensors.items()}
    name = apart[0][: -len("_scale_inv")]  # rebuilt (not dropped), its scale still in its own shard
    res = run_cli("stitch", str(out / "mtp_overlay"), "--target", str(post), "-o", str(tmp_path / "st"), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["quantization"]["requantized"] == 0, res.output
    assert torch.equal(Checkpoint(tmp_path / "st").get(name), after.get(name))


def test_bad_sizes_and_broken_indexes_are_one_line(drafters, tmp_path: Path) -> None:
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(tmp_path / "x"), "--max-shard-size", "5 parsecs")
    assert_bad_input(res, "--max-shard-size '5 parsecs'")
    assert not (tmp_path / "x").exists()
    broken = tmp_path / "broken"
    shutil.copytree(drafters["sharded"], broken)
    victim = sorted(broken.glob("model-*.safetensors"))[1]
    victim.unlink()
    res = run_cli("bench", str(broken), "--target", str(FIXTURE), "--quick", "--max-new-tokens", "4")
    assert_bad_input(res, f"names shard '{victim.name}', which is missing")
