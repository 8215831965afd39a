"""A distillation's record: the entry `recycle.json` gains under `distillation`, and what `--json` prints.

It says what was trained (source, target, budget, data and its passes, losses, frozen groups, optimizer), what came
of it (the held-out agreement before, at the best step and at the last; which weights were written and why), and what
it cost (time per phase, the target forward's share, peak memory, the time estimate, the online teacher's disk).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

from recycle import __version__
from recycle.corpus import is_corpus_name
from recycle.distill.setup import Prepared
from recycle.hardware import peak_rss_bytes

OBJECTIVE = "Σ_k decay^k/Z · (Σ_terms weight·term + feature_weight·SmoothL1)"  # terms: `loss` (--loss's spelling)


def expected_length(agree: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} a_j: tokens per step of a chain whose step k is accepted at rate a_k (the held-out estimate)."""
    tau, run = 1.0, 1.0
    for a in agree:
        run *= a
        tau += run
    return tau


def _selected(best: dict, step: int) -> dict:
    """Which weights are written, and why (never worse: the best held-out estimate, the input's included)."""
    return {"step": best["step"], "tokens": best["tokens"], "estimate": round(best["estimate"], 4),
            "why": ("the last step" if best["step"] == step else
                    "the input: no step beat its held-out estimate, so its weights are written unchanged"
                    if best["step"] == 0 else
                    f"step {best['step']}: the best held-out estimate, better than the last step's")}


def _data(p: Prepared) -> dict:
    o, data = p.opts, p.run.data
    renderer = data.renderer
    return {"source": o.data or "stdlib", **data.source.log.to_json(), "passes": round(data.passes, 2),
            "self_distill": o.self_distill,
            "chat": None if renderer is None else {
                "template": o.chat_template or "the target tokenizer's", "mask": renderer.method,
                "counted": "assistant tokens only (empty reasoning blocks excluded)",
                "self_distill": "every assistant turn written by the target, turn by turn" if o.self_distill
                else None},
            "prompt_len": o.prompt_len if o.self_distill and renderer is None else None,
            "temperature": o.sd_temperature if o.self_distill else None,
            "seq_len": o.seq_len, "batch_per_rank": o.batch, "world_size": p.run.ranks.world, "seed": o.seed,
            "packing": o.packing, "padding_share": round(p.stream.padding_share, 5),
            "curriculum": [{"seq_len": s.length, "steps": s.steps, "rows_per_step": s.rows} for s in p.schedule.stages()]
            if o.curriculum else None,
            "sharding": p.shard.described}


def _heldout(p: Prepared) -> dict:
    o, h, source = p.opts, p.heldout, p.run.data.source
    return {"source": source.name + (" (held-out split)" if is_corpus_name(source.name) else " (tail, not trained on)"),
            "rows": int(h.ids.shape[0]), "seq_len": int(h.ids.shape[1]),
            "continuation": f"target greedy after {h.prompt} prompt tokens" if h.prompt
            else "the target's own assistant turns" if h.mask is not None and o.self_distill
            else "none (the held-out text itself)",
            "counted": "assistant tokens" if h.mask is not None else "every position"}


def build(p: Prepared, last: dict, final: list[float], wall: float, resumed: bool) -> dict:
    """The record of a finished run: `last` the last step's metrics row, `final` the last step's held-out agreement,
    `wall` the training time (resumed runs' included)."""
    o, c = p.opts, p.counters
    best, t = c.best, c.timing
    step_s = sum(t.values())
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "recycle_version": __version__,
        "from": str(Path(o.drafter).resolve()),
        "target": str(Path(o.target).resolve()),
        "init": o.init,
        "budget_tokens": o.tokens,
        "tokens": c.tokens,
        "steps": c.step,
        "data": _data(p),
        "losses": {**asdict(o.loss), "loss": o.loss.described(),
                   "terms": [{"term": t.name, "temperature": t.temperature or 1.0, "weight": t.weight}
                             for t in o.loss.terms()],
                   "draft_steps": p.unroller.steps, "objective": OBJECTIVE},
        "freeze": p.frozen,
        "optimizer": {"name": "AdamW", "lr": o.lr, "betas": [0.9, 0.95], "weight_decay": o.weight_decay,
                      "warmup": o.warmup, "schedule": "linear warm-up + cosine", "min_lr": o.min_lr, "clip": o.clip},
        "final": {"loss": last.get("loss"), "heldout_agreement_before": c.before,
                  "heldout_agreement_after": best["agree"], "heldout_agreement_last_step": final,
                  "heldout_estimate_before": round(expected_length(c.before), 4),
                  "heldout_estimate_after": round(best["estimate"], 4)},
        "selected": _selected(best, c.step),
        "heldout": _heldout(p),
        "target_io": p.target_io,
        "train_s": round(wall, 3),
        "setup_s": p.run.phases,
        "tokens_per_s": round(c.tokens / wall, 1) if wall else None,
        "timing": {k: round(v, 3) for k, v in t.items()},
        "target_forward_share": round(t["teacher_s"] / step_s, 4) if step_s else None,
        "overhead_share": round((t["data_s"] + t["optimizer_s"] + t["log_s"]) / step_s, 4) if step_s else None,
        "device": str(p.device),
        "precision": p.precision,
        "sharded": "fsdp2" if p.shard.sharded else None,
        # the most the run held at once: the CUDA allocator's peak, or the process's peak RSS on a CPU
        "peak_memory_bytes": torch.cuda.max_memory_allocated(p.device) if p.device.type == "cuda"
        else peak_rss_bytes(),
        "resumed": resumed,
        "time_estimate": c.time_estimate,
        "cache_hits": p.teacher.cache_hits,
        "trunk_loaded": p.teacher.model is not None,
        "online": None if p.producer is None else {
            "ahead": p.producer.ahead, "max_key_files": p.producer.max_present,
            "max_key_bytes": p.producer.max_bytes},
    }
