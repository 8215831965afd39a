"""One options object per command, each validated in one place (mergekit's MergeOptions is the model).

The CLI parses flags into these and the library takes them whole, so a check lives once, whoever calls:
`validate()` runs every check that needs no model (paths, ranges, which options go together). Options
that distill and harvest share (the data, the windows, the budget, self-distillation) are declared once,
in `DataOptions`, which both inherit: the two commands cannot disagree about what a window is.

This module imports nothing heavy; a check that needs the drafter-format records imports them when it runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from recycle.errors import RecycleError
from recycle.preflight import data_name, parse_tokens

DTYPES = ("bf16", "fp16", "fp32")  # storage (--dtype) and compute (--precision) names; torch's in checkpoint.py
PRECISIONS = ("bf16", "fp32")
CONVERT_OPTIONS = {  # the format-specific convert options, by their flag
    "heads": "--heads", "draft_vocab": "--draft-vocab", "vocab_corpus": "--vocab-corpus", "layouts": "--layouts",
    "calibrate": "--calibrate", "target": "--target", "data": "--data", "eagle3_attention": "--eagle3-attention",
}


def _choice(value: str | None, choices: Iterable[str], flag: str) -> None:
    choices = tuple(choices)
    if value is not None and value not in choices:
        raise RecycleError(f"{flag} {value!r}: choose from {', '.join(choices)}")


def _at_least(pairs: Iterable[tuple[str, int | None, int]]) -> None:
    for flag, value, low in pairs:
        if value is not None and value < low:
            raise RecycleError(f"{flag} must be at least {low}")


@dataclass(kw_only=True)
class ConvertOptions:
    """`recycle convert SOURCE --to FORMAT -o OUT`."""

    source: str
    to: str
    out: str
    dtype: str = "bf16"
    overwrite: bool = False
    heads: int | None = None  # medusa
    draft_vocab: int | None = None  # eagle3
    vocab_corpus: str | None = None  # eagle3, with draft_vocab
    layouts: tuple[str, ...] | str | None = None  # eagle
    eagle3_attention: str | None = None  # eagle3: llama (default) or mla
    calibrate: int | None = None  # medusa: tokens to fit the ResBlocks on
    calibrate_steps: int = 400
    target: str | None = None  # medusa with calibrate; eagle3/medusa from a Gemma 4 assistant
    data: str | None = None  # with calibrate

    def validate(self) -> None:
        """Every check that reads no tensor; the format record says which options apply to it."""
        from recycle.formats import convertible, get

        fmt = get(self.to)
        if not fmt.convertible:
            raise RecycleError(f"--to {self.to}: recycle convert writes {', '.join(convertible())}")
        if self.dtype not in DTYPES:
            raise RecycleError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        given = {k for k in CONVERT_OPTIONS if getattr(self, k) is not None}
        for key in sorted(given - fmt.options):
            takers = [name for name in convertible() if key in get(name).options]
            raise RecycleError(f"{CONVERT_OPTIONS[key]} applies to --to {' or --to '.join(takers)} only")
        if self.vocab_corpus is not None and self.draft_vocab is None:
            raise RecycleError("--vocab-corpus needs --draft-vocab N")
        if "calibrate" in fmt.options and self.calibrate is None and (self.target or self.data) is not None:
            raise RecycleError("--target/--data need --calibrate TOKENS")
        _at_least((("--heads", self.heads, 1), ("--calibrate", self.calibrate, 1)))
        data_name(self.data)


@dataclass(frozen=True)
class LossConfig:
    """distill's objective weights (why these defaults: `recycle/distill/losses.py`)."""

    ce_weight: float = 0.1
    kl_weight: float = 1.0
    feature_weight: float = 0.0
    decay: float = 0.8


@dataclass(kw_only=True)
class DataOptions:
    """What a distillation reads, shared by distill and harvest: the same options name the same windows."""

    target: str
    tokens: int
    data: str | None = None  # corpus name, file, JSONL, directory or saved dataset (None: the stdlib corpus)
    seq_len: int = 256
    batch: int = 8  # sequences per step and rank
    seed: int = 0
    self_distill: bool = False
    prompt_len: int = 64
    sd_temperature: float = 0.0
    eval_rows: int = 16  # the held-out batch
    eval_prompt_len: int = 64  # its rows keep this many tokens; the target writes the rest

    def validate(self) -> None:
        if isinstance(self.tokens, str):
            self.tokens = parse_tokens(self.tokens)
        if self.tokens < 1:
            raise RecycleError("--tokens: the budget must be at least 1 token")
        if self.seq_len < 8:
            raise RecycleError("--seq-len must be at least 8")
        _at_least((("--batch", self.batch, 1), ("--prompt-len", self.prompt_len, 1)))
        if self.self_distill and not 1 <= self.prompt_len < self.seq_len:
            raise RecycleError(f"--prompt-len must be in [1, {self.seq_len - 1}], got {self.prompt_len}")
        if not (self.sd_temperature >= 0 and math.isfinite(self.sd_temperature)):
            raise RecycleError("--sd-temperature must be 0 (greedy) or a positive number")
        data_name(self.data)


@dataclass(kw_only=True)
class DistillOptions(DataOptions):
    """`recycle distill DRAFTER --target TARGET`."""

    drafter: str
    out: str | None = None  # default: DRAFTER-distilled beside the input
    lr: float = 5e-4
    warmup: float = 0.05
    min_lr: float = 0.1  # fraction of lr at the end of the cosine
    weight_decay: float = 0.0
    clip: float = 0.5
    draft_steps: int | None = None
    loss: LossConfig | None = None  # None: the defaults
    init: str = "recycled"  # or "scratch"
    checkpoint_every: int = 50
    eval_every: int = 25
    resume: bool = False
    state_dir: str | None = None
    cache_hidden: str | None = None
    online: int | None = None  # harvest in vLLM while training into cache_hidden, this many steps' keys ahead
    vllm_parallel: dict | None = None  # with online: vLLM's own parallelism arguments
    device: str | None = None
    precision: str | None = None  # None: bf16 where the device has native bf16, else fp32
    threads: int | None = None
    overwrite: bool = False
    snapshots: tuple[int, ...] = ()  # token counts at which to write a drafter dir (the experiment)
    snapshot_dir: str | None = None

    def validate(self) -> None:
        super().validate()
        _choice(self.init, ("recycled", "scratch"), "--init")
        _choice(self.precision, PRECISIONS, "--precision")
        _at_least((("--checkpoint-every", self.checkpoint_every, 1), ("--eval-every", self.eval_every, 1),
                   ("--draft-steps", self.draft_steps, 1), ("--threads", self.threads, 1)))
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise RecycleError("--lr must be a positive number")
        if self.online is not None:
            if self.online < 1:
                raise RecycleError("--online must be at least 1 (steps' windows kept ahead)")
            if not self.cache_hidden:
                raise RecycleError("--online needs --cache-hidden DIR (where the windows pass through)")
            if self.self_distill:
                raise RecycleError("--online trains on the data's own text: not with --self-distill "
                                   "(harvest --self-distill ahead instead)")


@dataclass(kw_only=True)
class HarvestOptions(DataOptions):
    """`recycle harvest --target TARGET -o CACHE`: distill's windows, computed by vLLM ahead of it."""

    out: str
    aux_layers: tuple[int, ...] = ()  # EAGLE-3's eagle_aux_hidden_state_layer_ids (transformers' hidden_states ids)
    overwrite: bool = False
    parallel: dict | None = None  # vLLM's own names: tensor_parallel_size, pipeline_parallel_size, ...


__all__ = ["ConvertOptions", "DataOptions", "DistillOptions", "HarvestOptions", "LossConfig", "DTYPES",
           "PRECISIONS"]
