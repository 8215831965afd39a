"""One options object per command, each validated in one place (mergekit's MergeOptions is the model).

The CLI parses flags into these and the library takes them whole, so a check lives once, whoever calls:
`validate()` runs every check that needs no model (paths, ranges, which options go together). Options
that distill and harvest share (the data, the windows, the budget, self-distillation) are declared once,
in `DataOptions`, which both inherit: the two commands cannot disagree about what a window is.

This module imports nothing heavy; a check that needs the drafter-format records imports them when it runs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from recycle import kinds
from recycle.errors import RecycleError, did_you_mean
from recycle.preflight import (
    DEFAULT_SHARD_SIZE, checkpoint_dir, data_name, data_path, drafter_dir, model_dir, output_dir, parse_size,
    parse_tokens)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # OWNER/NAME
DTYPES = ("bf16", "fp16", "fp32")  # storage (--dtype) and compute (--precision) names; torch's in checkpoint.py
PRECISIONS = ("bf16", "fp32")
MLP_WIDTHS = ("shared", "wide")  # --eagle3-mlp: the midlayer's MLP at the shared expert's width, or the target's
CONVERT_OPTIONS = {  # the format-specific convert options, by their flag
    "heads": "--heads", "draft_vocab": "--draft-vocab", "vocab_corpus": "--vocab-corpus", "layouts": "--layouts",
    "calibrate": "--calibrate", "target": "--target", "data": "--data", "eagle3_attention": "--eagle3-attention",
    "eagle3_mlp": "--eagle3-mlp", "module": "--module", "eagle3_names": "--eagle3-names",
}


def _choice(value: str | None, choices: Iterable[str], flag: str) -> None:
    choices = tuple(choices)
    if value is not None and value not in choices:
        raise RecycleError(f"{flag} {value!r}: choose from {', '.join(choices)}{did_you_mean(value, choices)}")


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
    eagle3_mlp: str | None = None  # eagle3 with calibrate: wide (the default on a MoE block) or shared
    calibrate: int | None = None  # medusa: tokens to fit the ResBlocks on; eagle3: to fit the midlayer on
    calibrate_steps: int | None = None  # None: the calibration's own default (Medusa 400; EAGLE-3 by its tokens)
    target: str | None = None  # with calibrate; eagle3/medusa from a Gemma 4 assistant; gguf: the trunk GGUF file
    data: str | None = None  # with calibrate
    module: int | None = None  # gguf: which MTP module to write (llama.cpp drafts with one)
    eagle3_names: str | None = None  # eagle3: official (midlayer.*, the default) or speculators (layers.0.*)
    max_shard_size: int | str | None = DEFAULT_SHARD_SIZE  # bytes (or "5GB"); None: every file whole

    def inputs(self) -> tuple[str | None, ...]:
        """Every path convert reads: -o may be none of them, inside one or around one."""
        return self.source, self.target, data_path(self.data), data_path(self.vocab_corpus)

    def validate(self) -> None:
        """Every check that reads no tensor; the format record says which options apply to it."""
        from recycle.formats import convertible, get

        self.max_shard_size = parse_size(self.max_shard_size)
        checkpoint_dir(self.source)
        output_dir(self.out, self.overwrite, self.inputs())
        fmt = get(self.to)
        target_file = fmt.target_file is not None and self.target is not None
        if target_file:  # a file the format pairs with (gguf: the trunk GGUF), read by its converter
            if not Path(self.target).is_file() or not str(self.target).endswith(fmt.target_file):
                raise RecycleError(f"--target {self.target}: --to {self.to} takes the trunk's {fmt.target_file} "
                                   "file (no such file)")
        elif self.target is not None:
            checkpoint_dir(self.target)
        if not fmt.convertible:
            raise RecycleError(f"--to {self.to}: recycle convert writes {', '.join(convertible())}")
        allowed = DTYPES + fmt.extra_dtypes  # the GGUF side file also takes llama.cpp's q8_0
        if self.dtype not in allowed:
            raise RecycleError(f"unknown dtype '{self.dtype}' (choose from {', '.join(allowed)})"
                               f"{did_you_mean(self.dtype, allowed)}")
        given = {k for k in CONVERT_OPTIONS if getattr(self, k) is not None}
        for key in sorted(given - fmt.options):
            takers = [name for name in convertible() if key in get(name).options]
            raise RecycleError(f"{CONVERT_OPTIONS[key]} applies to --to {' or --to '.join(takers)} only")
        if self.vocab_corpus is not None and self.draft_vocab is None:
            raise RecycleError("--vocab-corpus needs --draft-vocab N")
        if "calibrate" in fmt.options and self.calibrate is None and self.data is not None:
            raise RecycleError("--data needs --calibrate TOKENS")
        _choice(self.eagle3_mlp, MLP_WIDTHS, "--eagle3-mlp")
        if self.eagle3_names is not None:
            _choice(self.eagle3_names, tuple(fmt.spellings), "--eagle3-names")
        if self.eagle3_mlp == "wide" and self.calibrate is None:
            raise RecycleError("--eagle3-mlp wide needs --calibrate TOKENS (the routed experts it adds are chosen, "
                               "scaled and fitted there)")
        _at_least((("--heads", self.heads, 1), ("--calibrate", self.calibrate, 1), ("--module", self.module, 0),
                   ("--calibrate-steps", self.calibrate_steps, 1)))
        data_name(self.data)
        from recycle.formats import of_config

        drafter_source = of_config(kinds.source(self.source)) is not None  # a Gemma 4 assistant
        if self.target is not None and self.calibrate is None and not drafter_source and not target_file:
            raise RecycleError("--target needs --calibrate TOKENS here (alone it is for a Gemma 4 assistant source, "
                               "which drafts for it; MTP modules carry their trunk's norm and head)")
        if self.target is not None and not target_file:
            kinds.target(self.target)
        elif self.calibrate is not None:
            if drafter_source:
                raise RecycleError(f"--calibrate: {self.source} is a drafter; pass the model it drafts for as --target")
            kinds.target(self.source, "--calibrate runs the source as its own target (no --target):")


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
    chat_template: str | None = None  # a Jinja file replacing the target tokenizer's chat template (conversations)
    save_regenerated: str | None = None  # --self-distill on conversations: append each regenerated one here (JSONL)

    def inputs(self) -> tuple[str | None, ...]:
        """Every path the run reads: its output may be none of them, inside one or around one."""
        return self.target, data_path(self.data), self.chat_template

    def validate(self) -> None:
        model_dir(self.target)
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise RecycleError(f"--chat-template {self.chat_template}: no such file")
        if self.save_regenerated is not None and not self.self_distill:
            raise RecycleError("--save-regenerated keeps what --self-distill regenerates: pass --self-distill")
        if isinstance(self.tokens, str):
            self.tokens = parse_tokens(self.tokens)
        if self.tokens < 1:
            raise RecycleError("--tokens: the budget must be at least 1 token")
        if self.seq_len < 8:
            raise RecycleError("--seq-len must be at least 8")
        _at_least((("--batch", self.batch, 1), ("--prompt-len", self.prompt_len, 1)))
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
    freeze: tuple[str, ...] = ()  # parameter groups kept as they are (distill/freeze.py)
    micro_batch: int | None = None  # rows per forward/backward; the step's gradient accumulates over them
    activation_checkpointing: bool = False  # EAGLE: each draft step's decoder layer recomputed in backward
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

    def inputs(self) -> tuple[str | None, ...]:
        return self.drafter, *super().inputs(), self.cache_hidden

    def validate(self) -> None:
        drafter_dir(self.drafter)
        super().validate()
        _choice(self.init, ("recycled", "scratch"), "--init")
        _choice(self.precision, PRECISIONS, "--precision")
        _device_name(self.device)
        _at_least((("--checkpoint-every", self.checkpoint_every, 1), ("--eval-every", self.eval_every, 1),
                   ("--draft-steps", self.draft_steps, 1), ("--threads", self.threads, 1),
                   ("--micro-batch", self.micro_batch, 1)))
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
        kinds.drafter(self.drafter)
        kinds.target(self.target)
        if self.cache_hidden is not None:
            kinds.cache(self.cache_hidden)


@dataclass(kw_only=True)
class HarvestOptions(DataOptions):
    """`recycle harvest --target TARGET -o CACHE`: distill's windows, computed by vLLM ahead of it."""

    out: str
    aux_layers: tuple[int, ...] = ()  # EAGLE-3's eagle_aux_hidden_state_layer_ids (transformers' hidden_states ids)
    overwrite: bool = False
    parallel: dict | None = None  # vLLM's own names: tensor_parallel_size, pipeline_parallel_size, ...
    gpu_memory_utilization: float | None = None  # vLLM's share of device memory; None: the machine's default

    def validate(self) -> None:
        super().validate()
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RecycleError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: a share in (0, 1]")
        output_dir(self.out, self.overwrite, self.inputs())
        kinds.target(self.target)


@dataclass(kw_only=True)
class StitchOptions:
    """`recycle stitch OVERLAY --target TARGET -o OUT`."""

    overlay: str
    target: str
    out: str
    overwrite: bool = False
    mtp_dtype: str = "auto"  # into a quantized target: its scheme (auto) or BF16 in the ignore list
    max_shard_size: int | str | None = DEFAULT_SHARD_SIZE  # the stitched MTP file's shards

    def inputs(self) -> tuple[str | None, ...]:
        return self.overlay, self.target

    def validate(self) -> None:
        self.max_shard_size = parse_size(self.max_shard_size)
        _choice(self.mtp_dtype, ("auto", "bf16"), "--mtp-dtype")
        checkpoint_dir(self.overlay)
        checkpoint_dir(self.target)
        output_dir(self.out, self.overwrite, self.inputs())
        kinds.target(self.target)


MAX_NEW_TOKENS = 32768  # bench/plan --max-new-tokens: beyond, a run takes hours and outgrows most targets' positions


@dataclass(kw_only=True)
class BenchOptions:
    """`recycle bench DRAFTER --target TARGET`."""

    drafter: str | None  # drafter directory; None with native=True: the target's own MTP modules
    target: str
    prompts: list[tuple[str, object]] | None = None  # (set, text or Conversation); None: recycle.prompts.default_prompts()
    chat_template: str | None = None  # a Jinja file in place of the target tokenizer's (conversation prompts)
    max_new_tokens: int = 128
    temperature: float = 0.0
    tree: str | None = None
    device: str | None = None  # None: cuda when available, else cpu
    precision: str = "fp32"  # the target's and drafter's compute dtype
    native: bool = False
    compare_hf: bool = False
    seed: int = 0
    warmup: bool = True
    stop_at_eos: bool = True
    repeats: int = 1  # time each prompt this many times per decoder and keep the fastest (shared machines)
    save: bool = False  # also write the report as DRAFTER/bench.json (the model card's benchmark)

    def validate(self) -> None:
        """Reject bad options before any loading (so the CLI fails fast, before its progress bar)."""
        _at_least((("--max-new-tokens", self.max_new_tokens, 1), ("--repeats", self.repeats, 1)))
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise RecycleError(f"--max-new-tokens {self.max_new_tokens}: at most {MAX_NEW_TOKENS} per prompt (a "
                               "benchmark's tokens/s settles within a few hundred)")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise RecycleError("--temperature must be a finite number ≥ 0")
        _choice(self.precision, DTYPES, "--precision")
        _device_name(self.device)
        if self.drafter is None and not self.native:
            raise RecycleError("give a DRAFTER_DIR, or --native-mtp to draft with the target's own MTP modules")
        if self.drafter is not None:
            drafter_dir(self.drafter)
        model_dir(self.target)
        from recycle.decoding.drafting import parse_shape  # torch: after the checks that need none

        parse_shape(self.tree, 1)
        kinds.target(self.target)
        native = self.drafter is None or Path(self.drafter).resolve() == Path(self.target).resolve()
        if not native:
            kinds.drafter(self.drafter)
        if self.save:
            self._check_save(native)

    def _check_save(self, native: bool) -> None:
        """--save writes into the drafter directory: there must be one, and not the target checkpoint itself
        (native MTP drafts with the target's own modules, and recycle never writes into a source)."""
        import os

        if native or self.native:
            raise RecycleError("--save: native MTP has no drafter directory (the drafter is the target checkpoint, "
                               "which recycle never writes into); use --json > FILE")
        if not os.access(self.drafter, os.W_OK):
            raise RecycleError(f"--save: cannot write into {self.drafter}")


@dataclass(kw_only=True)
class PlanOptions:
    """`recycle plan DRAFTER --target TARGET`: bench's measurement, then the predictions."""

    bench: BenchOptions
    gpus: list[str] = field(default_factory=lambda: ["H100", "H200", "A100", "L40S", "RTX4090"])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 128])  # the roofline's batch sizes
    context: int = 2048  # tokens already cached per sequence in the roofline
    max_chain: int = 8
    verify_max: int = 32
    model_config: str | None = None  # roofline this config (e.g. the full-size model's) with the measured τ
    plot: str | None = None

    def validate(self) -> None:
        from recycle.hardware import gpu

        self.bench.validate()
        for g in self.gpus:
            gpu(g)
        if not self.batches or any(b < 1 for b in self.batches):
            raise RecycleError("--batch-sizes: expected positive integers")
        if self.max_chain < 1 or self.verify_max < 2 or self.context < 0:
            raise RecycleError("--max-chain ≥ 1, --context ≥ 0")
        if self.plot is not None and not Path(self.plot).expanduser().resolve().parent.is_dir():
            raise RecycleError(f"--plot {self.plot}: no such directory {Path(self.plot).parent}")


@dataclass(kw_only=True)
class PushOptions:
    """`recycle push DRAFTER --repo OWNER/NAME`."""

    drafter: str
    repo: str
    private: bool = False
    revision: str | None = None
    commit_message: str | None = None
    base_model: str | None = None  # the card's base_model (a Hub id), only as given
    license: str | None = None
    dry_run: bool = False
    card_out: str | None = None
    attempts: int | None = None  # None: RECYCLE_HUB_ATTEMPTS or 3
    backoff: float | None = None  # None: RECYCLE_HUB_BACKOFF or 2 s

    def validate(self) -> None:
        from recycle.preflight import drafter_record

        if not HUB_ID.match(self.repo):
            raise RecycleError(f"--repo {self.repo!r}: expected OWNER/NAME")
        if self.base_model is not None and not HUB_ID.match(self.base_model):
            raise RecycleError(f"--base-model {self.base_model!r}: expected the Hub id (OWNER/NAME) of the model the "
                               "drafter drafts for")
        if self.revision is not None and (not self.revision.strip() or self.revision.startswith("refs/")):
            raise RecycleError(f"--revision {self.revision!r}: give a branch name")
        drafter_record(self.drafter)
        if self.card_out is not None:
            out, src = Path(self.card_out).expanduser().resolve(), Path(self.drafter).expanduser().resolve()
            if out == src or src in out.parents:
                raise RecycleError(f"--card-out {out}: inside the drafter directory; push never writes there")


def parse_batch_sizes(value: str) -> list[int]:
    """`--batch-sizes 1,8,32,128`: positive integers, comma-separated."""
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out):
        raise RecycleError(f"--batch-sizes {value!r}: expected positive integers separated by commas, e.g. 1,8,32")
    return sorted(set(out))


def _device_name(name: str | None) -> None:
    if name is not None and name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise RecycleError(f"--device {name!r}: choose cpu or cuda{did_you_mean(name, ('cpu', 'cuda'))}")


__all__ = ["BenchOptions", "PlanOptions", "PushOptions", "StitchOptions", "parse_batch_sizes", "ConvertOptions", "DataOptions", "DistillOptions", "HarvestOptions", "LossConfig", "DTYPES",
           "PRECISIONS"]
