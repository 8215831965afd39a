"""The committed trained fixtures: layout, tokenizer, corpus split, and that their MTP really drafts.

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

from tests.trained import FIXTURE, TRAINED, H, L

# Held-out files present in every CPython ≥ 3.11 (the fixture was trained without them).
SNIPPET_FILES = ("heapq.py", "http/client.py", "glob.py", "tomllib/_parser.py", "warnings.py", "uuid.py")
SNIPPET_START, SNIPPET_LEN = 200, 256
# Measured on these snippets after the builds (DeepSeek: trunk loss 3.94 nats/token, MTP/trunk-greedy
# agreement 0.563 at depth 1 and 0.533 at depth 2; GLM: 4.29 nats/token and 0.603 at depth 1); an
# untrained fixture gives loss 8.3 and agreement ~0. The floors sit ~20% below the measurement and far
# above chance (1/4096).
MIN_AGREE = {"deepseek_v3": {1: 0.45, 2: 0.42}, "glm4_moe": {1: 0.48}}
MAX_TRUNK_LOSS = 4.5
# Layout facts per fixture: the config keys that decide how engines run it.
LAYOUT = {
    "deepseek_v3": {"model_type": "deepseek_v3", "num_nextn_predict_layers": 2, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "glm4_moe": {"model_type": "glm4_moe", "num_nextn_predict_layers": 1, "num_key_value_heads": 2, "head_dim": 32,
                 "attention_bias": True, "use_qk_norm": True},
}


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


def test_fixtures_share_the_tokenizer():
    for d in TRAINED.values():
        assert (d / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer.json").read_bytes()


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


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_fixture_layout(family):
    ck = Checkpoint(TRAINED[family])
    cfg = ck.config
    assert {k: cfg.get(k) for k in LAYOUT[family]} == LAYOUT[family]
    assert cfg["num_hidden_layers"] == L and cfg["first_k_dense_replace"] == 1 and cfg["hidden_size"] == H
    assert ck.bytes_total < 20 * 2**20
    m = match(ck)
    depth = cfg["num_nextn_predict_layers"]
    assert m.family.name == family and len(m.modules) == depth
    if family == "glm4_moe":  # GLM-4.5's block: GQA with biases and q/k norms, partial rotary
        p = f"model.layers.{L}.self_attn."
        assert {f"{p}{n}" for n in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "q_norm.weight", "k_norm.weight")
                } <= set(ck.tensors)
        assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    for k in range(depth):
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


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_trunk_loads_with_transformers_and_only_mtp_is_unexpected(family):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(TRAINED[family], output_loading_info=True)
    assert type(model).__name__ == Checkpoint(TRAINED[family]).config["architectures"][0]
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


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_mtp_agrees_with_trunk_greedy_on_heldout_code(tokenizer, family):
    from transformers import AutoModelForCausalLM

    trunk = AutoModelForCausalLM.from_pretrained(TRAINED[family], dtype=torch.float32).eval()
    mtp = MTP.from_checkpoint(TRAINED[family])
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
        assert agree > MIN_AGREE[family][k], (k, agree)


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_build_report_matches_readme(family):
    report = json.loads((TRAINED[family] / "build_report.json").read_text())
    ev = report["final_eval_256_windows"]
    readme = (TRAINED[family] / "README.md").read_text()
    assert f"{ev['heldout_loss']:.3f}" in readme
    assert len(ev["mtp_top1_vs_trunk"]) == Checkpoint(TRAINED[family]).config["num_nextn_predict_layers"]
