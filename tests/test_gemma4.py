"""Gemma 4 assistants (`recycle.drafters.gemma4`): drafting from the target's own KV cache, exactly as
transformers runs them, lossless in recycle's decoder, trained as the decoder drafts, and bad input refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recycle.decoding import MaskCache, Target, generate, load_target
from recycle.decoding.drafting import Drafter, load_engine
from recycle.decoding.drafting.gemma4_assistant import AssistantEngine
from recycle.drafters import load_drafter
from recycle.drafters.gemma4 import new_assistant, step
from recycle.formats.gemma4_assistant import assistant_kv_modes

from tests.cli_helpers import assert_bad_input, run_cli
from tests.helpers import chi2_sf, exact_marginals

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TARGET, ASSISTANT = FIXTURES / "gemma4_target", FIXTURES / "gemma4_assistant"
POSTTRAINED = FIXTURES / "gemma4_target_posttrained"


@pytest.fixture(scope="module")
def pair():
    model = load_target(TARGET)
    return model, load_drafter(ASSISTANT)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    texts = ["def read_config(path):\n    with open(path", "class Cache:\n    def __init__(self, size):\n",
             "The module provides functions to", "    for key, value in sorted(items.items()):\n"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_workaround_builds_an_assistant_and_restores_transformers():
    from transformers import Gemma4TextConfig

    before = Gemma4TextConfig.__dict__["kv_sharing_modes"]
    a = load_drafter(ASSISTANT)
    assert all(lyr.self_attn.is_kv_shared_layer for lyr in a.model.layers)
    assert Gemma4TextConfig.__dict__["kv_sharing_modes"] is before
    with assistant_kv_modes():
        assert a.config.get_text_config().kv_sharing_modes == ["reuse"] * len(a.model.layers)


def test_a_step_is_transformers_own_forward(pair, prompts):
    """`step` with an explicit mask equals Gemma4AssistantForCausalLM.forward on the target's shared K/V."""
    model, a = pair
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, return_shared_kv_states=True)
        p = ids.shape[1] - 1
        kv = {k: (v[0][..., :p, :], v[1][..., :p, :]) for k, v in out.shared_kv_states.items()}
        x = torch.cat([model.get_input_embeddings()(ids[:, p:]), out.hidden_states[-1][:, p - 1 : p]], dim=-1)
        ref = a(inputs_embeds=x, position_ids=torch.tensor([[p]]), shared_kv_states=kv)
        logits, state = step(a, x, torch.tensor([[p]]), kv, None)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, ref.last_hidden_state, rtol=0, atol=1e-5)


def test_first_round_drafts_equal_transformers_candidate_generator(pair, prompts):
    """After the prefill, recycle's chain equals transformers' SinglePositionMultiTokenCandidateGenerator's."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    model, a = pair
    target = Target(model)
    engine = AssistantEngine(a, 4, MaskCache(torch.float32, "cpu"), target)
    target.set_taps(engine.taps)
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, return_shared_kv_states=True)
        root = int(out.logits[0, -1].argmax())
        a.generation_config.num_assistant_tokens = 4
        gen = SinglePositionMultiTokenCandidateGenerator(a, model.get_input_embeddings(), GenerationConfig(max_length=512))
        full = torch.cat([ids, torch.tensor([[root]])], dim=1)
        cand, _ = gen.get_candidates(full, {}, out, is_first_iteration=False, n_last_matches=0)
        theirs = cand[0, full.shape[1]:].tolist()
        cache = target.new_cache()
        engine.bind(cache)
        with torch.no_grad():
            _, feats = target.forward(ids, torch.arange(len(p))[None], None, cache)
        engine.start(p, feats)
        assert engine.propose(root).tokens[1:] == theirs


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,2,8"])
def test_native_assistant_is_lossless_and_accepts(pair, prompts, tree):
    model, _ = pair
    target = Target(model)
    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(str(ASSISTANT), target, masks, tree=tree, target_dir=str(TARGET))
    target.set_taps(engine.taps)
    taus = []
    for p in prompts:
        ar = generate(target, Drafter(), p, 48, masks=masks)
        sp = generate(target, engine, p, 48, masks=masks)
        assert sp.tokens == ar.tokens
        taus.append(sp.stats.tau)
    assert sum(taus) / len(taus) > 1.8, taus  # a trained assistant: well above one token per step


def test_decoder_greedy_equals_transformers_generate_with_the_assistant(pair, prompts):
    model, a = pair
    target = Target(model)
    a.generation_config.num_assistant_tokens = 4
    for p in prompts[:2]:
        ids = torch.tensor([p])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                            assistant_model=a)
        assert hf[0, len(p):].tolist() == generate(target, Drafter(), p, 24).tokens


def _tiny_pair(vocab: int = 8):
    from transformers import Gemma4AssistantConfig, Gemma4ForCausalLM, Gemma4TextConfig

    from fixtures.build_gemma4 import ASSISTANT_TEXT, TARGET

    torch.manual_seed(0)
    small = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab)
    target = Gemma4ForCausalLM(Gemma4TextConfig(**(TARGET | small))).eval()
    text = Gemma4TextConfig(**(ASSISTANT_TEXT | {"vocab_size": vocab}))
    return target, new_assistant(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=TARGET["hidden_size"])).eval()


@pytest.mark.slow  # 1,200 sampled runs, ~80 s; greedy losslessness through the same engine stays in the default run
def test_assistant_sampling_follows_the_target_law():
    model, a = _tiny_pair()
    target = Target(model)
    masks = MaskCache(torch.float32, "cpu")
    engine = AssistantEngine(a, 2, masks, target)
    target.set_taps(engine.taps)
    prompt, runs = [1, 5, 2, 7, 3], 1200
    exact = exact_marginals(model, prompt, 1.0)
    counts = torch.zeros(3, 8, dtype=torch.float64)
    accepted = 0
    for seed in range(runs):
        g = generate(target, engine, prompt, 3, temperature=1.0, seed=seed, masks=masks)
        for i, t in enumerate(g.tokens[:3]):
            counts[i, t] += 1
        accepted += sum(g.stats.accepted)
    assert accepted > runs // 10
    for i in range(3):
        expected = exact[i] * runs
        keep = expected >= 5
        stat = float((((counts[i] - expected) ** 2) / expected.clamp(min=1e-12))[keep].sum())
        assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (i, counts[i].tolist(), expected.tolist())


def test_training_rows_are_the_decoder_s_rows(pair, prompts):
    """Anchor i of a training step k (distill's unroller) is what the decoder computes at position i+1 at chain
    step k, and the teacher's logits are the target's own (soft-capped)."""
    from recycle.distill.losses import step_terms
    from recycle.distill.teacher import Teacher
    from recycle.distill.unroll import make_unroller

    model, a = pair
    teacher = Teacher(TARGET, torch.device("cpu"), precision="fp32", kv=True)
    unroller = make_unroller("gemma4-assistant", a, 3, teacher.embed)
    ids = torch.tensor([prompts[1]])
    n = ids.shape[1]
    with torch.no_grad():
        te = teacher(ids)
        torch.testing.assert_close(te.logits(te.last[0]), model(ids).logits[0].float(), rtol=0, atol=1e-5)
        steps = unroller.unroll(ids, te.last, None, te.logits, kv=te.kv)
        i = unroller.positions(n) // 2  # the decoder: root t_{i+1} at position i+1, state h_i, K/V of positions ≤ i
        kv = {k: (v[0][..., : i + 1, :], v[1][..., : i + 1, :]) for k, v in te.kv.items()}
        x = torch.cat([teacher.embed(ids[:, i + 1 : i + 2]), te.last[:, i : i + 1]], dim=-1)
        for k in range(3):
            logits, state = step(a, x, torch.tensor([[i + 1]]), kv, None)
            torch.testing.assert_close(steps[k].logits()[0][i], logits[0, 0], rtol=0, atol=1e-4)
            x = torch.cat([teacher.embed(ids[:, i + k + 2 : i + k + 3]), state], dim=-1)
    agree = float(step_terms(steps[0], grad=False)["agree"])
    assert agree > 0.5  # the trained assistant agrees with its target's greedy token most of the time


def test_distill_realigns_the_assistant_in_its_own_layout(tmp_path):
    """`recycle distill ASSISTANT --target POSTTRAINED` writes the assistant's own files (same keys, dtypes,
    config), which transformers' own class loads, with the run recorded in recycle.json."""
    from safetensors import safe_open
    from transformers import Gemma4AssistantForCausalLM

    out = tmp_path / "realigned"
    res = run_cli("distill", str(ASSISTANT), "--target", str(POSTTRAINED), "--tokens", "4096", "--seq-len", "128",
                  "--batch", "4", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["tokens"] == 4096 and len(rec["final"]["heldout_agreement_before"]) == 4

    def header(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}

    assert header(out) == header(ASSISTANT)
    assert json.loads((out / "config.json").read_text()) == json.loads((ASSISTANT / "config.json").read_text())
    assert json.loads((out / "recycle.json").read_text())["distillation"][0]["target"] == str(POSTTRAINED.resolve())
    with assistant_kv_modes():  # transformers 5.23.0 needs the workaround to build any assistant
        Gemma4AssistantForCausalLM.from_pretrained(out)
    load_drafter(out)


def test_bench_cli_reports_the_assistant(tmp_path):
    res = run_cli("bench", str(ASSISTANT), "--target", str(TARGET), "--quick", "--max-new-tokens", "16",
                  "--tree", "chain:3", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["drafter_kind"] == "gemma4-assistant"
    assert rep["overall"]["greedy_match"] == "4/4"


def test_a_gemma_target_as_its_own_drafter_names_the_assistant():
    res = run_cli("bench", str(TARGET), "--target", str(TARGET), "--max-new-tokens", "4")
    assert_bad_input(res, "assistant")


@pytest.mark.parametrize("key,value,needle", [("backbone_hidden_size", 64, "backbone_hidden_size 64"),
                                              ("vocab_size", 5000, "vocabulary 5000")])
def test_an_assistant_that_does_not_fit_is_refused(tmp_path, key, value, needle):
    bad = tmp_path / "assistant"
    shutil.copytree(ASSISTANT, bad)
    cfg = json.loads((bad / "config.json").read_text())
    if key == "vocab_size":
        cfg["text_config"]["vocab_size"] = value
        # the embedding must still load: make the weights the size the config says
        from safetensors.torch import load_file, save_file

        state = load_file(str(bad / "model.safetensors"))
        e = state["model.embed_tokens.weight"]
        state["model.embed_tokens.weight"] = torch.cat([e, e[: value - e.shape[0]]])
        save_file(state, str(bad / "model.safetensors"))
    else:
        cfg[key] = value
        from safetensors.torch import load_file, save_file

        state = load_file(str(bad / "model.safetensors"))
        w = state["pre_projection.weight"]
        state["pre_projection.weight"] = w[:, : 2 * value].contiguous()
        state["post_projection.weight"] = state["post_projection.weight"][:value].contiguous()
        save_file(state, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(cfg))
    res = run_cli("bench", str(bad), "--target", str(TARGET), "--max-new-tokens", "4")
    assert_bad_input(res, needle)


def test_corrupt_assistant_weights_are_refused(tmp_path):
    bad = tmp_path / "assistant"
    shutil.copytree(ASSISTANT, bad)
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:1000])
    res = run_cli("bench", str(bad), "--target", str(TARGET), "--max-new-tokens", "4")
    assert_bad_input(res, "safetensors")


def test_inspect_says_the_assistant_is_a_drafter_already():
    res = run_cli("inspect", str(ASSISTANT), "--json")
    assert res.exit_code == 0, res.output
    assert "already_drafter" in res.stdout


@pytest.fixture(scope="module")
def long_ids(pair, prompts):
    """Past the sliding window (512 in the fixture): the prompts' ids in turn, window + 96 of them."""
    window = pair[1].config.get_text_config().sliding_window
    ids = [t for _ in range(window) for p in prompts for t in p]
    return ids[: window + 96]


def test_past_the_sliding_window_the_assistant_reads_the_window_s_keys(pair, long_ids):
    """Past its window the assistant drafts (before, recycle refused): its sliding layers read the `window` keys
    before the query, its full layers every key; a round equals `step` on exactly those keys, and not on every
    key (so the window decides here); decoding stays lossless."""
    model, a = pair
    window = a.config.get_text_config().sliding_window
    target = Target(model)
    engine = AssistantEngine(a, 3, MaskCache(torch.float32, "cpu"), target)
    target.set_taps(engine.taps)
    p = long_ids
    cache = target.new_cache()
    engine.bind(cache)
    with torch.no_grad():
        _, feats = target.forward(torch.tensor([p]), torch.arange(len(p))[None], None, cache)
        root = 7
        engine.start(p, feats)
        got = engine.propose(root).tokens[1:]
        C, full = len(p), {t: (cache.layers[i].keys, cache.layers[i].values) for t, i in engine.sources.items()}

        def chain(first: int) -> list[int]:
            kv = {t: (k[..., (first if t == "sliding_attention" else 0):C, :],
                      v[..., (first if t == "sliding_attention" else 0):C, :]) for t, (k, v) in full.items()}
            x, out = torch.cat([target.embed(torch.tensor([[root]])), feats["last"][-1:][None]], dim=-1), []
            for _ in range(3):
                logits, state = step(a, x, torch.tensor([[C]]), kv, None)
                out.append(int(logits[0, -1].argmax()))
                x = torch.cat([target.embed(torch.tensor([[out[-1]]])), state], dim=-1)
            return out

        assert got == chain(C - window)
        logits_all = step(a, torch.cat([target.embed(torch.tensor([[root]])), feats["last"][-1:][None]], dim=-1),
                          torch.tensor([[C]]), {t: (k[..., :C, :], v[..., :C, :]) for t, (k, v) in full.items()},
                          None)[0]
        logits_win = step(a, torch.cat([target.embed(torch.tensor([[root]])), feats["last"][-1:][None]], dim=-1),
                          torch.tensor([[C]]), {t: (k[..., (C - window if t == "sliding_attention" else 0):C, :],
                                                    v[..., (C - window if t == "sliding_attention" else 0):C, :])
                                                for t, (k, v) in full.items()}, None)[0]
        assert (logits_all - logits_win).abs().max() > 1e-3
    masks = MaskCache(torch.float32, "cpu")
    sp, ar = generate(target, engine, p, 24, masks=masks), generate(target, Drafter(), p, 24, masks=masks)
    assert sp.tokens == ar.tokens and sp.stats.tau > 1.0


def test_past_the_window_training_rows_are_the_decoder_s_rows(pair, long_ids):
    """Distill's rows past the window read what the decoder reads there: the window's keys on sliding layers."""
    from recycle.distill.teacher import Teacher
    from recycle.distill.unroll import make_unroller

    model, a = pair
    window = a.config.get_text_config().sliding_window
    teacher = Teacher(TARGET, torch.device("cpu"), precision="fp32", kv=True)
    unroller = make_unroller("gemma4-assistant", a, 2, teacher.embed)
    ids = torch.tensor([long_ids])
    with torch.no_grad():
        te = teacher(ids)  # its cache keeps every key of the sliding layers: the target's logits are still its own
        torch.testing.assert_close(te.logits(te.last[0]), model(ids).logits[0].float(), rtol=0, atol=1e-5)
        steps = unroller.unroll(ids, te.last, None, te.logits, kv=te.kv)
        i = window + 40  # the decoder: root t_{i+1} at position i+1, state h_i, K/V of positions ≤ i in the window
        kv = {k: (v[0][..., (i + 1 - window if k == "sliding_attention" else 0): i + 1, :],
                  v[1][..., (i + 1 - window if k == "sliding_attention" else 0): i + 1, :]) for k, v in te.kv.items()}
        x = torch.cat([teacher.embed(ids[:, i + 1 : i + 2]), te.last[:, i : i + 1]], dim=-1)
        for k in range(2):
            logits, state = step(a, x, torch.tensor([[i + 1]]), kv, None)
            torch.testing.assert_close(steps[k].logits()[0][i], logits[0, 0], rtol=0, atol=1e-4)
            x = torch.cat([teacher.embed(ids[:, i + k + 2 : i + k + 3]), state], dim=-1)
