"""The committed trained fixture: layout, tokenizer, corpus split, and that its MTP really drafts.

Random MTP weights would pass every layout check, so the decisive test here is agreement of the
MTP's top-1 with the trunk's own greedy token on held-out code: that is what acceptance in
speculative decoding depends on, and it fails for an untrained or mis-wired module.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from recycle.checkpoint import Checkpoint
from recycle.corpus import HELDOUT_PERCENT, documents, is_heldout, split_paths, stdlib_files, stdlib_root
from recycle.families import match
from recycle.mtp import MTP
from tests.trained import FIXTURE, H, L

# Held-out files present in every CPython ≥ 3.11 (the fixture was trained without them).
SNIPPET_FILES = ("heapq.py", "http/client.py", "glob.py", "tomllib/_parser.py", "warnings.py", "uuid.py")
SNIPPET_START, SNIPPET_LEN = 200, 256
# Measured on these snippets after the build: trunk loss 3.94 nats/token, MTP/trunk-greedy agreement
# 0.563 (depth 1) and 0.533 (depth 2); an untrained fixture gives loss 8.3 and agreement ~0. The
# floors sit ~20% below the measurement and far above chance (1/4096).
MIN_AGREE = {1: 0.45, 2: 0.42}
MAX_TRUNK_LOSS = 4.5


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)


# -- corpus ------------------------------------------------------------------------------------


def test_corpus_split_is_deterministic_and_disjoint():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 500
    assert not [f for f in files if {"test", "tests", "site-packages"} & set(f.split("/")[:-1])]
    assert not [f for f in files if f.startswith(("idlelib/idle_test/", "lib2to3/tests/"))]
    train, held = split_paths(files)
    assert not set(train) & set(held) and len(train) + len(held) == len(files)
    assert 0.02 < len(held) / len(files) < 0.10  # ~HELDOUT_PERCENT
    assert split_paths(list(reversed(files))) == (train[::-1], held[::-1])  # membership is per path
    # Pinned values: the hash of the path decides, on every machine.
    assert HELDOUT_PERCENT == 5
    assert [is_heldout(p) for p in ("heapq.py", "glob.py", "os.py", "json/decoder.py", "asyncio/tasks.py")] == [
        True,
        True,
        False,
        False,
        False,
    ]
    held_docs = [d.path for d in documents("heldout")]
    assert set(held_docs) <= set(held) and "heapq.py" in held_docs


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_loads_offline(tokenizer):
    assert len(tokenizer) == 4096
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    code = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n"
    ids = tokenizer(code)["input_ids"]
    assert tokenizer.decode(ids) == code  # byte-level: lossless
    typical = "    def __init__(self, name, value=None):\n        self.name = name\n        return self\n"
    assert len(tokenizer(typical)["input_ids"]) < len(typical) / 3  # a trained BPE, not bytes


# -- layout ------------------------------------------------------------------------------------


def test_fixture_layout_is_deepseek_v3():
    ck = Checkpoint(FIXTURE)
    cfg = ck.config
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_nextn_predict_layers"] == 2
    assert cfg["num_hidden_layers"] == L and cfg["first_k_dense_replace"] == 1
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert min(cfg["qk_nope_head_dim"], cfg["v_head_dim"]) >= 32
    assert ck.bytes_total < 20 * 2**20
    m = match(ck)
    assert m.family.name == "deepseek_v3" and len(m.modules) == 2
    for k in range(2):
        p = f"model.layers.{L + k}."
        for leaf in ("enorm", "hnorm", "shared_head.norm", "embed_tokens", "shared_head.head", "input_layernorm"):
            assert p + leaf + ".weight" in ck.tensors
        assert ck.tensors[p + "eh_proj.weight"].shape == (H, 2 * H)
        for e in range(cfg["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{p}mlp.experts.{e}.{proj}.weight" in ck.tensors
        assert not [n for n in ck.tensors if "gate_up_proj" in n or n.endswith("experts.down_proj")]
        assert ck.tensors[p + "mlp.gate.e_score_correction_bias"].dtype == "F32"
        # DeepSeek stores copies of the trunk's embedding and head in the MTP layer.
        assert torch.equal(ck.raw(p + "embed_tokens.weight"), ck.raw("model.embed_tokens.weight"))
        assert torch.equal(ck.raw(p + "shared_head.head.weight"), ck.raw("lm_head.weight"))
    assert {i.dtype for i in ck.tensors.values()} == {"BF16", "F32"}


def test_trunk_loads_with_transformers_and_only_mtp_is_unexpected():
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(FIXTURE, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}.")) for k in info["unexpected_keys"])


# -- it was really trained -----------------------------------------------------------------------


def _snippets(tokenizer) -> torch.Tensor:
    root = stdlib_root()
    rows = []
    for rel in SNIPPET_FILES:
        assert is_heldout(rel), rel
        ids = tokenizer(root.joinpath(rel).read_text(encoding="utf-8"))["input_ids"]
        rows.append(ids[SNIPPET_START : SNIPPET_START + SNIPPET_LEN + 3])
    return torch.tensor(rows)


def test_mtp_agrees_with_trunk_greedy_on_heldout_code(tokenizer):
    from transformers import DeepseekV3ForCausalLM

    trunk = DeepseekV3ForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    mtp = MTP.from_checkpoint(FIXTURE)
    ids = _snippets(tokenizer)
    t = SNIPPET_LEN
    with torch.no_grad():
        hidden = trunk.model(input_ids=ids[:, :t]).last_hidden_state
        logits = trunk.lm_head(hidden)
        drafts = mtp(hidden, ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1 : t + 1].flatten()).item()
    assert loss < MAX_TRUNK_LOSS, loss
    greedy = logits.argmax(-1)
    for k, lg in enumerate(drafts, start=1):
        # depth k at i predicts t_{i+k+1}; the trunk's greedy guess for it sits at position i+k
        agree = (lg.argmax(-1)[:, : t - k] == greedy[:, k:]).float().mean().item()
        assert agree > MIN_AGREE[k], (k, agree)


def test_build_report_matches_readme():
    report = json.loads((FIXTURE / "build_report.json").read_text())
    ev = report["final_eval_256_windows"]
    readme = (FIXTURE / "README.md").read_text()
    assert f"{ev['heldout_loss']:.3f}" in readme
    assert len(ev["mtp_top1_vs_trunk"]) == 2
