"""A target loaded tensor by tensor straight onto its devices: one process holding it over several GPUs of a node.

`skeleton` builds the model with no parameter memory (accelerate's `init_empty_weights`; buffers stay real, so the
rotary tables are computed as usual). `load_streamed` then reads the checkpoint one decoder layer at a time through
recycle's lazy reader (every codec's dequantization computed in float32 and rounded once into the compute dtype; small
tensors kept float32 until their parameter's dtype is known), maps the names with transformers' own
conversion for the model type (per-expert → fused experts; `recycle.mtp.to_runtime_layout`), casts each tensor to its
dtype (transformers' `_get_dtype_plan`: the modules a model keeps in float32 under bf16, DeepSeek-V4's hyper-connection
mixers and sinks among them) and puts it on the device its module is mapped to (accelerate's
`set_module_tensor_to_device`). Host memory beyond what the map puts on the CPU: one decoder layer's tensors at the
compute dtype, twice while transformers' conversion fuses its experts (measured about 2.5× a layer,
`benchmarks/target_load_memory.py`; a V4-Pro layer is 51 GB in bf16); the whole-state loader it replaces held the model
and the checkpoint's state both in float32 (8 bytes a parameter: 2.3 TB for V4-Flash) before casting.

A multimodal release loads as its image-text-to-text class (`lm_class`: transformers gives Step-3.7, GLM-5.3-Flash,
MiniMax-M3 and Inkling no causal-LM class), and a multimodal model's text config standing alone (Step-3.5-Flash) as the
multimodal model whose text config it is (`model_config`); recycle runs only the text decoder and head, so the skeleton
leaves the towers out (`_drop_towers`): on this path (quantized builds, a text config alone, several GPUs) they are
never planned, read or allocated. A multimodal release as stored in bf16 loads through transformers' `from_pretrained`,
towers included.

`device_map` places whole decoder layers (the model's `_no_split_modules`) over the GPUs in order with accelerate's
`infer_auto_device_map`, each filled to `share` of its memory (the rest for the forward's activations); anything it
would put on the CPU or disk is refused. `load_placed` joins them and `dispatch_model` adds the hooks that move each
module's inputs to its device as the forward reaches it (accelerate's big-model inference: it rests on reading
accelerate's code and on the placement tests; one device is all this machine has). `load_kept` instead hands a
block-FP8 release to transformers' own quantized path, which keeps FP8 weights and DeepSeek-V4's FP4 experts as
stored on the GPUs (`--keep-quantized`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import nn

from recycle.errors import RecycleError
from recycle.release_config import transformers_keys

PLACED_SHARE = 0.8  # of each GPU's memory for the target's weights (the rest: the forward's activations, the runtime)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def lm_class(config):
    """The auto class that builds a language model for `config`: AutoModelForCausalLM, or, for a multimodal release
    that transformers gives no causal-LM class (Step-3.7, GLM-5.3-Flash, MiniMax-M3, Inkling), its image-text-to-text
    class: run on token ids alone, its decoder and head are the text model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    kind = type(config)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def skeleton(config, dtype: torch.dtype, attn: str) -> nn.Module:
    """transformers' language model for `config` (`lm_class`), its parameters on the meta device and its buffers
    real; a multimodal release's towers left out (`_drop_towers`)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = lm_class(config).from_config(config, dtype=dtype, attn_implementation=attn)
    _drop_towers(model)
    return model


def _drop_towers(model: nn.Module) -> None:
    """Remove what lies outside the text decoder and the head: a multimodal release's towers (vision, audio, their
    projectors; Step-3.7-Flash's are 1.98 B parameters, 3.96 GB at bf16). recycle feeds its target token ids and runs
    only those two (`Target`), so the towers are neither planned onto devices, nor read, nor allocated; the streamed
    reader maps the text model's names (the model type's conversion) and skips the rest."""
    text = {id(model.get_decoder()), id(model.get_output_embeddings())}

    def walk(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if id(child) in text:
                continue
            if any(id(m) in text for m in child.modules()):  # holds the decoder: look inside
                walk(child)
            elif any(True for _ in child.parameters()):
                setattr(module, name, nn.Module())

    walk(model)


def model_config(raw: dict):
    """transformers' config for a checkpoint's config.json, its quantization left out (the loader dequantizes). A
    text-only release of a multimodal model, which transformers gives no language-model class of its own (Step-3.5-
    Flash: Step-3.7's text config at the top level, `Step3p7TextConfig`), comes wrapped in the multimodal config whose
    text config it is, found in transformers' image-text-to-text mapping (its towers, which no weight fills, the
    skeleton leaves out: `_drop_towers`)."""
    from transformers import AutoConfig

    row = release_row(raw)
    if row is not None:  # a model type transformers has no config class for (MiMo-V2.5's mimo_v2): the row reads it
        raw = transformers_keys(raw, row.keys.release_config, row.title)
    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "quantization_config"})
    outer = _outer_config(config)
    return config if outer is None else outer(text_config=config.to_dict())


def config_of(path: str | Path, raw: dict | None = None):
    """`model_config` of a target directory's config.json (`raw`: as already read; a model type transformers has no
    class for read by its row; never the release's own code), anything transformers raises on it one line."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    from recycle.preflight import load_json

    try:
        return model_config(raw if raw is not None else load_json(Path(path) / "config.json", "config.json"))
    except (ValueError, KeyError, TypeError, AttributeError, StrictDataclassClassValidationError) as e:
        # transformers' refusals: an unknown model type, a config its class (or its validator) rejects
        why = " ".join(str(e).split(". Should contain")[0].split())[:200]  # not the list of every model type
        raise RecycleError(f"{path}: transformers cannot read its config.json ({type(e).__name__}: {why})") from None


def release_row(raw: dict):
    """The family row that reads this config.json in its own way (a release config reader, fused tensors), if any."""
    from recycle.families import config_rows

    rows = config_rows(str(raw.get("model_type", "")), set(raw.get("architectures") or []))
    return next((f for f in rows if f.keys.release_config or f.layout.fused), None)


def text_only(config) -> bool:
    """Whether `config` is a multimodal model's text config standing alone (see `model_config`)."""
    return _outer_config(config) is not None


def _outer_config(config):
    """The multimodal config class whose text config `config` is, where transformers gives `config` no language-model
    class of its own; else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    kind = type(config)
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING or kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return None
    return next((c for c in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.keys()
                 if getattr(c, "sub_configs", {}).get("text_config") is kind), None)


def skeleton_of(ckpt, dtype: torch.dtype, attn: str) -> nn.Module:
    """`skeleton` of a checkpoint's config (`model_config`)."""
    config = model_config(ckpt.config)
    config._attn_implementation = attn
    return skeleton(config, dtype, attn)


def check_gpus(gpus: int, keep_quantized: bool = False) -> None:
    """Refuse (one line) `--gpus` past the GPUs this process sees, and `--keep-quantized` without CUDA."""
    if keep_quantized and not torch.cuda.is_available():
        raise RecycleError("--keep-quantized: transformers keeps FP8 and FP4 weights as stored on CUDA GPUs only (on a "
                           "CPU it dequantizes them): drop it here")
    seen = torch.cuda.device_count()
    if gpus > 1 and gpus > seen:
        raise RecycleError(f"--gpus {gpus}: this process sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES names a shard's)")


def device_map(model: nn.Module, budgets: dict[int, int], dtype: torch.dtype) -> dict[str, int]:
    """Whole decoder layers over the GPUs `budgets` names (index → bytes for weights), filled in order; refused
    (one line) when the weights do not fit them."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    with _quiet_accelerate():
        dmap = infer_auto_device_map(model, max_memory={**budgets, "cpu": 0, "disk": 0},
                                     no_split_module_classes=list(model._no_split_modules or ()), dtype=dtype)
    off = sorted({str(v) for v in dmap.values() if not isinstance(v, int)})
    if off:
        need = compute_module_sizes(model, dtype=dtype)[""]
        raise RecycleError(f"the target's {need / 1e9:.1f} GB of weights at {str(dtype).removeprefix('torch.')} do "
                           f"not fit {len(budgets)} GPU(s) at {sum(budgets.values()) / 1e9:.1f} GB for weights "
                           f"(accelerate's map puts {', '.join(off)} parts off them): more --gpus")
    return dmap


class _quiet_accelerate:
    """accelerate warns for every GPU index a map names that this process cannot see (a plan made elsewhere)."""

    def __enter__(self):
        import logging

        self.log = logging.getLogger("accelerate.utils.modeling")
        self.level = self.log.level
        self.log.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.log.setLevel(self.level)


def _owner(dmap: dict[str, int | str], name: str) -> int | str:
    """The device the map gives the module holding parameter `name` (its longest prefix; "" is the whole model)."""
    parts = name.split(".")
    for k in range(len(parts), -1, -1):
        key = ".".join(parts[:k])
        if key in dmap:
            return dmap[key]
    raise RecycleError(f"the device map places no module of {name}")


def _groups(names: list[str], layers: int) -> list[list[str]]:
    """The checkpoint's names one decoder layer at a time, then the rest; MTP modules (`mtp.*`, a layer index past the
    trunk's) are left out: the trunk never holds them."""
    by_layer: dict[int, list[str]] = {}
    rest = []
    for n in names:
        m = _LAYER.search(n)
        if n.startswith("mtp.") or ".mtp." in n or (m is not None and int(m.group(1)) >= layers):
            continue
        (by_layer.setdefault(int(m.group(1)), []) if m is not None else rest).append(n)
    return [by_layer[i] for i in sorted(by_layer)] + [rest]


def stored_trunk_bytes(ckpt) -> int:
    """The bytes the trunk's tensors take as stored (FP8 weights, FP4 experts and their scales; MTP modules left
    out): what a target loaded with its quantization kept holds (`load_kept`), from the headers alone."""
    layers = int(ckpt.config.get("num_hidden_layers") or (ckpt.config.get("text_config") or {}).get("num_hidden_layers"))
    return sum(ckpt.stored[n].nbytes for group in _groups(list(ckpt.stored), layers) for n in group)


KEPT_METHODS = ("fp8",)  # quantizations transformers runs as stored on GPUs (FineGrainedFP8: block FP8, V4's FP4 experts)


def load_kept(path: Path, dtype: torch.dtype, attn: str, gpus: int, share: float = PLACED_SHARE) -> nn.Module:
    """transformers' own load of a block-FP8 release with its quantization kept: FP8 linears and DeepSeek-V4's FP4
    experts stay as stored on the GPUs (`FineGrainedFP8` and `FP8Experts(expert_dtype="fp4")`, transformers 5.23's
    `integrations/finegrained_fp8.py`: Triton kernels, DeepGEMM where loadable, the activations quantized to FP8 per
    token as the serving engines do), whole decoder layers over `gpus` GPUs at `share` of each. The weights are
    the ones recycle's reader dequantizes (checked on a CPU, where transformers dequantizes them itself); the
    kernels rest on reading transformers' code: no GPU ran them here."""
    from transformers import AutoConfig

    from recycle.checkpoint import Checkpoint

    check_gpus(gpus, keep_quantized=True)
    method = str(Checkpoint(path).quant_config.get("quant_method") or "")
    if method not in KEPT_METHODS:
        raise RecycleError(f"--keep-quantized: transformers keeps {', '.join(KEPT_METHODS)} releases as stored; "
                           f"{path} is {method or 'not quantized'}: load it dequantized (drop --keep-quantized)")
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if text_only(config):
        raise RecycleError(f"--keep-quantized: {path} is a multimodal model's text config alone, which transformers "
                           "loads with no class of its own: load it dequantized (drop --keep-quantized)")
    budgets = {i: int(share * torch.cuda.get_device_properties(i).total_memory) for i in range(gpus)}
    model = lm_class(config).from_pretrained(path, dtype=dtype, attn_implementation=attn, device_map="auto",
                                             trust_remote_code=False,
                                             max_memory=budgets)
    off = sorted({str(v) for v in (getattr(model, "hf_device_map", None) or {}).values() if not isinstance(v, int)})
    if off:
        raise RecycleError(f"--keep-quantized: the target does not fit {gpus} GPU(s) at {share:.0%} of each (its map "
                           f"puts parts on {', '.join(off)}): more --gpus")
    return model


SMALL = 1 << 22  # elements: a tensor under this stays float32 until its parameter's dtype is known (norms, hc mixers)


def _read(ckpt, name: str, dtype: torch.dtype, row_chunks: int = 1) -> torch.Tensor:
    """One stored tensor, read straight into the compute dtype unless small (the codecs and the FP8 reader compute in
    float32 and round once into it: no float32 copy of a large tensor exists); a small one stays float32 until its
    parameter's dtype is known. Integer tables (I64) as stored. `row_chunks`: a pre-sharded fused tensor's chunks,
    whose FP8 scales may be tiled per chunk (`recycle.fused`)."""
    if ckpt.tensors[name].dtype == "I64":
        return ckpt.raw(name)
    return ckpt.get(name, torch.float32 if math.prod(ckpt.tensors[name].shape) < SMALL else dtype, row_chunks)


def load_streamed(ckpt, model: nn.Module, dmap: dict[str, int | str], dtype: torch.dtype) -> None:
    """Fill `model`'s meta parameters from `ckpt` (a `recycle.checkpoint.Checkpoint`), a decoder layer at a time, each
    tensor on the device `dmap` gives its module, at its dtype; refused in one line when a stored tensor no codec reads
    would be loaded, or when the checkpoint leaves a parameter unfilled."""
    from accelerate.utils import set_module_tensor_to_device
    from transformers.core_model_loading import build_glob_alternation

    from recycle.fused import scale_chunks, split
    from recycle.mtp import to_runtime_layout

    config = model.config
    row = release_row(ckpt.config)
    fused = row.layout.fused if row is not None else ()
    scales = {s.name for n, i in ckpt.tensors.items() if i.is_fp8 and (s := ckpt.scale_for(n)) is not None}
    # I64: index tables the model holds as integers (DeepSeek-V4's hash routing `tid2eid`), read as stored; no
    # quantization stores codes in 64-bit integers
    odd = next((n for n, i in ckpt.tensors.items() if not i.quantized and i.dtype not in ("F32", "F16", "BF16", "I64")
                and not i.is_scale and n not in scales), None)  # an FP8 weight's native `.scale` (e8m0) is read
    if odd is not None:
        raise RecycleError(f"{ckpt.path}: {odd} is stored as {ckpt.tensors[odd].dtype}, which no codec recycle knows "
                           f"reads (quantization {ckpt.quant_config.get('quant_method') or ckpt.quant_config.get('quant_algo')!r})")
    plan = model._get_dtype_plan(dtype)
    keep_fp32 = build_glob_alternation(list(plan))[0] if plan else None
    want = dict(model.named_parameters()) | dict(model.named_buffers())
    prefix = f"{model.base_model_prefix}."  # names stored without it (DeepSeek-V4's `embed`, `layers.{i}`), as
    filled: set[str] = set()  # from_pretrained adds it
    names = [n for n, i in ckpt.tensors.items() if not i.is_scale and n not in scales]

    def rows_of(name: str) -> int | None:  # a fused tensor's part, as the model holds it
        key = name if name in want else prefix + name
        return want[key].shape[0] if key in want else None

    for group in _groups(names, int(config.get_text_config().num_hidden_layers)):
        state = {n: _read(ckpt, n, dtype, scale_chunks(n, fused, ckpt.config)) for n in group}
        if fused:  # q/k/v stored as one pre-sharded tensor (MiMo-V2.5): cut to the model's own q/k/v
            try:
                state = split(state, fused, ckpt.config, rows_of)
            except RecycleError as e:
                raise RecycleError(f"{ckpt.path}: {e}") from None
        state = to_runtime_layout(state, config)
        for key, value in state.items():
            key = key if key in want or prefix + key not in want else prefix + key
            if key not in want:
                continue
            to = value.dtype if not value.is_floating_point() else \
                torch.float32 if keep_fp32 is not None and keep_fp32.search(key) else dtype
            set_module_tensor_to_device(model, key, _owner(dmap, key), value=value, dtype=to)
            filled.add(key)
        del state
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, _ in model.named_parameters() if n not in filled]  # a tied head is its embedding
    if missing:
        raise RecycleError(f"{ckpt.path}: the checkpoint does not fill {type(model).__name__} (missing {missing[:3]})")


def load_placed(path: Path, dtype: torch.dtype, attn: str, gpus: int, share: float = PLACED_SHARE) -> nn.Module:
    """The target over `gpus` GPUs of this node (whole decoder layers each), read tensor by tensor and dispatched."""
    from accelerate import dispatch_model

    from recycle.checkpoint import Checkpoint

    check_gpus(gpus)
    ckpt = Checkpoint(path)
    model = skeleton_of(ckpt, dtype, attn)
    budgets = {i: int(share * torch.cuda.get_device_properties(i).total_memory) for i in range(gpus)}
    dmap = device_map(model, budgets, dtype)
    load_streamed(ckpt, model, dmap, dtype)
    return dispatch_model(model, dmap)
