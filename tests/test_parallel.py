"""Parallel heads (issue 14): Meta's layout through the family row's name map, native parallel drafting
(lossless, greedy and sampled), Medusa conversion with calibration, and the bad-input cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from recycle.audit import inspect_checkpoint
from recycle.decoding import Drafter, MaskCache, Target, generate, load_target
from recycle.decoding.drafting import load_engine
from recycle.distill.calibrate import convert_calibrated
from recycle.drafters import MedusaDrafter, load_drafter
from recycle.drafters.parallel import ParallelHeads

from fixtures.build_parallel import PARAMS, ParallelLM, llama_config, save
from tests.cli_helpers import assert_bad_input, run_cli
from tests.helpers import chi2_sf, exact_marginals
from tests.trained import FIXTURE

TINY = dict(PARAMS, dim=64, n_layers=5, n_heads=2, n_kv_heads=2, multiple_of=32)  # layers.0-1 (trunk, head) + 3 extra


def _build(out: Path, params: dict, seed: int = 0, scale: float = 1.0) -> tuple[Path, ParallelLM]:
    torch.manual_seed(seed)
    cfg = llama_config(params)
    model = ParallelLM(cfg, params["n_future_tokens"] - 1).eval()
    with torch.no_grad():
        model.lm.lm_head.weight.mul_(scale)
    save(out, model, cfg, params, tokenizer=FIXTURE if params["vocab_size"] == PARAMS["vocab_size"] else None)
    for p in model.parameters():  # what the file holds: bf16 values
        p.data = p.data.to(torch.bfloat16).float()
    return out, model


@pytest.fixture(scope="module")
def par(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ParallelLM]:
    return _build(tmp_path_factory.mktemp("par") / "ckpt", TINY)


def test_meta_layout_runs_through_transformers_exactly(par) -> None:
    """Meta's names and interleaved rotary rows, mapped by the family row onto transformers' Llama, give
    the training model's logits for every head."""
    d, model = par
    names = set(safe_open(str(d / "model.safetensors"), "pt").keys())
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention.wq.weight",
            "extra_heads.1.feed_forward.w2.weight"} <= names and not any(n.startswith("model.") for n in names)
    assert json.loads((d / "params.json").read_text())["n_future_tokens"] == 4
    ids = torch.randint(3, 4096, (2, 24))
    target = load_target(d)
    heads = ParallelHeads.from_checkpoint(d, target)
    with torch.no_grad():
        ref = model(ids)
        out = target(ids, output_hidden_states=True)
        mine = heads(out.hidden_states[len(target.model.layers) - 1])
    torch.testing.assert_close(out.logits, ref[0], rtol=0, atol=1e-5)
    for k in range(heads.num_heads):
        torch.testing.assert_close(mine[k], ref[k + 1], rtol=0, atol=1e-5)


def test_native_parallel_drafting_is_lossless_and_cached_exactly(par) -> None:
    d, _ = par
    model = load_target(d)
    target = Target(model)
    masks = MaskCache(target.dtype, target.device)
    engine = load_engine(str(d), target, masks, target_dir=str(d))
    target.set_taps(engine.taps)
    assert engine.kind == "parallel-heads"
    prompt = torch.randint(3, 4096, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = generate(target, Drafter(), prompt, 24, masks=masks)
    sp = generate(target, engine, prompt, 24, masks=masks)
    assert sp.tokens == ar.tokens
    # the caches hold exactly the committed trunk states: the heads' rows equal a full forward's
    engine.start(prompt, target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], None,
                                        target.new_cache())[1])
    seen = {}
    engine.heads.features, orig = (lambda *a, **k: seen.setdefault("rows", orig(*a, **k))), engine.heads.features
    engine.propose(prompt[-1])
    h = target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], None, target.new_cache())[1]
    full = ParallelHeads.features(engine.heads, h[engine.taps[0]][None])
    for k, rows in enumerate(seen["rows"]):
        torch.testing.assert_close(rows[0, -1], full[k][0, -1], rtol=0, atol=1e-4)


def test_parallel_drafting_samples_the_target_law(tmp_path: Path) -> None:
    params = dict(TINY, vocab_size=8, dim=32, n_heads=2, n_kv_heads=2, n_layers=4, n_future_tokens=3)
    d, _ = _build(tmp_path / "v8", params, scale=15.0)
    model = load_target(d)
    target = Target(model)
    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(str(d), target, masks, tree="chain:2", target_dir=str(d))
    target.set_taps(engine.taps)
    prompt, runs = [1, 5, 2, 7, 3], 1200
    exact = exact_marginals(model, prompt, 1.0)
    counts = torch.zeros(3, 8, dtype=torch.float64)
    for seed in range(runs):
        g = generate(target, engine, prompt, 3, temperature=1.0, seed=seed, masks=masks)
        for i, t in enumerate(g.tokens[:3]):
            counts[i, t] += 1
    for i in range(3):
        expected = exact[i] * runs
        keep = expected >= 5
        stat = float((((counts[i] - expected) ** 2) / expected.clamp(min=1e-12))[keep].sum())
        assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (i, counts[i].tolist(), expected.tolist())


def test_medusa_from_parallel_heads_calibrated(par, tmp_path: Path) -> None:
    d, _ = par
    out = Path(convert_calibrated(d, "medusa", tmp_path / "m", calibrate=2048, calibrate_steps=60)["out"])
    assert isinstance(load_drafter(out), MedusaDrafter)
    rec = json.loads((out / "recycle.json").read_text())
    for h in rec["calibration"]["heads"]:  # calibration lowers the held-out fit error against the identity
        assert h["calibrated"]["kl"] < h["identity"]["kl"]
    kinds = {r["tensor"]: r["kind"] for r in rec["mapping"] if r["file"] == "model.safetensors"}
    assert kinds["blocks.0.layers.0.weight"] == "approx" and kinds["lm_heads.0.weight"] == "exact"
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # vLLM's MedusaModel key set
        assert set(f.keys()) == {f"blocks.{i}.layers.0.{p}" for i in range(3) for p in ("weight", "bias")} | {
            f"lm_heads.{i}.weight" for i in range(3)}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["num_heads"] == cfg["medusa_num_heads"] == 3
    with safe_open(str(out / "medusa_lm_head.safetensors"), "pt") as f:  # FasterDecoding's key set too
        assert set(f.keys()) == {f"{i}.{j}" for i in range(3) for j in ("0.linear.weight", "0.linear.bias", "1.weight")}
    assert not torch.equal(load_drafter(out).blocks[0].layers[0].weight, torch.zeros(64, 64))


def test_eagle_from_parallel_heads_is_refused(par, tmp_path: Path) -> None:
    d, _ = par
    assert_bad_input(run_cli("convert", str(d), "--to", "eagle", "-o", str(tmp_path / "e")), "sequential")


def test_a_missing_head_is_found_and_refused(par, tmp_path: Path) -> None:
    d, _ = par
    short = tmp_path / "short"
    shutil.copytree(d, short)
    from safetensors.torch import load_file, save_file

    state = {k: v for k, v in load_file(str(short / "model.safetensors")).items() if not k.startswith("extra_heads.2.")}
    save_file(state, str(short / "model.safetensors"))
    assert "mtp_declared_missing" in {f.code for f in inspect_checkpoint(short).findings}
    assert_bad_input(run_cli("convert", str(short), "--to", "medusa", "-o", str(tmp_path / "o")), "missing a head")
    assert not (tmp_path / "o").exists()


def test_calibrating_against_a_target_that_does_not_fit(par, tmp_path: Path) -> None:
    d, _ = par
    res = run_cli("convert", str(d), "--to", "medusa", "-o", str(tmp_path / "o"), "--calibrate", "1k",
                  "--target", str(FIXTURE))
    assert_bad_input(res, "does not fit")
    assert not (tmp_path / "o").exists()


PARALLEL = Path(__file__).resolve().parents[1] / "fixtures" / "meta_mtp_parallel"


@pytest.mark.skipif(not (PARALLEL / "build_report.json").is_file(), reason="the parallel-heads fixture is not built")
def test_the_fixture_heads_reproduce_their_recorded_accuracies() -> None:
    """recycle's runtime path (transformers' Llama through the name map + ParallelHeads) scores the committed
    file's heads on the build's last 64-window evaluation as the build recorded them from its training model."""
    from transformers import AutoTokenizer

    from fixtures.build_trained import eval_starts, token_stream

    report = json.loads((PARALLEL / "build_report.json").read_text())
    recorded = report["history"][-1]
    assert recorded["step"] == report["steps"]
    t, windows = int(report["args"]["seq"]), 64
    held = token_stream(AutoTokenizer.from_pretrained(PARALLEL), "heldout")
    model = load_target(PARALLEL)
    heads = ParallelHeads.from_checkpoint(PARALLEL, model)
    n = heads.num_heads + 1
    starts = eval_starts(len(held), t, windows)
    truth, trunk, cnt = [0] * n, [0] * n, [0] * n
    with torch.no_grad():
        for i in range(0, windows, 16):
            w = torch.stack([held[s : s + t + n] for s in starts[i : i + 16]])
            out = model(w[:, :t], output_hidden_states=True)
            logits = [out.logits, *heads(out.hidden_states[len(model.model.layers) - 1])]
            greedy = logits[0].argmax(-1)
            for k in range(n):
                pred = logits[k].argmax(-1)
                truth[k] += (pred == w[:, k + 1 : k + 1 + t]).sum().item()
                trunk[k] += (pred[:, : t - k] == greedy[:, k:]).sum().item()
                cnt[k] += pred[:, : t - k].numel()
    for k in range(n):  # bf16-rounded stored weights vs the build's fp32 masters under bf16 autocast
        assert abs(truth[k] / (windows * t) - recorded["top1_vs_truth"][k]) < 0.01, k
        assert abs(trunk[k] / cnt[k] - recorded["top1_vs_trunk"][k]) < 0.01, k
    assert recorded["top1_vs_trunk"][1] > 0.3  # the first extra head agrees with the trunk often enough to draft
