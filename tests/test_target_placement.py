"""A target over several GPUs of one node (`recycle.decoding.placed`, `recycle harvest --engine transformers --gpus N`):
the device map on DeepSeek-V4-Flash's real widths (284 B parameters on the meta device: 8 H200s' budgets, no GPU
here), the loader reading one decoder layer at a time onto the devices the map names, and the refusals.

What these rest on: tests of placement (the map and the loader's order, here) and reading accelerate's code for the
run itself (its `dispatch_model` hooks move each module's inputs to its device); no GPU ran it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from recycle.decoding import placed
from recycle.errors import RecycleError

from tests.cli_helpers import assert_bad_input, run_cli

H200 = int(placed.PLACED_SHARE * 141e9)  # an H200's bytes for weights (recycle.hardware's 141 GB)
V4 = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v4_mtp"


@pytest.fixture(scope="module")
def flash():
    """DeepSeek-V4-Flash as transformers 5.23 configures it by default (h4096, 43 layers, 256 experts), no memory."""
    from transformers import DeepseekV4Config

    return placed.skeleton(DeepseekV4Config(), torch.bfloat16, "eager")


def test_v4_flash_spreads_whole_layers_over_six_h200s(flash) -> None:
    from accelerate.utils import compute_module_sizes

    params = sum(p.numel() for p in flash.parameters())
    assert 284e9 < params < 285e9 and all(p.is_meta for p in flash.parameters())
    dmap = placed.device_map(flash, {i: H200 for i in range(8)}, torch.bfloat16)
    assert sorted(set(dmap.values())) == list(range(6))  # 568.7 GB at bf16: 6 GPUs at 80 %, as harvest --plan says
    layers = [k for k in dmap if k.startswith("model.layers.")]
    assert layers == [f"model.layers.{i}" for i in range(43)]  # each decoder layer whole on one GPU, in order
    on = [dmap[k] for k in layers]
    assert on == sorted(on) and dmap["model.embed_tokens"] == 0 and dmap["lm_head"] == 5
    sizes = compute_module_sizes(flash, dtype=torch.bfloat16)
    for gpu in range(6):
        assert sum(sizes[k] for k, v in dmap.items() if v == gpu) <= H200
    with pytest.raises(RecycleError, match=r"do not fit 4 GPU\(s\).*more --gpus"):
        placed.device_map(flash, {i: H200 for i in range(4)}, torch.bfloat16)


def test_the_loader_reads_one_layer_at_a_time_onto_its_devices(monkeypatch) -> None:
    """Every tensor goes to the device the map gives its module, and no tensor of layer i+1 is read before every
    tensor of layer i is placed (host memory: one layer's tensors). The values are the whole loader's (the V4
    release-storage test, tests/test_family_v4.py)."""
    from accelerate import utils
    from transformers import AutoConfig

    from recycle.checkpoint import Checkpoint

    ckpt = Checkpoint(V4)
    config = AutoConfig.for_model(**ckpt.config)
    model = placed.skeleton(config, torch.float32, "eager")
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.layers.2": "cpu",
            "model.layers.3": "cpu", "model": "cpu", "lm_head": "cpu"}
    events: list[tuple[str, str, str]] = []
    get, put = Checkpoint.get, utils.set_module_tensor_to_device
    monkeypatch.setattr(Checkpoint, "get", lambda self, n, *a, **k: events.append(("read", n, "")) or get(self, n, *a, **k))

    def placing(module, name, device, value=None, **kw):
        events.append(("put", name, str(device)))
        return put(module, name, device, value=value, **kw)

    monkeypatch.setattr(utils, "set_module_tensor_to_device", placing)
    placed.load_streamed(ckpt, model, dmap, torch.float32)
    assert not any(p.is_meta for p in model.parameters())
    layer = lambda n: int(m.group(1)) if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n)) else None
    reads = [layer(n) for kind, n, _ in events if kind == "read"]
    puts = [(layer(n), i) for i, (kind, n, _) in enumerate(events) if kind == "put"]
    assert not any(n.startswith("mtp.") for kind, n, _ in events if kind == "read")  # the MTP module: never read
    for k in range(3):  # layer k's last placement comes before layer k+1's first read
        last_put = max(i for lk, i in puts if lk == k)
        first_read = next(i for i, (kind, n, _) in enumerate(events) if kind == "read" and layer(n) == k + 1)
        assert last_put < first_read
    assert sorted(set(r for r in reads if r is not None)) == [0, 1, 2, 3]
    assert {d for kind, _, d in events if kind == "put"} == {"cpu"}


def test_more_gpus_than_this_process_sees_is_refused(tmp_path) -> None:
    args = ["harvest", "--target", str(V4), "--tokens", "2k", "--engine", "transformers", "-o", str(tmp_path / "c")]
    assert_bad_input(run_cli(*args, "--gpus", "2"), "--gpus 2: this process sees 0 GPU(s)")
    assert_bad_input(run_cli(*args, "--gpus", "2", "--device", "cpu"), "a CPU holds it whole")
    assert_bad_input(run_cli(*args, "--gpus", "0"), "--gpus 0: 1 or more")
    assert not (tmp_path / "c").exists()


def test_transformers_reads_v4s_fp8_and_fp4_storage_as_recycle_does(tmp_path) -> None:
    """`--keep-quantized` hands a block-FP8 release to transformers' own quantized path (FP8 linears, V4's FP4 experts
    kept as stored on GPUs). On a CPU transformers dequantizes the same storage itself: every parameter equals what
    recycle's reader makes of it (random FP4 codes, e8m0 scales), so the kept path multiplies the weights recycle
    checks everywhere else. Its GPU kernels are not run here. The plan's bytes for it are the stored trunk's."""
    import json

    from transformers import AutoModelForCausalLM

    from recycle.checkpoint import Checkpoint
    from recycle.decoding.target import load_target

    from tests.test_family_v4 import _release_storage

    out, _ = _release_storage(V4, tmp_path / "fp", codes=torch.Generator().manual_seed(0))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / f).write_bytes((V4 / f).read_bytes())
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").state_dict()
    ours = load_target(out, dtype=torch.float32).state_dict()
    assert set(theirs) == set(ours)
    for name, t in ours.items():
        assert torch.equal(theirs[name], t), name
    with open(out / "model.safetensors", "rb") as f:  # the header's own byte ranges, read here
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    trunk = sum(v["data_offsets"][1] - v["data_offsets"][0] for n, v in header.items()
                if n != "__metadata__" and not n.startswith("mtp."))
    assert placed.stored_trunk_bytes(Checkpoint(out)) == trunk < sum(t.numel() * 2 for t in ours.values())


def test_keeping_the_quantization_needs_cuda_gpus(tmp_path) -> None:
    args = ["harvest", "--target", str(V4), "--tokens", "2k", "-o", str(tmp_path / "c")]
    assert_bad_input(run_cli(*args, "--engine", "transformers", "--keep-quantized"), "on CUDA GPUs only")
    assert_bad_input(run_cli(*args, "--keep-quantized"), "--engine transformers'")
    assert not (tmp_path / "c").exists()


def test_the_loader_keeps_in_float32_what_transformers_keeps() -> None:
    """At bf16 the loader gives every parameter transformers' own dtype and value: DeepSeek-V4's hyper-connection
    mixers, sinks and norms stay float32 (`_keep_in_fp32_modules_strict`), the rest bf16. (accelerate's
    `set_module_tensor_to_device` casts to the meta parameter's dtype unless told otherwise: before, all came out
    bf16.)"""
    from transformers import AutoModelForCausalLM

    from recycle.checkpoint import Checkpoint

    theirs = AutoModelForCausalLM.from_pretrained(V4, dtype=torch.bfloat16, attn_implementation="eager")
    ckpt = Checkpoint(V4)
    ours = placed.skeleton_of(ckpt, torch.bfloat16, "eager")
    placed.load_streamed(ckpt, ours, {"": "cpu"}, torch.bfloat16)
    want = dict(theirs.named_parameters())
    kept = set()
    for name, p in ours.named_parameters():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name
        if p.dtype == torch.float32:
            kept.add(name.split(".")[-2])
    assert {"attn_hc", "ffn_hc", "hc_head", "input_layernorm"} <= kept


def test_a_multimodal_release_is_planned_without_its_towers() -> None:
    """Step-3.7-Flash at its real widths (transformers' defaults): the skeleton is the text decoder and head alone,
    195.85 B parameters; the vision tower and projector (1.98 B, 3.96 GB at bf16) are neither planned nor read."""
    from accelerate import init_empty_weights
    from transformers.models.step3p7.configuration_step3p7 import Step3p7Config

    with init_empty_weights():  # the whole multimodal model, towers included, for their size
        whole = placed.lm_class(Step3p7Config()).from_config(Step3p7Config(), dtype=torch.bfloat16)
    towers = sum(p.numel() for n, p in whole.named_parameters() if not n.startswith(("model.language_model.", "lm_head.")))
    assert 1.97e9 < towers < 1.99e9  # 3.96 GB at bf16
    model = placed.skeleton(Step3p7Config(), torch.bfloat16, "eager")
    names = [n for n, _ in model.named_parameters()]
    assert names and all(n.startswith(("model.language_model.", "lm_head.")) for n in names)
    assert 195.8e9 < sum(p.numel() for p in model.parameters()) < 195.9e9
    from accelerate.utils import compute_module_sizes

    dmap = placed.device_map(model, {i: H200 for i in range(8)}, torch.bfloat16)
    sizes = compute_module_sizes(model, dtype=torch.bfloat16)
    towers = [k for k in dmap if not k.startswith(("model.language_model", "lm_head"))]
    assert towers == ["model.vision_model", "model.multi_modal_projector"] and all(sizes[k] == 0 for k in towers)
    assert sorted(set(dmap.values())) == list(range(4))  # 391.7 GB at bf16: 4 H200s at 80 %
