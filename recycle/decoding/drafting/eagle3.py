"""EAGLE-3 drafting (`eagle3`): the drafter's one layer run recursively, EAGLE-2 style."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from recycle.decoding.cache import crop
from recycle.decoding.drafting.base import DEFAULT_DYNAMIC, ENGINES, Drafter, EngineRequest
from recycle.decoding.tree import Expander, MaskCache, Shape, Tree, parse_shape
from recycle.formats.eagle3 import aux_layers


class Eagle3Engine(Drafter):
    """EAGLE-3: one layer over [emb(t_{i+1}); fc(aux_i)] at position i; deeper tree levels feed the
    layer's own output back at the next position (EAGLE-2 drafting), with a tree mask over the
    draft rows. Committed rows stay in the cache; draft rows are cropped after each proposal."""

    kind = "eagle3"

    def __init__(self, model: nn.Module, shape: Shape, masks: MaskCache, embed: nn.Module, aux_layers: list[int]) -> None:
        self.model, self.shape, self.masks = model, shape, masks
        self.embed = model.embed_tokens if model.embed_tokens is not None else embed
        self.taps = tuple(f"layer:{i}" for i in aux_layers)
        self.layer = model.midlayer

    def _feats(self, feats: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([feats[t] for t in self.taps], dim=-1)

    def start(self, ids: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids = list(ids)
        self.pending = [self._feats(feats)]
        self.cache = DynamicCache()
        self.done = 0

    def commit(self, tokens: list[int], feats: dict[str, torch.Tensor]) -> None:
        self.ids.extend(tokens[1:])
        self.pending.append(self._feats(feats))

    def _run(self, g: torch.Tensor, tokens: list[int], positions: list[int], mask: torch.Tensor,
             rows: slice | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The midlayer with this engine's cache (the module's own forward runs without one)."""
        m, lyr = self.model, self.layer
        dev = g.device
        if g.shape[-1] == m.fc.in_features:
            g = m.fc(g)
        emb = self.embed(torch.tensor(tokens, device=dev))[None]
        g = g[None]
        pos = torch.tensor(positions, device=dev)[None]
        normed = lyr.hidden_norm(g)
        residual = normed if lyr.norm_before_residual else g
        x = torch.cat([lyr.input_layernorm(emb), normed], dim=-1)
        a, _ = lyr.self_attn(x, position_embeddings=m.rotary(g, pos), attention_mask=mask, past_key_values=self.cache)
        y = residual + a
        y = (y + lyr.mlp(lyr.post_attention_layernorm(y)))[0]
        return y, m.to_target_logits(m.lm_head(m.norm(y[rows])))

    def propose(self, root: int, temperature: float = 0.0, gen: torch.Generator | None = None) -> Tree:
        C = len(self.ids)
        self.ids.append(root)
        aux = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        s = self.done
        y, logits = self._run(aux, self.ids[s + 1 : C + 1], list(range(s, C)), self.masks.causal(C - s, s),
                              slice(C - s - 1, C - s))
        self.done = C
        ex = Expander(root, self.shape, temperature, gen, self.draft_sample)
        ex.expand(logits)
        state = {0: y[-1]}
        slot: dict[int, int] = {}
        while not ex.done():
            front = ex.frontier()
            m, used = len(front), len(slot)
            allow = torch.zeros(m, used + m, dtype=torch.bool)
            for i, f in enumerate(front):
                a = ex.par[f]
                while a > 0:
                    allow[i, slot[a]] = True
                    a = ex.par[a]
                allow[i, used + i] = True
            allow = torch.cat([torch.ones(m, C, dtype=torch.bool), allow], dim=1).to(self.masks.device)
            mask = torch.zeros(allow.shape, dtype=self.masks.dtype, device=self.masks.device)
            mask = mask.masked_fill_(~allow, self.masks.neg)[None, None]
            hidden = torch.stack([state[ex.par[f]] for f in front])
            y, logits = self._run(hidden, [ex.tok[f] for f in front], [C - 1 + ex.dep[f] for f in front], mask,
                                  slice(None))
            for i, f in enumerate(front):
                state[f] = y[i]
                slot[f] = used + i
            ex.expand(logits)
        crop(self.cache, C)
        return ex.tree()[0]


@ENGINES.register("eagle3")
def eagle3_engine(r: EngineRequest) -> Drafter:
    aux = aux_layers(r.config, r.target.num_layers)
    return Eagle3Engine(r.model, parse_shape(r.tree, DEFAULT_DYNAMIC), r.masks, r.target.embed, list(aux))
