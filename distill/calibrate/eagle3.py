"""`convert --to eagle3 --calibrate TOKENS`: fit the folded midlayer to the MTP module it came from.

Why: the fold (`converters/eagle3.py`) copies what maps exactly, but an MTP block is not an EAGLE-3 layer: the
routed experts have no place in a dense MLP, `fc` reads three pre-norm aux streams where the module read one
final-normed state, the embedding half of `eh_proj` lands inside q/k/v, and q/k norms, biases and the output gate
are dropped. On the GLM fixture the fold alone drafts at τ 1.21 on chain:3 where the module it came from, chained,
drafts at 2.46, and calibrated on 32k tokens at 2.03 (BENCHMARKS.md, "Calibrated EAGLE-3 fold"): without the fit
most of the prior is lost before training starts.

What, as Medusa's calibration (`distill/calibrate/medusa.py`) does for its ResBlocks:
  1. the target runs once over the calibration text (the training side of `--data`); its aux states are
     kept, its final-normed states feed the module, and the token each position feeds a draft is the target's
     own greedy token (what greedy verification feeds it);
  2. the source's MTP module, as recycle's EAGLE drafter (module min(k, n-1) at step k, as engines chain it),
     gives its final-normed output at each of K draft steps: the teacher, cached once;
  3. the EAGLE-3 drafter is unrolled K steps exactly as distill trains it (`Eagle3Unroller`, the training-time
     test), and only the tensors the fold marked approx or fresh train, from their folded values, to minimise
     Σ_k λ_k [KL(P_module,k ‖ P_eagle3,k) + γ · SmoothL1(f_eagle3,k, f_module,k)] over the draft vocabulary
     (distill's own loss terms, `recycle.distill.losses`); exact copies (head rows, final norm, the embedding
     and post-attention norms, a dense MLP) stay as they are;
  4. a tenth of the windows is held out: KL and top-1 agreement with the module per step, before and after,
     go into recycle.json beside every fitted tensor (kind `approx`, with its fit error).

`--eagle3-mlp wide` (the default with `--calibrate` where the block is a MoE) widens the midlayer's MLP to the target's dense width (vLLM's Llama midlayer takes any
`intermediate_size`) before the fit: the shared expert, then the routed experts the module's router picked most
often on the calibration text, each scaled by its mean routed weight there (its expected share of the MoE output),
as many as fit. At DeepSeek-V3's widths that is the shared expert and 8 routed experts (9 × 2048 = 18,432, its
dense width).

Cost (DeepSeek-V3 widths, 3 steps, 64k tokens; BENCHMARKS.md has the measured fixture figures): the cache holds
the 3 aux states and K module states per token, (3 + K) × 7168 × 4 B = 172 KB/token, 10.3 GiB for 64k tokens in
float32 (160 GiB for the 1M tokens DeepSeek's fixture needed to pass its module; the cache stays in host memory
and only each minibatch moves to the GPU); the fit trains the midlayer's approximated tensors with Adam at
16 B/parameter: 1.78B of them for the Llama fold with the wide MLP (q/k/v over 2h inputs and o for 128 heads of
192, fc [7168, 21504], the MLP), 26.6 GiB, 0.58B (8.7 GiB) for the MLA midlayer, whose MLA tensors are exact
copies (`benchmarks/eagle3_calibrated.py --scale`); the target's forward over the calibration text is the only
pass through the trunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from recycle.converters.roles import APPROX, EXACT
from recycle.distill.calibrate.registry import CALIBRATORS, windows
from recycle.errors import RecycleError
from recycle.io.writer import Lazy

DEFAULT_LR = 3e-3
FEATURE_WEIGHT = 0.1  # γ: keeps the midlayer's state near the module's, which the next step reads
HELDOUT = 0.1
WINDOW = 256  # tokens per calibration window
MINIBATCH = 8  # windows per fit step
TOKENS_PER_STEP = 80  # the default fit: ~25 passes over the fit windows (0.9 × tokens / (WINDOW × MINIBATCH) per pass)
MIN_STEPS = 400


def default_steps(tokens: int) -> int:
    """`--calibrate-steps` when not given: the same ~25 passes whatever the text, at least 400. Four times the text
    at four times the steps took GLM's fit from 83% to 99% of the module's τ (BENCHMARKS.md): more text alone,
    at 400 steps, would be fewer passes."""
    return max(MIN_STEPS, tokens // TOKENS_PER_STEP)


@dataclass
class Cache:
    """What the fit reads, computed once: per window the tokens a draft is fed, the target's aux states, and the
    module's final-normed output at each draft step ((3 + K) · H values per token)."""

    ids: torch.Tensor  # [R, L]
    aux: torch.Tensor  # [R, L, 3H]
    module: list[torch.Tensor]  # K × [R, T, H]
    expert_use: dict[int, tuple[float, float]] | None = None  # routed expert → (share of picks, mean weight)


def _materialise(tensors: dict[str, Lazy]) -> dict[str, torch.Tensor]:
    return {n: (t.make().float() if (t.dtype is None or t.dtype.is_floating_point) else t.make())
            for n, t in tensors.items()}


def _module_drafter(w):
    """The source's MTP modules as recycle's EAGLE drafter (the `--to eagle` mapping, built in memory)."""
    from recycle.converters.eagle import drafter_config, drafter_tensors
    from recycle.drafters.eagle import build_eagle

    return build_eagle(drafter_config(w, "float32"), _materialise(drafter_tensors(w)), dtype=torch.float32)


def _router_hook(module, counts: dict[str, torch.Tensor]):
    """Count which routed experts module 0's MoE gate picks, and with what weight (transformers' MoE gates return
    (router logits, top-k weights with the routed scaling applied, top-k indices)); None without a MoE.
    `counts` gets "picks" and "weight", one entry per expert."""
    gate = dict(module.layers[0].block.named_modules()).get("mlp.gate")
    if gate is None:
        return None

    def hook(_mod, _inp, out):
        if not (isinstance(out, tuple) and len(out) == 3):
            return
        idx, wts = out[2].reshape(-1).cpu(), out[1].reshape(-1).float().cpu()
        n = max(int(idx.max()) + 1, len(counts.get("picks", ())))
        for key, add in (("picks", torch.ones_like(wts)), ("weight", wts)):
            acc = torch.zeros(n)
            acc[:len(counts.get(key, ()))] = counts.get(key, torch.zeros(0))
            counts[key] = acc.index_add_(0, idx, add)

    return gate.register_forward_hook(hook)


@torch.no_grad()
def collect(w, target: str | Path, tokens: int, data: str | None, steps: int, aux_layers: list[int],
            device: torch.device, progress: Callable | None = None) -> tuple[Cache, object]:
    """Run the target and the module over the calibration text (module docstring, steps 1-2)."""
    from recycle.distill.teacher import Teacher
    from recycle.encode import load_tokenizer

    teacher = Teacher(target, device, aux_layers=aux_layers, precision="fp32")
    tok = load_tokenizer(target)
    wins = windows(tok, data, tokens, WINDOW)
    module = _module_drafter(w).to(device)
    picks: dict[str, torch.Tensor] = {}
    handle = _router_hook(module, picks)
    t = WINDOW - steps - 1
    ids_, aux_, outs = [], [], [[] for _ in range(steps)]
    for s in range(0, wins.shape[0], MINIBATCH):
        if progress:
            progress(s, wins.shape[0], "calibrating: the target and the MTP module over the text")
        win = wins[s:s + MINIBATCH].to(device)
        out = teacher(win)
        greedy = teacher.logits(out.last.reshape(-1, out.last.shape[-1])).argmax(-1).view(win.shape)
        ids = torch.cat([win[:, :1], greedy[:, :-1]], 1)
        mo = module(out.last[:, :t], ids[:, :t + steps], steps=steps, heads=False)
        ids_.append(ids.cpu())
        aux_.append(out.aux.cpu())
        for k in range(steps):
            outs[k].append(mo.normed[k].cpu())
    if handle is not None:
        handle.remove()
    use = None
    if picks:
        n, total = picks["picks"], float(picks["picks"].sum()) or 1.0
        use = {e: (float(n[e]) / total, float(picks["weight"][e]) / max(float(n[e]), 1.0))
               for e in range(len(n)) if n[e] > 0}
    cache = Cache(torch.cat(ids_), torch.cat(aux_), [torch.cat(o) for o in outs], use)
    return cache, teacher


def widen_mlp(tensors: dict[str, Lazy], w, use: dict[int, tuple[float, float]] | None, width: int) -> tuple[int, list[int]]:
    """Replace the midlayer's MLP (the shared expert) by one `width` wide: the shared expert, then the routed experts
    picked most often, each down_proj scaled by its expected routed weight (share of picks × top-k × mean weight, the
    routed scaling factor included). Returns (the new width, the experts used)."""
    block = w.modules[0].block
    if not use:
        raise RecycleError("--eagle3-mlp wide: the MTP block has no routed experts to widen its MLP with")
    cfg = w.config
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    parts = {p: tensors[f"midlayer.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
    inter = parts["gate"].shape[0]
    order = sorted(use, key=lambda e: -use[e][0])
    chosen: list[int] = []
    for e in order:
        size = block[f"mlp.experts.{e}.gate_proj.weight"].shape[0]
        if inter + size * (len(chosen) + 1) > width:
            break
        chosen.append(e)
    if not chosen:
        raise RecycleError(f"--eagle3-mlp wide: no routed expert fits beside the shared one in {width}")
    experts = [{p: block[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")} for e in chosen]
    weights = [use[e][0] * top_k * use[e][1] for e in chosen]  # picks per token × mean weight (scaling included)
    new = inter + sum(x["gate"].shape[0] for x in experts)
    srcs = tuple(s for x in experts for t in x.values() for s in t.sources)
    note = (f"shared expert + routed experts {chosen} (most picked on the calibration text), down_proj scaled by "
            "their expected routed weight; then fitted")

    def cat_rows(p: str) -> Callable[[], torch.Tensor]:
        return lambda: torch.cat([parts[p].make().float()] + [x[p].make().float() for x in experts])

    def down() -> torch.Tensor:
        return torch.cat([parts["down"].make().float()] + [x["down"].make().float() * wt
                                                           for x, wt in zip(experts, weights)], dim=1)

    h = parts["down"].shape[0]
    tensors["midlayer.mlp.gate_proj.weight"] = Lazy((new, h), cat_rows("gate"), parts["gate"].sources + srcs, APPROX, note)
    tensors["midlayer.mlp.up_proj.weight"] = Lazy((new, h), cat_rows("up"), parts["up"].sources + srcs, APPROX, note)
    tensors["midlayer.mlp.down_proj.weight"] = Lazy((h, new), down, parts["down"].sources + srcs, APPROX, note)
    return new, chosen


def _scores(unroller, cache: Cache, rows: torch.Tensor, head, device) -> dict:
    """Held-out KL(module ‖ EAGLE-3) and top-1 agreement per draft step."""
    from recycle.distill.losses import step_terms

    kl = [0.0] * unroller.steps
    agree = [0.0] * unroller.steps
    n = 0
    with torch.no_grad():
        for s in range(0, len(rows), MINIBATCH):
            idx = rows[s:s + MINIBATCH]
            outs = _steps(unroller, cache, idx, head, device)
            for k, o in enumerate(outs):
                terms = step_terms(o, grad=False)
                kl[k] += float(terms["kl"]) * len(idx)
                agree[k] += float(terms["agree"]) * len(idx)
            n += len(idx)
    return {"kl": [round(x / max(n, 1), 5) for x in kl], "top1_agreement": [round(x / max(n, 1), 5) for x in agree]}


def _steps(unroller, cache: Cache, idx: torch.Tensor, head, device) -> list:
    """The EAGLE-3 drafter's K unrolled steps on windows `idx`, each paired with the module's output as target."""
    from recycle.distill.losses import StepOutput

    ids, aux = cache.ids[idx].to(device), cache.aux[idx].to(device)
    h = cache.module[0].shape[-1]
    last = aux.new_zeros(()).expand(*ids.shape, h)  # the unroller pairs rows with the target's; the module's replace them
    steps = unroller.unroll(ids, last, aux, logits=None)
    out = []
    for k, s in enumerate(steps):
        target = cache.module[k][idx].to(device).reshape(-1, s.draft.shape[-1])
        out.append(StepOutput(s.draft, target, torch.full_like(s.labels, -1), s.draft, target,
                              head=s.head, target_head=head))
    return out


def fit(unroller, cache: Cache, head, steps: int, device: torch.device, seed: int = 0,
        progress: Callable | None = None) -> dict:
    """Adam on the unroller's trainable tensors (module docstring, steps 3-4); returns the held-out report."""
    from recycle.distill.losses import distill_loss
    from recycle.options import LossConfig

    n = cache.ids.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = max(1, int(n * HELDOUT)) if n > 1 else 0
    held, train = perm[:cut], perm[cut:]
    if len(train) < 1:
        raise RecycleError("--calibrate: too few tokens to fit on; give more")
    before = _scores(unroller, cache, held, head, device) if len(held) else None
    params = unroller.trainable()
    opt = torch.optim.Adam(params, lr=DEFAULT_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(  # 20 warm-up steps, then cosine to 0
        opt, lambda i: min(1.0, (i + 1) / 20) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    cfg = LossConfig(ce_weight=0.0, kl_weight=1.0, feature_weight=FEATURE_WEIGHT)
    gen = torch.Generator().manual_seed(seed + 1)
    for i in range(steps):
        if progress and i % 10 == 0:
            progress(i, steps, "calibrating: fitting the EAGLE-3 midlayer (steps)")
        idx = train[torch.randint(0, len(train), (min(MINIBATCH, len(train)),), generator=gen)]
        loss, _ = distill_loss(_steps(unroller, cache, idx, head, device), cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    after = _scores(unroller, cache, held, head, device) if len(held) else None
    return {"heldout_windows": len(held), "fit_windows": len(train), "folded": before, "calibrated": after}


@CALIBRATORS.register("eagle3")
def calibrate_eagle3(plan, w, opts, progress: Callable | None = None) -> dict:
    """EAGLE-3's calibration (`CALIBRATORS["eagle3"]`): fit the plan's approximated midlayer tensors to the MTP
    module on the target's own features; returns the record for recycle.json."""
    from recycle.converters.eagle3_layout import WEIGHTS
    from recycle.distill.unroll import Eagle3Unroller
    from recycle.drafters.eagle3 import build_eagle3

    if w.family.kind != "mtp":
        raise RecycleError("--calibrate with --to eagle3 fits the fold to MTP modules; a Gemma 4 assistant's "
                           "EAGLE-3 is distilled instead (recycle distill)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = opts.target or str(w.ckpt.path)
    tensors: dict[str, Lazy] = plan.tensors[WEIGHTS]
    config = plan.jsons["config.json"]
    aux = list(config["eagle_aux_hidden_state_layer_ids"])
    k_steps = Eagle3Unroller.default_steps
    cache, teacher = collect(w, target, opts.calibrate, opts.data, k_steps, aux, device, progress)
    record: dict = {}
    if (opts.eagle3_mlp or ("wide" if cache.expert_use and w.config.get("intermediate_size") else "shared")) == "wide":
        width = int(w.config.get("intermediate_size") or 0)
        new, chosen = widen_mlp(tensors, w, cache.expert_use, width)
        config["intermediate_size"] = new
        if "transformer_layer_config" in config:
            config["transformer_layer_config"]["intermediate_size"] = new
        record["mlp"] = {"width": new, "routed_experts": chosen,
                         "expert_use": {str(e): [round(a, 4), round(b, 4)] for e, (a, b) in
                                        sorted(cache.expert_use.items())}}
    fitted = {n for n, t in tensors.items() if t.kind != EXACT and (t.dtype is None or t.dtype.is_floating_point)}
    made = _materialise(tensors)  # read once: the fit starts from these, and the writer takes the exact ones from here
    drafter = build_eagle3(config, made, dtype=torch.float32).to(device)
    unroller = Eagle3Unroller(drafter, k_steps, teacher.embed, aux)
    for name, p in drafter.named_parameters():
        p.requires_grad_(name in fitted)
    head = _module_head(w, drafter.target_ids(), device)
    steps = opts.calibrate_steps or default_steps(opts.calibrate)
    report = fit(unroller, cache, head, steps, device, progress=progress)
    state = {n: p.detach().cpu().clone() for n, p in drafter.named_parameters()}
    note = f"calibrated on {int(cache.ids.numel()):,} tokens"
    if report["calibrated"]:
        f, c = report["folded"], report["calibrated"]
        note += (": held-out KL to the MTP module by step " + " / ".join(f"{a:.3f}→{b:.3f}" for a, b in zip(f["kl"], c["kl"]))
                 + ", top-1 agreement " + " / ".join(f"{a:.3f}→{b:.3f}" for a, b in
                                                    zip(f["top1_agreement"], c["top1_agreement"])))
    for name, old in list(tensors.items()):
        if name in fitted:
            t = state[name]
            tensors[name] = Lazy(tuple(t.shape), (lambda t=t: t), old.sources + ("calibration",), APPROX,
                                 f"{old.note}; {note}" if old.note else note)
        else:  # unchanged, and already read: the writer need not read the source again
            tensors[name] = replace(old, make=(lambda t=made[name]: t), reads=())
    plan.notes.append(f"EAGLE-3 midlayer calibrated to MTP module 0 ({len(fitted)} tensors fitted, {k_steps} steps)")
    return record | {"tokens": int(cache.ids.numel()), "data": opts.data or "stdlib",
                     "target": str(Path(target).resolve()), "steps": steps, "lr": DEFAULT_LR,
                     "draft_steps": k_steps, "feature_weight": FEATURE_WEIGHT, "fitted": sorted(fitted),
                     "objective": "Σ_k 0.8^k [KL(P_module,k ‖ P_eagle3,k) + γ·SmoothL1(features)], approx tensors "
                                  "from their folded values, exact ones fixed",
                     "report": report}


def _module_head(w, vocab: torch.Tensor, device: torch.device):
    """The module's own LM head over the draft vocabulary (what the native module scores with), as a function of
    final-normed rows."""
    head = w.modules[0].leaves["head"].make().float().to(device).index_select(0, vocab)
    return lambda rows: F.linear(rows.float(), head)
