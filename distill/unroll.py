"""How each drafter format runs during training: which weights train, and the unrolled draft steps.

Index convention (the decoder's, `recycle/decoding/drafting/`): for a batch of L tokens and K
draft steps, anchor i ∈ [0, T), T = L − K − 1, is the position of the target's last committed
state; step k (0-based) at anchor i predicts t_{i+k+2}, and its teacher is the target's softmax at
position i+k+1. Every step after the first consumes the drafter's *own* previous output, never the
target's feature for that position (EAGLE-3's training-time test), because that is what it will
be fed when drafting:

  eagle   `EagleDrafter.forward` already chains: step k runs module min(k, n−1) on its step-(k−1)
          state and t_{i+k+1}, over all anchors at once with step k's own causal attention, which
          is exactly the cache the decoder's MTPStack builds. DeepSeek-V4's (`HyperEagleDrafter`) the same
          over the target's hyper-connection streams (the teacher's aux), as the decoder's StreamChain.
  eagle3  step 0 runs the midlayer on fc(aux_i) and emb(t_{i+1}) at position i; step k feeds the
          step-(k−1) output of the same anchor at position i+k with emb(t_{i+k+1}). Its queries see
          the step-0 keys of positions ≤ i plus the anchor's own step-1..k keys (one KV cache
          grown per step, a [T, (k+1)T] mask: causal block, then diagonal blocks), the mask the
          decoder's tree levels use; as SpecForge's TTT.
  medusa  head k reads the target's state at anchor i; no chaining.
  gemma4-assistant  a Gemma 4 assistant, as the decoder's AssistantEngine drafts: every step of anchor i
          sits at position i+1 and attends the target's K/V at positions ≤ i (no cache of its own); step 0
          reads [E(t_{i+1}); h_i], step k the step-(k−1) projected output with E(t_{i+k+1}).

Frozen: the eagle drafter's embedding and LM head(s) (copies of the target's, as EAGLE freezes
them and as `nextn/` engines take the target's own), EAGLE-3's embedding (the target's) and its
d2t/t2d maps. `reinit` is `--init scratch`: every trainable tensor drawn again with the module's
own initialisation (normal(0, initializer_range) matrices, unit norms, zero biases; Medusa's
ResBlocks zero as Medusa initialises them), frozen target copies kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from recycle.distill.losses import StepOutput, TargetLogits
from recycle.drafters import Eagle3Drafter, EagleDrafter, MedusaDrafter
from recycle.errors import RecycleError
from recycle.formats import DrafterFormat, get
from recycle.registry import Registry


def _init_std(model: nn.Module) -> float:
    cfg = getattr(model, "config", None)
    return float(getattr(cfg, "initializer_range", 0.02) or 0.02)


class Unroller(ABC):
    """Base: a drafter module, K steps, and what the teacher must provide. Each format's subclass is filed in
    `UNROLLERS` under the format's name (its record declares the "unroller" hook)."""

    default_steps = 3
    needs_kv = False  # the teacher must hand over the target's K/V (a Gemma 4 assistant attends it)
    checkpointable = False  # --activation-checkpointing: each draft step's decoder layer recomputed in backward
    shardable = False  # FSDP2 under torchrun: the drafter runs only through its forward, trained weights never read
    # outside it (the loss reads frozen heads only)
    aux_layers: list[int] | None = None

    def __init__(self, model: nn.Module, steps: int) -> None:
        self.model, self.steps = model, steps
        for name, p in model.named_parameters():
            p.requires_grad_(not self.frozen(name))

    @classmethod
    def steps_for(cls, model: nn.Module, steps: int | None) -> int:
        """`--draft-steps` for this drafter (None: the format's default)."""
        k = steps or cls.default_steps
        if k < 1:
            raise RecycleError("--draft-steps must be at least 1")
        return k

    @classmethod
    def make(cls, model: nn.Module, steps: int | None, embed: nn.Module | None = None,
             aux_layers: list[int] | None = None) -> Unroller:
        """The unroller for `model`; `embed` is the target's embedding, `aux_layers` the layers it taps."""
        return cls(model, cls.steps_for(model, steps))

    def adopt_target_io(self, embed: torch.Tensor, head: torch.Tensor) -> dict:
        """Make the drafter's frozen copies of the target's embedding / LM head the target's own; returns, per
        role, how far its copy was. Formats that carry no copies (they borrow the target's) keep nothing."""
        return {}

    def frozen(self, name: str) -> bool:
        return False

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def positions(self, length: int) -> int:
        """Anchors T a sequence of `length` tokens trains (≤ 0: too short for K steps)."""
        return length - self.steps - 1

    @torch.no_grad()
    def reinit(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        std = _init_std(self.model)
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name.rsplit(".", 1)[0].split(".")[-1] else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    @abstractmethod
    def unroll(self, ids: torch.Tensor, last: torch.Tensor, aux: torch.Tensor | None,
               logits: Callable[..., torch.Tensor], with_features: bool = False, kv: dict | None = None
               ) -> list[StepOutput]:
        """The drafter's outputs for K unrolled steps at every anchor (each format defines its own): per step the
        rows its head reads and the head, and the target's final-normed rows at the predicted positions with
        `logits` (the teacher's: rows, vocab → logits), so the loss makes logits a chunk of rows at a time."""

    def file_state(self) -> dict[str, torch.Tensor]:
        """The weights under the names model.safetensors stores."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}


# A format's unroller is its Unroller subclass (the class is the hook's signature), keyed by the format's name.
UNROLLERS: Registry[type[Unroller]] = Registry("unroller")


def unroller_for(fmt: DrafterFormat) -> type[Unroller]:
    """The Unroller subclass of a format (a one-line RecycleError where it has none)."""
    return UNROLLERS.get(fmt.name, fmt.title)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _scored(last: torch.Tensor, t: int, steps: int, head) -> tuple[TargetLogits, list[torch.Tensor]]:
    """The target's logits at every position of `last` [B, L, H], shared by the steps, and each step's positions:
    step k at anchor i (row b·T + i) is scored at position i+k+1 of its sequence, flattened b·L + i+k+1."""
    b, length = last.shape[:2]
    base = (torch.arange(b, device=last.device)[:, None] * length + torch.arange(t, device=last.device)[None]).reshape(-1)
    return TargetLogits(_rows(last), head), [base + k + 1 for k in range(steps)]


@UNROLLERS.register("eagle")
class EagleUnroller(Unroller):
    shardable = True
    checkpointable = True  # MTP.checkpoint_blocks

    def adopt_target_io(self, embed: torch.Tensor, head: torch.Tensor) -> dict:
        """An EAGLE drafter's frozen embedding and LM head(s) are copies of its source's; when the target moved
        away (post-training, a fine-tune), drafting against it with the old ones both feeds the module stale token
        vectors and scores its output with a head the target no longer has. Returns, per role, the relative
        Frobenius distance of the drafter's copy from the target's and whether it was replaced.

        Then the drafter holds the target's own tensors, not a copy (stored once: at DeepSeek-V3's vocabulary the
        pair is 3.7 GB in bf16); what it writes out is their values either way."""
        m: EagleDrafter = self.model
        pairs = {"embed": [m.embed] + [lyr.embed for lyr in m.layers if lyr.embed is not None],
                 "head": [m.head] + [lyr.head for lyr in m.layers if lyr.head is not None]}
        theirs = {"embed": embed, "head": head}
        out = {}
        with torch.no_grad():
            for role, modules in pairs.items():
                ref = theirs[role].detach().float().cpu()
                dist = max(float((mod.weight.detach().float().cpu() - ref).norm() / ref.norm().clamp_min(1e-12))
                           for mod in modules)
                for mod in modules:
                    if isinstance(theirs[role], nn.Parameter) and theirs[role].shape == mod.weight.shape:
                        mod.weight = theirs[role]  # the same tensor as the teacher's (frozen in both)
                    elif dist > 0:
                        mod.weight.copy_(ref.to(mod.weight.dtype))
                out[role] = {"relative_difference": round(dist, 6), "replaced_by_target": dist > 0}
        return out

    def frozen(self, name: str) -> bool:
        leaf = name.rsplit(".", 1)[0].split(".")[-1]
        return leaf in ("embed", "head")

    def unroll(self, ids, last, aux, logits, with_features=False, kv=None):
        m: EagleDrafter = self.model
        k_steps, t = self.steps, self.positions(ids.shape[1])
        # DeepSeek-V4's modules (HyperEagleDrafter) chain the target's streams, which the teacher hands over as aux
        state = aux if getattr(m, "reads", None) == "streams" else last
        if state is None:
            raise ValueError("a DeepSeek-V4 drafter needs the target's streams (Teacher(streams=True))")
        out = m(state[:, :t], ids[:, :t + k_steps], steps=k_steps, heads=False)
        shared, where = _scored(last, t, k_steps, logits)
        steps = []
        for k in range(k_steps):
            target = _rows(last[:, k + 1:k + 1 + t])
            feats, tfeats = (_rows(out.normed[k]), target) if with_features else (None, None)
            steps.append(StepOutput(_rows(out.normed[k]), target, ids[:, k + 2:k + 2 + t].reshape(-1), feats, tfeats,
                                    head=m.role(m.layer_for(k), "head"), target_head=logits, shared=shared,
                                    positions=where[k]))
        return steps

    def file_state(self):
        return self.model.file_state()  # its blocks in their checkpoint layout (ChainedSteps.block_to_stored)


@UNROLLERS.register("eagle3")
class Eagle3Unroller(Unroller):
    @classmethod
    def make(cls, model, steps, embed=None, aux_layers=None):
        return cls(model, cls.steps_for(model, steps), embed, aux_layers or [])

    def __init__(self, model: Eagle3Drafter, steps: int, embed: nn.Module, aux_layers: list[int]) -> None:
        super().__init__(model, steps)
        self.embed = model.embed_tokens if model.embed_tokens is not None else embed
        self.aux_layers = list(aux_layers)
        vocab = model.config.vocab_size
        self.target_ids = model.target_ids()
        tmap = torch.full((vocab,), -1, dtype=torch.long)
        tmap[self.target_ids.cpu()] = torch.arange(model.draft_vocab_size)
        self.tmap = tmap

    def frozen(self, name: str) -> bool:
        return name.startswith("embed_tokens")

    @staticmethod
    def ttt_mask(t: int, k: int, device: torch.device) -> torch.Tensor:
        """Step k's visibility [1, 1, T, (k+1)T]: causal over step 0, diagonal over steps 1..k."""
        blocks = [torch.ones(t, t, dtype=torch.bool, device=device).tril_()]
        blocks += [torch.eye(t, dtype=torch.bool, device=device)] * k
        return torch.cat(blocks, dim=1)[None, None]

    def unroll(self, ids, last, aux, logits, with_features=False, kv=None):
        m: Eagle3Drafter = self.model
        lyr = m.midlayer
        b, length = ids.shape
        t = self.positions(length)
        dev = ids.device
        tid, tmap = self.target_ids.to(dev), self.tmap.to(dev)
        g = m.fc(aux[:, :t])
        cache = DynamicCache()
        base = torch.arange(t, device=dev)[None].expand(b, t)
        def vocab_logits(rows, tid=tid):  # the target's logits over the draft vocabulary
            return logits(rows, tid)

        shared, where = _scored(last, t, self.steps, vocab_logits)
        steps = []
        for k in range(self.steps):
            emb = self.embed(ids[:, k + 1:k + 1 + t])
            pos = base + k
            normed = lyr.hidden_norm(g)
            residual = normed if lyr.norm_before_residual else g
            x = torch.cat([lyr.input_layernorm(emb), normed], dim=-1)
            a, _ = lyr.self_attn(x, position_embeddings=m.rotary(g, pos), attention_mask=self.ttt_mask(t, k, dev),
                                 past_key_values=cache)
            y = residual + a
            y = y + lyr.mlp(lyr.post_attention_layernorm(y))
            steps.append(StepOutput(_rows(m.norm(y)), _rows(last[:, k + 1:k + 1 + t]),
                                    tmap[ids[:, k + 2:k + 2 + t]].reshape(-1), head=m.lm_head,
                                    target_head=vocab_logits, shared=shared, positions=where[k]))
            g = y
        return steps

    def file_state(self):
        return {k: v.detach() for k, v in self.model.state_dict().items() if not k.startswith("rotary.")}


@UNROLLERS.register("medusa")
class MedusaUnroller(Unroller):
    @classmethod
    def steps_for(cls, model, steps):
        """Medusa unrolls one step per head: all of them by default, never more."""
        k = steps or model.num_heads
        if k > model.num_heads:
            raise RecycleError(f"--draft-steps {k}: this Medusa drafter has {model.num_heads} heads")
        return super().steps_for(model, k)

    @torch.no_grad()
    def reinit(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.model.named_parameters():
            if name.startswith("blocks."):
                p.zero_()  # Medusa's ResBlock init: the identity
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def unroll(self, ids, last, aux, logits, with_features=False, kv=None):
        m: MedusaDrafter = self.model
        t = self.positions(ids.shape[1])
        h = last[:, :t]
        shared, where = _scored(last, t, self.steps, logits)
        steps = []
        for k in range(self.steps):
            steps.append(StepOutput(_rows(m.blocks[k](h)), _rows(last[:, k + 1:k + 1 + t]),
                                    ids[:, k + 2:k + 2 + t].reshape(-1), head=m.lm_heads[k], target_head=logits,
                                    shared=shared, positions=where[k]))
        return steps


@UNROLLERS.register("gemma4-assistant")
class AssistantUnroller(Unroller):
    default_steps = 4
    needs_kv = True

    @classmethod
    def make(cls, model, steps, embed=None, aux_layers=None):
        return cls(model, cls.steps_for(model, steps), embed)

    def __init__(self, model: nn.Module, steps: int, embed: nn.Module) -> None:
        super().__init__(model, steps)
        self.embed = embed  # the target's (scaled) embedding: the assistant reads the target's token vectors

    def unroll(self, ids, last, aux, logits, with_features=False, kv=None):
        from recycle.drafters.gemma4 import head, teacher_forced

        if kv is None:
            raise ValueError("a Gemma 4 assistant needs the target's K/V (Teacher(kv=True))")
        t = self.positions(ids.shape[1])
        shared, where = _scored(last, t, self.steps, logits)
        return [StepOutput(_rows(normed), _rows(last[:, k + 1:k + 1 + t]), ids[:, k + 2:k + 2 + t].reshape(-1),
                           head=lambda rows: head(self.model, rows), target_head=logits, shared=shared,
                           positions=where[k])
                for k, normed in enumerate(teacher_forced(self.model, self.embed, ids, last, kv, self.steps, t))]

    def file_state(self):
        from recycle.drafters.gemma4 import stored_state

        return stored_state(self.model)


def make_unroller(fmt, model: nn.Module, steps: int | None, embed: nn.Module | None = None,
                  aux_layers: list[int] | None = None) -> Unroller:
    """The unroller of a format (`fmt`: a DrafterFormat or its name) for `model`."""
    fmt = get(fmt) if isinstance(fmt, str) else fmt
    return unroller_for(fmt).make(model, steps, embed, aux_layers)
