"""What `recycle bench` measured, typed: `run_bench` returns a `BenchResult`; the report, the model card, push's
check of a saved `bench.json`, plan and the benchmark scripts read its attributes.

`to_json()` is the `--json` report and, less `saved`, the `bench.json` that `--save` writes (the same keys in the
same order, floats as measured: docs/bench.md lists the schema). `from_json()` reads such a report back, a file
written by an earlier version included: the keys added since (`rollbacks`, a prompt's `speedup` and `repeats`,
`spread`, `notes`, `saved`, `sweep`, `contexts`) take their empty values, and keys of a later version are skipped. A report without `overall.spec.tau`, or with a piece of the
wrong shape, raises `ValueError`. Imports no torch: push's validation and the card read saved files with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Self


def _plain(v: Any) -> Any:
    if is_dataclass(v):
        return v.to_json()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _tuple(v: Any) -> tuple:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"expected a list, got {type(v).__name__}")
    return tuple(v)


class _Record:
    """JSON in field order (nested records and tuples as JSON objects and lists), and back."""

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def _read(cls, d: Any, what: str, older: dict | None = None, **convert) -> Self:
        """An instance from the keys of `d` that name fields (a converter per field where the JSON value is not the
        field's value; None stays None). `older`: the values of keys that reports of earlier versions lack."""
        if not isinstance(d, dict):
            raise ValueError(f"{what} is not an object")
        kw = dict(older or {})
        for f in fields(cls):
            if f.name in d:
                v = d[f.name]
                kw[f.name] = convert[f.name](v) if f.name in convert and v is not None else v
        missing = [f.name for f in fields(cls) if f.name not in kw]
        if missing:
            raise ValueError(f"{what} has no {', '.join(missing)}")
        return cls(**kw)

    @classmethod
    def from_json(cls, d: Any) -> Self:
        return cls._read(d, cls.__name__)


@dataclass(frozen=True)
class Quartiles(_Record):
    """min, q1, median, q3, max (inclusive quartiles: a handful of prompts is the whole population)."""

    min: float
    q1: float
    median: float
    q3: float
    max: float


@dataclass(frozen=True)
class Span(_Record):
    """How far a rate ranged: its lowest, its highest, and their ratio."""

    min: float
    max: float
    ratio: float


@dataclass(frozen=True)
class PromptSpread(_Record):
    """Across prompts: the quartiles of per-prompt speedup (None: no AR run took time) and τ, and how far AR
    decoding's steps per second ranged (None: no AR run decoded a step)."""

    speedup: Quartiles | None
    tau: Quartiles
    ar_decode_steps_per_s: Span | None

    @classmethod
    def from_json(cls, d: Any) -> PromptSpread:
        return cls._read(d, "spread.prompts", speedup=Quartiles.from_json, tau=Quartiles.from_json,
                         ar_decode_steps_per_s=Span.from_json)


@dataclass(frozen=True)
class RepeatSpread(_Record):
    """Across --repeats: each repeat's overall figures, every prompt timed once."""

    n: int
    speedup: Quartiles
    ar_tokens_per_s: Quartiles
    spec_tokens_per_s: Quartiles

    @classmethod
    def from_json(cls, d: Any) -> RepeatSpread:
        return cls._read(d, "spread.repeats", speedup=Quartiles.from_json, ar_tokens_per_s=Quartiles.from_json,
                         spec_tokens_per_s=Quartiles.from_json)


@dataclass(frozen=True)
class Spread(_Record):
    """How much the figures move; `loaded`: AR decoding's speed ranged so far across prompts that the machine was
    busy with other work."""

    prompts: PromptSpread
    repeats: RepeatSpread | None
    loaded: bool

    @classmethod
    def from_json(cls, d: Any) -> Spread:
        return cls._read(d, "overall.spread", prompts=PromptSpread.from_json, repeats=RepeatSpread.from_json)


@dataclass(frozen=True)
class Measure(_Record):
    """One side (autoregressive or speculative) summed over every prompt. Times in seconds; `acceptance[d]` =
    `accepted[d]` / `tried[d]` at draft depth d+1; `rollbacks`: a hybrid target's steps whose recurrent states
    went back."""

    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    steps: int
    tau: float
    acceptance: tuple[float, ...]
    accepted: tuple[int, ...]
    tried: tuple[int, ...]
    draft_s: float
    verify_s: float
    prefill_s: float
    tree_nodes_per_step: float
    rollbacks: int

    @classmethod
    def from_json(cls, d: Any, what: str = "overall") -> Measure:
        return cls._read(d, what, {"rollbacks": 0}, acceptance=_tuple, accepted=_tuple, tried=_tuple)


@dataclass(frozen=True)
class Predicted(_Record):
    """The cost model (recycle/bench.py's docstring): τ from acceptance, per-step costs in AR steps, speedup."""

    tau: float
    c_draft: float
    c_verify: float
    speedup: float


@dataclass(frozen=True)
class Overall(_Record):
    """Every prompt together: both sides, the measured speedup (None: AR took no time), the cost model's, how many
    prompts decoded exactly as AR did (greedy only), and the spread."""

    ar: Measure
    spec: Measure
    speedup: float | None
    predicted: Predicted
    greedy_match: str | None
    spread: Spread | None

    @classmethod
    def from_json(cls, d: Any) -> Overall:
        spec = d.get("spec") if isinstance(d, dict) else None
        if not isinstance(spec, dict) or "tau" not in spec:
            raise ValueError("no overall.spec.tau")
        return cls._read(d, "overall", {"spread": None}, ar=lambda v: Measure.from_json(v, "overall.ar"),
                         spec=lambda v: Measure.from_json(v, "overall.spec"), predicted=Predicted.from_json,
                         spread=Spread.from_json)


@dataclass(frozen=True)
class PromptRun(_Record):
    """One side's decode of one prompt (the fastest of --repeats): the decode loop's counts and times, its tokens
    per second, and (the speculative side only) τ."""

    new_tokens: int
    forwards: int
    rollbacks: int
    steps: int
    tree_nodes: int
    prefill_s: float
    draft_s: float
    verify_s: float
    total_s: float
    tried: tuple[int, ...]
    accepted: tuple[int, ...]
    tokens_per_s: float
    tau: float | None  # the AR side has none (nor the key)

    def to_json(self) -> dict:
        out = super().to_json()
        if self.tau is None:
            del out["tau"]
        return out

    @classmethod
    def from_json(cls, d: Any, what: str = "prompt") -> PromptRun:
        return cls._read(d, what, {"rollbacks": 0, "tau": None}, tried=_tuple, accepted=_tuple)


@dataclass(frozen=True)
class PromptRepeats(_Record):
    """Each repeat's tokens per second, AR and speculative (--repeats > 1)."""

    ar_tokens_per_s: tuple[float, ...]
    spec_tokens_per_s: tuple[float, ...]

    @classmethod
    def from_json(cls, d: Any) -> PromptRepeats:
        return cls._read(d, "prompt repeats", ar_tokens_per_s=_tuple, spec_tokens_per_s=_tuple)


@dataclass(frozen=True)
class PromptResult(_Record):
    """One prompt: its set (code, text, user), length and opening text, both sides, the speedup (None: AR took no
    time), whether the tokens equal AR's (greedy only), and the repeats' speeds."""

    set: str
    prompt_tokens: int
    text: str
    ar: PromptRun
    spec: PromptRun
    speedup: float | None
    greedy_match: bool | None
    repeats: PromptRepeats | None

    @classmethod
    def from_json(cls, d: Any) -> PromptResult:
        return cls._read(d, "prompt", {"speedup": None, "repeats": None}, ar=lambda v: PromptRun.from_json(v, "prompt.ar"),
                         spec=lambda v: PromptRun.from_json(v, "prompt.spec"), repeats=PromptRepeats.from_json)


@dataclass(frozen=True)
class Bandwidth(_Record):
    """Memory bandwidth in GB/s: the card's datasheet peak and what each side moved (weights × forwards / time)."""

    peak_gbs: float
    ar_gbs: float
    spec_gbs: float


@dataclass(frozen=True)
class HfPeer(_Record):
    """transformers' own `generate` on the same prompts (--compare-hf): None figures where it failed (`error`)."""

    method: str
    new_tokens: int
    seconds: float
    tokens_per_s: float | None
    greedy_match: str | None
    error: str | None
    speedup_vs_our_ar: float | None

    @classmethod
    def from_json(cls, d: Any) -> HfPeer:
        return cls._read(d, "hf", {"speedup_vs_our_ar": None})


@dataclass(frozen=True)
class ContextPrompt(_Record):
    """One long prompt's decode (--context-buckets): its bucket, where in the held-out stream it ends (prompt k of
    every bucket ends at the same place), its length, the tokens it generated, its context position (length + half
    the generated tokens), steps, per-depth counts, τ."""

    bucket: str
    end: int
    prompt_tokens: int
    new_tokens: int
    position: float
    steps: int
    tried: tuple[int, ...]
    accepted: tuple[int, ...]
    tau: float

    @classmethod
    def from_json(cls, d: Any) -> ContextPrompt:
        return cls._read(d, "contexts prompt", tried=_tuple, accepted=_tuple)


@dataclass(frozen=True)
class ContextBucket(_Record):
    """One bucket's prompts together: positions [lo, hi), acceptance per depth (accepted / tried), τ."""

    bucket: str
    lo: int
    hi: int
    prompts: int
    new_tokens: int
    acceptance: tuple[float, ...]
    accepted: tuple[int, ...]
    tried: tuple[int, ...]
    tau: float

    @classmethod
    def from_json(cls, d: Any) -> ContextBucket:
        return cls._read(d, "contexts bucket", acceptance=_tuple, accepted=_tuple, tried=_tuple)


@dataclass(frozen=True)
class ContextDecay(_Record):
    """Per-prompt depth-1 acceptance against context position: the least-squares slope per 1k positions (None: fewer
    than two distinct positions) and its 95% bootstrap interval over prompts (None: fewer than three)."""

    slope_per_1k: float | None
    low: float | None
    high: float | None
    includes_zero: bool | None
    prompts: int
    resamples: int
    seed: int


@dataclass(frozen=True)
class ContextRun(_Record):
    """One temperature (with the first draft-sampling rule): its buckets, the decay, and every prompt."""

    temperature: float
    draft_sample: str
    buckets: tuple[ContextBucket, ...]
    decay: ContextDecay
    prompts: tuple[ContextPrompt, ...]

    @classmethod
    def from_json(cls, d: Any) -> ContextRun:
        return cls._read(d, "contexts run", buckets=lambda v: tuple(ContextBucket.from_json(b) for b in _tuple(v)),
                         decay=ContextDecay.from_json,
                         prompts=lambda v: tuple(ContextPrompt.from_json(p) for p in _tuple(v)))


@dataclass(frozen=True)
class ContextResult(_Record):
    """--context-buckets: where the long prompts came from, how many per bucket, the seconds it took, one run per
    temperature."""

    source: str
    prompts_per_bucket: int
    seconds: float
    runs: tuple[ContextRun, ...]

    @classmethod
    def from_json(cls, d: Any) -> ContextResult:
        return cls._read(d, "contexts", runs=lambda v: tuple(ContextRun.from_json(r) for r in _tuple(v)))


@dataclass(frozen=True)
class Interval(_Record):
    """A 95% interval: the 2.5th and 97.5th percentiles of a bootstrap over prompts (prompts resampled with
    replacement, a fixed seed; tokens within a prompt are correlated, so prompts, not tokens, are resampled)."""

    low: float
    high: float


@dataclass(frozen=True)
class SweepRow(_Record):
    """One temperature × draft-sampling rule (`draft_sample`: greedy or probabilistic; at T = 0 drafts are the
    top-k whatever the rule, one row named greedy): every prompt's speculative decode against the AR decode at the
    same temperature. `acceptance[d]` = `accepted[d]` / `tried[d]` at depth d+1, with its quartiles across prompts
    (those that tried that depth) and its bootstrap interval; τ likewise; the speedup with its quartiles."""

    temperature: float
    draft_sample: str
    prompts: int
    acceptance: tuple[float, ...]
    accepted: tuple[int, ...]
    tried: tuple[int, ...]
    acceptance_quartiles: tuple[Quartiles, ...]
    acceptance_interval: tuple[Interval, ...]
    tau: float
    tau_quartiles: Quartiles
    tau_interval: Interval
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float | None
    speedup_quartiles: Quartiles | None
    greedy_match: str | None  # T = 0: prompts whose tokens equal AR's

    @classmethod
    def from_json(cls, d: Any) -> SweepRow:
        return cls._read(d, "sweep row", acceptance=_tuple, accepted=_tuple, tried=_tuple,
                         acceptance_quartiles=lambda v: tuple(Quartiles.from_json(x) for x in _tuple(v)),
                         acceptance_interval=lambda v: tuple(Interval.from_json(x) for x in _tuple(v)),
                         tau_quartiles=Quartiles.from_json, tau_interval=Interval.from_json,
                         speedup_quartiles=Quartiles.from_json)


LATER = ("contexts", "sweep")  # BenchResult keys added after reports were saved: absent where None


@dataclass(frozen=True)
class BenchResult(_Record):
    """One `recycle bench` run. `saved`: where `--save` wrote bench.json (a local path: never in the file).
    `sweep`: one row per --temperature × --draft-sample (None: a report from before them); `temperature`,
    `prompts` and `overall` are its first row's, measured in full."""

    target: str | None
    drafter: str | None  # None: the target's own MTP modules drafted
    drafter_kind: str | None
    tree: str | None
    device: str | None
    dtype: str | None
    threads: int | None
    temperature: float | None
    max_new_tokens: int | None
    seed: int | None
    repeats: int | None
    prompts: tuple[PromptResult, ...]
    overall: Overall
    bandwidth: Bandwidth | None
    hf: tuple[HfPeer, ...] | None
    notes: tuple[str, ...]
    saved: str | None
    contexts: ContextResult | None = None  # --context-buckets: acceptance by context position
    sweep: tuple[SweepRow, ...] | None = None  # --temperature × --draft-sample

    def to_json(self) -> dict:
        """The report; the keys of later additions (`contexts`, `sweep`) only where they hold something, so a report
        without them writes back as it was read."""
        return {k: v for k, v in super().to_json().items() if v is not None or k not in LATER}

    def file_json(self) -> dict:
        """What bench.json holds: the report less `saved`."""
        return {k: v for k, v in self.to_json().items() if k != "saved"}

    @classmethod
    def from_json(cls, d: Any) -> BenchResult:
        """A report read back (module docstring); settings a file lacks read as None."""
        if not isinstance(d, dict):
            raise ValueError("no overall.spec.tau")
        d = d | {"overall": Overall.from_json(d.get("overall")), "prompts": d.get("prompts") or [],
                 "notes": d.get("notes") or []}
        return cls._read(d, "report", {f.name: None for f in fields(cls)},
                         prompts=lambda v: tuple(PromptResult.from_json(p) for p in _tuple(v)),
                         notes=lambda v: tuple(n for n in _tuple(v) if isinstance(n, str)),
                         bandwidth=Bandwidth.from_json, hf=lambda v: tuple(HfPeer.from_json(r) for r in _tuple(v)),
                         contexts=ContextResult.from_json,
                         sweep=lambda v: tuple(SweepRow.from_json(r) for r in _tuple(v)))


__all__ = ["Bandwidth", "BenchResult", "ContextBucket", "ContextDecay", "ContextPrompt", "ContextResult", "ContextRun",
           "HfPeer", "Interval", "SweepRow", "Measure", "Overall", "Predicted", "PromptRepeats", "PromptResult",
           "PromptRun", "PromptSpread", "Quartiles", "RepeatSpread", "Span", "Spread"]
