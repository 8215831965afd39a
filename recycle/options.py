"""One options object per command, each validated in one place (mergekit's MergeOptions is the model).

The CLI parses flags into these and the library takes them whole, so a check lives once, whoever calls:
`validate()` runs every check that needs no model (paths, ranges, which options go together). Options
that distill and harvest share (the data, the windows, the budget, self-distillation) are declared once,
in `DataOptions`, which both inherit: the two commands cannot disagree about what a window is.

Each command-line flag is declared here, once, on the field it sets (`cli`/`opt`: its names, help, choices,
default, hidden old name); `recycle.flags` makes the Typer parameters from these fields.

This module imports nothing heavy; a check that needs the drafter-format records imports them when it runs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path

from recycle import kinds
from recycle.errors import RecycleError, did_you_mean
from recycle.preflight import (
    DEFAULT_SHARD_SIZE,
    RECORDS,
    checkpoint_dir,
    data_name,
    data_path,
    drafter_dir,
    model_dir,
    output_dir,
    parse_size,
    parse_tokens,
    target_context,
)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # OWNER/NAME
DTYPES = ("bf16", "fp16", "fp32")  # storage (--dtype) and compute (--precision) names; torch's in checkpoint.py
PRECISIONS = ("bf16", "fp32")
MLP_WIDTHS = ("shared", "wide")  # --eagle3-mlp: the midlayer's MLP at the shared expert's width, or the target's
CONVERT_OPTIONS = ("heads", "draft_vocab", "vocab_corpus", "layouts", "calibrate", "target", "data",  # per format
                   "eagle3_attention", "eagle3_mlp", "module", "eagle3_names")


FIELD_DEFAULT = object()  # a flag whose default on the command line is its field's


@dataclass(frozen=True)
class Old:
    """A flag's hidden old spelling (`flag` None: the argument's old place), still accepted with a `note`."""

    flag: str | None
    note: str


@dataclass(frozen=True)
class Flag:
    """How the command line sets a field: `recycle.flags` makes the Typer parameter from this."""

    names: tuple[str, ...]  # none: a positional argument
    help: str
    type: type | None = None  # what the command line parses; None: the default's type, else str
    metavar: str | None = None
    choices: tuple[str, ...] | Callable[[], Iterable[str]] = ()  # shown as [a|b]; `_chosen` checks the value
    cli_default: object = FIELD_DEFAULT  # on the command line, where it is not the field's (None: not given)
    parse: Callable | None = None  # the command line's value → the field's
    old: Old | None = None


def flag(*names: str, help: str, **kw) -> Flag:
    return Flag(names, help, **kw)


def cli(spec: Flag, default=MISSING, factory=MISSING, **change) -> Field:
    """A field the command line sets through `spec` (a flag several options share; `change` adapts it here)."""
    return field(default=default, default_factory=factory, metadata={"flag": replace(spec, **change)})


def opt(*names: str, help: str, default=MISSING, factory=MISSING, **kw) -> Field:
    """A field with its own flag."""
    return cli(flag(*names, help=help, **kw), default, factory)


def nested(cls: type, default=MISSING) -> Field:
    """A field holding another options object, whose flags are the command's too."""
    return field(default=default, metadata={"options": cls})


def flag_of(cls: type, name: str) -> Flag:
    return next(f.metadata["flag"] for f in fields(cls) if f.name == name)


def _formats() -> list[str]:
    from recycle.formats import convertible

    return convertible()


def _tokens_or_none(value: str | None) -> int | None:
    return parse_tokens(value, "--calibrate") if value else None


# -- flags that several options share -------------------------------------------------------------------------
CHECKPOINT = flag(help="Checkpoint directory (config.json + *.safetensors).", metavar="CKPT_DIR", type=Path)
TARGET = flag("--target", help="Target model directory.", metavar="TARGET_DIR", type=Path, cli_default=None)
OLD_TARGET = "TARGET_DIR as {} is deprecated; use --target TARGET_DIR"  # before --target, it was an argument
OUTPUT = flag("-o", "--output", help="Output directory (default: ./INPUT-SUFFIX here; it must not exist, see "
              "--overwrite).", metavar="OUT_DIR", type=Path, cli_default=None)
OVERWRITE = flag("--overwrite", help="Replace an existing output directory that recycle wrote (or an empty one).")
MAX_SHARD_SIZE = flag("--max-shard-size", help="Split each safetensors file larger than this into shards with an "
                      "index (huggingface_hub's naming: model-00001-of-00003.safetensors; every engine and recycle "
                      "command reads either form); none: one file each.", metavar="SIZE")
CHAT_TEMPLATE = flag("--chat-template", help="A Jinja chat template file, used in place of the target tokenizer's "
                     "own (needed for conversations when it has none).")
SEED = flag("--seed", help="Seed for the data order (and initialisation, sampling).")
HARVEST_ENGINES = ("vllm", "transformers")  # `recycle harvest --engine`
DEVICE = flag("--device", help="Default: cuda when available.", choices=("cpu", "cuda"))
FAMILY = flag("--family", help="The family-table row to read the checkpoint as (`recycle inspect --json` names the "
              "detected one), when its tensor names match one row and config.json names another.", metavar="NAME",
              cli_default=None)
THREADS = flag("--threads", help="torch CPU threads (default: torch's choice).", type=int, cli_default=None)


def _choice(value: str | None, choices: Iterable[str], flag: str) -> None:
    choices = tuple(choices)
    if value is not None and value not in choices:
        raise RecycleError(f"{flag} {value!r}: choose from {', '.join(choices)}{did_you_mean(value, choices)}")


def _chosen(opts: object, name: str) -> None:
    """The field's value is one of its flag's choices."""
    spec = flag_of(type(opts), name)
    _choice(getattr(opts, name), spec.choices, spec.names[-1])


@dataclass(frozen=True)
class Every:
    """A cadence (--checkpoint-every, --eval-every): every `count` steps, or, written with a k/M/B suffix, every
    `count` tokens (a plain integer stays steps, as before)."""

    count: int
    tokens: bool = False

    @classmethod
    def parse(cls, value: int | str, option: str) -> Every:
        text = str(value).strip().replace("_", "")
        if text.isdigit():
            if int(text) < 1:
                raise RecycleError(f"{option} must be at least 1")
            return cls(int(text))
        count = text.removesuffix("tokens").strip()  # the normalised spelling (`value`) reads back
        if isinstance(value, str) and count and (count != text or count[-1].isalpha()):
            return cls(parse_tokens(count, option), tokens=True)
        raise RecycleError(f"{option} {value!r}: expected steps (50) or tokens with a k/M/B suffix (50M)")

    @property
    def value(self) -> int | str:
        """The option's normalised value: steps as an int, tokens as `<count> tokens`."""
        return f"{self.count} tokens" if self.tokens else self.count

    def due(self, step: int, before: int, after: int) -> bool:
        """Whether step `step`, which took the run from `before` to `after` tokens, ends a period. A function of the
        counters a checkpoint keeps, so a resumed run keeps an uninterrupted run's cadence exactly."""
        return after // self.count > before // self.count if self.tokens else step % self.count == 0


def _at_least(pairs: Iterable[tuple[str, int | None, int]]) -> None:
    for flag, value, low in pairs:
        if value is not None and value < low:
            raise RecycleError(f"{flag} must be at least {low}")


@dataclass(kw_only=True)
class ConvertOptions:
    """`recycle convert SOURCE --to FORMAT -o OUT`."""

    source: str = cli(CHECKPOINT)
    to: str = opt("--to", help="Drafter format.", choices=_formats)
    out: str = cli(OUTPUT)
    dtype: str = opt("--dtype", help="Storage dtype of the output (--to gguf also q8_0: llama.cpp's 8-bit blocks, "
                     "the head and embeddings kept f16).", choices=DTYPES, default="bf16")
    overwrite: bool = cli(OVERWRITE, False)
    heads: int | None = opt("--heads", help="--to medusa: heads (default 3).", type=int, default=None)
    draft_vocab: int | None = opt("--draft-vocab", help="--to eagle3: draft vocabulary size (the top-N corpus tokens; "
                                  "default: the full vocabulary).", type=int, default=None)
    vocab_corpus: str | None = opt("--vocab-corpus", help="--to eagle3: text to count tokens in (default: recycle's "
                                   "stdlib corpus).", type=Path, default=None)  # with draft_vocab
    layouts: tuple[str, ...] | str | None = opt("--layouts", help="--to eagle: comma list of recycle, nextn, overlay "
                                                "(default: all three).", default=None)
    eagle3_attention: str | None = opt("--eagle3-attention", help="--to eagle3: llama (default; every engine) or mla "
                                       "(MLA sources: vLLM's DeepSeek EAGLE-3, which pairs with MLA targets on vLLM's "
                                       "CPU backend).", choices=("llama", "mla"), default=None)
    eagle3_mlp: str | None = opt("--eagle3-mlp", help="--to eagle3 with --calibrate: wide (the default for a MoE "
                                 "block: the target's dense width, the shared expert plus the routed experts picked "
                                 "most often, then fitted) or shared (the shared expert's width).", choices=MLP_WIDTHS,
                                 default=None)
    calibrate: int | None = opt("--calibrate", help="--to medusa: fit each ResBlock to the source head on this many "
                                "tokens (e.g. 64k) instead of the identity. --to eagle3: fit the folded midlayer to "
                                "the MTP module on them.", metavar="TOKENS", parse=_tokens_or_none, default=None)
    calibrate_steps: int | None = opt("--calibrate-steps", help="With --calibrate: optimizer steps of the fit (fewer: "
                                      "faster, looser; default: Medusa 400, EAGLE-3 one per 80 tokens and at least "
                                      "400, e.g. 1,600 for 128k).", type=int, default=None)
    target: str | None = opt("--target", help="With --calibrate: the model whose states the heads read (default: "
                             "the checkpoint). From a Gemma 4 assistant: the model it drafts for. --to gguf: the trunk "
                             "GGUF the side file pairs with (its header and token_embd are copied).", metavar="TARGET",
                             type=Path, default=None)
    data: str | None = opt("--data", help="With --calibrate: calibration text, as distill's --data.", default=None)
    module: int | None = opt("--module", help="--to gguf: the one MTP module to write (needed when the checkpoint "
                             "has several and llama.cpp drafts with one; Step-3.5/3.7's side file holds all three "
                             "unless this picks one).", type=int, default=None)
    eagle3_names: str | None = opt("--eagle3-names", help="--to eagle3: tensor names for official (midlayer.*: vLLM, "
                                   "SGLang, SpecForge; the default) or speculators (layers.0.*: vLLM, speculators).",
                                   metavar="[official|speculators]", default=None)  # the format's spellings
    max_shard_size: int | str | None = cli(MAX_SHARD_SIZE, DEFAULT_SHARD_SIZE)  # bytes (or "5GB"); None: whole files
    family: str | None = cli(FAMILY, None)

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
            raise RecycleError(f"{flag_of(ConvertOptions, key).names[-1]} applies to --to {' or --to '.join(takers)} "
                               "only")
        if self.vocab_corpus is not None and self.draft_vocab is None:
            raise RecycleError("--vocab-corpus needs --draft-vocab N")
        if "calibrate" in fmt.options and self.calibrate is None and self.data is not None:
            raise RecycleError("--data needs --calibrate TOKENS")
        _chosen(self, "eagle3_mlp")
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


LOSS_TERMS = {  # --loss's term names: what each compares (chunk-wise, distill/losses.py)
    "kl": "KL(P_target ‖ P_draft)",
    "tv": "total variation ½·Σ|P_target − P_draft|: 1 − the acceptance of a draft sampled from P_draft",
    "ce": "cross-entropy to the data label",
}
DEFAULT_LOSS = "kl,ce=0.1"  # the terms --kl-weight and --ce-weight weigh when --loss is not given
# the default for a drafter served at --temperature > 0: measured on the post-trained and chat fixtures at T = 0, 0.7
# and 1 (BENCHMARKS.md, "Which loss for sampled serving"), kl, tv and kl+tv stayed within each other's 95% intervals
# at every temperature, on both prompt sets; no term won, so sampled serving keeps the greedy default
SAMPLED_LOSS = DEFAULT_LOSS


@dataclass(frozen=True)
class LossTerm:
    """One weighted term of --loss: `kl`, `tv` (both distributions at temperature 1, or at T: `kl@T`, `tv@T`) or `ce`."""

    name: str
    temperature: float | None = None  # None: 1 (the logits as they are)
    weight: float = 1.0

    @property
    def key(self) -> str:
        """The term's name in the metrics and the record: kl, tv, ce, kl@0.7 ..."""
        return self.name if self.temperature is None else f"{self.name}@{self.temperature:g}"

    def spec(self) -> str:
        return self.key if self.weight == 1 else f"{self.key}={self.weight:g}"


def _number(text: str, what: str, item: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise RecycleError(f"--loss {item}: the {what} must be a finite number ≥ 0, got {text!r}")
    return value


def parse_loss(text: str) -> tuple[LossTerm, ...]:
    """--loss: terms `NAME[@T][=WEIGHT]` joined by `,` or `+` (kl, tv, kl@0.7, ce=0.1 ...; weight 1 where none is
    given). An unknown term, a temperature on ce, a repeated term or no weight above 0 is a one-line error."""
    terms: dict[str, LossTerm] = {}
    for item in (x.strip() for x in re.split(r"[,+]", text)):
        if not item:
            raise RecycleError(f"--loss {text!r}: an empty term (terms are NAME[@T][=WEIGHT], joined by , or +)")
        head, _, w = item.partition("=")
        name, at, t = head.strip().partition("@")
        if name not in LOSS_TERMS:
            raise RecycleError(f"--loss: unknown term {name!r} in {item!r}{did_you_mean(name, list(LOSS_TERMS))} "
                               "(kl, tv, kl@T, tv@T, ce)")
        temperature = None
        if at:
            if name == "ce":
                raise RecycleError(f"--loss {item}: ce compares with the data's token and takes no temperature")
            temperature = _number(t, "temperature", item)
            if temperature == 0:
                raise RecycleError(f"--loss {item}: the temperature must be above 0 (T = 0 is greedy: no "
                                   "distribution to compare)")
            temperature = None if temperature == 1 else temperature
        term = LossTerm(name, temperature, _number(w, "weight", item) if w else 1.0)
        if term.key in terms:
            raise RecycleError(f"--loss {text!r}: {term.key} is named twice")
        terms[term.key] = term
    if not any(t.weight > 0 for t in terms.values()):
        raise RecycleError(f"--loss {text!r}: every weight is 0: nothing to train toward")
    return tuple(terms.values())


@dataclass(frozen=True)
class LossConfig:
    """distill's objective weights (why these defaults: `recycle/distill/losses.py`)."""

    ce_weight: float = opt("--ce-weight", help="Weight of CE to the data label.", default=0.1)
    kl_weight: float = opt("--kl-weight", help="β: weight of KL(P_target ‖ P_draft).", default=1.0)
    feature_weight: float = opt("--feature-weight", help="Smooth-L1 feature regression (EAGLE).", default=0.0)
    decay: float = opt("--step-decay", help="Weight of draft step k ∝ decay^k.", default=0.8)
    loss: str | None = opt("--loss", metavar="TERM[=W],...", help="The objective's terms, each NAME[@T][=WEIGHT], "
                           "joined by , or +: kl (KL(P_target ‖ P_draft)), tv (total variation: 1 − the acceptance "
                           "of drafts sampled at T = 1), kl@T / tv@T (both sides at temperature T), ce (the data "
                           f"label). Default {DEFAULT_LOSS} (--kl-weight, --ce-weight), or the --temperature "
                           "default.", default=None)
    temperature: float | None = opt("--temperature", metavar="T", help="The temperature the drafter will serve at: "
                                    "picks the default --loss (measured, docs/distill.md). Default 0 (greedy).",
                                    type=float, default=None)

    def terms(self) -> tuple[LossTerm, ...]:
        """The weighted terms: --loss, else the --temperature default, else kl and ce at --kl-weight, --ce-weight."""
        defaults = {f.name: f.default for f in fields(LossConfig)}
        changed = [flag for name, flag in (("kl_weight", "--kl-weight"), ("ce_weight", "--ce-weight"))
                   if getattr(self, name) != defaults[name]]
        if self.temperature is not None and not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RecycleError(f"--temperature {self.temperature:g}: must be a finite number ≥ 0")
        if self.loss is not None:
            if changed:
                raise RecycleError(f"--loss names every term's weight: drop {' and '.join(changed)}")
            return parse_loss(self.loss)
        if self.temperature and not changed:
            return parse_loss(SAMPLED_LOSS)
        return tuple(t for t in (LossTerm("kl", None, self.kl_weight), LossTerm("ce", None, self.ce_weight))
                     if t.weight or t.name == "kl")

    def described(self) -> str:
        """The objective as --loss would spell it (the record's `loss`)."""
        return ",".join(t.spec() for t in self.terms())


@dataclass(kw_only=True)
class DataOptions:
    """What a distillation reads, shared by distill and harvest: the same options name the same windows."""

    target: str = cli(TARGET)
    tokens: int = opt("--tokens", help="Budget in target tokens read: 64k, 2M, 1.5B ...", cli_default=None)
    data: str | None = opt("--data", help="Text file, JSONL/JSON rows ('text', OpenAI 'messages' or ShareGPT "
                           "'conversations'), directory of text files, a saved `datasets` dataset, or hf:NAME (a "
                           "dataset in the local datasets cache, offline); its tail is held out. Or a corpus: stdlib "
                           "(default) or py:PACKAGE (an installed package's source). Conversations render with the "
                           "target's chat template; only assistant tokens count.", default=None)
    seq_len: int = opt("--seq-len", help="Tokens per packed sequence, up to the target's context "
                       "(max_position_embeddings).", default=256)
    packing: str = opt("--packing", help="whole: a document that fits a window stays in one (first-fit, the rest "
                       "masked padding); stream: documents concatenated and cut, no padding.",
                       choices=("whole", "stream"), default="whole")
    batch: int = opt("--batch", help="Sequences per optimizer step and rank.", default=8)
    seed: int = cli(SEED, 0)
    self_distill: bool = opt("--self-distill", help="The target writes each sequence after its first --prompt-len "
                             "tokens (its own distribution); on conversations, every assistant turn, turn by turn.",
                             default=False)
    prompt_len: int = opt("--prompt-len", help="Self-distillation prompt tokens per sequence.", default=64)
    sd_temperature: float = opt("--sd-temperature", help="Self-distillation sampling temperature (0: greedy).",
                                default=0.0)
    eval_rows: int = 16  # the held-out batch
    eval_prompt_len: int = 64  # its rows keep this many tokens; the target writes the rest
    chat_template: str | None = cli(CHAT_TEMPLATE, None)  # a Jinja file in place of the tokenizer's template
    save_regenerated: str | None = opt("--save-regenerated", help="With --self-distill on conversations: append each "
                                       "regenerated conversation to this JSONL (reuse it as --data).", default=None)

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
        _chosen(self, "packing")
        data_name(self.data)
        context = target_context(self.target)
        if context is not None and self.seq_len > context:
            raise RecycleError(f"--seq-len {self.seq_len} is past the target's context: {self.target} has "
                               f"{context} positions (max_position_embeddings)")


def parse_curriculum(text: str | None, seq_len: int, rows: int) -> tuple[tuple[int, float], ...]:
    """--curriculum: window lengths run before --seq-len, in order, each `LEN` or `LEN:SHARE` (a share of the
    budget; without shares each stage gets an equal share, the rest runs at --seq-len). Lengths rise, stay below
    --seq-len and divide `rows` × --seq-len (the tokens a step reads stay the same: rows per step = rows × seq_len /
    LEN). Returns ((length, share), ...); empty without a curriculum."""
    if not text:
        return ()
    items = [x.strip() for x in str(text).split(",")]
    stages: list[tuple[int, float | None]] = []
    for item in items:
        n, colon, share = item.partition(":")
        try:
            length = int(n)
            frac = float(share) if colon else None
        except ValueError:
            raise RecycleError(f"--curriculum {text}: stages are LEN or LEN:SHARE (e.g. 256,1024 or "
                               f"256:0.25,1024:0.25), got {item!r}") from None
        if length < 8 or length >= seq_len:
            raise RecycleError(f"--curriculum {text}: a stage's window ({length}) must be at least 8 and shorter "
                               f"than --seq-len {seq_len}")
        if stages and length <= stages[-1][0]:
            raise RecycleError(f"--curriculum {text}: windows run short to long: {length} after {stages[-1][0]}")
        if (rows * seq_len) % length:
            raise RecycleError(f"--curriculum {text}: a step reads {rows} × {seq_len} = {rows * seq_len} tokens, "
                               f"which {length}-token windows do not divide; choose a length that does")
        if frac is not None and not (0 < frac < 1 and math.isfinite(frac)):
            raise RecycleError(f"--curriculum {text}: a stage's share of the budget is in (0, 1), got {share!r}")
        stages.append((length, frac))
    given = [f for _, f in stages if f is not None]
    if given and len(given) != len(stages):
        raise RecycleError(f"--curriculum {text}: give every stage a share or none")
    if not given:
        return tuple((length, 1 / (len(stages) + 1)) for length, _ in stages)
    if sum(given) >= 1:
        raise RecycleError(f"--curriculum {text}: the shares sum to {sum(given):g}; under 1 leaves --seq-len its share")
    return tuple((length, float(f)) for length, f in stages)


@dataclass(kw_only=True)
class DistillOptions(DataOptions):
    """`recycle distill DRAFTER --target TARGET`."""

    drafter: str = cli(flag(help="Drafter directory (from `recycle convert`, or a Gemma 4 assistant: re-aligned in "
                            "its own layout).", metavar="DRAFTER_DIR", type=Path))
    out: str | None = cli(OUTPUT, None, old=Old("--out", "--out is deprecated; use -o/--output"))
    lr: float = opt("--lr", help="Peak AdamW learning rate.", default=5e-4)
    warmup: float = 0.05
    min_lr: float = 0.1  # fraction of lr at the end of the cosine
    weight_decay: float = 0.0
    clip: float = 0.5
    draft_steps: int | None = opt("--draft-steps", help="Unrolled draft steps (default 3; Medusa: its heads).",
                                  type=int, default=None)
    loss: LossConfig | None = nested(LossConfig, None)  # None: the defaults
    init: str = opt("--init", help="The converted weights, or re-initialised (the same architecture).",
                    choices=("recycled", "scratch"), default="recycled")
    freeze: tuple[str, ...] = opt("--freeze", metavar="GROUP,...", help="Parameter groups that stay as they are: "
                                  "experts, shared_experts, router, mlp, attention, norms, projection (e.g. --freeze "
                                  "experts: DeepSeek-V3's drafter then trains 0.34B of its 11.6B parameters).",
                                  default=(), cli_default=None, parse=lambda groups: tuple((groups or "").split(",")))
    micro_batch: int | None = opt("--micro-batch", help="Rows per forward/backward; the step's gradient accumulates "
                                  "over them, so --batch is the step and memory follows this.", type=int, default=None)
    activation_checkpointing: bool = opt("--activation-checkpointing", help="EAGLE drafters: recompute each draft "
                                         "step's decoder layer in backward instead of keeping its activations (one "
                                         "more forward of each layer; --plan shows what it saves).", default=False)
    checkpoint_every: int | str = opt("--checkpoint-every", help="Steps between checkpoints, or tokens with a k/M/B "
                                      "suffix (50M: a checkpoint each time the run passes a multiple of 50M tokens).",
                                      metavar="STEPS|TOKENS", type=str, default=50)
    eval_every: int | str = opt("--eval-every", help="Steps between held-out agreement checks, or tokens with a k/M/B "
                                "suffix (as --checkpoint-every).", metavar="STEPS|TOKENS", type=str, default=25)
    resume: bool = opt("--resume", help="Continue from the last checkpoint in OUT.distill/.", default=False)
    curriculum: str | None = opt("--curriculum", metavar="LEN[:SHARE],...", help="Shorter windows first: each LEN "
                                 "runs before --seq-len, in order, on an equal share of the budget (or SHARE of it: "
                                 "256:0.25,1024:0.25), the rest at --seq-len; a step reads the same tokens in every "
                                 "stage (rows × --seq-len / LEN rows).", default=None)
    state_dir: str | None = None
    cache_hidden: str | None = opt("--cache-hidden", help="Store/reuse the target's features per batch here; a "
                                   "`recycle harvest` cache is read without loading the target.", metavar="CACHE_DIR",
                                   type=Path, default=None)
    online: int | None = opt("--online", help="Harvest in vLLM while training, at most N steps' windows ahead in "
                             "--cache-hidden (disk stays flat); the target is never loaded here. Under torchrun vLLM "
                             "runs beside rank 0.", metavar="N", type=int, default=None)
    follow: bool = opt("--follow", help="With --cache-hidden: read a harvest still being written (recycle harvest "
                       "--engine transformers --ahead N, on other GPUs or nodes, the directory shared): wait for each "
                       "step's windows and delete them once read, so disk stays at N keys.", default=False)
    vllm_parallel: dict | None = None  # with online: vLLM's own parallelism arguments
    teacher: str | None = opt("--teacher", help="A teacher server's URL (`recycle teacher serve`): each step's "
                              "features stream from it and the target's trunk is loaded nowhere here; each rank "
                              "fetches its rows.", metavar="URL", default=None)
    teacher_ahead: int = opt("--teacher-ahead", help="With --teacher: steps fetched ahead of training (the shared "
                             "directory holds at most this many steps' files).", metavar="N", default=2)
    device: str | None = cli(DEVICE, None)
    nccl_timeout: float | None = opt("--nccl-timeout", help="Under torchrun: seconds a collective waits for the "
                                     "slowest rank before the run fails (default: torch's, 600 s for NCCL). The "
                                     "best-snapshot and end-of-run writes happen while the other ranks wait: raise it "
                                     "for a large drafter.", metavar="SECONDS", type=float, default=None)
    precision: str | None = opt("--precision", help="Compute dtype (default: bf16 on CUDA and CPUs with native bf16, "
                                "else fp32).", choices=PRECISIONS, default=None)
    threads: int | None = cli(THREADS, None)
    overwrite: bool = opt("--overwrite", help="Replace OUT and any earlier run's checkpoint.", default=False)
    host_ram: float | None = opt("--host-ram", help="With --plan: each node's RAM in GB (default: this machine's); "
                                 "a plan that needs more is refused.", metavar="GB", type=float, default=None)
    gpus_per_node: int = opt("--gpus-per-node", help="With --plan: ranks per node (host RAM per node, the teacher's "
                             "placement).", metavar="N", type=int, default=8)

    def inputs(self) -> tuple[str | None, ...]:
        return self.drafter, *super().inputs(), self.cache_hidden

    def stages(self) -> tuple[tuple[int, float], ...]:
        """--curriculum's (window length, share of the budget) before --seq-len; empty without one."""
        stages = parse_curriculum(self.curriculum, self.seq_len, self.batch)
        if stages:
            for flag, value in (("--cache-hidden", self.cache_hidden), ("--teacher", self.teacher)):
                if value is not None:
                    raise RecycleError(f"--curriculum: not with {flag} (its windows are all --seq-len long); "
                                       "drop one of them")
            if self.self_distill and not self.prompt_len < stages[0][0]:
                raise RecycleError(f"--curriculum {self.curriculum}: --prompt-len {self.prompt_len} leaves nothing "
                                   f"for the target to write in {stages[0][0]}-token windows")
        return stages

    def validate(self) -> None:
        drafter_dir(self.drafter)
        super().validate()
        _chosen(self, "init")
        _chosen(self, "precision")
        _device_name(self.device)
        self.checkpoint_every = Every.parse(self.checkpoint_every, "--checkpoint-every").value
        self.eval_every = Every.parse(self.eval_every, "--eval-every").value
        _at_least((("--draft-steps", self.draft_steps, 1), ("--threads", self.threads, 1),
                   ("--micro-batch", self.micro_batch, 1)))
        if self.loss is not None:
            self.loss.terms()  # an unknown term or a bad weight: one line, before anything loads
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise RecycleError("--lr must be a positive number")
        if self.nccl_timeout is not None and not (self.nccl_timeout > 0 and math.isfinite(self.nccl_timeout)):
            raise RecycleError(f"--nccl-timeout {self.nccl_timeout:g}: must be a positive number of seconds")
        if self.online is not None:
            if self.online < 1:
                raise RecycleError("--online must be at least 1 (steps' windows kept ahead)")
            if not self.cache_hidden:
                raise RecycleError("--online needs --cache-hidden DIR (where the windows pass through)")
            if self.self_distill:
                raise RecycleError("--online trains on the data's own text: not with --self-distill "
                                   "(harvest --self-distill ahead instead)")
        if self.follow and (not self.cache_hidden or self.online is not None):
            raise RecycleError("--follow reads a harvest in --cache-hidden DIR as it is written: give --cache-hidden, "
                               "and not --online (which harvests in this run)")
        if self.teacher is not None:
            _teacher_url(self)
        self.stages()
        if self.cache_hidden is not None:
            manifest = Path(self.cache_hidden).expanduser() / "manifest.json"
            try:
                window = json.loads(manifest.read_text()).get("seq_len") if manifest.is_file() else None
            except (OSError, ValueError, AttributeError):
                window = None
            if isinstance(window, int) and window != self.seq_len:  # as check_manifest says it, before any model
                raise RecycleError(f"--cache-hidden {self.cache_hidden}: harvested for other options: seq_len {window} "
                                   f"(distill: {self.seq_len})")
        kinds.drafter(self.drafter)
        kinds.target(self.target)
        if self.cache_hidden is not None:
            kinds.cache(self.cache_hidden)


HARVEST_STATE = ".harvest"  # CACHE/.harvest/: an unfinished harvest's state, shared by its shards


@dataclass(kw_only=True)
class HarvestOptions(DataOptions):
    """`recycle harvest --target TARGET -o CACHE`: distill's windows, computed by vLLM ahead of it."""

    target: str = cli(TARGET, old=Old(None, OLD_TARGET.format("an argument")))
    out: str = cli(OUTPUT)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3's eagle_aux_hidden_state_layer_ids (transformers' hidden_states ids)
    overwrite: bool = cli(OVERWRITE, False)
    parallel: dict | None = None  # vLLM's own names: tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel
    gpu_memory_utilization: float | None = opt("--gpu-memory-utilization", help="vLLM's own: its share of each "
                                               "device's memory (default 0.9 on GPUs, 0.5 of RAM on CPUs).",
                                               type=float, default=None)
    shard: str | None = opt("--shard", help="i/N: harvest only shard i (0 ≤ i < N) of the windows, one engine, into the "
                            "same -o as the other shards (a shared filesystem across nodes); the last shard to finish "
                            "writes the manifest.", metavar="I/N", default=None)
    convert_workers: int = opt("--convert-workers", help="Threads turning vLLM's files into cache files (the final "
                               "norm); 0: min(8, CPUs).", default=0)
    plan: bool = opt("--plan", help="Print the cache's storage, the teacher's prefill FLOPs and hours, and the GPUs its "
                     "weights need, from the configs alone; runs nothing.", default=False)
    gpu: str | None = opt("--gpu", help="With --plan: the GPU the engines run on (H100, H200, ...).", default=None)
    engine: str = opt("--engine", help="What runs the target: vllm (its parallel options spread it), or transformers "
                      "(recycle's own teacher, in this process, as distill runs it: the one engine that keeps "
                      "DeepSeek-V4's hyper-connection streams, which its drafters train on).",
                      choices=HARVEST_ENGINES, default="vllm")
    device: str | None = cli(DEVICE, None)  # --engine transformers: where the target runs
    keep_quantized: bool = opt("--keep-quantized", help="--engine transformers on GPUs: keep a block-FP8 release's "
                               "FP8 weights and FP4 experts as stored (transformers' own kernels; activations "
                               "quantized to FP8 per token, as engines serve it) instead of dequantizing to bf16: "
                               "DeepSeek-V4-Pro then fits one node of 8 H200s.", default=False)
    ahead: int | None = opt("--ahead", help="--engine transformers: a harvest distill consumes as it goes (`distill "
                            "--cache-hidden DIR --follow`, which deletes each step's windows once read): at most N "
                            "unread keys on disk; the manifest comes first.", metavar="N", type=int, default=None)
    gpus: int = opt("--gpus", help="--engine transformers: spread the target over this many GPUs of this node (whole "
                    "decoder layers each, read tensor by tensor onto them); run one shard per GPU group, each with "
                    "CUDA_VISIBLE_DEVICES naming its GPUs.", metavar="N", default=1)
    precision: str | None = opt("--precision", help="--engine transformers: compute dtype (default: distill's, bf16 "
                                "on CUDA and CPUs with native bf16, else fp32).", choices=PRECISIONS, default=None)

    def shards(self) -> tuple[int, int]:
        """(i, N) of --shard i/N; (0, 1) without it."""
        if self.shard is None:
            return 0, 1
        i, _, n = str(self.shard).partition("/")
        try:
            i, n = int(i), int(n)
        except ValueError:
            raise RecycleError(f"--shard {self.shard}: i/N with whole numbers, e.g. --shard 0/8") from None
        if n < 1 or not 0 <= i < n:
            raise RecycleError(f"--shard {self.shard}: i must be in [0, {max(n, 1) - 1}] (shards 0/N ... N-1/N)")
        return i, n

    def validate(self) -> None:
        super().validate()
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RecycleError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: a share in (0, 1]")
        if self.convert_workers < 0:
            raise RecycleError(f"--convert-workers {self.convert_workers}: 0 (automatic) or more")
        _, n = self.shards()
        if n > 1 and self.overwrite:
            raise RecycleError("--overwrite with --shard: the shards share -o; remove it once before starting them")
        if self.engine not in HARVEST_ENGINES:
            raise RecycleError(f"--engine {self.engine!r}: choose {' or '.join(HARVEST_ENGINES)}"
                               f"{did_you_mean(self.engine, HARVEST_ENGINES)}")
        if self.engine == "transformers" and (self.parallel or self.gpu_memory_utilization is not None):
            raise RecycleError("--engine transformers runs the target in this process: vLLM's parallel options and "
                               "--gpu-memory-utilization do not apply (run N shards instead: --shard i/N)")
        if self.engine == "vllm" and (self.device is not None or self.precision is not None or self.gpus != 1
                                      or self.keep_quantized):
            raise RecycleError("--device, --gpus, --keep-quantized and --precision are --engine transformers' (vLLM "
                               "takes this machine's build and dtype, and its parallel options)")
        if self.gpus < 1:
            raise RecycleError(f"--gpus {self.gpus}: 1 or more")
        if self.ahead is not None:
            if self.ahead < 1:
                raise RecycleError(f"--ahead {self.ahead}: 1 or more keys")
            if self.self_distill:
                raise RecycleError("--ahead with --self-distill: the continuations are all written before the first "
                                   "key; harvest them without --ahead")
            if self.engine != "transformers" or n > 1:
                raise RecycleError("--ahead: one --engine transformers harvest, unsharded (a vLLM teacher read as it "
                                   "goes is distill --online, or --teacher URL)")
        if self.gpus > 1 and self.device == "cpu":
            raise RecycleError(f"--gpus {self.gpus} with --device cpu: GPUs spread the target, a CPU holds it whole")
        _device_name(self.device)
        self.out_checked()
        kinds.target(self.target)

    def out_checked(self, *also: str | Path) -> None:
        """-o may be an unfinished harvest (its shards' or a killed run's state, `HARVEST_STATE`): it is resumed;
        `also`: more inputs it must not be."""
        unfinished = (Path(self.out).expanduser() / HARVEST_STATE / "plan.json").is_file()
        output_dir(self.out, self.overwrite or unfinished, (*self.inputs(), *also),
                   records=(*RECORDS, f"{HARVEST_STATE}/plan.json") if unfinished else None)


@dataclass(kw_only=True)
class StitchOptions:
    """`recycle stitch OVERLAY --target TARGET -o OUT`."""

    overlay: str = cli(flag(help="An MTP overlay directory (OUT/mtp_overlay from convert --to eagle or distill).",
                            metavar="OVERLAY_DIR", type=Path))
    target: str = cli(TARGET, old=Old(None, OLD_TARGET.format("a second argument")))
    out: str = cli(OUTPUT)
    overwrite: bool = cli(OVERWRITE, False)
    mtp_dtype: str = opt("--mtp-dtype", help="Into a quantized target: auto writes the MTP weights as the engines "
                         "expect for its scheme (the target's own MTP storage where it has one; block FP8 re-quantized "
                         "with fresh scales; NVFP4/MXFP4/compressed-tensors through their codecs; else BF16 with the "
                         "scheme's ignore entry); bf16 keeps them BF16 and adds them to the scheme's ignore list "
                         "(ignore, exclude_modules, ignored_layers, modules_to_not_convert, GPTQ dynamic).",
                         choices=("auto", "bf16"), default="auto")
    max_shard_size: int | str | None = cli(MAX_SHARD_SIZE, DEFAULT_SHARD_SIZE)  # the stitched MTP file's shards

    def inputs(self) -> tuple[str | None, ...]:
        return self.overlay, self.target

    def validate(self) -> None:
        self.max_shard_size = parse_size(self.max_shard_size)
        _chosen(self, "mtp_dtype")
        checkpoint_dir(self.overlay)
        checkpoint_dir(self.target)
        output_dir(self.out, self.overwrite, self.inputs())
        kinds.target(self.target)


MAX_NEW_TOKENS = 32768  # bench/plan --max-new-tokens: beyond, a run takes hours and outgrows most targets' positions
GPUS, BATCH_SIZES = "H100,H200,A100,L40S,RTX4090", "1,8,32,128"  # plan's roofline, by default


def _names(value: str) -> list[str]:
    return [g for g in value.split(",") if g.strip()]


def _temperatures(value: str) -> tuple[float, ...]:
    """--temperature T[,T...] (each checked in BenchOptions.validate)."""
    out = []
    for item in value.split(","):
        try:
            out.append(float(item))
        except ValueError:
            raise RecycleError(f"--temperature {value}: {item.strip()!r} is not a number (e.g. 0,0.7,1.0)") from None
    return tuple(out)


def _buckets(value: str | None) -> tuple[tuple[int, int], ...]:
    """--context-buckets LO-HI[,LO-HI...] (recycle.contexts; checked again in BenchOptions.validate)."""
    from recycle.contexts import parse_buckets

    return parse_buckets(value)


def _rules(value: str | None) -> tuple[str, ...]:
    """--draft-sample RULE[,RULE...] (each checked in BenchOptions.validate); not given: the shape's default."""
    return () if value is None else tuple(r.strip() for r in value.split(","))


@dataclass(kw_only=True)
class BenchOptions:
    """`recycle bench DRAFTER --target TARGET`."""

    drafter: str | None = cli(flag(help="Drafter directory (from `recycle convert` or `distill`), or the target "
                                   "directory itself to draft with its own MTP modules.", metavar="DRAFTER_DIR",
                                   type=Path, cli_default=None))  # None with native=True: the target's own modules
    target: str = cli(TARGET)
    prompts: list[tuple[str, object]] | None = opt(  # (set, text or Conversation); None: prompts.default_prompts()
        "--prompts", help='JSONL, one {"prompt": "..."} or conversation ("messages" / "conversations", rendered with '
        'the chat template up to the assistant turn) per line (a "set" field groups them); or a corpus: stdlib '
        "(held-out code + English, the default) or py:PACKAGE.", default=None)
    chat_template: str | None = cli(CHAT_TEMPLATE, None)  # a Jinja file in place of the target tokenizer's
    max_new_tokens: int = opt("--max-new-tokens", help="New tokens per prompt.", default=128, cli_default=None,
                              type=int)
    temperatures: tuple[float, ...] = opt(
        "--temperature", metavar="T[,T...]", help="Temperatures, comma-separated (e.g. 0,0.7,1.0): 0 greedy, > 0 "
        "lossless speculative sampling; each is measured in turn.", cli_default="0", parse=_temperatures,
        factory=lambda: (0.0,))
    draft_samples: tuple[str, ...] = opt(
        "--draft-sample", metavar="RULE[,RULE...]", help="How drafts are chosen at T > 0, comma-separated (vLLM's "
        "draft_sample_method): greedy (the draft's top-k) or probabilistic (sampled from the draft's distribution; "
        "chains and static trees). Default: probabilistic, greedy on a dynamic tree.", cli_default=None,
        parse=_rules, factory=tuple)
    tree: str | None = opt("--tree", help="chain[:N], dynamic[:DEPTH,TOPK,TOTAL], or a JSON list of Medusa-style "
                           "paths (or a file holding one).", default=None)
    device: str | None = cli(DEVICE, None)  # None: cuda when available, else cpu
    precision: str = opt("--precision", help="Compute dtype.", choices=DTYPES, default="fp32", cli_default=None,
                         old=Old("--dtype", "--dtype is deprecated; use --precision"))  # the target's and drafter's
    native: bool = opt("--native-mtp", help="Draft with the target's own MTP modules.", default=False)
    compare_hf: bool = opt("--compare-hf", help="Also time transformers' generate: plain, use_mtp, assistant_model= (a "
                           "Gemma 4 assistant) and prompt lookup.", default=False)
    seed: int = cli(SEED, 0)
    warmup: bool = True
    stop_at_eos: bool = True
    repeats: int = opt("--repeats", help="Time each prompt N times per decoder, keep the fastest; the report gives "
                       "the spread over the N.", default=1)  # shared machines
    save: bool = opt("--save", help="Also write the --json report as DRAFTER_DIR/bench.json, which `recycle push` puts "
                     "in the model card (not with native MTP: recycle never writes into a target).", default=False)
    context_buckets: tuple[tuple[int, int], ...] = opt(
        "--context-buckets", metavar="LO-HI[,LO-HI...]", help="Also measure acceptance by context position: long "
        "prompts cut from held-out text to lengths spread across each bucket of positions (e.g. 0-512,512-2k,2k-8k; "
        "k = ×1024, M = ×1024²), each decoded once per temperature; per-bucket acceptance and its decay (slope per 1k "
        "positions, bootstrap interval).", cli_default=None, parse=_buckets, factory=tuple)
    context_prompts: int = opt("--context-prompts", help="Long prompts per context bucket; prompt k of every bucket "
                               "ends at the same held-out text (only the context before it grows).", default=4)
    data: str | None = opt("--data", help="With --context-buckets: the text long prompts are cut from (any --data "
                           "distill takes; only its held-out tail is read). Default: the --prompts corpus, else stdlib.",
                           default=None)

    def validate(self) -> None:
        """Reject bad options before any loading (so the CLI fails fast, before its progress bar)."""
        _at_least((("--max-new-tokens", self.max_new_tokens, 1), ("--repeats", self.repeats, 1)))
        self._check_contexts()
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise RecycleError(f"--max-new-tokens {self.max_new_tokens}: at most {MAX_NEW_TOKENS} per prompt (a "
                               "benchmark's tokens/s settles within a few hundred)")
        self._check_sweep()
        _chosen(self, "precision")
        _device_name(self.device)
        if self.drafter is None and not self.native:
            raise RecycleError("give a DRAFTER_DIR, or --native-mtp to draft with the target's own MTP modules")
        if self.drafter is not None:
            drafter_dir(self.drafter)
        model_dir(self.target)
        self._check_context_room()
        from recycle.decoding.tree import check_rule, parse_shape  # torch: after the checks that need none

        shape = parse_shape(self.tree, 1)  # no --tree: the engine's default, whose rule run_bench checks
        for rule in self.draft_samples:
            check_rule(rule, shape)
        kinds.target(self.target)
        native = self.drafter is None or Path(self.drafter).resolve() == Path(self.target).resolve()
        if not native:
            kinds.drafter(self.drafter)
        if self.save:
            self._check_save(native)

    @property
    def temperature(self) -> float:
        """The first --temperature: the one `overall`, the per-prompt rows and --compare-hf measure."""
        return self.temperatures[0]

    def _check_sweep(self) -> None:
        """--temperature and --draft-sample: finite temperatures ≥ 0 and known rules, none twice."""
        if not self.temperatures:
            raise RecycleError("--temperature: give at least one temperature, e.g. 0 or 0,0.7,1.0")
        for t in self.temperatures:
            if not (math.isfinite(t) and t >= 0):
                raise RecycleError(f"--temperature {t:g}: must be a finite number ≥ 0")
        for flag_name, values in (("--temperature", self.temperatures), ("--draft-sample", self.draft_samples)):
            seen = [v for i, v in enumerate(values) if v in values[:i]]
            if seen:
                raise RecycleError(f"{flag_name}: {seen[0]:g} is named twice" if isinstance(seen[0], float)
                                   else f"{flag_name}: {seen[0]} is named twice")

    def _check_contexts(self) -> None:
        """--context-buckets (ascending, non-overlapping), --context-prompts ≥ 1, --data only with buckets (and found)."""
        from recycle.contexts import parse_buckets

        self.context_buckets = parse_buckets(self.context_buckets)
        if not self.context_buckets:
            if self.data is not None:
                raise RecycleError("--data: long prompts are cut from it only with --context-buckets")
            return
        _at_least((("--context-prompts", self.context_prompts, 1),))
        data_name(self.data)

    def _check_context_room(self) -> None:
        """Each context bucket within the target's max_position_embeddings (its config.json alone) and wide enough
        for a prompt and --max-new-tokens (the tree's draft tokens: once its shape is known, recycle.bench)."""
        if self.context_buckets:
            from recycle.contexts import check_buckets
            from recycle.preflight import load_json, max_positions

            config = load_json(Path(self.target) / "config.json", "config.json")
            check_buckets(self.context_buckets, max_positions(config), self.max_new_tokens, 0)

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

    bench: BenchOptions = nested(BenchOptions)
    gpus: list[str] = opt("--gpu", help="GPUs for the roofline, comma-separated (H100, H200, H100-PCIe, A100, "
                          "A100-40GB, L40S, L4, RTX4090).", cli_default=GPUS, parse=_names,
                          factory=lambda: _names(GPUS))
    batches: list[int] = opt("--batch-sizes", help=f"Batch sizes for the roofline table [default: {BATCH_SIZES}].",
                             cli_default=None, factory=lambda: parse_batch_sizes(BATCH_SIZES),
                             old=Old("--batch", "--batch (plan) is deprecated; use --batch-sizes"))
    context: int = opt("--context", help="Tokens cached per sequence in the roofline.", default=2048)
    max_chain: int = opt("--max-chain", help="Longest chain measured (shorter ones are derived).", default=8)
    verify_max: int = 32
    model_config: str | None = opt("--model-config", help="Roofline this config.json instead of the target's (the "
                                   "full-size model a stand-in was measured for).", default=None)
    plot: str | None = opt("--plot", help="Write speedup against batch size (PNG).", metavar="OUT.png", type=Path,
                           default=None)

    def validate(self) -> None:
        from recycle.hardware import gpu

        if not isinstance(self.batches, list):  # the command line's --batch-sizes
            self.batches = parse_batch_sizes(BATCH_SIZES if self.batches is None else self.batches)
        self.bench.validate()
        if len(self.bench.temperatures) > 1:
            raise RecycleError(f"--temperature {','.join(f'{t:g}' for t in self.bench.temperatures)}: plan measures "
                               "at one temperature (its chains and trees are timed there); run it once per temperature")
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

    drafter: str = cli(flag(help="Drafter directory (from `recycle convert` or `recycle distill`).",
                            metavar="DRAFTER_DIR", type=Path))
    repo: str = opt("--repo", help="Hub repository, OWNER/NAME (created if missing).", metavar="OWNER/NAME")
    private: bool = opt("--private", help="Create the repository private.", default=False)
    revision: str | None = opt("--revision", help="Branch to commit to (created if missing; default main).",
                               default=None)
    commit_message: str | None = opt("--commit-message", help="Commit summary.", default=None)
    base_model: str | None = opt("--base-model", help="Hub id of the target model for the card's base_model.",
                                 default=None)  # only as given
    license: str | None = opt("--license", help="Hub license id for the card (default: from the source's config, "
                              "README or LICENSE).", default=None)
    dry_run: bool = opt("--dry-run", help="Validate, write the card and list the files; upload nothing.", default=False)
    card_out: str | None = opt("--card-out", help="Also write the model card here (outside the drafter directory); "
                               "--dry-run prints it otherwise.", type=Path, default=None)
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


def _teacher_url(o: DistillOptions) -> None:
    """--teacher: an http(s) URL, and none of the other teachers."""
    if not re.match(r"^https?://[^/\s]+", o.teacher):
        raise RecycleError(f"--teacher {o.teacher!r}: a server's URL, e.g. http://HOST:8000")
    for given, name in ((o.online is not None, "--online"), (o.cache_hidden, "--cache-hidden"), (o.follow, "--follow"),
                        (o.self_distill, "--self-distill")):
        if given:
            raise RecycleError(f"--teacher streams the features of the data's own text: not with {name}")
    _at_least((("--teacher-ahead", o.teacher_ahead, 1),))


@dataclass(kw_only=True)
class TeacherServeOptions:
    """`recycle teacher serve TARGET --shared-dir DIR`: the target in vLLM's own server, for `distill --teacher URL`."""

    target: str = cli(flag(help="Target model directory (every node of the server reads it at this path).",
                           metavar="TARGET_DIR", type=Path))
    shared_dir: str = opt("--shared-dir", help="Where the server writes each request's hidden states: a directory "
                          "every trainer node reads at the same path (a shared filesystem across nodes).",
                          metavar="DIR", type=Path)
    aux_layers: tuple[int, ...] = opt("--aux-layers", metavar="I,J,...", help="EAGLE-3's aux layers (transformers' "
                                      "hidden_states ids) captured beside the last layer.", default=(),
                                      cli_default=None, parse=lambda v: tuple(int(i) for i in (v or "").split(",")
                                                                              if i.strip()))
    port: int = opt("--port", help="The server's port (vLLM's own).", default=8000)
    host: str | None = opt("--host", help="The address it listens on (vLLM's own; default all).", default=None)
    max_model_len: int | None = opt("--max-model-len", help="vLLM's own: the longest row (at least distill's "
                                    "--seq-len + 1); default the model's.", type=int, default=None)
    gpu_memory_utilization: float | None = opt("--gpu-memory-utilization", help="vLLM's own: its share of each "
                                               "device's memory (default 0.9 on GPUs, 0.5 of RAM on CPUs).",
                                               type=float, default=None)
    # vLLM's own parallel options, passed through under its names (vLLM 0.32 engine/arg_utils.py:1134-1276)
    tensor_parallel_size: int = opt("--tensor-parallel-size", help="vLLM's own.", default=1)
    pipeline_parallel_size: int = opt("--pipeline-parallel-size", help="vLLM's own.", default=1)
    data_parallel_size: int = opt("--data-parallel-size", help="vLLM's own: engine replicas.", default=1)
    data_parallel_size_local: int | None = opt("--data-parallel-size-local", help="vLLM's own: replicas on this node.",
                                               type=int, default=None)
    data_parallel_start_rank: int | None = opt("--data-parallel-start-rank", help="vLLM's own: this node's first "
                                               "replica (secondary nodes).", type=int, default=None)
    data_parallel_address: str | None = opt("--data-parallel-address", help="vLLM's own: the data-parallel head "
                                            "node's address.", default=None)
    data_parallel_rpc_port: int | None = opt("--data-parallel-rpc-port", help="vLLM's own: the data-parallel RPC "
                                             "port (the same on every node).", type=int, default=None)
    enable_expert_parallel: bool = opt("--enable-expert-parallel", help="vLLM's own: experts split over the ranks.",
                                       default=False)
    nnodes: int = opt("--nnodes", help="vLLM's own: nodes one engine spans (multi-node TP/PP).", default=1)
    node_rank: int = opt("--node-rank", help="vLLM's own: this node's rank among --nnodes.", default=0)
    master_addr: str | None = opt("--master-addr", help="vLLM's own: node 0's address (multi-node).", default=None)
    master_port: int | None = opt("--master-port", help="vLLM's own: node 0's port (multi-node).", type=int,
                                  default=None)
    headless: bool = opt("--headless", help="vLLM's own: a secondary node (workers only, no API server).",
                         default=False)
    print_only: bool = opt("--print", help="Print the vllm serve command line and exit.", default=False)

    PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "data_parallel_size_local",
                "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port",
                "enable_expert_parallel", "nnodes", "node_rank", "master_addr", "master_port", "headless")

    def parallel(self) -> dict:
        """The parallel options given (not at vLLM's defaults), under vLLM's names."""
        defaults = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1, "nnodes": 1,
                    "node_rank": 0}
        return {k: getattr(self, k) for k in self.PARALLEL
                if getattr(self, k) not in (None, False) and getattr(self, k) != defaults.get(k)}

    def validate(self) -> None:
        model_dir(self.target)
        kinds.target(self.target)
        _at_least((("--tensor-parallel-size", self.tensor_parallel_size, 1),
                   ("--pipeline-parallel-size", self.pipeline_parallel_size, 1),
                   ("--data-parallel-size", self.data_parallel_size, 1), ("--nnodes", self.nnodes, 1),
                   ("--max-model-len", self.max_model_len, 2), ("--port", self.port, 1)))
        if not 0 <= self.node_rank < self.nnodes:
            raise RecycleError(f"--node-rank {self.node_rank}: in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master_addr:
            raise RecycleError("--nnodes > 1: pass --master-addr (node 0's address), as vLLM's launcher needs")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RecycleError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: a share in (0, 1]")
        if any(i < 0 for i in self.aux_layers):
            raise RecycleError(f"--aux-layers {','.join(map(str, self.aux_layers))}: layer ids are 0 or more")
        shared = Path(self.shared_dir).expanduser()
        if shared.exists() and not shared.is_dir():
            raise RecycleError(f"--shared-dir {shared}: not a directory")


def _device_name(name: str | None) -> None:
    if name is not None and name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise RecycleError(f"--device {name!r}: choose cpu or cuda{did_you_mean(name, ('cpu', 'cuda'))}")


__all__ = ["BenchOptions", "PlanOptions", "PushOptions", "StitchOptions", "parse_batch_sizes", "ConvertOptions", "DataOptions", "DistillOptions", "HarvestOptions", "LossConfig", "LossTerm", "parse_loss", "DTYPES",
           "TeacherServeOptions",
           "PRECISIONS"]
