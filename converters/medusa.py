"""`--to medusa --heads K`: K Medusa heads whose LM heads come from the MTP head(s).

Written twice from the same tensors (each made once):
  * vLLM's layout at the top of OUT: `model.safetensors` with `blocks.{i}.layers.0.{weight,bias}`
    and `lm_heads.{i}.weight`;
  * FasterDecoding's (TGI, TensorRT-LLM) beside it: `medusa_lm_head.safetensors` with
    `{i}.0.linear.{weight,bias}` and `{i}.1.weight` (v1: every head has its own LM head).
One config.json carries both key sets (`model_type: medusa`, `MedusaModel`, `num_heads`,
`num_hidden_layers`, `medusa_fc_bias: true` for vLLM; `medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path` for FasterDecoding/TGI).

    tensor                          ← source                                kind
    lm_heads.i / i.1.weight         ← head of MTP module min(i, n-1)         exact (shared head: the trunk's lm_head)
    blocks.i.layers.0.weight / bias ← zeros: ResBlock = identity            fresh (Medusa's own init)

From a Gemma 4 assistant (narrower than its target, `backbone` = the target): every lm_heads.i is the
target's head at the target's width, and `--calibrate` (required there) fits the ResBlocks to the
assistant's chain.

The MTP block, norms and projection have no counterpart in a Medusa head (it reads only the
target's last hidden state), so nothing else carries over; the heads need training to look ahead.
"""

from __future__ import annotations

from recycle.converters.assistant import require_target
from recycle.converters.registry import CONVERTERS, REWRITERS
from recycle.converters.roles import Backbone, Plan, RoleWeights, zeros
from recycle.errors import RecycleError
from recycle.formats.medusa import FD_WEIGHTS, WEIGHTS, faster_decoding_names
from recycle.io.writer import Lazy

DEFAULT_HEADS = 3
LAYERS = 1


@CONVERTERS.register("medusa")
def convert(w: RoleWeights, req) -> Plan:
    """Medusa's converter (`req`: converters.registry.ConvertRequest). From a source that reads its target (a Gemma 4
    assistant) the heads are built at the target's width (`--target`) and must be calibrated to it."""
    backbone = None
    if w.family.exports.reads_target:
        if req.options.calibrate is None:
            raise RecycleError(f"{w.ckpt.path}: Medusa heads from a {w.family.title} are fitted to it: pass "
                               "--calibrate TOKENS --target TARGET")
        backbone = require_target(w, req, "medusa")
    heads = DEFAULT_HEADS if req.options.heads is None else req.options.heads
    return heads_plan(w, heads=heads, dtype_name=req.dtype_name, backbone=backbone)


def heads_plan(w: RoleWeights, *, heads: int = DEFAULT_HEADS, dtype_name: str = "bfloat16",
               base_model: str | None = None, backbone: Backbone | None = None) -> Plan:
    """`backbone`: the target of a drafter narrower than it (a Gemma 4 assistant): the heads take its width
    and its LM head, and only calibration (recycle.distill.calibrate) teaches them what the assistant predicts."""
    if heads < 1:
        raise RecycleError(f"--heads must be at least 1, got {heads}")
    h, vocab = backbone.hidden_size if backbone is not None else w.hidden_size, w.vocab_size
    note = "ResBlock zero-initialised (identity), as Medusa initialises it"
    weight = zeros((h, h), note)
    bias = zeros((h,), note)
    vllm: dict[str, Lazy] = {}
    for i in range(heads):
        for j in range(LAYERS):
            vllm[f"blocks.{i}.layers.{j}.weight"] = weight
            vllm[f"blocks.{i}.layers.{j}.bias"] = bias
        vllm[f"lm_heads.{i}.weight"] = (backbone.head if backbone is not None
                                        else w.modules[min(i, len(w.modules) - 1)].leaves["head"])
    fd = {faster: vllm[name] for name, faster in faster_decoding_names(heads, LAYERS).items()}
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": h,
        "vocab_size": vocab,
        "num_heads": heads,
        "num_hidden_layers": LAYERS,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        "medusa_num_heads": heads,
        "medusa_num_layers": LAYERS,
        "base_model_name_or_path": base_model or str((backbone.path if backbone else w.ckpt.path).resolve()),
        "torch_dtype": dtype_name,
    }
    plan = Plan(tensors={WEIGHTS: vllm, FD_WEIGHTS: fd}, jsons={"config.json": config})
    if backbone is None and heads > len(w.modules):
        plan.notes.append(f"{heads} heads from {len(w.modules)} MTP module(s): heads past the stored depth "
                          "reuse the last module's head")
    return plan


@REWRITERS.register("medusa")
def rewrite(src, main: dict, model) -> tuple[dict, list[str], list[str]]:
    """Medusa's layout rewriter: the FasterDecoding file from the trained vLLM-layout weights, where the
    directory has one."""
    if not (src / FD_WEIGHTS).is_file():
        return {}, [], []
    names = faster_decoding_names(model.num_heads, len(model.blocks[0].layers))
    return {FD_WEIGHTS: {names[k]: v for k, v in main.items()}}, [], []
