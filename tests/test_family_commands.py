"""Every command on every 2026 row (issue 47), on each generator's exact layout: inspect names the row with no
error, `convert --to eagle` writes a drafter that computes what the source's MTP modules compute (every depth), the
other formats write or refuse in one line, and `--to gguf` refuses where recycle writes no llama.cpp MTP graph.
DeepSeek-V4's modules, which chain hyper-connection streams, go only --to eagle (as `HyperEagleDrafter`) and
--to gguf (llama.cpp's deepseek4 graph)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recycle.drafters import load_drafter
from recycle.mtp import MTP

from tests.cli_helpers import assert_bad_input, run_cli

# variant -> (row, modules, what convert --to eagle does: None writes, else the refusal's words)
ROWS = {
    "glm5": ("glm_moe_dsa", 1, None),
    "glm5_2": ("glm_moe_dsa", 1, None),
    "glm5_next": ("glm5_next", 1, None),
    "mimo_v2_flash": ("mimo_v2_flash", 3, None),
    "mimo_v2": ("mimo_v2", 3, None),
    "bailing_hybrid": ("bailing_hybrid", 1, None),
    "step3p7": ("step3p7", 3, None),
    "mellum": ("mellum", 1, None),
    "minimax_m3": ("minimax_m3", 1, None),
    "inkling": ("inkling", 2, "no drafter format carries the real row count"),  # its head is padded
    "deepseek_v4": ("deepseek_v4", 1, None),  # its own drafter: recycle.drafters.HyperEagleDrafter
}


@pytest.mark.parametrize("variant", sorted(ROWS))
def test_inspect_names_the_row(family_dir, variant):
    row, modules, _ = ROWS[variant]
    res = run_cli("inspect", str(family_dir(variant)), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["family"], data["mtp"]["declared"], data["mtp"]["found"]) == (row, modules, modules)
    assert data["worst"] != "error", data["findings"]


@pytest.mark.parametrize("variant", sorted(ROWS))
def test_eagle_drafter_computes_the_source_modules(family_dir, tmp_path, variant):
    row, modules, refusal = ROWS[variant]
    src, out = family_dir(variant), tmp_path / "eagle"
    res = run_cli("convert", str(src), "--to", "eagle", "--dtype", "fp32", "-o", str(out))
    if refusal is not None:
        assert_bad_input(res, refusal)
        assert not out.exists()
        return
    assert res.exit_code == 0, res.output
    native = MTP.from_checkpoint(src)
    drafter = load_drafter(out, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    t = 6
    # what the modules chain: one state, or DeepSeek-V4's hyper-connection streams [B, T, C, H]
    streams = (native.config.hc_mult,) if getattr(native, "reads", None) == "streams" else ()
    hidden = torch.randn(1, t, *streams, native.config.hidden_size, generator=g)
    ids = torch.randint(0, native.config.vocab_size, (1, t + modules), generator=g)
    with torch.no_grad():
        want, got = native(hidden, ids).logits, drafter(hidden, ids).logits
    assert len(want) == modules
    # what distill writes back is what the directory stores, names and values (before, MiniMax-M3's blocks came
    # back under transformers' own names, not its `block_conversions`, and the write-back was refused)
    from safetensors.torch import load_file

    written, stored = drafter.file_state(), load_file(str(out / "model.safetensors"))
    assert set(written) == set(stored)
    assert all(torch.equal(written[n].float(), stored[n].float()) for n in stored)
    for k in range(modules):
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)


def test_deepseek_v4_goes_to_eagle_and_gguf_only(family_dir, tmp_path):
    """EAGLE-3 folds a block that reads one state; V4's modules read four streams: refused in one line, nothing
    written. llama.cpp's deepseek4 graph runs them (`--to gguf`: the generator ships no vocabulary, the trained
    fixture does; its experts are stored bf16, so they are written at --dtype (the source's), not as MXFP4)."""
    out = tmp_path / "e3"
    assert_bad_input(run_cli("convert", str(family_dir("deepseek_v4")), "--to", "eagle3", "-o", str(out)),
                     "only --to eagle carries them (and --to gguf, to llama.cpp)")
    assert not out.exists()
    res = run_cli("convert", str(family_dir("deepseek_v4")), "--to", "gguf", "-o", str(tmp_path / "g"))
    assert_bad_input(res, "no tokenizer.json for the side file's vocabulary")
    trained = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v4_mtp"
    res = run_cli("convert", str(trained), "--to", "gguf", "-o", str(tmp_path / "g"), "--json")
    assert res.exit_code == 0, res.output
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "g" / "mtp.gguf")).tensors}
    assert types["blk.4.ffn_up_exps.weight"] == types["blk.4.nextn.eh_proj.weight"] == "BF16"  # the source's


@pytest.mark.parametrize("variant", sorted(set(ROWS) - {"deepseek_v4"}))
def test_gguf_refuses_in_one_line(family_dir, tmp_path, variant):
    assert_bad_input(run_cli("convert", str(family_dir(variant)), "--to", "gguf", "-o", str(tmp_path / "g")), "")


# The releases transformers runs only as multimodal models (no causal-LM class), and Step-3.5-Flash, whose config is
# Step-3.7's text config alone: the reference each is compared with is its multimodal class's own from_pretrained.
MULTIMODAL = {"glm5_next": "glm5_next", "step3p7": "step3p7", "minimax_m3": "minimax_m3", "inkling": "inkling",
              "step3p5": "step3p7"}


@pytest.mark.parametrize("variant", sorted(MULTIMODAL))
@pytest.mark.parametrize("fp8", [False, True], ids=["as-stored", "block-fp8"])
def test_the_release_and_its_fp8_build_load_as_targets(family_dir, tmp_path, variant, fp8):
    """The target of bench, distill and harvest: the release (for Step-3.5-Flash's text-only config, built as the
    multimodal model whose text config it is, its towers dropped) and its block-FP8 build (through recycle's
    dequantizing reader) compute exactly what the same values stored as float32 compute through transformers' own
    from_pretrained of the multimodal class. Before, the FP8 builds were refused ("Unrecognized configuration class
    ... for AutoModelForCausalLM"), and Step-3.5-Flash whether quantized or not."""
    from safetensors.torch import save_file

    from recycle.checkpoint import Checkpoint
    from recycle.decoding import load_target

    from fixtures.fp8 import make_fp8

    src = family_dir(variant)
    target = make_fp8(src, tmp_path / "fp8") if fp8 else src
    ckpt = Checkpoint(target)
    assert fp8 == any(i.dtype.startswith("F8") for i in ckpt.tensors.values())
    plain = tmp_path / "plain"
    plain.mkdir()
    state = {n: ckpt.get(n, torch.float32) for n, i in ckpt.tensors.items() if not i.is_scale}
    save_file(state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = dict(Checkpoint(family_dir(MULTIMODAL[variant])).config)
    (plain / "config.json").write_text(json.dumps(config))
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    got_model, want_model = load_target(target), load_target(plain)
    assert type(got_model) is type(want_model)
    with torch.no_grad():
        got, want = (m(input_ids=ids).logits for m in (got_model, want_model))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
