"""The trained DeepSeek-V4 fixtures in recycle's decoder and commands (`fixtures/deepseek_v4_mtp`:
DeepseekV4ForCausalLM with hyper-connections, compressed sparse and heavily compressed attention and hash-routed MoE,
one MTP module trained with it; `fixtures/deepseek_v4_mtp_posttrained`: that trunk trained further, its module
copied: stale).

The target verifies chains (its compressor caches are rolled back whole), and its modules draft over the streams.
Ties: the fixture's compressed sparse attention has 4 indexer heads, and ReLU'd scores tie at 0, so the tests break
`torch.topk` ties by index (`tests.helpers.stable_topk`), as the GLM-5 tests do.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from recycle.decoding import MaskCache, Target, generate, load_target
from recycle.decoding.drafting import Drafter, load_engine
from recycle.prompts import default_prompts

from tests.cli_helpers import run_cli
from tests.helpers import stable_topk
from tests.trained import FIXTURE

V4 = FIXTURE.parent / "deepseek_v4_mtp"
POST = FIXTURE.parent / "deepseek_v4_mtp_posttrained"
NEW = 24


@pytest.fixture(scope="module", autouse=True)
def stable_ties():
    with stable_topk():
        yield


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(load_target(V4))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(V4)
    out = [tok(text, add_special_tokens=False)["input_ids"] for _, text in default_prompts()[:2]]
    assert all(len(ids) > 64 for ids in out)  # past the 32-token window and several compressed entries
    return out


def test_native_chain_is_lossless_and_its_drafts_are_taken(target, prompts):
    masks = MaskCache(torch.float32, "cpu")
    plain = [generate(target, Drafter(), ids, NEW, masks=masks).tokens for ids in prompts]
    engine = load_engine(None, target, masks, tree="chain:2", native=True, target_dir=str(V4))
    target.set_taps(engine.taps)
    runs = [generate(target, engine, ids, NEW, masks=masks) for ids in prompts]
    assert [r.tokens for r in runs] == plain
    assert sum(r.stats.accepted[0] for r in runs) > 0  # trained: the module's drafts are accepted


@pytest.mark.slow  # a distillation, a stitch and three benches: about a minute here
def test_the_transplant_end_to_end(tmp_path):
    """The stale module of the post-trained fixture: converted, re-aligned on its target's streams, stitched back into
    the target, and drafting from the stitched checkpoint as the re-aligned drafter does."""
    eagle, tuned, stitched = tmp_path / "eagle", tmp_path / "tuned", tmp_path / "stitched"
    assert run_cli("convert", str(POST), "--to", "eagle", "-o", str(eagle)).exit_code == 0
    res = run_cli("distill", str(eagle), "--target", str(POST), "--tokens", "4k", "--seq-len", "128",
                  "--batch", "4", "-o", str(tuned), "--json")
    assert res.exit_code == 0, res.output
    res = run_cli("stitch", str(tuned / "mtp_overlay"), "--target", str(POST), "-o", str(stitched), "--json")
    assert res.exit_code == 0, res.output
    with safe_open(str(tuned / "mtp_overlay" / "mtp.safetensors"), "pt") as f, \
            safe_open(str(stitched / "recycle-mtp.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert all(torch.equal(f.get_tensor(n), g.get_tensor(n)) for n in f.keys())
    taus = {}
    for name, drafter, tgt in (("tuned", tuned, POST), ("stitched", stitched, stitched)):
        res = run_cli("bench", str(drafter), "--target", str(tgt), "--tree", "chain:1", "--quick",
                      "--max-new-tokens", "16", "--json")
        assert res.exit_code == 0, res.output
        taus[name] = json.loads(res.stdout)["overall"]["spec"]["tau"]
    assert taus["stitched"] == taus["tuned"]


def test_stitch_into_a_release_that_ships_no_mtp(tmp_path):
    """The V4-Flash-0731 case: a post-trained V4 with no MTP tensors, no depth and `compress_ratios` for its trunk
    only. The base's module goes in; the config gains the depth and the MTP layer's compress ratio from the module's
    source config, and the stitched checkpoint's module is the base's, tensor for tensor."""
    from safetensors.torch import load_file, save_file

    from recycle.mtp import MTP

    bare = tmp_path / "bare"
    bare.mkdir()
    tensors = load_file(str(POST / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(bare / "model.safetensors"))
    cfg = json.loads((POST / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg |= {"num_nextn_predict_layers": 0, "compress_ratios": cfg["compress_ratios"][:layers]}
    (bare / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((POST / name).read_bytes())
    from recycle.audit import inspect_checkpoint

    rep = inspect_checkpoint(bare)  # inspect says what is missing, and the way back
    assert [f.code for f in rep.findings] == ["mtp_absent"] and rep.worst == "info"
    eagle, out = tmp_path / "eagle", tmp_path / "stitched"
    assert run_cli("convert", str(V4), "--to", "eagle", "--layouts", "overlay", "-o", str(eagle)).exit_code == 0
    res = run_cli("stitch", str(eagle / "mtp_overlay"), "--target", str(bare), "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    got = json.loads((out / "config.json").read_text())
    assert got["num_nextn_predict_layers"] == 1
    assert got["compress_ratios"] == cfg["compress_ratios"] + [0]  # the MTP layer's, from the base's config
    base, stitched = MTP.from_checkpoint(V4), MTP.from_checkpoint(out)
    assert stitched.config.mtp_layer_types == ["sliding_attention"]
    theirs = stitched.state_dict()
    for name, a in base.state_dict().items():
        if name.split(".")[-2] not in ("head", "embed"):  # those are the trunk's, post-trained, in the stitched one
            assert torch.equal(a, theirs[name]), name
