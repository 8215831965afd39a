"""The target model as the decoder sees it: logits plus the hidden features drafters read.

Loaded with transformers' AutoModelForCausalLM (never remote code). Features are taken with
forward hooks instead of `output_hidden_states=True`, which would keep every layer's output alive
and, on a tiny model, costs more than the layers themselves.

Feature names ("taps"):
  "last"     the decoder's output after its final norm (what MTP modules and Medusa heads read)
  "prenorm"  the input of the final norm (the last layer's raw output)
  "layer:i"  the input of decoder layer i, i.e. transformers' `hidden_states[i]` (EAGLE-3 aux states)
  "streams"  the last decoder layer's output as it leaves the layer: DeepSeek-V4's hyper-connection streams
             [N, C, H], before its hc_head and norm (what V4's MTP modules read)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from recycle.decoding.placed import lm_class, release_row, text_only
from recycle.decoding.tree import windowed
from recycle.encode import quiet_transformers
from recycle.errors import RecycleError


def load_target(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, attn: str = "sdpa",
    gpus: int = 1, keep_quantized: bool = False,
) -> nn.Module:
    """AutoModelForCausalLM (or a multimodal release's image-text-to-text class, `placed.lm_class`) from a directory,
    eval mode, on `device`; with `gpus` > 1, over that many GPUs of this node, whole decoder layers each
    (`recycle.decoding.placed`: read tensor by tensor onto its device). `keep_quantized`: a block-FP8 release (FP4
    experts too) kept as stored on the GPUs by transformers' own quantized path (`placed.load_kept`)."""
    from recycle.families import config_rows
    from recycle.preflight import load_json

    path = Path(path)
    if not (path / "config.json").is_file():
        raise RecycleError(f"{path}: not a model directory (no config.json)")
    # the rows the config names say how to run the trunk: another codebase's names (`layout.hf_layout`), an attention
    # the row forces (MiMo-V2, DeepSeek-V4: their attention sinks have no sdpa path in transformers, trunk as block)
    raw = load_json(path / "config.json", "config.json")
    rows = config_rows(raw.get("model_type"), set())
    layout = next((f.name for f in rows if f.layout.hf_layout is not None), None)
    attn = next((f.run.attn_implementation for f in rows if f.run.attn_implementation), attn)
    try:
        with quiet_transformers():
            if layout is not None:  # another codebase's names (Meta's Llama): mapped onto transformers' model
                from recycle.checkpoint import Checkpoint
                from recycle.families import match
                from recycle.layouts import load_causal_lm

                ckpt = Checkpoint(path)
                if gpus > 1 or keep_quantized:
                    raise RecycleError(f"--gpus/--keep-quantized: a {layout} checkpoint loads whole on one device")
                model = load_causal_lm(ckpt, match(ckpt, layout), dtype, attn)
            elif keep_quantized:
                from recycle.decoding.placed import load_kept

                return load_kept(path, dtype, attn, gpus).eval()
            elif gpus > 1:
                from recycle.decoding.placed import load_placed

                return load_placed(path, dtype, attn, gpus).eval()
            elif _quantized(path, raw) or release_row(raw) is not None:
                # quantized, or a release transformers cannot read as stored (MiMo-V2.5: its own config keys, q/k/v
                # in one pre-sharded tensor): recycle's reader, which maps it onto transformers' model
                model = _load_dequantized(path, dtype, attn)
            else:
                config = AutoConfig.from_pretrained(path, trust_remote_code=False)
                if text_only(config):  # Step-3.5-Flash: Step-3.7's text config alone, which has no class of its own
                    model = _load_dequantized(path, dtype, attn)  # built as Step-3.7, its towers left out
                else:
                    model = lm_class(config).from_pretrained(path, config=config, dtype=dtype, trust_remote_code=False,
                                                             attn_implementation=attn)
    except RecycleError:
        raise
    except Exception as e:  # whatever a corrupt directory makes transformers raise is bad input
        raise RecycleError(f"{path}: transformers cannot load it as a causal LM ({type(e).__name__}: "
                           f"{_first_sentence(e)})") from None
    return model.to(device).eval()


def _quantized(path: Path, config: dict) -> bool:
    """Whether the release declares a quantization (its config.json, `config`, or ModelOpt's hf_quant_config.json)."""
    from recycle.checkpoint import QUANT_CONFIG_FILE

    return bool(config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
                or (path / QUANT_CONFIG_FILE).is_file())


def _load_dequantized(path: Path, dtype: torch.dtype, attn: str) -> nn.Module:
    """A quantized target (block FP8 as DeepSeek-V3 ships; NVFP4, MXFP4, compressed-tensors, AWQ, GPTQ through their
    codecs) with its weights dequantized by recycle's reader: the weights a quantized engine computes with, at
    `dtype` (activations are not quantized here: for W4A4/W8A8 schemes that is the one difference). transformers'
    own quantized paths need a GPU or a kernel package (its FP8 path on a CPU also refuses a weight whose rows are
    not a whole number of blocks, such as DeepSeek's 576-row kv_a_proj); the checkpoint's names reach the model
    through transformers' own conversion mapping (per-expert → fused), a decoder layer at a time
    (`recycle.decoding.placed.load_streamed`: host memory one layer's tensors, not the model's state in float32). A
    stored integer or packed tensor that no codec reads is refused in one line: loading it as a float would be a
    silently wrong teacher. A multimodal release's text model and head alone: the skeleton leaves its towers out
    (`placed.skeleton`), and a text config standing alone (Step-3.5-Flash, `placed.text_only`) loads here quantized or
    not."""
    from recycle.checkpoint import Checkpoint
    from recycle.decoding.placed import load_streamed, skeleton_of

    ckpt = Checkpoint(path)
    model = skeleton_of(ckpt, dtype, attn)
    load_streamed(ckpt, model, {"": "cpu"}, dtype)
    return model


def _first_sentence(e: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, cut short (transformers' can run to pages)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def softcap(logits: torch.Tensor, config) -> torch.Tensor:
    """cap·tanh(logits/cap) where the config sets `final_logit_softcapping` (Gemma): what the model's own forward
    does after its head, which the decoder and the distiller call directly."""
    cap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


class Target:
    """Runs the target over tokens at given positions with a given mask and cache; returns logits and taps."""

    def __init__(self, model: nn.Module, taps: Iterable[str] = ()) -> None:
        self.model = model
        self.config = model.config
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self._captured: dict[str, torch.Tensor] = {}
        self._hooks: list = []
        self.taps: tuple[str, ...] = ()
        self.set_taps(taps)
        # sliding-window layers (MiMo-V2, Step-3.7, Gemma 4): their cache keeps every token and the window is applied
        # in the mask, since a layer that evicted cannot be cut back to the accepted tokens (its whole history costs
        # what a full layer's does: bench's contexts are short)
        from recycle.decoding.cache import rolls_back, whole

        text = self.config.get_text_config()  # a multimodal release keeps them in its text config
        types = getattr(text, "layer_types", None) or ()
        cache = self.new_cache()
        self.window = getattr(text, "sliding_window", None) if "sliding_attention" in types and not whole(cache) else None
        # a hybrid (Gated DeltaNet / Mamba layers) or DeepSeek-V4 (compressor caches): verifies chains, its states
        # rolled back on rejection (recycle.decoding.cache)
        self.rolls_back = rolls_back(cache)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    def set_taps(self, taps: Iterable[str]) -> None:
        """Install hooks for the requested features (removing the previous ones)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.taps = tuple(dict.fromkeys(taps))
        for tap in self.taps:
            if tap == "last":
                continue
            if tap == "streams":
                self._hooks.append(self.decoder.layers[-1].register_forward_hook(self._grab_output(tap)))
                continue
            if tap == "prenorm":
                module = getattr(self.decoder, "norm", None)
                if module is None:
                    raise RecycleError("the target's decoder has no final `norm`; cannot tap its input")
            elif tap.startswith("layer:"):
                i = int(tap.split(":", 1)[1])
                if i == self.num_layers:  # hidden_states[L] is the final-normed output
                    continue
                if not 0 <= i < self.num_layers:
                    raise RecycleError(f"feature {tap!r}: the target has {self.num_layers} layers")
                module = self.decoder.layers[i]
            else:
                raise ValueError(f"unknown feature tap {tap!r}")
            self._hooks.append(module.register_forward_pre_hook(self._grab(tap), with_kwargs=True))

    def _grab(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._captured[name] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _grab_output(self, name: str):
        def hook(module: nn.Module, args: tuple, out) -> None:
            self._captured[name] = out[0] if isinstance(out, tuple) else out

        return hook

    def new_cache(self) -> DynamicCache:
        """transformers' cache for the target, its plain sliding-window layers keeping every token (the window is in
        the mask); a cache rolled back whole (DeepSeek-V4's) as transformers builds it."""
        from recycle.decoding.cache import whole

        cache = DynamicCache(config=self.config)
        if not whole(cache):
            cache.layers = [DynamicLayer() if type(lyr) is DynamicSlidingWindowLayer else lyr for lyr in cache.layers]
        return cache

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DynamicCache,
        logits_for: slice | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """ids/positions [1, N]; mask None (causal) or additive [1, 1, N, past+N].

        Returns logits [N', V] (float32; N' rows selected by `logits_for`, default all) and taps
        {name: [N, H]} (views, valid until the next forward).
        """
        if mask is not None and self.window:  # each layer type its own mask (the model takes them by type)
            prefix = mask.shape[-1] - ids.shape[1]
            mask = {"full_attention": mask,
                    "sliding_attention": windowed(mask, positions[0].tolist(), prefix, self.window)}
        out = self.decoder(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state[0]
        feats = {}
        for tap in self.taps:
            if tap == "last" or tap == f"layer:{self.num_layers}":
                feats[tap] = hidden
            else:
                feats[tap] = self._captured.pop(tap)[0]
        h = hidden if logits_for is None else hidden[logits_for]
        return softcap(self.head(h).float(), self.config), feats
