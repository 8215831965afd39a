"""`recycle harvest --engine transformers`: DeepSeek-V4's hyper-connection streams in the one cache format (and any
target's features, as distill stores them).

vLLM captures no V4 streams (0.32 hands over their mean), so the transformers engine harvests a V4 target: the
cache must hold, key for key, the bytes an in-process `distill --cache-hidden` run stores (the same loader, hook and
dtype), and a distill from it, with the trunk loaded nowhere, must train exactly as the in-process run reading its
own cache. The engines that cannot feed a V4 drafter refuse in one line, before anything starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recycle.distill import harvest as hv
from recycle.distill.teacher import STREAMS_KEY
from recycle.distill.train import DistillOptions, distill
from recycle.options import HarvestOptions

from tests.cli_helpers import assert_bad_input, run_cli

V4 = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v4_mtp"
RUN = dict(target=str(V4), tokens=2048, seq_len=64, batch=8, precision="fp32")


@pytest.fixture(scope="module")
def v4_eagle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v4") / "eagle"
    assert run_cli("convert", str(V4), "--to", "eagle", "-o", str(out)).exit_code == 0
    return out


@pytest.fixture(scope="module")
def harvested(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("v4") / "cache"
    return out, hv.harvest(HarvestOptions(out=str(out), engine="transformers", **RUN))


def _losses(rec: dict) -> list[float]:
    return [json.loads(x)["loss"] for x in (Path(rec["state_dir"]) / "metrics.jsonl").read_text().splitlines()]


def test_the_cache_is_what_distill_stores_and_trains_without_the_trunk(harvested, v4_eagle, tmp_path) -> None:
    cache, rec = harvested
    manifest = json.loads((cache / "manifest.json").read_text())
    assert rec["complete"] and rec["engine"] == "transformers" and rec["streams"] == manifest["streams"] == 4
    assert manifest["eval"]["continuation"] == "transformers greedy"
    own = tmp_path / "own"
    run = dict(drafter=str(v4_eagle), **RUN)
    first = distill(DistillOptions(out=str(tmp_path / "first"), cache_hidden=str(own), **run))  # stores as it trains
    stored = sorted(p.name for p in own.glob("*.safetensors"))
    assert stored and first["trunk_loaded"]
    for name in stored:  # the bytes, key for key: ids and streams [n, T, C, H]; the last state is not stored
        a, b = load_file(str(own / name)), load_file(str(cache / name))
        assert a[STREAMS_KEY].shape == (8, 64, 4, 128) and a[STREAMS_KEY].dtype == torch.bfloat16
        assert "last" not in a and "last" not in b, name
        for k in ("input_ids", STREAMS_KEY):
            assert torch.equal(a[k], b[k]), (name, k)
    again = distill(DistillOptions(out=str(tmp_path / "again"), cache_hidden=str(own), **run))
    cached = distill(DistillOptions(out=str(tmp_path / "cached"), cache_hidden=str(cache), **run))
    assert not cached["trunk_loaded"] and cached["cache_hits"] >= len(stored)
    assert _losses(cached) == _losses(again)  # the same features, read back: the same steps
    one, two = _losses(first), _losses(cached)  # against features never rounded to bf16
    assert len(one) == len(two) >= 4 and max(abs(x - y) / abs(y) for x, y in zip(one, two)) < 1e-3


def test_the_last_state_is_mixed_back_from_the_stored_streams_by_the_trunks_own_tail(harvested) -> None:
    """A stream cache holds no last state: a teacher that never loads the trunk mixes it from the stored streams with
    the trunk's hc_head and norm read alone from the checkpoint (`TrunkTail.from_checkpoint`). That is what the loaded
    trunk's own modules compute from the same streams, exactly, and the trunk's unrounded last state but for the
    streams' bf16 rounding."""
    from recycle.distill.teacher import Teacher
    from recycle.mtp.deepseek_v4 import TrunkTail

    cache, _ = harvested
    key = sorted(p.stem for p in cache.glob("*.safetensors"))[0]
    stored = load_file(str(cache / f"{key}.safetensors"))
    ids = stored["input_ids"]
    cpu = torch.device("cpu")
    reader = Teacher(str(V4), cpu, precision="fp32", cache_dir=cache, trunk=False, streams=True)
    last, streams = reader._load(key, ids)
    assert torch.equal(streams, stored[STREAMS_KEY].float())
    whole = Teacher(str(V4), cpu, precision="fp32", streams=True)
    with torch.no_grad():
        assert torch.equal(last, TrunkTail.of(whole.decoder)(streams))
        unrounded, _ = whole.features(ids)
    err = ((last - unrounded).norm() / unrounded.norm()).item()
    assert 0 < err < 3e-3, err  # stored in bf16, the last state was about 0.16% off (BENCHMARKS.md)


def test_a_killed_transformers_harvest_resumes_to_the_same_bytes(harvested, monkeypatch, tmp_path) -> None:
    cache, _ = harvested
    real, calls = hv._Job.store_local, []

    def dies_on_the_third(self, dest, ids, mask=None):
        calls.append(dest.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(self, dest, ids, mask)

    monkeypatch.setattr(hv._Job, "store_local", dies_on_the_third)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        hv.harvest(HarvestOptions(out=str(out), engine="transformers", **RUN))
    assert len(list(out.glob("*.safetensors"))) == 2 and not (out / "manifest.json").exists()
    monkeypatch.setattr(hv._Job, "store_local", real)
    rec = hv.harvest(HarvestOptions(out=str(out), engine="transformers", **RUN))
    assert rec["complete"] and rec["keys_resumed"] == 2
    names = sorted(p.name for p in cache.iterdir() if p.is_file())
    assert names == sorted(p.name for p in out.iterdir() if p.is_file())
    assert all((out / n).read_bytes() == (cache / n).read_bytes() for n in names)


def test_what_cannot_feed_a_v4_drafter_refuses_in_one_line(harvested, v4_eagle, tmp_path) -> None:
    cache, _ = harvested
    why = "vLLM 0.32 captures neither"
    args = ["harvest", "--target", str(V4), "--tokens", "2k", "-o", str(tmp_path / "c")]
    assert_bad_input(run_cli(*args), why)
    assert_bad_input(run_cli(*args, "--plan"), why)
    assert_bad_input(run_cli("teacher", "serve", str(V4), "--shared-dir", str(tmp_path / "hs"), "--print"), why)
    distill_args = ["distill", str(v4_eagle), "--target", str(V4), "--tokens", "2k", "--seq-len", "64",
                    "-o", str(tmp_path / "d")]
    assert_bad_input(run_cli(*distill_args, "--teacher", "http://127.0.0.1:9"), why)
    assert_bad_input(run_cli(*args, "--engine", "transformers", "--tensor-parallel-size", "2"),
                     "vLLM's parallel options")
    assert_bad_input(run_cli(*args, "--device", "cpu"), "--engine transformers'")
    flat = tmp_path / "flat"  # a cache without the streams (as a vLLM harvest would have been)
    shutil.copytree(cache, flat)
    manifest = json.loads((flat / "manifest.json").read_text())
    (flat / "manifest.json").write_text(json.dumps(manifest | {"streams": 0}))
    assert_bad_input(run_cli(*distill_args, "--seq-len", "64", "--batch", "8", "--cache-hidden", str(flat)),
                     "holds no hyper-connection streams")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_the_plan_counts_the_streams(tmp_path) -> None:
    res = run_cli("harvest", "--target", str(V4), "--engine", "transformers", "--tokens", "1M", "--seq-len", "64",
                  "--batch", "8", "--plan", "--json", "-o", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    hidden, streams = 128, 4
    assert d["streams"] == streams and d["cache_bytes_per_token"] == 8 + hidden * 2 * streams  # no last state
    assert d["scheme"] == "bf16, dequantized" and not (tmp_path / "c").exists()


def test_a_harvest_read_as_it_is_written_keeps_n_keys_and_trains_the_same(harvested, v4_eagle, tmp_path) -> None:
    """`harvest --ahead 2` beside `distill --follow` (a thread here; other GPUs or nodes in use): the manifest and the
    held-out rows come first, at most 2 keys are ever on disk, each is deleted once read, and the run's loss at every
    step is the one a distill from the finished harvest gives."""
    import threading

    cache, _ = harvested
    run = dict(drafter=str(v4_eagle), **RUN)
    whole = distill(DistillOptions(out=str(tmp_path / "whole"), cache_hidden=str(cache), **run))
    shared = tmp_path / "shared"
    done: list = []
    producer = threading.Thread(target=lambda: done.append(hv.harvest(HarvestOptions(
        out=str(shared), engine="transformers", ahead=2, **RUN))))
    producer.start()
    try:
        followed = distill(DistillOptions(out=str(tmp_path / "followed"), cache_hidden=str(shared), follow=True, **run))
    finally:
        producer.join(timeout=120)
    assert done and done[0]["complete"]
    assert not followed["trunk_loaded"] and followed["online"]["max_key_files"] <= 2
    assert _losses(followed) == _losses(whole)
    assert sorted(p.name for p in shared.iterdir()) == [".follow.json", "eval.safetensors", "manifest.json"]


def test_a_restarted_harvest_skips_what_the_follower_read(tmp_path) -> None:
    out = tmp_path / "c"
    out.mkdir()
    (out / hv.FOLLOW).write_text(json.dumps({"step": 3}))  # distill --follow waits for step 3
    rec = hv.harvest(HarvestOptions(out=str(out), engine="transformers", ahead=8, **RUN))
    assert rec["complete"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["eval.safetensors", "s00000003r0f.safetensors"]


def test_follow_and_ahead_refuse_what_would_lose_windows(harvested, v4_eagle, tmp_path) -> None:
    cache, _ = harvested
    distill_args = ["distill", str(v4_eagle), "--target", str(V4), "--tokens", "2k", "--seq-len", "64", "--batch", "8",
                    "-o", str(tmp_path / "d")]
    assert_bad_input(run_cli(*distill_args, "--follow"), "--follow reads a harvest in --cache-hidden DIR")
    assert_bad_input(run_cli(*distill_args, "--cache-hidden", str(cache), "--follow"),
                     "a finished harvest (made without --ahead)")
    args = ["harvest", "--target", str(V4), "--tokens", "2k", "-o", str(tmp_path / "c")]
    assert_bad_input(run_cli(*args, "--ahead", "2"), "--ahead: one --engine transformers harvest, unsharded")
    assert_bad_input(run_cli(*args, "--engine", "transformers", "--ahead", "2", "--shard", "0/2"), "unsharded")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


@pytest.mark.slow  # two spawned gloo ranks beside a harvest thread (20 s here)
def test_two_gloo_ranks_follow_a_harvest_as_one_process(harvested, v4_eagle, tmp_path) -> None:
    """Under torchrun (2 gloo ranks, --batch 4 each) a `--follow` distill beside `harvest --ahead 2` (its global batch
    8): each rank reads its rows of every key, rank 0 deletes a key once both have passed its step, and the loss curve
    is the one-process run's on the finished harvest (within 2e-3, as tests/test_family_v4.py's two ranks)."""
    import threading

    import torch.multiprocessing as mp

    from tests import helpers

    cache, _ = harvested
    one = distill(DistillOptions(drafter=str(v4_eagle), out=str(tmp_path / "one"), cache_hidden=str(cache), **RUN))
    shared = tmp_path / "shared"
    done: list = []
    producer = threading.Thread(target=lambda: done.append(hv.harvest(HarvestOptions(
        out=str(shared), engine="transformers", ahead=2, **RUN))))
    producer.start()
    queue = mp.get_context("spawn").SimpleQueue()
    run = dict(RUN, batch=4, drafter=str(v4_eagle), cache_hidden=str(shared), follow=True, out=str(tmp_path / "two"))
    try:
        mp.spawn(helpers.distill_rank, args=(2, helpers.free_port(), run, queue), nprocs=2, join=True)
    finally:
        producer.join(timeout=300)
    two = next(rec for _, rec in (queue.get() for _ in range(2)) if rec is not None)
    assert done and done[0]["complete"] and two["online"]["max_key_files"] <= 2
    la, lb = _losses(one), _losses(two)
    print(f"2 ranks against one process: {len(la)} steps, largest relative loss difference "
          f"{max(abs(x - y) / abs(y) for x, y in zip(la, lb)):.2e}, at most {two['online']['max_key_files']} keys")
    assert len(la) == len(lb) >= 4 and max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 2e-3
    assert sorted(p.name for p in shared.iterdir()) == [".follow.json", "eval.safetensors", "manifest.json"]


@pytest.mark.parametrize("mode", ["eagle3", "self_distill"])
def test_the_transformers_engine_writes_what_distill_stores_for_any_target(mode, tmp_path) -> None:
    """Not only V4: on the DeepSeek-V3 fixture the transformers engine stores, key for key, what an in-process
    `distill --cache-hidden` run stores: an EAGLE-3 drafter's aux layers, and with `--self-distill` (greedy) the rows
    the target continued, written by the same `generate`."""
    from tests.trained import FIXTURE

    drafter = tmp_path / "d"
    assert run_cli("convert", str(FIXTURE), "--to", "eagle3" if mode == "eagle3" else "eagle", "-o",
                   str(drafter)).exit_code == 0
    common = dict(target=str(FIXTURE), tokens=768, seq_len=48, batch=4, precision="fp32")
    extra = dict(self_distill=True, prompt_len=16, sd_temperature=0.0) if mode == "self_distill" else {}
    aux = tuple(json.loads((drafter / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids") or ())
    hv.harvest(HarvestOptions(out=str(tmp_path / "h"), engine="transformers", aux_layers=aux, **common, **extra))
    distill(DistillOptions(drafter=str(drafter), out=str(tmp_path / "o"), cache_hidden=str(tmp_path / "own"), **common,
                           **extra))
    stored = sorted(p.name for p in (tmp_path / "own").glob("s*.safetensors"))
    assert stored
    for name in stored:
        a, b = load_file(str(tmp_path / "own" / name)), load_file(str(tmp_path / "h" / name))
        assert ("aux" in a) == (mode == "eagle3") and STREAMS_KEY not in b
        for k in ("input_ids", "last", *(("aux",) if mode == "eagle3" else ())):
            assert torch.equal(a[k], b[k]), (name, k)


def test_a_resumed_follower_deletes_the_keys_it_will_never_read(tmp_path) -> None:
    """`distill --follow --resume` at step 2: the keys before it go unread (the harvest would otherwise wait on them,
    holding N keys nobody reads); the step it waits for is posted for the harvest; other ranks only read."""
    out = tmp_path / "c"
    out.mkdir()
    names = [f"s{s:08d}r0f.safetensors" for s in range(4)] + ["eval.safetensors"]
    for n in names:
        (out / n).write_bytes(b"x")
    hv.Follower(out, main=False).begin(2)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    hv.Follower(out).begin(2)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["eval.safetensors", names[2], names[3]]
    assert hv.follow_position(out) == 2
