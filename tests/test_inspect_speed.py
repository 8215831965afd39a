"""The fast paths `recycle inspect` takes on a full release's headers (issue 47: DeepSeek-V4-Pro's 145,109 tensors in
<= 1.5 s) give what the plain rules give: the fold of packed weights in place, the MTP-looking names found by
`str.find`, the one scan for FP8 parts."""

from __future__ import annotations

import json
import re

import numpy as np
from safetensors.numpy import save_file

from recycle.audit import MTP_LOOKING_LINES, _mtp_looking
from recycle.checkpoint import Checkpoint, TensorInfo
from recycle.quant.fp8 import FP8_PARTS, any_engine_fp8_part


def test_mtp_looking_names_are_the_rule_s():
    names = ["mtp.0.enorm.weight", "model.layers.3.mtp_proj.weight", "model.xmtp.weight", "smtp.bias",
             "layers.61.eh_proj.weight", "layers.61.shared_head.head.weight", "a.b.nextn.c", "a.bnextn.c",
             "enorm", "x.hnorm.y.mtp.z", "model.extra_heads.0.weight", "model.embed_tokens.weight", "eh_projx.y",
             "model.layers.61.hnormal.weight"]
    want = [m.group(0) for m in MTP_LOOKING_LINES.finditer("\n".join(names))]
    assert _mtp_looking(names) == want
    assert "model.xmtp.weight" not in want and "layers.61.eh_proj.weight" in want
    assert _mtp_looking([]) == [] and _mtp_looking(["model.norm.weight"]) == []


def test_fp8_parts_are_found_in_one_scan():
    part = re.compile("|".join(map(re.escape, FP8_PARTS)))
    for names in (["layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight"],
                  ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"],
                  ["model.layers.3.mlp.experts.0.up_proj.weight"], []):
        assert any_engine_fp8_part(names) == any(part.search(n) for n in names)


def test_the_fold_in_place_is_the_walk_over_every_name(tmp_path):
    """DeepSeek-V4's FP4 pairs (`X.weight` I8 + `X.scale` e8m0) between plain tensors, over two shards and an index:
    `tensors` is `stored` in its order with each pair one MXFP4 entry where its weight stood, the scale left out."""
    codes, scale = np.zeros((4, 16), np.int8), np.full((4, 1), 127, np.uint8)
    shards = {"model-1.safetensors": {"embed.weight": np.zeros((8, 32), np.float32),
                                      "layers.0.ffn.experts.0.w1.weight": codes,
                                      "layers.0.ffn.experts.0.w1.scale": scale,
                                      "layers.0.ffn.gate.weight": np.zeros((2, 32), np.float32)},
              "model-2.safetensors": {"layers.0.ffn.experts.1.w1.weight": codes,
                                      "layers.0.ffn.experts.1.w1.scale": scale,
                                      "norm.weight": np.zeros((32,), np.float32)}}
    for file, tensors in shards.items():
        save_file(tensors, str(tmp_path / file))
    for file in shards:  # numpy has no e8m0: retype the scales in the header, as DeepSeek stores them
        raw = (tmp_path / file).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, v in header.items():
            if name.endswith(".scale"):
                v["dtype"] = "F8_E8M0"
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        (tmp_path / file).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))

    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.packed) == ["layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.1.w1.weight"]
    walk = {}
    for name, info in ckpt.stored.items():
        p = ckpt.packed.get(name)
        if p is not None:
            walk[name] = TensorInfo(name, info.file, p.tag, tuple(p.shape))
        elif not name.endswith(".scale"):
            walk[name] = info
    assert list(ckpt.tensors.items()) == list(walk.items())
    assert ckpt.tensors["layers.0.ffn.experts.1.w1.weight"] == TensorInfo(
        "layers.0.ffn.experts.1.w1.weight", "model-2.safetensors", "MXFP4", (4, 32))
    assert ckpt.params() == 8 * 32 + 2 * 4 * 32 + 2 * 32 + 32
