"""`recycle convert`: every format on the trained fixture and on family fixtures, the lossless EAGLE
path, engine key sets, provenance, atomic writing, and bad input (exit 2, one stderr line)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tests.cli_helpers import assert_bad_input, run_cli

from converters.api import convert_checkpoint
from converters.eagle3 import aux_layer_ids
from recycle.checkpoint import Checkpoint
from recycle.drafters import Eagle3Drafter, EagleDrafter, MedusaDrafter, load_drafter
from recycle.families import match
from recycle.mtp import MTP

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_mtp"

# What vLLM's llama_eagle3.py loads for a one-layer drafter without embed_tokens (read from
# vllm-project/vllm vllm/model_executor/models/llama_eagle3.py): every parameter of
# Eagle3LlamaForCausalLM after `midlayer.`→`layers.0.`, `d2t`→`draft_id_to_target_id`; `t2d` is
# skipped, `embed_tokens` optional. Its default loader fails on any parameter left unloaded.
VLLM_EAGLE3_REQUIRED = frozenset({
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t",
})
VLLM_EAGLE3_OPTIONAL = frozenset({"t2d", "embed_tokens.weight"})
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


def _inputs(t: int = 10, extra: int = 2, h: int = 192, seed: int = 0):
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
    assert st.tensors["model.layers.3.eh_proj.weight"].file == "recycle-mtp.safetensors"
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
        want_norm = stored["embed_norm"] + (1 if m.family.norm == "1+w" else 0)
        torch.testing.assert_close(state["layers.0.embed_norm.weight"].float(), want_norm.to(torch.bfloat16).float())
        p = stored["proj"]
        want_proj = torch.cat([p[:, h:], p[:, :h]], 1) if m.family.concat_order == "he" else p
        assert torch.equal(state["layers.0.proj.weight"], want_proj.to(torch.bfloat16))
        for rel, full in mod.block_names().items():
            if not rel.endswith("_scale_inv"):
                assert torch.equal(state[f"layers.0.block.{rel}"], src.get(full).to(torch.bfloat16)), rel
        assert (d / "nextn").is_dir() == (m.family.nextn_architecture is not None)
        overlay = safe_open(d / "mtp_overlay" / "mtp.safetensors", "pt")
        assert set(overlay.keys()) == set(m.mtp_names)  # FP8 weights keep their scales, byte for byte
        if variant == "deepseek_v3_fp8":
            nextn = safe_open(d / "nextn" / "nextn_layer_parameters.safetensors", "pt")
            assert not any(k.endswith("_scale_inv") for k in nextn.keys())
            assert any(src.tensors[k].is_fp8 for k in overlay.keys())
            assert isinstance(load_drafter(d), EagleDrafter)
    elif fmt == "eagle3":
        assert set(state) == VLLM_EAGLE3_REQUIRED | {"t2d"}
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
    h, v = 192, 4096
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == v and cfg["num_hidden_layers"] == 1 and "bias" not in cfg
    assert cfg["speculators_model_type"] == "eagle3"
    sc = cfg["speculators_config"]
    assert sc["default_proposal_method"] == sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert Path(sc["verifier"]["name_or_path"]) == FIXTURE and sc["verifier"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["transformer_layer_config"]["vocab_size"] == v
    assert cfg["eagle_aux_hidden_state_layer_ids"] == aux_layer_ids(3) == [0, 1, 2]
    hd, heads = cfg["head_dim"], cfg["num_attention_heads"]
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (heads * hd, 2 * h)
    assert state["midlayer.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert state["lm_head.weight"].shape == (v, h) and state["d2t"].dtype == torch.int64
    assert not state["d2t"].any() and state["t2d"].all()
    assert not state["fc.weight"][:, : 2 * h].any()  # only the deepest aux slot carries eh_proj's hidden half
    src = Checkpoint(FIXTURE)
    assert torch.equal(state["norm.weight"], src.get("model.layers.3.shared_head.norm.weight"))
    assert torch.equal(state["midlayer.input_layernorm.weight"], src.get("model.layers.3.enorm.weight"))
    drafter = load_drafter(d)
    hidden, ids = _inputs()
    logits, _ = drafter(torch.randn(2, 10, 3 * h), inputs_embeds=src.get("lm_head.weight").float()[ids[:, 1:11]])
    assert logits.shape == (2, 10, v)
    assert aux_layer_ids(61) == [2, 30, 60] and aux_layer_ids(4) == [1, 2, 3]
    rec = json.loads((d / "recycle.json").read_text())
    kinds = {r["tensor"]: r["kind"] for r in rec["mapping"]}
    assert kinds["norm.weight"] == kinds["lm_head.weight"] == "exact"
    assert kinds["fc.weight"] == kinds["midlayer.self_attn.q_proj.weight"] == "approx"


def test_eagle3_draft_vocab(converted, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50 + "import os\nprint(os.getcwd())\n" * 20)
    d = converted(FIXTURE, "eagle3", draft_vocab=64, vocab_corpus=str(corpus))
    state = load_file(d / "model.safetensors")
    d2t, t2d = state["d2t"], state["t2d"]
    assert d2t.shape == (64,) and t2d.shape == (4096,) and int(t2d.sum()) == 64
    target = torch.arange(64) + d2t  # target id = draft id + d2t[draft id]
    assert torch.all(target[1:] > target[:-1]) and t2d[target].all()
    head = Checkpoint(FIXTURE).get("model.layers.3.shared_head.head.weight")
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


def test_eagle3_loads_with_speculators(converted, tmp_path):
    """The speculators package (separate cached venv) loads the directory; with its `layers.0.*`
    names mapped from our `midlayer.*`, every tensor it holds equals ours."""
    sys.path.insert(0, str(Path(__file__).parent))
    import validators

    try:
        py = validators.speculators_python()
    except validators.Unreachable as e:
        pytest.skip(f"PyPI unreachable, cannot install speculators: {e}")
    d = converted(FIXTURE, "eagle3", draft_vocab=512)
    script = tmp_path / "load.py"
    script.write_text(
        "import sys, json, torch\n"
        "from safetensors.torch import load_file\n"
        "from speculators import SpeculatorModel\n"
        "d = sys.argv[1]\n"
        "plain = SpeculatorModel.from_pretrained(d)\n"
        "m = SpeculatorModel.from_pretrained(d, key_mapping={r'^midlayer\\.': 'layers.0.'})\n"
        "sd = m.state_dict()\n"
        "ours = load_file(d + '/model.safetensors')\n"
        "diff = [k for k, v in ours.items() if not torch.equal(sd[k.replace('midlayer.', 'layers.0.')].to(v.dtype), v)]\n"
        "print(json.dumps({'cls': type(m).__name__, 'plain': type(plain).__name__, 'diff': diff,\n"
        "                  'draft_vocab': m.config.draft_vocab_size, 'aux': m.config.eagle_aux_hidden_state_layer_ids}))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([str(py), str(script), str(d)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"cls": "Eagle3DraftModel", "plain": "Eagle3DraftModel", "diff": [], "draft_vocab": 512,
                   "aux": [0, 1, 2]}


# -- Medusa -------------------------------------------------------------------------------------


def test_medusa_both_layouts(converted):
    d = converted(FIXTURE, "medusa", heads=4)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["num_heads"] == cfg["medusa_num_heads"] == 4
    assert cfg["num_hidden_layers"] == cfg["medusa_num_layers"] == 1 and cfg["medusa_fc_bias"] is True
    assert cfg["hidden_size"] == 192 and cfg["vocab_size"] == 4096 and Path(cfg["base_model_name_or_path"]) == FIXTURE
    vllm = load_file(d / "model.safetensors")
    fd = load_file(d / "medusa_lm_head.safetensors")
    assert set(vllm) == {f"blocks.{i}.layers.0.{p}" for i in range(4) for p in ("weight", "bias")} | {
        f"lm_heads.{i}.weight" for i in range(4)}
    assert set(fd) == {f"{i}.0.linear.{p}" for i in range(4) for p in ("weight", "bias")} | {
        f"{i}.1.weight" for i in range(4)}
    src = Checkpoint(FIXTURE)
    for i in range(4):
        head = src.get(f"model.layers.{3 + min(i, 1)}.shared_head.head.weight")
        assert torch.equal(vllm[f"lm_heads.{i}.weight"], head) and torch.equal(fd[f"{i}.1.weight"], head)
        assert not vllm[f"blocks.{i}.layers.0.weight"].any() and not fd[f"{i}.0.linear.bias"].any()
    drafter = load_drafter(d)
    h = torch.randn(1, 3, 192)
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
    assert row["from"] == ["model.layers.4.eh_proj.weight"]


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
