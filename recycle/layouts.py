"""Checkpoints stored under another codebase's names, run as transformers models.

Meta's multi-token-prediction release keeps its reference Llama's names (`layers.{i}.attention.wq`,
`feed_forward.w1`, `tok_embeddings`, ...) and its interleaved rotary pairs. Rather than a second
transformer, the family row's `HFLayout` maps those names (and the rotary row order) onto
transformers' own model, which then runs the trunk; the same map turns a parallel head's block into
the state of transformers' decoder layer, and back when a fixture is saved.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from recycle.checkpoint import Checkpoint
from recycle.errors import RecycleError
from recycle.families import HFLayout, MTPMatch

BLOCK_PREFIX = "layers.0."  # a parallel head's block is mapped as if it were trunk layer 0
HF_BLOCK_PREFIX = "model.layers.0."


def rotary_rows(w: torch.Tensor, heads: int, to_hf: bool = True) -> torch.Tensor:
    """Reorder a q/k projection's rows per head between interleaved rotary pairs (Meta's reference:
    rows 2j, 2j+1 rotate together) and transformers' half split (rows j, j + d/2 rotate together)."""
    out, inp = w.shape
    d = out // heads
    if to_hf:
        return w.view(heads, d // 2, 2, inp).transpose(1, 2).reshape(out, inp)
    return w.view(heads, 2, d // 2, inp).transpose(1, 2).reshape(out, inp)


def hf_name(layout: HFLayout, name: str) -> str | None:
    """The transformers name of a checkpoint tensor (None: not part of the mapped model)."""
    for pattern, template in layout.names:
        m = re.match(pattern, name)
        if m:
            return template.format(*m.groups())
    return None


def checkpoint_name(layout: HFLayout, name: str) -> str | None:
    """The inverse of `hf_name` (for writing a checkpoint in the source's own layout)."""
    for pattern, template in layout.names:
        hf_pattern = "^" + re.escape(template).replace(r"\{0\}", r"(\d+)") + "$"
        m = re.match(hf_pattern, name)
        if m:
            plain = pattern.strip("^$").replace(r"(\d+)", "{0}").replace("\\", "")
            return plain.format(*m.groups())
    return None


def hf_config(layout: HFLayout, config: Mapping, ckpt: Checkpoint | None = None,
              tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict:
    """The transformers config of the mapped model: the layout's keys, the trunk's layer count and the
    MLP width (read off the first layer's gate projection)."""
    shapes = dict(tensor_shapes or {n: i.shape for n, i in (ckpt.tensors.items() if ckpt else ())})
    out: dict = {"model_type": layout.model_type, "tie_word_embeddings": False}
    for hf_key, key in layout.config.items():
        if config.get(key) is not None:
            out[hf_key] = config[key]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        if config.get(key) is not None:
            out[key] = config[key]
    layers = {int(m.group(1)) for n in shapes for m in [re.match(layout.layer, n)] if m}
    if not layers:
        raise RecycleError("no trunk layers found under the layout's layer names")
    out["num_hidden_layers"] = max(layers) + 1
    gate = next((shp for n, shp in shapes.items() if hf_name(layout, n) == "model.layers.0.mlp.gate_proj.weight"), None)
    if gate is not None:
        out["intermediate_size"] = int(gate[0])
    return out


def _transformers_config(layout: HFLayout, cfg: dict):
    from transformers import AutoConfig

    kw = dict(cfg)
    model_type = kw.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **kw)
    except (ValueError, TypeError, KeyError) as e:
        raise RecycleError(f"transformers cannot build a '{model_type}' config from this layout ({e})") from None


def _to_hf(layout: HFLayout, config, hf: str, t: torch.Tensor) -> torch.Tensor:
    for suffix, heads_key in layout.rope_permute.items():
        if hf.endswith(suffix):
            return rotary_rows(t, int(getattr(config, heads_key)), to_hf=True)
    return t


def load_causal_lm(ckpt: Checkpoint, m: MTPMatch, dtype: torch.dtype, attn: str = "sdpa") -> torch.nn.Module:
    """The checkpoint's trunk as a transformers causal LM (its extra heads are not part of it)."""
    from transformers import AutoModelForCausalLM

    layout = m.family.layout.hf_layout
    assert layout is not None
    config = _transformers_config(layout, hf_config(layout, m.config, ckpt))
    config._attn_implementation = attn
    state = {}
    for name in ckpt.tensors:
        hf = hf_name(layout, name)
        if hf is not None:
            state[hf] = _to_hf(layout, config, hf, ckpt.get(name, torch.float32))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RecycleError(f"{ckpt.path}: the {m.family.name} layout does not fill {model.__class__.__name__} "
                           f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    return model.to(dtype)


def block_state(layout: HFLayout, config, ckpt: Checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    """A parallel head's block (tensors under `prefix`) as the state dict of transformers' decoder layer."""
    state = {}
    for name in ckpt.tensors:
        if not name.startswith(prefix):
            continue
        hf = hf_name(layout, BLOCK_PREFIX + name[len(prefix):])
        if hf is None or not hf.startswith(HF_BLOCK_PREFIX):
            raise RecycleError(f"{ckpt.path}: {name} fits no block tensor of the {layout.model_type} layout")
        rel = hf[len(HF_BLOCK_PREFIX):]
        state[rel] = _to_hf(layout, config, rel, ckpt.get(name, torch.float32))
    return state


def to_checkpoint_names(layout: HFLayout, config, state: Mapping[str, torch.Tensor], prefix: str = "") -> dict:
    """transformers names → the source layout's (rotary rows back to interleaved): the inverse of the
    loaders above; `prefix` re-homes a decoder layer's state (`extra_heads.0.`)."""
    out = {}
    for name, t in state.items():
        hf = HF_BLOCK_PREFIX + name if prefix else name
        ck = checkpoint_name(layout, hf)
        if ck is None:
            raise RecycleError(f"{name}: no name for it in the {layout.model_type} layout")
        for suffix, heads_key in layout.rope_permute.items():
            if hf.endswith(suffix):
                t = rotary_rows(t, int(getattr(config, heads_key)), to_hf=False)
        out[prefix + ck[len(BLOCK_PREFIX):] if prefix else ck] = t
    return out
