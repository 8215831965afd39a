"""`recycle harvest`: the teacher's features from vLLM (slow; vLLM in the venv recycle manages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recycle.distill.harvest import HarvestOptions, harvest
from recycle.distill.teacher import Teacher
from recycle.distill.train import DistillOptions, distill
from recycle.engines.vllm_env import run_job
from recycle.errors import RecycleError

from tests.trained import TRAINED

pytestmark = pytest.mark.slow
# vLLM 0.32 extracts hidden states through the EAGLE-3 aux-output interface, which Glm4MoeForCausalLM lacks.
VLLM_NO_EXTRACTION = {"glm4_moe": "Model does not support EAGLE3 interface"}


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_vllm_states_equal_transformers_at_every_position(family):
    """vLLM's layer ids (k < L: the stream entering layer k; L: before the final norm) against transformers' fp32
    forward, every position of two windows, and the cache files against the in-process teacher's."""
    d = TRAINED[family]
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    windows = [list(range(100, 164)), list(range(300, 340))]
    import tempfile

    if family in VLLM_NO_EXTRACTION:  # vLLM's refusal, recorded: docs/harvest.md says which targets harvest runs
        with tempfile.TemporaryDirectory() as tmp, pytest.raises(RecycleError, match=VLLM_NO_EXTRACTION[family]):
            run_job({"mode": "harvest", "target": str(d), "windows": windows, "layers": [2, n], "out_dir": tmp},
                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        return
    with tempfile.TemporaryDirectory() as tmp:
        res = run_job({"mode": "harvest", "target": str(d), "windows": windows, "layers": [2, 5, n], "out_dir": tmp},
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        raw = [load_file(f)["hidden_states"] for f in res["files"]]
    teacher = Teacher(d, torch.device("cpu"), [2, 5], "fp32")
    pre: dict = {}
    hook = teacher.decoder.norm.register_forward_hook(lambda m, i, o: pre.__setitem__("x", i[0]))
    for w, hs in zip(windows, raw):
        ids = torch.tensor([w])
        last, aux = teacher.features(ids)
        assert hs.shape == (len(w), 3, last.shape[-1])
        scale = float(pre["x"].abs().max())
        torch.testing.assert_close(hs[:, 0], aux[0, :, : last.shape[-1]], atol=1e-4, rtol=0)
        torch.testing.assert_close(hs[:, 1], aux[0, :, last.shape[-1]:], atol=1e-4, rtol=0)
        assert float((hs[:, 2] - pre["x"][0]).abs().max()) <= 1e-5 * max(scale, 1.0) + 1e-4
    hook.remove()


def test_a_window_as_long_as_the_context_is_extracted():
    """A window of the target's whole context (2,048 positions): vLLM takes it (the slack past the context is allowed,
    `vllm_job.model_len`, since no position past it is computed) and its last layer's states at the far end equal
    transformers' fp32 forward."""
    import tempfile

    d = TRAINED["deepseek_v3"]
    config = json.loads((d / "config.json").read_text())
    n, context = config["num_hidden_layers"], config["max_position_embeddings"]
    window = [(7 * i) % 4000 + 3 for i in range(context)]
    with tempfile.TemporaryDirectory() as tmp:
        res = run_job({"mode": "harvest", "target": str(d), "windows": [window], "layers": [n], "out_dir": tmp},
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        hs = load_file(res["files"][0])["hidden_states"]
    assert hs.shape[0] == context and bool(torch.isfinite(hs).all())
    teacher = Teacher(d, torch.device("cpu"), [], "fp32")
    pre: dict = {}
    hook = teacher.decoder.norm.register_forward_hook(lambda m, i, o: pre.__setitem__("x", i[0]))
    teacher.features(torch.tensor([window]))
    hook.remove()
    far = slice(context - 256, context)
    scale = float(pre["x"][0, far].abs().max())
    assert float((hs[far, 0] - pre["x"][0, far]).abs().max()) <= 1e-5 * max(scale, 1.0) + 1e-4


def test_distilling_from_a_harvested_cache_matches_in_process(tmp_path, converted):
    """Same windows, same options: the loss curve from vLLM's features equals the in-process teacher's (both
    caches hold bf16 features; the harvested one is read at every step)."""
    d = TRAINED["deepseek_v3"]
    e3 = str(converted("eagle3", source=d, eagle3_attention="mla"))
    common = dict(tokens=3000, seq_len=64, batch=4, seed=0)
    aux = tuple(json.loads((Path(e3) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"])
    rec = harvest(HarvestOptions(target=str(d), out=str(tmp_path / "cache"), aux_layers=aux, **common))
    assert rec["tokens"] == 3000
    run = dict(drafter=e3, target=str(d), eval_every=10**6, precision="fp32", threads=2, **common)
    a = distill(DistillOptions(out=str(tmp_path / "a"), cache_hidden=str(tmp_path / "cache"), **run))
    b = distill(DistillOptions(out=str(tmp_path / "b"), cache_hidden=str(tmp_path / "own"), **run))
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert a["cache_hits"] == len(manifest["keys"]) + 1  # every step's windows and the held-out rows
    assert b["cache_hits"] == 0
    assert a["trunk_loaded"] is False and b["trunk_loaded"] is True
    # vLLM wrote the held-out continuations; greedy in fp32, they are transformers' tokens
    assert manifest["eval"]["prompt_len"] == 16 and a["heldout"] == b["heldout"]

    def losses(r: dict) -> list[float]:
        return [json.loads(x)["loss"] for x in (Path(r["state_dir"]) / "metrics.jsonl").read_text().splitlines()]

    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) >= 10
    assert max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 1e-3

    # Online: vLLM stays up and computes each step's windows while distill trains, at most 2 keys ahead;
    # every consumed key file is deleted, so the directory ends with the held-out rows and the manifest.
    c = distill(DistillOptions(out=str(tmp_path / "c"), cache_hidden=str(tmp_path / "online"), online=2, **run))
    assert c["trunk_loaded"] is False and c["online"]["ahead"] == 2
    assert 1 <= c["online"]["max_key_files"] <= 2
    assert sorted(p.name for p in (tmp_path / "online").iterdir()) == ["eval.safetensors", "manifest.json"]
    lc = losses(c)
    assert len(lc) == len(lb) and max(abs(x - y) / abs(y) for x, y in zip(lc, lb)) < 1e-3


def test_self_distill_harvest_matches_in_process(tmp_path, converted):
    """`harvest --self-distill` (greedy): vLLM writes every window after its prompt; distilling from that cache
    follows the in-process self-distillation, whose target writes the same windows with transformers."""
    d = TRAINED["deepseek_v3"]
    eagle = str(converted("eagle", source=d))
    common = dict(tokens=2000, seq_len=64, batch=4, seed=0)
    harvest(HarvestOptions(target=str(d), out=str(tmp_path / "cache"), self_distill=True, prompt_len=16, **common))
    run = dict(drafter=eagle, target=str(d), eval_every=10**6, precision="fp32", threads=2, self_distill=True,
               prompt_len=16, **common)
    a = distill(DistillOptions(out=str(tmp_path / "a"), cache_hidden=str(tmp_path / "cache"), **run))
    b = distill(DistillOptions(out=str(tmp_path / "b"), **run))
    assert a["trunk_loaded"] is False and b["timing"]["generate_s"] > 0 and a["timing"]["generate_s"] == 0

    def losses(r: dict) -> list[float]:
        return [json.loads(x)["loss"] for x in (Path(r["state_dir"]) / "metrics.jsonl").read_text().splitlines()]

    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) >= 7
    # Measured 2026-11-24: vLLM wrote every window token for token as transformers did; the losses differ by
    # 1.6e-3 (relative) at most because the cache holds bf16 features and the in-process teacher fp32 ones.
    assert max(abs(x - y) / abs(y) for x, y in zip(la, lb)) < 3e-3


def test_harvest_self_distill_on_conversations_writes_the_targets_turns_in_vllm(tmp_path, converted):
    """`harvest --self-distill` on chat data: vLLM writes every assistant turn (greedy, turn by turn) as the
    in-process generator does, user turns stay byte for byte, the cache stores each window's assistant mask and the
    regenerated set, and distill trains from it on assistant tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recycle.chat import ChatRenderer, Conversation
    from recycle.distill.data import in_process, regenerate_turns
    from recycle.encode import quiet_transformers

    root = Path(__file__).resolve().parents[2]
    chat, data = root / "fixtures" / "deepseek_v3_mtp_chat", root / "docs" / "chats.jsonl"
    common = dict(tokens=2048, seq_len=128, batch=4, seed=0, data=str(data), self_distill=True)
    harvest(HarvestOptions(target=str(chat), out=str(tmp_path / "cache"), **common))
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["chat"]["assistant_mask"] == "stored with every key"
    regenerated = [json.loads(line)["messages"] for line in (tmp_path / "cache" / "regenerated.jsonl").open()]
    originals = {json.dumps([m for m in json.loads(line)["messages"] if m["role"] != "assistant"])
                 for line in data.open()}
    assert regenerated and all(json.dumps([m for m in r if m["role"] != "assistant"]) in originals for r in regenerated)
    tok = AutoTokenizer.from_pretrained(chat)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(chat, dtype=torch.float32).eval()
    sources = {json.dumps([m for m in json.loads(line)["messages"] if m["role"] != "assistant"]):
               Conversation(tuple(json.loads(line)["messages"])) for line in data.open()}
    sample = [sources[json.dumps([m for m in r if m["role"] != "assistant"])] for r in regenerated[:4]]
    ours = regenerate_turns(in_process(model, tok.pad_token_id), ChatRenderer(tok), sample, 0.0, 0, 128)
    assert [list(c.messages) for c in ours] == regenerated[:4]  # greedy fp32: vLLM's turns are transformers'
    for key in manifest["keys"]:
        assert "assistant_mask" in load_file(str(tmp_path / "cache" / f"{key}.safetensors"))
    e = str(converted("eagle", source=chat))
    rec = distill(DistillOptions(drafter=e, target=str(chat), cache_hidden=str(tmp_path / "cache"), out=str(tmp_path / "o"),
                                 eval_every=10**6, **common))
    assert rec["trunk_loaded"] is False and rec["heldout"]["counted"] == "assistant tokens"
    assert rec["cache_hits"] == len(manifest["keys"]) + 1
