"""`recycle convert`: every format on the trained fixture and on family fixtures, the lossless EAGLE
path, engine key sets, provenance, atomic writing, and bad input (exit 2, one stderr line)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from recycle.checkpoint import Checkpoint
from recycle.converters.api import convert_checkpoint
from recycle.drafters import Eagle3Drafter, EagleDrafter, MedusaDrafter, load_drafter
from recycle.errors import RecycleError
from recycle.families import match
from recycle.formats.eagle3 import fold_aux_layers
from recycle.mtp import MTP

from tests import helpers
from tests.cli_helpers import assert_bad_input, run_cli
from tests.trained import FIXTURE, H, L

# What vLLM's llama_eagle3.py loads for a one-layer drafter without embed_tokens (read from
# vllm-project/vllm vllm/model_executor/models/llama_eagle3.py, 0.32): every parameter of
# Eagle3LlamaForCausalLM after `midlayer.`→`layers.0.`; `draft_id_to_target_id` (from `d2t`) exists
# only when draft_vocab_size != vocab_size, and a `d2t` without it is refused ("There is no module or
# parameter named 'draft_id_to_target_id'"); `t2d` is skipped, `embed_tokens` optional. Its default
# loader fails on any parameter left unloaded.
VLLM_EAGLE3_REQUIRED = frozenset({
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight",
})
VLLM_EAGLE3_REDUCED_VOCAB = frozenset({"d2t", "t2d"})
VLLM_EAGLE3_OPTIONAL = frozenset({"embed_tokens.weight"})
# vLLM's deepseek_eagle3.py (Eagle3DeepseekV2ForCausalLM, 0.32): the same outer tensors, the midlayer's
# attention as DeepseekV2MLAAttention (q_a_proj and kv_a_proj_with_mqa fused on load, both 2h wide).
VLLM_EAGLE3_MLA = (VLLM_EAGLE3_REQUIRED - {f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"}) | {
    f"midlayer.self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                               "kv_a_layernorm", "kv_b_proj")}
FAMILIES = ("deepseek_v3_fp8", "qwen3_next", "mimo")


def tree_digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()






@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`convert(source, fmt, **opts)` → output dir, each made once per module."""
    root = tmp_path_factory.mktemp("converted")
    cache: dict = {}

    def get(source: Path, fmt: str, **opts) -> Path:
        key = (str(source), fmt, tuple(sorted(opts.items())))
        if key not in cache:
            out = root / f"{Path(source).name}-{fmt}-{len(cache)}"
            convert_checkpoint(source, fmt, out, **opts)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="module")
def mtp():
    return MTP.from_checkpoint(FIXTURE)


def _inputs(t: int = 10, extra: int = 2, h: int = H, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, t, h, generator=g), torch.randint(3, 4096, (2, t + extra), generator=g)


# -- EAGLE (lossless) ---------------------------------------------------------------------------


def test_eagle_first_step_logits_equal_mtp(converted, mtp):
    d = converted(FIXTURE, "eagle", dtype="fp32")
    drafter = load_drafter(d)
    assert isinstance(drafter, EagleDrafter) and drafter.depth == mtp.depth
    hidden, ids = _inputs()
    with torch.no_grad():
        want, got = mtp(hidden, ids).logits, drafter(hidden, ids).logits
    assert (got[0] - want[0]).abs().max().item() <= 1e-5
    assert (got[1] - want[1]).abs().max().item() <= 1e-5  # within the stored depth every step is exact


def test_eagle_drafts_deeper_than_stored_depth(converted, mtp):
    drafter = load_drafter(converted(FIXTURE, "eagle", dtype="fp32"))
    hidden, ids = _inputs(extra=1)
    steps = mtp.depth + 2
    drafts = drafter.draft(hidden, ids, steps=steps)
    assert drafts.shape == (2, steps)
    assert drafter.layer_for(steps - 1) is drafter.layers[-1]
    # Step k feeds the token drafted at step k-1: replaying the chain through the MTP modules
    # (depths 1..n) reproduces the drafter's first n tokens.
    chain = torch.cat([ids, drafts], dim=1)
    with torch.no_grad():
        logits = mtp(hidden, chain[:, : ids.shape[1] + mtp.depth - 1]).logits
    for k in range(mtp.depth):
        assert torch.equal(logits[k][:, -1].argmax(-1), drafts[:, k])
    # Past the depth: the last module again, on the chained state and the drafted tokens.
    with torch.no_grad():
        out = drafter(hidden, chain[:, : ids.shape[1] + steps - 1], steps=steps)
    assert torch.equal(out.logits[-1][:, -1].argmax(-1), drafts[:, -1])


def test_eagle_nextn_and_overlay_layouts(converted):
    d = converted(FIXTURE, "eagle")
    src = Checkpoint(FIXTURE)
    L = src.config["num_hidden_layers"]
    cfg = json.loads((d / "nextn" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLMNextN"]
    assert cfg["num_hidden_layers"] == 1 and cfg["num_nextn_predict_layers"] == 1
    assert "quantization_config" not in cfg
    nextn = load_file(d / "nextn" / "nextn_layer_parameters.safetensors")
    module0 = {n for n in src.tensors if n.startswith(f"model.layers.{L}.")}
    want = {n.replace(f"model.layers.{L}.", "model.layers.0.") for n in module0
            if not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    assert set(nextn) == want
    for leaf in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
        assert torch.equal(nextn[f"model.layers.0.{leaf}.weight"], src.get(f"model.layers.{L}.{leaf}.weight"))
    index = json.loads((d / "nextn" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == want
    assert (d / "nextn" / "tokenizer.json").is_file() and (d / "tokenizer.json").is_file()
    overlay = load_file(d / "mtp_overlay" / "mtp.safetensors")
    assert set(overlay) == set(match(src).mtp_names)
    assert all(torch.equal(t, src.raw(n)) for n, t in overlay.items())
    frag = json.loads((d / "mtp_overlay" / "mtp.safetensors.index.json").read_text())
    assert set(frag["weight_map"]) == set(overlay) and frag["metadata"]["modules"] == 2


def test_stitch_overlay_back_into_target(converted, tmp_path, mtp):
    d = converted(FIXTURE, "eagle")
    before = tree_digest(FIXTURE)
    res = run_cli("stitch", str(d / "mtp_overlay"), str(FIXTURE), "-o", str(tmp_path / "st"), "--json")
    assert res.exit_code == 0, res.output
    assert tree_digest(FIXTURE) == before
    st, src = Checkpoint(tmp_path / "st"), Checkpoint(FIXTURE)
    assert set(st.tensors) == set(src.tensors)
    assert all(torch.equal(st.raw(n), src.raw(n)) for n in src.tensors)
    assert st.tensors[f"model.layers.{L}.eh_proj.weight"].file == "recycle-mtp.safetensors"
    hidden, ids = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(MTP.from_checkpoint(st.path)(hidden, ids).logits[0], mtp(hidden, ids).logits[0])


# -- every format on family fixtures --------------------------------------------------------------


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("fmt", ["eagle", "eagle3", "medusa"])
def test_formats_on_families(family_dir, converted, variant, fmt):
    src_dir = family_dir(variant)
    d = converted(src_dir, fmt)
    src = Checkpoint(src_dir)
    m = match(src)
    h = m.config["hidden_size"]
    rec = json.loads((d / "recycle.json").read_text())
    assert rec["source"]["family"] == m.family.name and rec["target"]["format"] == fmt
    state = load_file(d / "model.safetensors")
    assert all(t.dtype in (torch.bfloat16, torch.int64, torch.bool) for t in state.values())
    assert all(torch.isfinite(t.float()).all() for t in state.values())
    mod = m.modules[0]
    if fmt == "eagle":
        stored = {r: src.get(mod.tensor(r), torch.float32) for r in ("embed_norm", "proj")}
        want_norm = stored["embed_norm"] + (1 if m.family.run.norm == "1+w" else 0)
        torch.testing.assert_close(state["layers.0.embed_norm.weight"].float(), want_norm.to(torch.bfloat16).float())
        p = stored["proj"]
        want_proj = torch.cat([p[:, h:], p[:, :h]], 1) if m.family.run.concat_order == "he" else p
        assert torch.equal(state["layers.0.proj.weight"], want_proj.to(torch.bfloat16))
        for rel, full in mod.block_names().items():
            if not rel.endswith("_scale_inv"):
                assert torch.equal(state[f"layers.0.block.{rel}"], src.get(full).to(torch.bfloat16)), rel
        assert (d / "nextn").is_dir() == (m.family.exports.nextn_architecture is not None)
        overlay = safe_open(d / "mtp_overlay" / "mtp.safetensors", "pt")
        assert set(overlay.keys()) == set(m.mtp_names)  # FP8 weights keep their scales, byte for byte
        if variant == "deepseek_v3_fp8":
            nextn = safe_open(d / "nextn" / "nextn_layer_parameters.safetensors", "pt")
            assert not any(k.endswith("_scale_inv") for k in nextn.keys())
            assert any(src.tensors[k].is_fp8 for k in overlay.keys())
            assert isinstance(load_drafter(d), EagleDrafter)
    elif fmt == "eagle3":
        assert set(state) == VLLM_EAGLE3_REQUIRED
        assert state["fc.weight"].shape == (h, 3 * h)
        assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
        assert isinstance(load_drafter(d), Eagle3Drafter)
    else:
        assert isinstance(load_drafter(d), MedusaDrafter)
        assert torch.equal(state["lm_heads.0.weight"], src.get(mod.tensor("head")).to(torch.bfloat16))


# -- EAGLE-3 ------------------------------------------------------------------------------------


def test_eagle3_key_set_shapes_and_config(converted):
    d = converted(FIXTURE, "eagle3")
    state = load_file(d / "model.safetensors")
    assert VLLM_EAGLE3_REQUIRED <= set(state) <= VLLM_EAGLE3_REQUIRED | VLLM_EAGLE3_OPTIONAL
    assert "embed_tokens.weight" not in state
    cfg = json.loads((d / "config.json").read_text())
    h, v = H, 4096
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == v and cfg["num_hidden_layers"] == 1 and "bias" not in cfg
    assert cfg["speculators_model_type"] == "eagle3"
    sc = cfg["speculators_config"]
    assert sc["default_proposal_method"] == sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert Path(sc["verifier"]["name_or_path"]) == FIXTURE and sc["verifier"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["transformer_layer_config"]["vocab_size"] == v
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert ids == fold_aux_layers(L) and len(set(ids)) == 3 and max(ids) == L - 1  # the last captured state
    hd, heads = cfg["head_dim"], cfg["num_attention_heads"]
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (heads * hd, 2 * h)
    assert state["midlayer.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert state["lm_head.weight"].shape == (v, h) and not set(state) & VLLM_EAGLE3_REDUCED_VOCAB
    assert not state["fc.weight"][:, : 2 * h].any()  # only the deepest aux slot carries eh_proj's hidden half
    src = Checkpoint(FIXTURE)
    assert torch.equal(state["norm.weight"], src.get(f"model.layers.{L}.shared_head.norm.weight"))
    assert torch.equal(state["midlayer.input_layernorm.weight"], src.get(f"model.layers.{L}.enorm.weight"))
    drafter = load_drafter(d)
    hidden, ids = _inputs()
    logits, _ = drafter(torch.randn(2, 10, 3 * h), inputs_embeds=src.get("lm_head.weight").float()[ids[:, 1:11]])
    assert logits.shape == (2, 10, v)
    assert fold_aux_layers(61) == [2, 30, 60] and fold_aux_layers(4) == [1, 2, 3]
    rec = json.loads((d / "recycle.json").read_text())
    kinds = {r["tensor"]: r["kind"] for r in rec["mapping"]}
    assert kinds["norm.weight"] == kinds["lm_head.weight"] == "exact"
    assert kinds["fc.weight"] == kinds["midlayer.self_attn.q_proj.weight"] == "approx"


def test_eagle3_draft_vocab(converted, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50 + "import os\nprint(os.getcwd())\n" * 20)
    d = converted(FIXTURE, "eagle3", draft_vocab=64, vocab_corpus=str(corpus))
    state = load_file(d / "model.safetensors")
    assert set(state) == VLLM_EAGLE3_REQUIRED | VLLM_EAGLE3_REDUCED_VOCAB
    d2t, t2d = state["d2t"], state["t2d"]
    assert d2t.shape == (64,) and d2t.dtype == torch.int64 and t2d.shape == (4096,) and int(t2d.sum()) == 64
    target = torch.arange(64) + d2t  # target id = draft id + d2t[draft id]
    assert torch.all(target[1:] > target[:-1]) and t2d[target].all()
    head = Checkpoint(FIXTURE).get(f"model.layers.{L}.shared_head.head.weight")
    assert torch.equal(state["lm_head.weight"], head[target])
    from tokenizers import Tokenizer

    seen = set(Tokenizer.from_file(str(FIXTURE / "tokenizer.json")).encode(corpus.read_text(),
                                                                          add_special_tokens=False).ids)
    assert len(seen) <= 64 and seen <= set(target.tolist())  # every corpus token made the cut
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64
    drafter = load_drafter(d)
    full = drafter.to_target_logits(torch.randn(1, 2, 64))
    assert torch.isinf(full[0, 0, ~t2d]).all() and torch.isfinite(full[0, 0, t2d]).all()


@pytest.mark.parametrize("n", ["0", "4097"])
def test_eagle3_draft_vocab_out_of_range_exits_2(tmp_path, n):
    res = run_cli("convert", str(FIXTURE), "--to", "eagle3", "--draft-vocab", n, "-o", str(tmp_path / "out"))
    assert res.exit_code == 2 and "--draft-vocab must be between 1 and the vocabulary size 4096" in res.stderr
    assert not (tmp_path / "out").exists()


def test_eagle3_mla_variant_keeps_the_blocks_attention(converted):
    """`--eagle3-attention mla`: vLLM's DeepSeek EAGLE-3 key set and config; the MLA tensors copied
    unchanged except the two input projections, which take [emb; hidden] (2h)."""
    d = converted(FIXTURE, "eagle3", eagle3_attention="mla")
    state = load_file(d / "model.safetensors")
    assert set(state) == VLLM_EAGLE3_MLA
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2" and cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64 and cfg["num_hidden_layers"] == 1
    src = Checkpoint(FIXTURE)
    a = f"model.layers.{L}.self_attn."
    for n in ("q_b_proj", "kv_b_proj", "kv_a_layernorm", "q_a_layernorm", "o_proj"):
        assert torch.equal(state[f"midlayer.self_attn.{n}.weight"], src.get(f"{a}{n}.weight"))
    for n in ("q_a_proj", "kv_a_proj_with_mqa"):
        w = state[f"midlayer.self_attn.{n}.weight"]
        assert w.shape[1] == 2 * H and torch.equal(w[:, H:], src.get(f"{a}{n}.weight"))
    drafter = load_drafter(d)
    assert type(drafter.midlayer.self_attn).__name__ == "DeepseekV3Attention"
    hidden, ids = _inputs()
    logits, _ = drafter(torch.randn(2, 10, 3 * H), inputs_embeds=src.get("lm_head.weight").float()[ids[:, 1:11]])
    assert logits.shape == (2, 10, 4096) and torch.isfinite(logits).all()


def test_eagle3_mla_needs_an_mla_source(tmp_path):
    from fixtures.families import build

    src = build("mimo", tmp_path / "src")
    res = run_cli("convert", str(src), "--to", "eagle3", "--eagle3-attention", "mla", "-o", str(tmp_path / "out"))
    assert res.exit_code == 2 and "needs an MLA source" in res.stderr and not (tmp_path / "out").exists()


SPECULATORS_RUN = """
import sys, json, torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
inputs, work, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
x = load_file(inputs)
report = {}
for i, d in enumerate(dirs):
    cfg = SpeculatorModelConfig.from_pretrained(d)
    cfg.transformer_layer_config._attn_implementation = "eager"
    m = SpeculatorModel.from_pretrained(d, config=cfg).float().eval()
    sd, stored = m.state_dict(), load_file(d + "/model.safetensors")
    got = {}
    with torch.no_grad():
        m.embed_tokens.weight.copy_(x["embed"])  # recycle's EAGLE-3 reads the target's embedding
        hook = m.lm_head.register_forward_hook(lambda mod, inp, o: got.setdefault("logits", o))
        m(hidden_states=x["aux"], input_ids=x["ids"], document_ids=torch.zeros_like(x["ids"]), ttt_steps=1)
        hook.remove()
    save_file({"logits": got["logits"].contiguous()}, f"{work}/logits{i}.safetensors")
    m.save_pretrained(f"{work}/saved{i}")
    report[d] = {"cls": type(m).__name__, "absent": sorted(k for k in stored if k not in sd),
                 "differ": sorted(k for k in stored if k in sd and not torch.equal(sd[k].to(stored[k].dtype), stored[k]))}
print(json.dumps(report))
"""


def test_eagle3_loads_in_speculators_with_its_names_and_gives_our_logits(converted, tmp_path):
    """speculators 0.9.0 (separate cached venv) reads `layers.0.*`: with `--eagle3-names speculators` every stored
    tensor lands on its parameter and its first draft step's logits equal recycle's (fp32, eager attention, the
    target's embedding in both); a directory speculators saves loads back in recycle with the same logits. The
    default (`midlayer.*`, SGLang's) is measured too: speculators leaves that layer initialised at random."""
    sys.path.insert(0, str(Path(__file__).parent))
    import validators
    from safetensors.torch import save_file

    try:
        py = validators.speculators_python()
    except validators.Unreachable as e:
        pytest.skip(f"PyPI unreachable, cannot install speculators: {e}")
    official = converted(FIXTURE, "eagle3", draft_vocab=512)
    ours = tmp_path / "spec"
    assert run_cli("convert", str(FIXTURE), "--to", "eagle3", "--draft-vocab", "512", "--eagle3-names", "speculators",
                   "-o", str(ours)).exit_code == 0
    assert {k.split(".")[0] for k in load_file(ours / "model.safetensors")} >= {"layers", "fc", "lm_head"}
    g = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(1, 12, 3 * H, generator=g), torch.randint(0, 4096, (1, 12), generator=g)
    embed = Checkpoint(FIXTURE).get("model.embed_tokens.weight").float()
    save_file({"aux": aux, "ids": ids, "embed": embed}, str(tmp_path / "in.safetensors"))
    (tmp_path / "run.py").write_text(SPECULATORS_RUN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    res = helpers.run([str(py), str(tmp_path / "run.py"), str(tmp_path / "in.safetensors"), str(tmp_path),
                       str(official), str(ours)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report[str(official)]["absent"] == sorted(
        k for k in load_file(official / "model.safetensors") if k.startswith("midlayer."))
    assert report[str(ours)] == {"cls": "Eagle3DraftModel", "absent": [], "differ": []}
    theirs = load_file(str(tmp_path / "logits1.safetensors"))["logits"]
    with torch.no_grad():
        mine, _ = load_drafter(ours)(aux, inputs_embeds=torch.nn.functional.embedding(ids, embed))
        back, _ = load_drafter(tmp_path / "saved1")(aux, input_ids=ids)  # speculators' own save, read here
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=0)
    torch.testing.assert_close(back, mine, atol=1e-4, rtol=0)


# -- Medusa -------------------------------------------------------------------------------------


def test_medusa_both_layouts(converted):
    d = converted(FIXTURE, "medusa", heads=4)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["num_heads"] == cfg["medusa_num_heads"] == 4
    assert cfg["num_hidden_layers"] == cfg["medusa_num_layers"] == 1 and cfg["medusa_fc_bias"] is True
    assert cfg["hidden_size"] == H and cfg["vocab_size"] == 4096 and Path(cfg["base_model_name_or_path"]) == FIXTURE
    vllm = load_file(d / "model.safetensors")
    fd = load_file(d / "medusa_lm_head.safetensors")
    assert set(vllm) == {f"blocks.{i}.layers.0.{p}" for i in range(4) for p in ("weight", "bias")} | {
        f"lm_heads.{i}.weight" for i in range(4)}
    assert set(fd) == {f"{i}.0.linear.{p}" for i in range(4) for p in ("weight", "bias")} | {
        f"{i}.1.weight" for i in range(4)}
    src = Checkpoint(FIXTURE)
    for i in range(4):
        head = src.get(f"model.layers.{L + min(i, 1)}.shared_head.head.weight")
        assert torch.equal(vllm[f"lm_heads.{i}.weight"], head) and torch.equal(fd[f"{i}.1.weight"], head)
        assert not vllm[f"blocks.{i}.layers.0.weight"].any() and not fd[f"{i}.0.linear.bias"].any()
    drafter = load_drafter(d)
    h = torch.randn(1, 3, H)
    torch.testing.assert_close(drafter(h)[0], h @ src.get("lm_head.weight").float().T)  # ResBlock = identity
    assert drafter.draft(h).shape == (1, 4)


# -- provenance, atomicity, bad input --------------------------------------------------------------


def test_recycle_json(converted):
    d = converted(FIXTURE, "eagle")
    rec = json.loads((d / "recycle.json").read_text())
    assert rec["recycle_version"] and rec["created"].endswith("+00:00")
    assert rec["source"]["path"] == str(FIXTURE) and rec["source"]["family"] == "deepseek_v3"
    assert rec["source"]["modules"] == 2 and rec["source"]["fp8"] is False
    assert rec["target"]["format"] == "eagle" and rec["target"]["dtype"] == "bfloat16"
    assert set(rec["target"]["layouts"]) == {"model.safetensors", "nextn/", "mtp_overlay/"}
    written = {}
    for f in ("model.safetensors", "nextn/nextn_layer_parameters.safetensors", "mtp_overlay/mtp.safetensors"):
        written.update({(f, k): None for k in safe_open(d / f, "pt").keys()})
    assert {(r["file"], r["tensor"]) for r in rec["mapping"]} == set(written)
    assert all(r["kind"] in ("exact", "approx", "fresh") for r in rec["mapping"])
    assert rec["summary"]["exact"] == rec["summary"]["tensors"] == len(written)
    row = next(r for r in rec["mapping"] if r["tensor"] == "layers.1.proj.weight")
    assert row["from"] == [f"model.layers.{L + 1}.eh_proj.weight"]


def test_cli_json_overwrite_and_source_untouched(tmp_path):
    before = tree_digest(FIXTURE)
    out = tmp_path / "out"
    res = run_cli("convert", str(FIXTURE), "--to", "medusa", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["format"] == "medusa"
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "medusa", "-o", str(out)), "already exists")
    (out / "marker").write_text("old")
    res = run_cli("convert", str(FIXTURE), "--to", "eagle3", "-o", str(out), "--overwrite")
    assert res.exit_code == 0, res.output
    assert not (out / "marker").exists() and json.loads((out / "recycle.json").read_text())["target"]["format"] == "eagle3"
    assert tree_digest(FIXTURE) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary siblings left


def test_failure_mid_write_leaves_nothing(family_dir, tmp_path):
    out = tmp_path / "out"
    res = run_cli("convert", str(family_dir("deepseek_v3_nan")), "--to", "eagle", "-o", str(out))
    assert_bad_input(res, "NaN")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # --overwrite keeps the old output when the new one fails
    convert_checkpoint(FIXTURE, "medusa", out)
    before = tree_digest(out)
    assert_bad_input(run_cli("convert", str(family_dir("deepseek_v3_nan")), "--to", "eagle", "-o", str(out),
                             "--overwrite"), "NaN")
    assert tree_digest(out) == before and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("args, needle", [
    (["--to", "eagle"], "stores no MTP module"),
])
def test_declared_but_missing(family_dir, tmp_path, args, needle):
    res = run_cli("convert", str(family_dir("minimax_m2_declared_missing")), *args, "-o", str(tmp_path / "o"))
    assert_bad_input(res, needle)


def test_bad_inputs(family_dir, tmp_path):
    o = str(tmp_path / "o")
    assert_bad_input(run_cli("convert", str(tmp_path / "nope"), "--to", "eagle", "-o", o), "no such checkpoint")
    assert_bad_input(run_cli("convert", str(family_dir("deepseek_v3_bad_shape")), "--to", "eagle", "-o", o), "shape")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle2", "-o", o), "unknown format")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "--dtype", "fp8", "-o", o), "unknown dtype")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "--heads", "2", "-o", o), "--heads")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle3", "--draft-vocab", "0", "-o", o), "--draft-vocab")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "medusa", "--heads", "0", "-o", o), "--heads")
    assert_bad_input(run_cli("convert", str(family_dir("meta_mtp")), "--to", "eagle", "-o", o), "sequential")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(FIXTURE / "sub")), "inside")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(FIXTURE)), "inside")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(blocker)), "not a directory")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "-o", str(blocker / "sub")), "cannot write")
    nontok = tmp_path / "notok"
    shutil.copytree(family_dir("deepseek_v3"), nontok)
    assert_bad_input(run_cli("convert", str(nontok), "--to", "eagle3", "--draft-vocab", "8", "-o", o), "tokenizer.json")
    assert not Path(o).exists()


# -- FP8 dequantization, the NaN/Inf scan, byte copies, --layouts ----------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so equality is bit for bit (torch.equal says -0.0 == 0.0)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _dequant_by_definition(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """W.float() * S with S expanded to W's shape: the definition, done the slow way."""
    w, s = ckpt.raw(name), ckpt.raw(name + "_scale_inv")
    b0, b1 = ckpt.block_size()
    return w.float() * s.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: w.shape[0], : w.shape[1]]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fp8_dequantization_is_bit_exact(family_dir, converted, dtype):
    src_dir = family_dir("deepseek_v3_fp8")
    src = Checkpoint(src_dir)
    state = load_file(converted(src_dir, "eagle", dtype=dtype) / "model.safetensors")
    fp8 = {rel: full for rel, full in match(src).modules[0].block_names().items() if src.tensors[full].is_fp8}
    assert len(fp8) >= 5 and any(src.tensors[n].shape[0] % 128 for n in fp8.values())  # ragged blocks too
    for rel, full in fp8.items():
        want = _dequant_by_definition(src, full)
        assert torch.equal(_bits(src.get(full, torch.float32)), _bits(want)), full
        assert torch.equal(_bits(torch.cat(list(src.iter_chunks(full, max_elements=1)))), _bits(want)), full
        got = state[f"layers.0.block.{rel}"]  # the float32 product rounded once into the output's dtype
        assert torch.equal(_bits(got), _bits(want.to(got.dtype))), full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_scan_finds_every_code(dtype):
    from recycle.converters.roles import FINITE_CHUNK, check_finite

    big = torch.finfo(dtype).max
    ok = torch.tensor([0.0, -0.0, big, -big, torch.finfo(dtype).tiny], dtype=dtype)
    assert check_finite(ok, "ok") is ok
    for bad in (float("nan"), -float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(FINITE_CHUNK + 3, dtype=dtype)
        t[-1] = bad  # in the last slice
        with pytest.raises(RecycleError, match="NaN or Inf"):
            check_finite(t, "t")


def test_overlay_bytes_copied_without_kernel_copy(family_dir, tmp_path, monkeypatch):
    """Where copy_file_range is refused (other filesystems, old kernels) the bytes are read and written."""
    import errno

    from recycle.checkpoint import Span
    from recycle.io.writer import copy_span

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")

    src_dir = family_dir("deepseek_v3_fp8")
    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    convert_checkpoint(src_dir, "eagle", tmp_path / "o", layouts="overlay")
    src = Checkpoint(src_dir)
    overlay = Checkpoint(tmp_path / "o" / "mtp_overlay")
    assert set(overlay.tensors) == set(match(src).mtp_names)
    assert all(torch.equal(_bits(overlay.raw(n)), _bits(src.raw(n))) for n in overlay.tensors)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    with open(tmp_path / "dst", "wb", buffering=0) as f, pytest.raises(RecycleError, match="ends before byte 6"):
        copy_span(Span(short, 1, 5), f)
    monkeypatch.undo()
    with open(tmp_path / "dst", "wb", buffering=0) as f:
        copy_span(Span(short, 1, 2), f)
        with pytest.raises(RecycleError, match="ends before byte 6"):
            copy_span(Span(short, 1, 5), f)
    assert (tmp_path / "dst").read_bytes() == b"bcbc"


def test_eagle_layouts_option(converted, tmp_path):
    full = converted(FIXTURE, "eagle")
    res = run_cli("convert", str(FIXTURE), "--to", "eagle", "--layouts", "recycle", "-o", str(tmp_path / "r"), "--json")
    assert res.exit_code == 0, res.output
    r = tmp_path / "r"
    assert sorted(json.loads(res.stdout)["files"]) == sorted(p.name for p in r.iterdir())
    assert not (r / "nextn").exists() and not (r / "mtp_overlay").exists()
    assert (r / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    rec = json.loads((r / "recycle.json").read_text())
    assert set(rec["target"]["layouts"]) == {"model.safetensors"} and rec["target"]["options"]["layouts"] == ["recycle"]
    assert {row["file"] for row in rec["mapping"]} == {"model.safetensors"}
    assert isinstance(load_drafter(r), EagleDrafter)
    both = convert_checkpoint(FIXTURE, "eagle", tmp_path / "b", layouts=["overlay", "nextn"])
    b = tmp_path / "b"
    assert not (b / "model.safetensors").exists() and not (b / "config.json").exists()
    for rel in ("nextn/nextn_layer_parameters.safetensors", "mtp_overlay/mtp.safetensors"):
        assert (b / rel).read_bytes() == (full / rel).read_bytes()
    rec = json.loads((b / "recycle.json").read_text())
    assert set(rec["target"]["layouts"]) == {"nextn/", "mtp_overlay/"}
    assert rec["target"]["options"]["layouts"] == ["nextn", "overlay"] and both["bytes"] < dir_bytes(full)
    assert json.loads((full / "recycle.json").read_text())["target"]["options"]["layouts"] == [
        "recycle", "nextn", "overlay"]


def test_eagle_layouts_bad_values(family_dir, tmp_path):
    o = str(tmp_path / "o")
    for bad in ("foo", "recycle,foo", "", ","):
        assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "eagle", "--layouts", bad, "-o", o), "--layouts")
    assert_bad_input(run_cli("convert", str(FIXTURE), "--to", "medusa", "--layouts", "recycle", "-o", o), "--layouts")
    assert_bad_input(run_cli("convert", str(family_dir("mimo")), "--to", "eagle", "--layouts", "nextn", "-o", o),
                     "nothing to write")
    assert not Path(o).exists()


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
