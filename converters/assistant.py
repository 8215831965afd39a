"""`--to eagle3` from a Gemma 4 assistant: one of its layers folded into an EAGLE-3 Llama midlayer, at the target's width.

An assistant step (recycle.drafters.gemma4) reads e, the target's scaled embedding of the last token, and h,
the target's final-normed last state, into a narrower width a:

    x0 = P_e·e + P_h·h                                     pre_projection [a, 2H]
    x1 = x0 + post_attn_norm(Wo·attn(q_norm(Wq·ln1(x0)), K, V))    Q-only: K, V are the target's own cache,
    x2 = x1 + post_ff_norm(mlp_gelu(pre_ff_norm(x1)))               from its last non-shared layer of that type
    ...  (every layer), final norm, tied head E_a

EAGLE-3 (`norm_before_residual: true`) reads aux states of the target through `fc` and recomputes K/V for
every position from its own inputs:

    r = hidden_norm(fc(aux));  y = r + attn(cat[input_layernorm(emb); r]);  y += mlp_silu(post_attention_layernorm(y))

The fold keeps one layer, the assistant's last full-attention one (on the fixture it keeps more than the
sliding layer's fold: step-1 agreement 0.30 against 0.20 at 0 tokens, `benchmarks/assistant_fold.py`):

    EAGLE-3 tensor                    ← from                                                    kind
    fc.weight, slot 3 (aux N-1)       ← M = [P_h·diag(target final norm); c·B], B an orthonormal   approx
                                        basis of what P_h cannot see: r holds P_h·h in its first a
                                        coordinates and, small, the rest of the aux state, so M⁻¹
                                        recovers the whole state for K/V
    midlayer.hidden_norm              ← the expected scale ‖M‖_F/sqrt(H) (isotropic states)        approx
    attention heads 0..n-1            ← the assistant layer's own: q = its Wq·diag(ln1) on          approx
      (q_proj, k_proj, v_proj, o_proj)  [c_e·P_e·ê; r], k/v = the target's Wk/Wv·diag(ln) of the
                                        K/V source layer on M⁻¹·r (the aux state standing in for that
                                        layer's input), o = diag(post_attn_norm)·Wo; q_norm, k_norm,
                                        v_norm and post_attn_norm's RMS step replaced by their expected
                                        scales, Gemma's attention scale 1 by Llama's 1/sqrt(d)
    attention heads n..               ← the embedding term c_e·P_e·ê of x0, which EAGLE-3's         approx
                                        residual lacks: extra K/V heads attend the position itself
                                        (q = β·A·ê, k = A·ê, A the embedding's top singular
                                        directions; repeats of a token carry the same value) and
                                        return P_e's singular triplets
    midlayer.post_attention_layernorm ← the layer's pre_feedforward_layernorm                    approx
    midlayer.mlp.{gate,up,down}       ← its MLP; gelu_tanh(x) ≈ silu(1.702x)/1.702; down scaled by  approx
                                        diag(post_feedforward_layernorm)/(the MLP's expected RMS)
    norm.weight, lm_head.weight       ← the assistant's final norm and tied head E_a (padded)      approx
RoPE: Llama's at the layer type's theta; exact for sliding layers (full rotary), for full-attention layers
Gemma 4 rotates only the first pairs (partial, "proportional"): Llama's same-theta frequencies agree there
and turn the other pairs slowly. Dropped: the other layers, post_projection (EAGLE-3 feeds y itself to
the next step), the centroid-masked logits. The measured τ at 0 tokens and after distillation, against
scratch at equal tokens, is in BENCHMARKS.md ("Gemma 4 assistant → EAGLE-3").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from recycle.converters.eagle3_layout import DEFAULT_SPEC_TOKENS, WEIGHTS, draft_head, llama_config
from recycle.converters.roles import APPROX, Backbone, Plan, RoleWeights
from recycle.errors import RecycleError
from recycle.formats.eagle3 import fold_aux_layers
from recycle.io.writer import Lazy

GELU_SILU = 1.702  # gelu(x) ≈ x·sigmoid(1.702x) = silu(1.702x)/1.702
SELF_SCORE = 24.0  # mean attention logit of an embedding head on its own position: weight ≈ 1 over hundreds
JUNK = 0.1  # scale of the aux state's unseen part in r, relative to P_h·h's expected RMS
EMBED_SAMPLE = 16384  # embedding rows the singular directions and scales are estimated from
MLP_PROBES = 4096  # random unit-RMS inputs the MLP's output scale is estimated from


def chosen_layer(cfg: dict) -> int:
    """The assistant layer the midlayer copies: its last full-attention layer (else its last)."""
    types = list(cfg.get("layer_types") or [])
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    return full[-1] if full else max(int(cfg.get("num_hidden_layers") or 1) - 1, 0)


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    out = t.new_zeros(n, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


def _pad_cols(t: torch.Tensor, n: int) -> torch.Tensor:
    out = t.new_zeros(t.shape[0], n)
    out[:, : t.shape[1]] = t
    return out


def _head_rms(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Expected RMS of each head's output of `w` [heads·d, in] on isotropic unit-RMS inputs: ‖W_head‖_F/sqrt(d)."""
    return w.view(-1, head_dim, w.shape[1]).pow(2).sum((1, 2)).sqrt() / math.sqrt(head_dim)


@dataclass
class Sources:
    """The tensors the fold reads: the assistant's layer and projections, the target's K/V source layer."""

    proj: Lazy
    final: Lazy
    head: Lazy
    layer: dict[str, Lazy]  # the assistant layer, names relative to it
    target_norm: Lazy
    target_embed: Lazy
    kv: dict[str, Lazy]  # the target's K/V source layer: input_layernorm, k_proj, v_proj, k_norm


def _sources(w: RoleWeights, bb: Backbone, i: int, kv_layer: int) -> Sources:
    m0 = w.modules[0]
    layer = {k[len(f"{i}."):]: v for k, v in m0.block.items() if k.startswith(f"{i}.")}
    need = ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    missing = [n for n in need if n not in layer]
    if missing:
        raise RecycleError(f"{w.ckpt.path}: assistant layer {i} has no {missing[0]}")
    base = f"layers.{kv_layer}."
    kv = {"ln": bb.tensor(f"{base}input_layernorm.weight"), "k": bb.tensor(f"{base}self_attn.k_proj.weight"),
          "k_norm": bb.tensor(f"{base}self_attn.k_norm.weight")}
    v_name = f"{bb.prefix}{base}self_attn.v_proj.weight"
    kv["v"] = bb.tensor(f"{base}self_attn.v_proj.weight") if v_name in bb.ckpt.tensors else kv["k"]  # k_eq_v layers
    return Sources(m0.leaves["proj"], m0.leaves["final_norm"], m0.leaves["head"], layer, bb.final_norm, bb.embed, kv)


def fold(src: Sources, *, a: int, big: int, heads: int, kv_heads: int, head_dim: int, extra: int) -> tuple[dict, list[str]]:
    """The midlayer's tensors (H wide, Llama names) and notes on what was estimated; fp32. `extra` K/V heads carry
    the embedding term (those past what its singular directions need stay zero)."""
    f = lambda lazy: lazy.make().float()
    d = head_dim
    lay = {k: f(v) for k, v in src.layer.items()}
    proj = f(src.proj)
    p_e, p_h = proj[:, :big], proj[:, big:] * f(src.target_norm)[None, :]  # P_e, P_h·diag(target final norm)
    notes: list[str] = []
    # the embedding: unit-RMS rows ê, and c_e = the mean RMS of Gemma's scaled embedding sqrt(H)·E[t]
    rows = f(src.target_embed)
    if rows.shape[0] > EMBED_SAMPLE:
        rows = rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))[:EMBED_SAMPLE]]
    rms_e = rows.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    unit, c_e = rows / rms_e, float(rms_e.mean()) * math.sqrt(big)
    # M: P_h·diag(norm) on top, a small orthonormal complement below; r = γ·M·x̂ with γ = ‖M‖_F/sqrt(H) undone
    rms_u = float(p_h.norm()) / math.sqrt(a)
    _, _, vh = torch.linalg.svd(p_h, full_matrices=True)
    m = torch.cat([p_h, JUNK * rms_u * vh[a:]], dim=0)  # [H, H]
    gamma = float(m.norm()) / math.sqrt(big)
    m_inv = torch.linalg.inv(m)
    hidden_norm = torch.full((big,), gamma)
    x_hat = m_inv  # r = γ·M·x/RMS(M·x) ≈ M·x̂ (RMS(M·x) ≈ γ·RMS(x))  ⇒  x̂ ≈ M⁻¹·r
    # the assistant's queries: x0 ≈ c_e·P_e·ê + r[:a], normalised jointly by ln1 (its RMS estimated)
    rho0 = math.sqrt((c_e * float(p_e.norm())) ** 2 / a + rms_u ** 2)
    wq = lay["self_attn.q_proj.weight"] * lay["input_layernorm.weight"][None, :] / rho0
    q_scale = (lay["self_attn.q_norm.weight"].repeat(heads)
               / _head_rms(wq, d).repeat_interleave(d).clamp_min(1e-12)) * math.sqrt(d)
    q_asst = torch.cat([q_scale[:, None] * (wq @ (c_e * p_e)), _pad_cols(q_scale[:, None] * wq, big)], dim=1)
    # keys and values: the target's own projections of its K/V source layer, on x̂ = M⁻¹·r
    ln = f(src.kv["ln"])
    wk, wv = f(src.kv["k"]) * ln[None, :] @ x_hat, f(src.kv["v"]) * ln[None, :] @ x_hat
    k_scale = f(src.kv["k_norm"]).repeat(kv_heads) / _head_rms(f(src.kv["k"]) * ln[None, :], d).repeat_interleave(d)
    v_scale = 1.0 / _head_rms(f(src.kv["v"]) * ln[None, :], d).repeat_interleave(d)
    zeros_e = torch.zeros(kv_heads * d, big)
    k_asst = torch.cat([zeros_e, k_scale[:, None] * wk], dim=1)
    v_asst = torch.cat([zeros_e, v_scale[:, None] * wv], dim=1)
    wo = lay["self_attn.o_proj.weight"]
    o_asst = _pad_rows(lay["post_attention_layernorm.weight"][:, None] * wo * math.sqrt(a) / float(wo.norm()), big)
    # extra heads: the embedding term c_e·P_e·ê through attention to the position itself
    u, s, wt = torch.linalg.svd(c_e * p_e, full_matrices=False)
    group = heads // kv_heads
    directions = torch.linalg.svd(unit, full_matrices=False).Vh[:d]  # [d, H]
    beta = SELF_SCORE * math.sqrt(d) / float((unit @ directions.T).pow(2).sum(-1).mean())
    q_extra = torch.zeros(extra * group * d, 2 * big)
    k_extra, v_extra = torch.zeros(extra * d, 2 * big), torch.zeros(extra * d, 2 * big)
    o_extra = torch.zeros(big, extra * group * d)
    for j in range(-(-s.numel() // d)):  # one K/V head per head_dim singular directions
        q_extra[j * group * d:j * group * d + d, :big] = beta * directions
        k_extra[j * d:(j + 1) * d, :big] = directions
        part = slice(j * d, min((j + 1) * d, s.numel()))
        n = part.stop - part.start
        v_extra[j * d:j * d + n, :big] = s[part, None] * wt[part]
        o_extra[:a, j * group * d:j * group * d + n] = u[:, part]
    # the MLP: gelu → silu, its output scaled by post_ff_norm's weight over its expected RMS
    pre_ff, post_ff = lay["pre_feedforward_layernorm.weight"], lay["post_feedforward_layernorm.weight"]
    gate, up, down = lay["mlp.gate_proj.weight"], lay["mlp.up_proj.weight"], lay["mlp.down_proj.weight"]
    probe = torch.randn(MLP_PROBES, a, generator=torch.Generator().manual_seed(1)) * pre_ff
    rms_mlp = float(((F.gelu(probe @ gate.T, approximate="tanh") * (probe @ up.T)) @ down.T).pow(2).mean().sqrt())
    shrink = math.sqrt(a / big)  # RMS over H of what lives in the first a coordinates, per unit of RMS over a
    tensors = {
        "midlayer.hidden_norm.weight": hidden_norm,
        "midlayer.input_layernorm.weight": torch.ones(big),
        "midlayer.self_attn.q_proj.weight": torch.cat([q_asst, q_extra]),
        "midlayer.self_attn.k_proj.weight": torch.cat([k_asst, k_extra]),
        "midlayer.self_attn.v_proj.weight": torch.cat([v_asst, v_extra]),
        "midlayer.self_attn.o_proj.weight": torch.cat([o_asst, o_extra], dim=1),
        "midlayer.post_attention_layernorm.weight": _pad_rows(shrink * pre_ff, big),
        "midlayer.mlp.gate_proj.weight": _pad_cols(GELU_SILU * gate, big),
        "midlayer.mlp.up_proj.weight": _pad_cols(up, big),
        "midlayer.mlp.down_proj.weight": _pad_rows(post_ff[:, None] * down / (GELU_SILU * max(rms_mlp, 1e-12)), big),
        "norm.weight": _pad_rows(shrink * f(src.final), big),
        "fc.weight": torch.cat([torch.zeros(big, 2 * big), m], dim=1),
    }
    notes.append(f"attention: {heads} query heads of the assistant layer over {kv_heads} K/V heads recomputed from the "
                 f"aux state, plus {extra} K/V heads ({extra * group} query heads) carrying the embedding term "
                 f"(all {s.numel()} singular directions; self-score {SELF_SCORE:g})")
    notes.append(f"estimated scales: embedding RMS {c_e:.3g}, P_h·h RMS {rms_u:.3g}, x0 RMS {rho0:.3g}, MLP output RMS "
                 f"{rms_mlp:.3g}, fc gain {gamma:.3g}")
    return tensors, notes


def require_target(w: RoleWeights, req, to: str) -> Backbone:
    """The assistant's target (`--target`), which it reads states, norm and head from: a Gemma 4 model."""
    from recycle.formats.gemma4_assistant import TARGET_TYPES

    bb = req.backbone
    if bb is None:
        raise RecycleError(f"{w.ckpt.path}: a {w.family.title} reads its target's states, norm and head: pass "
                           f"--target (the model it drafts for){' with --calibrate TOKENS' if to == 'medusa' else ''}")
    if bb.config.get("model_type") not in TARGET_TYPES:
        raise RecycleError(f"--target {bb.path}: a Gemma 4 assistant drafts for a Gemma 4 model, not "
                           f"{bb.config.get('model_type')!r}")
    return bb


def convert(w: RoleWeights, bb: Backbone, *, draft_ids: torch.Tensor | None = None, dtype_name: str = "bfloat16",
            speculative_tokens: int = DEFAULT_SPEC_TOKENS, layer: int | None = None) -> Plan:
    """Role weights of a Gemma 4 assistant + its target's backbone → the EAGLE-3 plan (Llama midlayer, width H).
    `layer`: the assistant layer to fold (default `chosen_layer`; benchmarks/assistant_fold.py compares them)."""
    from recycle.formats.gemma4_assistant import kv_source_layers

    cfg, a, big = w.config, w.hidden_size, bb.hidden_size
    if a > big:
        raise RecycleError(f"{w.ckpt.path}: the assistant ({a} wide) is wider than its target ({big}); the EAGLE-3 "
                           "fold pads the assistant into the target's width")
    i = chosen_layer(cfg) if layer is None else layer
    kind = list(cfg.get("layer_types") or ["full_attention"])[i]
    sources = kv_source_layers(SimpleNamespace(layer_types=bb.config.get("layer_types") or [],
                                               num_kv_shared_layers=bb.config.get("num_kv_shared_layers") or 0))
    if kind not in sources:
        raise RecycleError(f"{w.ckpt.path}: assistant layer {i} attends {kind} K/V; the target caches none")
    src = _sources(w, bb, i, sources[kind])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    d = int(cfg.get("head_dim") or a // heads)
    if heads % kv_heads:
        raise RecycleError(f"{w.ckpt.path}: {heads} query heads do not group over {kv_heads} K/V heads")
    group = heads // kv_heads
    # K/V heads for the embedding term: one per head_dim of its a singular directions, rounded up so that the
    # query heads divide the width (transformers' LlamaConfig requires it)
    extra = -(-a // d)
    while big % ((kv_heads + extra) * group) and (kv_heads + extra) * group <= big:
        extra += 1
    if big % ((kv_heads + extra) * group):
        raise RecycleError(f"{w.ckpt.path}: no head count divides the target's width {big} with {kv_heads} K/V heads "
                           f"of {d} and the embedding heads")
    q_rows, kv_rows = (heads + extra * group) * d, (kv_heads + extra) * d
    made: dict[str, torch.Tensor] = {}
    notes: list[str] = []

    def get(name: str) -> torch.Tensor:
        if not made:
            out, n = fold(src, a=a, big=big, heads=heads, kv_heads=kv_heads, head_dim=d, extra=extra)
            made.update(out)
            notes.extend(n)
        return made[name]

    lay_srcs = tuple(s for lz in src.layer.values() for s in lz.sources)
    everything = src.proj.sources + src.target_norm.sources + src.target_embed.sources + lay_srcs + tuple(
        s for lz in src.kv.values() for s in lz.sources)
    shapes = {
        "fc.weight": ((big, 3 * big), src.proj.sources + src.target_norm.sources,
                      f"slot 3 (aux layer {fold_aux_layers(bb.num_layers)[2]}) = [P_h·diag(target final norm); small "
                      "complement]: the whole aux state, P_h·h first; slots 1-2 zero"),
        "midlayer.hidden_norm.weight": ((big,), src.proj.sources + src.target_norm.sources, "fc gain ‖M‖_F/sqrt(H)"),
        "midlayer.input_layernorm.weight": ((big,), (), "ones: the embedding's scale is folded into q and v"),
        "midlayer.self_attn.q_proj.weight": ((q_rows, 2 * big), everything,
                                             f"assistant layer {i} queries, then the embedding heads'"),
        "midlayer.self_attn.k_proj.weight": ((kv_rows, 2 * big), everything,
                                             f"target layer {sources[kind]} keys on M⁻¹·r, then the embedding heads'"),
        "midlayer.self_attn.v_proj.weight": ((kv_rows, 2 * big), everything,
                                             f"target layer {sources[kind]} values on M⁻¹·r, then P_e's directions"),
        "midlayer.self_attn.o_proj.weight": ((big, q_rows), everything,
                                             f"diag(post_attention_layernorm)·o_proj of layer {i}, then P_e's directions"),
        "midlayer.post_attention_layernorm.weight": ((big,), lay_srcs, f"layer {i} pre_feedforward_layernorm"),
        "midlayer.mlp.gate_proj.weight": ((src.layer["mlp.gate_proj.weight"].shape[0], big), lay_srcs,
                                          f"layer {i}: gelu_tanh(x) ≈ silu({GELU_SILU}x)/{GELU_SILU}"),
        "midlayer.mlp.up_proj.weight": ((src.layer["mlp.up_proj.weight"].shape[0], big), lay_srcs, f"layer {i}"),
        "midlayer.mlp.down_proj.weight": ((big, src.layer["mlp.down_proj.weight"].shape[1]), lay_srcs,
                                          f"layer {i}: diag(post_feedforward_layernorm)/expected RMS"),
        "norm.weight": ((big,), src.final.sources, "the assistant's final norm, for the padding"),
    }
    tensors = {name: Lazy(shape, (lambda name=name: get(name)), srcs, APPROX, note)
               for name, (shape, srcs, note) in shapes.items()}
    padded_head = src.head.derive((src.head.shape[0], big), lambda t: _pad_cols(t.float(), big), APPROX,
                                  "the assistant's tied head, zero columns past its width")
    tensors.update(draft_head(padded_head, draft_ids, w.vocab_size))
    rope = (cfg.get("rope_parameters") or {}).get(kind) or {}
    config = llama_config(
        hidden=big, intermediate=src.layer["mlp.gate_proj.weight"].shape[0], heads=heads + extra * group,
        kv_heads=kv_heads + extra, head_dim=d, vocab=w.vocab_size, draft_vocab=tensors["lm_head.weight"].shape[0],
        eps=w.eps, max_positions=int(cfg.get("max_position_embeddings") or 4096),
        theta=float(rope.get("rope_theta") or 10000.0), aux=fold_aux_layers(bb.num_layers), dtype_name=dtype_name,
        norm_before_residual=True, verifier=str(bb.path.resolve()),
        verifier_architectures=bb.ckpt.config.get("architectures"), speculative_tokens=speculative_tokens)
    plan = Plan(tensors={WEIGHTS: tensors}, jsons={"config.json": config}, notes=notes)
    n = int(cfg.get("num_hidden_layers") or 1)
    plan.notes.append(f"assistant layer {i} ({kind}) of {n} folded into the midlayer"
                      + ("; the others dropped" if n > 1 else ""))
    if cfg.get("use_ordered_embeddings"):
        plan.notes.append("centroid-masked logits dropped: the head scores the whole vocabulary")
    return plan
