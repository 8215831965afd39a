"""`--to eagle3`: an EAGLE-3 drafter in the official/SpecForge layout, initialised from MTP module 0.

The layout is the one vLLM, SGLang, TensorRT-LLM and llama.cpp load (formats-target §0, §2.2):
`midlayer.*`, `fc.weight` [h, 3H], `norm.weight`, `lm_head.weight` [Vd, h], `d2t` int64 offsets
(target = draft + d2t[draft]), `t2d` bool [V]; no `embed_tokens` (engines share the target's).
config.json is a flat Llama config (`LlamaForCausalLMEagle3`) that also carries the speculators
keys, so `vllm serve OUT` and `speculators` read it too; `norm_before_residual` is always written.

EAGLE-3 is not MTP-shaped: it reads three *pre-norm residual streams* of the target (the inputs of
layers `eagle_aux_hidden_state_layer_ids`) through `fc`, and its one Llama layer attends over
[input_layernorm(emb); hidden_norm(fc(aux))]. MTP reads the final-normed last state through
hnorm/eh_proj into a full decoder block. So only part of the mapping is exact:

    EAGLE-3 tensor                    ← MTP module 0                                   kind
    norm.weight                       ← final norm (shared_head.norm, mtp.norm, …)     exact
    lm_head.weight                    ← head rows of the draft vocabulary (d2t order)   exact
    midlayer.input_layernorm          ← enorm (embedding norm)                          exact
    midlayer.post_attention_layernorm ← block post_attention_layernorm                  exact
    midlayer.mlp.{gate,up,down}_proj  ← dense block MLP                                 exact
                                      ← MoE: the shared expert (routed experts dropped)  approx
                                      ← MoE without a shared expert: expert 0            approx
    midlayer.hidden_norm              ← block input_layernorm (it normalises the fused   approx
                                        feature before attention, as hidden_norm does)
    fc.weight [h, 3H]                 ← slot 3 (the deepest aux layer, N-1): eh_proj's   approx
                                        hidden half · diag(hnorm); slots 1-2 zero. Aux
                                        states are pre-norm residual streams entering
                                        layer N-1, MTP read the final-normed output.
    midlayer.self_attn.{q,k,v}_proj   ← [W·diag(ln1)·eh_proj_e , W] where W is the       approx
                                        block's q/k/v (GQA: q_proj/k_proj/v_proj, gated
                                        q: the query half; MLA: q_b·diag(q_a_ln)·q_a,
                                        kv_b·diag(kv_a_ln)·kv_a with the shared rope key
                                        copied to every head, v zero-padded to the qk
                                        head size). Inner RMS scales, attention biases,
                                        q/k norms and MLA's partial interleaved RoPE are
                                        not representable and are dropped.
    midlayer.self_attn.o_proj         ← block o_proj (MLA: zero columns for padded v)   approx
    anything the block lacks          ← N(0, 0.02²) (down_proj: zeros)                   fresh
    d2t / t2d                         ← --draft-vocab N: top-N corpus tokens            approx
                                        (full vocabulary: not written; vLLM's llama_eagle3 and
                                        deepseek_eagle3 create `draft_id_to_target_id` only when
                                        draft_vocab_size != vocab_size and refuse the tensor otherwise)

`attention="mla"` (MLA sources only) writes vLLM's `Eagle3DeepseekV2ForCausalLM` instead: config
`model_type: deepseek_v2` (vLLM turns any `deepseek_v3` draft config into its MTP model); the
midlayer keeps the block's MLA attention, so MLA targets pair with it on engines whose KV cache needs
one attention kind (vLLM's CPU backend). More of its attention is copied exactly (acceptance barely
differs from the Llama fold's: BENCHMARKS.md, "EAGLE-3 midlayer"):

    midlayer.self_attn.q_a_proj       ← [q_a·diag(ln1)·eh_proj_e , q_a]   (or q_proj)    approx
    midlayer.self_attn.kv_a_proj_with_mqa ← [kv_a·diag(ln1)·eh_proj_e , kv_a]            approx
    midlayer.self_attn.{q_a_layernorm, q_b_proj, kv_a_layernorm, kv_b_proj, o_proj}      exact
                                        (RoPE included: the same interleaved rotary dims)
Only vLLM loads this variant (speculators and SGLang's EAGLE-3 readers expect the Llama layer).

A Gemma 4 assistant is no MTP module: converters/assistant.py folds it (same layout and config, through
`converters/eagle3_layout.py`'s `llama_config` and `draft_head`).
"""

from __future__ import annotations

import torch

from recycle.converters import assistant
from recycle.converters.eagle3_layout import DEFAULT_SPEC_TOKENS, WEIGHTS, draft_head, llama_config
from recycle.converters.registry import CONVERTERS
from recycle.converters.roles import (
    APPROX,
    EXACT,
    Plan,
    RoleWeights,
    block_norm,
    normal,
    ones,
    require_sequential,
    zeros,
)
from recycle.errors import RecycleError, did_you_mean
from recycle.formats.eagle3 import fold_aux_layers
from recycle.io.writer import Lazy
from recycle.mtp import renamed

ATTENTION = ("llama", "mla")
DEEPSEEK_MLA = frozenset(f"{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
                                                 "kv_a_layernorm", "kv_b_proj", "o_proj"))
MLA_CONFIG_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "rope_interleave", "rope_scaling", "rope_parameters", "num_key_value_heads")


def _get(block: dict[str, Lazy], *names: str) -> Lazy | None:
    for n in names:
        if n in block:
            return block[n]
    return None


def _attention(w: RoleWeights, block: dict[str, Lazy]) -> tuple[dict, dict[str, Lazy]]:
    """(dims, {q, k, v, o} as [out, H] / [H, in] effective Linear weights) from the block."""
    cfg, h = w.config, w.hidden_size
    heads = int(cfg.get("num_attention_heads") or max(1, h // 64))
    a = "self_attn."
    q, k, v, o = (_get(block, f"{a}{p}_proj.weight") for p in "qkvo")
    gqa = q is not None and k is not None and v is not None and o is not None
    # Step's per-head output gate: one row per head of this layer (its sliding layers have their own count)
    head_gate = _get(block, f"{a}g_proj.weight") if gqa else None
    own_heads = head_gate.shape[0] if head_gate is not None else heads
    # transformers' LlamaConfig (the midlayer's) refuses heads that do not divide hidden_size (Step: 96 at 4096)
    fits = head_gate is None or h % own_heads == 0
    heads = own_heads if fits else heads
    if fits and gqa:
        hd = int(cfg.get("head_dim") or h // heads)
        kv = k.shape[0] // hd
        gated = q.shape[0] == 2 * heads * hd
        if gated:  # Qwen3-Next: per head [query hd; gate hd]
            q = q.derive((heads * hd, h), lambda t: t.view(heads, 2 * hd, h)[:, :hd].reshape(heads * hd, h),
                         APPROX, "query half of the gated q_proj; output gate dropped")
        note = "GQA projection" + ("; biases, q/k norms dropped" if _get(block, f"{a}q_proj.bias", f"{a}q_norm.weight")
                                   else "") + ("; per-head output gate (g_proj) dropped" if head_gate is not None else "")
        if _get(block, f"{a}sinks", f"{a}attention_sink_bias"):
            note += "; attention sinks (and any sliding window) dropped"
        vd, scale = v.shape[0] // kv, float(cfg.get("attention_value_scale") or 1.0)
        if vd != hd or scale != 1.0:  # MiMo-V2: value heads narrower than the query/key heads, values rescaled
            def make_v(t: torch.Tensor) -> torch.Tensor:
                out = t.new_zeros(kv, hd, h)
                out[:, :vd] = scale * t.view(kv, vd, h)
                return out.reshape(kv * hd, h)

            def make_o(t: torch.Tensor) -> torch.Tensor:
                out = t.new_zeros(h, heads, hd)
                out[:, :, :vd] = t.view(h, heads, vd)
                return out.reshape(h, heads * hd)

            how = f"v heads zero-padded {vd} → {hd}" + (f", scaled by attention_value_scale {scale}" if scale != 1 else "")
            v = v.derive((kv * hd, h), make_v, APPROX, how)
            o = o.derive((h, heads * hd), make_o, APPROX, "o_proj with zero columns for the padded v dims")
            note += f"; {how}"
        return ({"heads": heads, "kv_heads": kv, "head_dim": hd},
                {"q": q, "k": k, "v": v, "o": o.derive(o.shape, lambda t: t, APPROX, note)} | {"note": note})
    kv_a = _get(block, f"{a}kv_a_proj_with_mqa.weight")
    kv_b = _get(block, f"{a}kv_b_proj.weight")
    if kv_a is not None and kv_b is not None and o is not None:
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        vd, kvl = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"])
        qk = nope + rope
        kv_ln = _get(block, f"{a}kv_a_layernorm.weight")
        q_a, q_ln, q_b = (_get(block, f"{a}{n}.weight") for n in ("q_a_proj", "q_a_layernorm", "q_b_proj"))
        sources = [x for x in (q_a, q_ln, q_b, q, kv_a, kv_ln, kv_b, o) if x is not None]
        srcs = tuple(s for x in sources for s in x.sources)
        note = "MLA folded into MHA: low-rank products, inner RMS scales and partial interleaved RoPE dropped"
        if _get(block, f"{a}g_proj.weight"):  # Ling's head-wise output gate
            note += "; output gate (g_proj) dropped"

        def ln(x: Lazy | None, size: int) -> torch.Tensor:
            return x.make().float() if x is not None else torch.ones(size)

        def make_q() -> torch.Tensor:
            if q_a is not None and q_b is not None:
                ql = q_a.shape[0]
                return q_b.make().float() @ (ln(q_ln, ql)[:, None] * q_a.make().float())
            return q.make().float()

        def latent() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            kva = kv_a.make().float()
            c = ln(kv_ln, kvl)[:, None] * kva[:kvl]  # [kvl, H]
            b = kv_b.make().float().view(heads, nope + vd, kvl)
            return c, b, kva[kvl:]

        def make_k() -> torch.Tensor:
            c, b, pe = latent()
            k_nope = torch.einsum("hnl,lH->hnH", b[:, :nope], c)
            return torch.cat([k_nope, pe.unsqueeze(0).expand(heads, rope, h)], dim=1).reshape(heads * qk, h)

        def make_v() -> torch.Tensor:
            c, b, _ = latent()
            out = torch.zeros(heads, qk, h)
            out[:, :vd] = torch.einsum("hvl,lH->hvH", b[:, nope:], c)
            return out.reshape(heads * qk, h)

        def make_o() -> torch.Tensor:
            out = torch.zeros(h, heads, qk)
            out[:, :, :vd] = o.make().float().view(h, heads, vd)
            return out.reshape(h, heads * qk)

        mk = {"q": make_q, "k": make_k, "v": make_v}
        eff = {n: Lazy((heads * qk, h), f, srcs, APPROX, note) for n, f in mk.items()}
        eff["o"] = Lazy((h, heads * qk), make_o, o.sources, APPROX, "o_proj with zero columns for the padded v dims")
        return {"heads": heads, "kv_heads": heads, "head_dim": qk}, eff | {"note": note}
    hd = int(cfg.get("head_dim") or h // heads)
    note = "no attention projections this mapping understands: fresh N(0, 0.02²)"
    if not fits:
        note = (f"the block's {own_heads} attention heads do not divide hidden size {h}, which a Llama midlayer needs: "
                "fresh N(0, 0.02²)")
    eff = {n: normal((heads * hd, h), i, note) for i, n in enumerate("qkv")}
    eff["o"] = normal((h, heads * hd), 3, note)
    return {"heads": heads, "kv_heads": heads, "head_dim": hd}, eff | {"note": note}


def _mlp(block: dict[str, Lazy], h: int) -> tuple[int, dict[str, Lazy]]:
    for prefix, kind, note in (("mlp.", EXACT, "dense MLP"),
                               ("mlp.shared_experts.", APPROX, "MoE → dense MLP: the shared expert; routed experts dropped"),
                               ("mlp.shared_expert.", APPROX, "MoE → dense MLP: the shared expert; routed experts and its gate dropped"),
                               ("mlp.experts.0.", APPROX, "MoE without a shared expert → dense MLP: expert 0")):
        parts = {p: block.get(f"{prefix}{p}_proj.weight") for p in ("gate", "up", "down")}
        if all(parts.values()):
            inter = parts["gate"].shape[0]
            return inter, {p: t.derive(t.shape, lambda x: x, kind, note) for p, t in parts.items()}
    inter = 4 * h
    note = "no gated MLP in the block: fresh (down_proj zero, so the MLP starts as a no-op)"
    return inter, {"gate": normal((inter, h), 10, note), "up": normal((inter, h), 11, note),
                   "down": zeros((h, inter), note)}


def _rope_theta(cfg: dict) -> float:
    """The rotary base; a per-layer list (Step's runs over the MTP layers after the trunk's) gives module 0's entry."""
    theta = cfg.get("rope_theta")
    if isinstance(theta, list) and theta:
        n = int(cfg.get("num_hidden_layers") or 0)
        theta = theta[n] if n < len(theta) else theta[-1]
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(theta or (rp.get("rope_theta") if isinstance(rp, dict) else None) or 10000.0)


def _mla_attention(block: dict[str, Lazy]) -> dict[str, Lazy] | None:
    """The block's MLA attention tensors by their name under `self_attn.`, or None if it is not MLA."""
    a = "self_attn."
    mla = {n[len(a):]: t for n, t in block.items() if n.startswith(a)}
    return mla if "kv_a_proj_with_mqa.weight" in mla else None


@CONVERTERS.register("eagle3")
def convert(w: RoleWeights, req) -> Plan:
    """EAGLE-3's converter (`req`: converters.registry.ConvertRequest): MTP module 0 folded into the midlayer (`fold`),
    or, from a source that reads its target (a Gemma 4 assistant), one of its layers (`converters.assistant`)."""
    attention = req.options.eagle3_attention or "llama"
    if w.family.exports.reads_target:
        bb = assistant.require_target(w, req, "eagle3")
        if attention != "llama":
            raise RecycleError("--eagle3-attention mla needs an MLA source; an assistant folds into the llama one")
        return assistant.convert(w, bb, draft_ids=req.draft_ids, dtype_name=req.dtype_name)
    require_sequential(w, "eagle3")
    return fold(w, draft_ids=req.draft_ids, dtype_name=req.dtype_name, attention=attention)


def fold(w: RoleWeights, *, draft_ids: torch.Tensor | None = None, dtype_name: str = "bfloat16",
         verifier: str | None = None, speculative_tokens: int = DEFAULT_SPEC_TOKENS, attention: str = "llama") -> Plan:
    """Role weights (module 0) → the EAGLE-3 state dict and config (hybrid Llama/speculators, or
    vLLM's DeepSeek EAGLE-3 for `attention="mla"`)."""
    if attention not in ATTENTION:
        raise RecycleError(f"unknown --eagle3-attention '{attention}' (choose from {', '.join(ATTENTION)})"
                           f"{did_you_mean(attention, ATTENTION)}")
    m0 = w.modules[0]
    h, vocab = w.hidden_size, w.vocab_size
    # the block under its decoder layer's names (MiMo-V2's `pre_mlp_layernorm`, Ling's `attention.*`)
    leaves, block = m0.leaves, renamed(m0.block, w.family.run.block_renames)
    mla = _mla_attention(block) if attention == "mla" else None
    if attention == "mla" and mla is None:
        raise RecycleError(f"--eagle3-attention mla needs an MLA source ({w.family.name}'s MTP block has no "
                           "self_attn.kv_a_proj_with_mqa); use the default llama")
    dims, att = _attention(w, block)
    inter, mlp = _mlp(block, h)
    ln1 = _get(block, "input_layernorm.weight")
    ln2 = _get(block, "post_attention_layernorm.weight")
    ln1 = block_norm(w, ln1) if ln1 is not None else None
    proj = leaves["proj"]

    def two_h(name: str, lin: Lazy | None = None) -> Lazy:
        lin = lin if lin is not None else att[name]
        srcs = lin.sources + proj.sources + (ln1.sources if ln1 is not None else ())

        def make() -> torch.Tensor:
            wt = lin.make().float()
            p_e = proj.make().float()[:, :h]
            g = ln1.make().float() if ln1 is not None else torch.ones(h)
            return torch.cat([wt @ (g[:, None] * p_e), wt], dim=1)

        note = att["note"] if mla is None else "MLA input projection"
        return Lazy((lin.shape[0], 2 * h), make, srcs, APPROX,
                    f"{note}; embedding half = W·diag(input_layernorm)·eh_proj[:, :H]")

    hnorm = leaves["hidden_norm"]
    n_layers = w.num_hidden_layers
    aux = fold_aux_layers(n_layers)

    def make_fc() -> torch.Tensor:
        fc = torch.zeros(h, 3 * h)
        fc[:, 2 * h:] = proj.make().float()[:, h:] * hnorm.make().float()[None, :]
        return fc

    fc = Lazy((h, 3 * h), make_fc, proj.sources + hnorm.sources, APPROX,
              f"slot 3 (aux layer {aux[2]}) = eh_proj[:, H:]·diag(hnorm); slots 1-2 zero")
    head_tensors = draft_head(leaves["head"], draft_ids, vocab)
    vd = head_tensors["lm_head.weight"].shape[0]
    final = leaves.get("final_norm")
    tensors: dict[str, Lazy] = {
        "fc.weight": fc,
        "midlayer.hidden_norm.weight": (ln1.derive(ln1.shape, lambda x: x, APPROX,
                                                   "block input_layernorm now normalises fc's output")
                                        if ln1 is not None else hnorm.derive(hnorm.shape, lambda x: x, APPROX, "hnorm")),
        "midlayer.input_layernorm.weight": leaves["embed_norm"],
        "midlayer.self_attn.q_proj.weight": two_h("q"),
        "midlayer.self_attn.k_proj.weight": two_h("k"),
        "midlayer.self_attn.v_proj.weight": two_h("v"),
        "midlayer.self_attn.o_proj.weight": att["o"],
        "midlayer.post_attention_layernorm.weight": (block_norm(w, ln2) if ln2 is not None
                                                     else ones((h,), "no post_attention_layernorm in the block")),
        "midlayer.mlp.gate_proj.weight": mlp["gate"],
        "midlayer.mlp.up_proj.weight": mlp["up"],
        "midlayer.mlp.down_proj.weight": mlp["down"],
        "norm.weight": final if final is not None else ones((h,), "the family has no final norm"),
        **head_tensors,
    }
    cfg = w.config
    if mla is not None:
        return _mla_plan(w, tensors, mla, two_h, inter, aux, vd, dtype_name)
    theta = _rope_theta(cfg)
    config = llama_config(
        hidden=h, intermediate=inter, heads=dims["heads"], kv_heads=dims["kv_heads"], head_dim=dims["head_dim"],
        vocab=vocab, draft_vocab=vd, eps=w.eps, max_positions=int(cfg.get("max_position_embeddings") or 4096),
        theta=theta, aux=aux, dtype_name=dtype_name, norm_before_residual=False,
        verifier=verifier or str(w.ckpt.path.resolve()), verifier_architectures=w.ckpt.config.get("architectures"),
        speculative_tokens=speculative_tokens)
    plan = Plan(tensors={WEIGHTS: tensors}, jsons={"config.json": config})
    if len(w.modules) > 1:
        plan.notes.append(f"initialised from MTP module 0 of {len(w.modules)}")
    if n_layers < 3:
        plan.notes.append(f"trunk has {n_layers} layers: aux layer ids {aux} include the final state, "
                          "which vLLM does not capture")
    return plan


def _mla_plan(w: RoleWeights, tensors: dict[str, Lazy], mla: dict[str, Lazy], two_h, inter: int, aux: list[int],
              vd: int, dtype_name: str) -> Plan:
    """vLLM's `Eagle3DeepseekV2ForCausalLM`: the Llama attention tensors swapped for the block's MLA ones."""
    tensors = {k: v for k, v in tensors.items() if not k.startswith("midlayer.self_attn.")}
    wide = ("q_a_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight")
    # what DeepseekV2's MLA holds: anything else (Ling's output gate g_proj) has no place in vLLM's midlayer
    dropped = sorted(n for n in mla if n not in DEEPSEEK_MLA)
    for name, lazy in sorted(mla.items()):
        if name in dropped:
            continue
        if name in wide:
            tensors[f"midlayer.self_attn.{name}"] = two_h(name, lazy)
        else:
            tensors[f"midlayer.self_attn.{name}"] = lazy.derive(lazy.shape, lambda x: x, EXACT, "the block's MLA tensor")
    cfg = w.config
    config = {k: cfg[k] for k in MLA_CONFIG_KEYS if k in cfg}
    config.update({
        "model_type": "deepseek_v2",  # vLLM rewrites a deepseek_v3 draft config into DeepSeekMTPModel
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "hidden_size": w.hidden_size,
        "intermediate_size": inter,
        "num_attention_heads": int(cfg["num_attention_heads"]),
        "num_hidden_layers": 1,
        "vocab_size": w.vocab_size,
        "draft_vocab_size": vd,
        "target_hidden_size": w.hidden_size,
        "rms_norm_eps": w.eps,
        "hidden_act": "silu",
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 4096),
        "rope_theta": _rope_theta(cfg),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "torch_dtype": dtype_name,
    })
    plan = Plan(tensors={WEIGHTS: tensors}, jsons={"config.json": config})
    plan.notes.append("MLA midlayer (vLLM Eagle3DeepseekV2ForCausalLM): loads in vLLM only")
    if dropped:
        plan.notes.append(f"the block's self_attn.{', self_attn.'.join(dropped)} dropped: DeepseekV2's MLA has no place "
                          "for it")
    if len(w.modules) > 1:
        plan.notes.append(f"initialised from MTP module 0 of {len(w.modules)}")
    return plan
