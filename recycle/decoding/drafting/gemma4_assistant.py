"""Gemma 4 assistant drafting (`gemma4-assistant`): the assistant's Q-only layers over the target's own KV cache."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from recycle.decoding.drafting.base import DEFAULT_DYNAMIC, ENGINES, Drafter, EngineRequest
from recycle.decoding.target import Target
from recycle.decoding.tree import Expander, MaskCache, Shape, Tree, parse_shape
from recycle.drafters.gemma4 import step, window_start
from recycle.formats.gemma4_assistant import ASSISTANT_FORMAT, kv_source_layers


class AssistantEngine(Drafter):
    """A Gemma 4 assistant (`recycle.drafters.gemma4`): every node of the round sits at the root's position
    C and attends the target's cached K/V at positions < C; a node's input is [target embedding of its
    token; its parent's projected output] (the root's: the target's last committed state). Nodes do not
    see each other, so a tree costs one assistant call per level and nothing is ever cropped."""

    kind = "gemma4-assistant"
    taps = ("last",)

    def __init__(self, assistant: nn.Module, shape: Shape, masks: MaskCache, target: Target) -> None:
        self.assistant, self.shape, self.masks, self.embed = assistant, shape, masks, target.embed
        self.sources = kv_source_layers(target.config)
        self.window = assistant.config.get_text_config().sliding_window  # the assistant's, as vLLM reads it

    def bind(self, cache: DynamicCache) -> None:
        self.cache = cache

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.n = len(ids)
        self.h = feats["last"][-1:]

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.n += len(tokens)
        self.h = feats["last"][-1:]

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        C = self.n
        layers = self.cache.layers
        first = {t: window_start(C, self.window if t == "sliding_attention" else None) for t in self.sources}
        kv = {t: (layers[i].keys[..., first[t]:C, :], layers[i].values[..., first[t]:C, :])
              for t, i in self.sources.items()}
        ex = Expander(root, self.shape, temperature, gen, self.draft_sample)
        out: dict[int, torch.Tensor] = {-1: self.h[0]}  # node -> its projected output (-1: the root's input)
        while not ex.done():
            front = ex.frontier()
            dev = self.h.device
            tokens = torch.tensor([ex.tok[f] for f in front], device=dev)
            inputs = torch.cat([self.embed(tokens), torch.stack([out[ex.par[f]] for f in front])], dim=-1)[None]
            pos = torch.full((1, len(front)), C, dtype=torch.long, device=dev)
            logits, nxt = step(self.assistant, inputs, pos, kv, None)
            for i, f in enumerate(front):
                out[f] = nxt[0, i]
            ex.expand(logits[0])
        return ex.tree()[0]


@ENGINES.register(ASSISTANT_FORMAT)
def assistant_engine(r: EngineRequest) -> Drafter:
    shape = parse_shape(r.tree, DEFAULT_DYNAMIC)
    if r.model.generation_config.num_assistant_tokens is None:  # transformers' assistant_model= reads it
        r.model.generation_config.num_assistant_tokens = shape if isinstance(shape, int) else shape.depth
    return AssistantEngine(r.model, shape, r.masks, r.target)
