"""Every output recycle writes for vLLM, run in vLLM and in recycle on the same prompt ids.

For one trained fixture this makes each output (native MTP, the target stitched from `mtp_overlay/`,
EAGLE-3 after a short distillation, the calibrated EAGLE-3 fold undistilled, calibrated Medusa), runs vLLM's CPU build once per target directory
(plain decoding plus k=1 speculation with each output) and `recycle bench --tree chain:1` on the same
prompt token ids, and returns one row per output: whether vLLM loads it, whether its speculative greedy
output equals its plain output and recycle's AR output, and both engines' k=1 acceptance counts.

`tests/engines/test_vllm.py` asserts on the rows; `benchmarks/engine_interop.py` prints them as the
interop table of docs/engines.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.checkpoint import Checkpoint
from recycle.converters.api import convert_checkpoint
from recycle.converters.overlay import stitch as stitch_overlay
from recycle.decoding import Drafter, MaskCache, Target, generate, load_target
from recycle.distill.calibrate import convert_calibrated
from recycle.distill.train import DistillOptions, distill
from recycle.engines.vllm_env import run_job
from recycle.errors import RecycleError
from recycle.families import match
from recycle.prompts import prompt_set

from fixtures.derive import derive

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "vLLM 0.32 (CPU)"
# The fixtures the engine check and benchmarks/engine_interop.py run, by their table name.
FIXTURES = {"DeepSeek-V3": ROOT / "fixtures" / "deepseek_v3_mtp", "GLM-4.5": ROOT / "fixtures" / "glm4_moe_mtp",
            "Gemma 4": ROOT / "fixtures" / "gemma4_target"}


@dataclass
class Row:
    fixture: str
    method: str  # vLLM's speculative method
    output: str  # what recycle wrote
    loads: bool
    error: str | None
    lossless: bool | None  # vLLM speculative == vLLM plain == recycle AR
    vllm_accepted: int | None
    vllm_drafts: int | None
    recycle_accepted: int
    recycle_tried: int

    @property
    def agreement(self) -> str:
        if not self.loads:
            return "n/a"
        if (self.vllm_accepted, self.vllm_drafts) == (self.recycle_accepted, self.recycle_tried):
            return "equal"
        return f"{abs(self.vllm_rate - self.recycle_rate) / max(self.recycle_rate, 1e-9):.1%} apart"

    @property
    def short_error(self) -> str:
        """The engine's refusal, its first sentence (docs/engines.md quotes it)."""
        return (self.error or "").split(". ")[0].split(" (")[0][:160]

    @property
    def vllm_rate(self) -> float:
        return (self.vllm_accepted or 0) / max(1, self.vllm_drafts or 0)

    @property
    def recycle_rate(self) -> float:
        return self.recycle_accepted / max(1, self.recycle_tried)

    def table_row(self) -> str:
        """The interop table's line for this output (docs/engines.md)."""
        if not self.loads:
            return (f"| {self.fixture} | {self.method} | {self.output} | no: {self.short_error} | – | "
                    f"– vs {self.recycle_accepted}/{self.recycle_tried} (recycle alone) |")
        k1 = (f"{self.vllm_accepted}/{self.vllm_drafts} vs {self.recycle_accepted}/{self.recycle_tried} "
              f"({self.agreement})")
        return f"| {self.fixture} | {self.method} | {self.output} | yes | {'yes' if self.lossless else 'NO'} | {k1} |"

    def as_dict(self) -> dict:
        return {**asdict(self), "agreement": self.agreement}


def _recycle_chain1(target: Path, drafter: Path | None, prompts, new_tokens: int) -> tuple[int, int]:
    r = run_bench(BenchOptions(drafter=str(drafter) if drafter else None, native=drafter is None, target=str(target),
                               prompts=prompts, max_new_tokens=new_tokens, tree="chain:1", stop_at_eos=False,
                               warmup=False))
    spec = r.overall.spec
    return int(spec.accepted[0]), int(spec.tried[0])


def ar_tokens(target: Path, ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    t = Target(load_target(str(target)))
    masks = MaskCache(t.dtype, t.device)
    return [generate(t, Drafter(), p, new_tokens, masks=masks, eos=None).tokens for p in ids]


def make_outputs(fixture: Path, work: Path, distill_tokens: int, calibrate_tokens: int) -> dict[str, tuple]:
    """name → (target dir, drafter dir or None, vLLM method, what it is)."""
    if fixture.name == "gemma4_target":  # Gemma 4's drafter is its own model, and what convert makes of it
        assistant = fixture.parent / "gemma4_assistant"
        e3 = convert_checkpoint(assistant, "eagle3", work / "eagle3", overwrite=True, target=fixture)["out"]
        e3d = distill(DistillOptions(drafter=e3, target=str(fixture), tokens=distill_tokens,
                                     out=str(work / "eagle3-d"), overwrite=True, eval_every=10**6))["out"]
        medusa = convert_calibrated(assistant, "medusa", work / "medusa", overwrite=True, calibrate=calibrate_tokens,
                                    target=fixture)["out"]
        return {"assistant": (fixture, assistant, "mtp", "Gemma 4 assistant (`gemma4_assistant`, as shipped)"),
                "eagle3": (fixture, Path(e3d), "eagle3",
                           f"EAGLE-3 folded from the assistant, distilled {distill_tokens // 1000}k tokens"),
                "medusa": (fixture, Path(medusa), "medusa",
                           f"Medusa from the assistant, calibrated on {calibrate_tokens // 1000}k tokens")}
    mla = "kv_a_proj_with_mqa" in " ".join(match(Checkpoint(fixture)).modules[0].names)
    eagle = convert_checkpoint(fixture, "eagle", work / "eagle", layouts="overlay", overwrite=True)["out"]
    dropped = derive(fixture, work / "dropped", 0, overwrite=True)["out"]
    stitched = stitch_overlay(Path(eagle) / "mtp_overlay", dropped, work / "stitched", overwrite=True)["out"]
    e3 = convert_checkpoint(fixture, "eagle3", work / "eagle3", overwrite=True,
                            eagle3_attention="mla" if mla else None)["out"]
    e3d = distill(DistillOptions(drafter=e3, target=str(fixture), tokens=distill_tokens, out=str(work / "eagle3-d"),
                                 overwrite=True, eval_every=10**6))["out"]
    e3c = convert_calibrated(fixture, "eagle3", work / "eagle3-cal", overwrite=True, calibrate=calibrate_tokens,
                             eagle3_attention="mla" if mla else None)["out"]
    medusa = convert_calibrated(fixture, "medusa", work / "medusa", overwrite=True, calibrate=calibrate_tokens)["out"]
    return {
        "mtp": (fixture, None, "mtp", "native MTP (the checkpoint as released)"),
        "stitched": (Path(stitched), None, "mtp", "target without MTP, stitched from `mtp_overlay/`"),
        "eagle3": (fixture, Path(e3d), "eagle3",
                   f"EAGLE-3 ({'MLA' if mla else 'Llama'} midlayer), distilled {distill_tokens // 1000}k tokens"),
        "eagle3-cal": (fixture, Path(e3c), "eagle3", f"EAGLE-3 ({'MLA' if mla else 'Llama'} midlayer), calibrated "
                       f"fold on {calibrate_tokens // 1000}k tokens, not distilled"),
        "medusa": (fixture, Path(medusa), "medusa", f"Medusa, calibrated on {calibrate_tokens // 1000}k tokens"),
    }


def interop(name: str, fixture: Path, work: Path, *, prompts: int = 6, new_tokens: int = 48,
            distill_tokens: int = 16_000, calibrate_tokens: int = 8_000) -> list[Row]:
    from transformers import AutoTokenizer

    work.mkdir(parents=True, exist_ok=True)
    ps = prompt_set("stdlib", prompts)
    tok = AutoTokenizer.from_pretrained(str(fixture))
    ids = [tok(p, add_special_tokens=False)["input_ids"] for _, p in ps]
    outputs = make_outputs(fixture, work, distill_tokens, calibrate_tokens)
    by_target: dict[Path, list[dict]] = {}
    for key, (target, drafter, method, _) in outputs.items():
        spec = {"method": method, "num_speculative_tokens": 1}
        if drafter is not None:
            spec["model"] = str(drafter)
        by_target.setdefault(Path(target), []).append({"name": key, "speculative_config": spec})
    engine: dict[str, dict] = {}
    for target, runs in by_target.items():
        # plain first; a drafter vLLM refuses last (a refusal can leave the process unusable)
        runs = [{"name": "plain"}, *sorted(runs, key=lambda r: r["name"].startswith("eagle3"))]
        res = run_job({"target": str(target), "prompt_ids": ids, "max_new_tokens": new_tokens, "runs": runs})
        engine.update({(str(target), k): v for k, v in res.items()})
    ar = ar_tokens(fixture, ids, new_tokens)
    rows = []
    for key, (target, drafter, method, what) in outputs.items():
        v = engine[(str(target), key)]
        plain = engine[(str(target), "plain")]
        acc, tried = _recycle_chain1(Path(target), drafter, ps, new_tokens)
        err = v.get("error")
        rows.append(Row(
            fixture=name, method=method, output=what, loads=err is None, error=err,
            lossless=None if err else (v["tokens"] == plain["tokens"] == ar),
            vllm_accepted=None if err else sum(v.get("accepted_per_pos") or [0]),
            vllm_drafts=None if err else v.get("drafts"), recycle_accepted=acc, recycle_tried=tried))
    return rows


def mimo_for_vllm(work: Path, *, window: int | None = None) -> Path:
    """MiMo-V2-Flash's layout generator (`fixtures.families.mimo_v2_flash`, random weights, three modules, the release's
    config keys beside transformers') in the shape vLLM's CPU build runs and made to draft: there is no trained MiMo
    fixture, and random modules accept nothing.
    * head_dim = v_head_dim = 96 (192/128 released): vLLM builds a different-V attention only on its GPU backends
      (`mimo_v2.py`: FLASH_ATTN_DIFFKV or TRITON_ATTN_DIFFKV), and its CPU attention takes head sizes from 32 up;
    * the trunk's layer outputs (o_proj, down_proj, the experts' too) zeroed: the trunk is a bigram model;
    * each module's eh_proj = [I, 0.3·R]: the drafted token's embedding plus a little of the trunk's state; its block
      (sliding-window attention with sinks, dense MLP, every norm) as generated, so the window decides drafts.
    `window` (the generator's is 4): `sliding_window_size` = window - 1, transformers attends to window keys."""
    from fixtures.families import write_tokenizer

    out = work / f"mimo_v2_flash-drafting{'' if window is None else f'-window{window}'}"
    if (out / "config.json").is_file():
        return out
    fx = mimo_drafting()
    if window is not None:
        fx.config.update(sliding_window_size=window - 1, sliding_window=window)
    return write_tokenizer(fx.write(out))


def mimo_drafting(kv: int = 1, heads: int = 4):
    """The MiMo-V2-Flash generator (`kv` full-attention KV heads, `heads` query heads) as `mimo_for_vllm` describes
    it, in memory."""
    import torch

    from fixtures.families import make

    fx = make("mimo_v2_flash", head_dim=96, v_head_dim=96, kv=kv, heads=heads)
    t = fx.tensors
    for name in list(t):
        if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
        elif name.endswith("eh_proj.weight"):
            h = t[name].shape[0]
            rand = torch.randn(h, h, generator=torch.Generator().manual_seed(0)) / h ** 0.5
            t[name] = torch.cat([torch.eye(h), 0.3 * rand], 1).to(t[name].dtype)
    return fx


# The release ships its own config class (config.json's `auto_map`; transformers has no `mimo_v2`), which vLLM loads
# with trust_remote_code. A stand-in that holds config.json's keys as they are, as the release's does for what vLLM
# reads, for the drafting copies below only: recycle itself never runs a checkpoint's code.
MIMO_V2_CONFIG = """from transformers import PretrainedConfig


class MiMoV2Config(PretrainedConfig):
    model_type = "mimo_v2"
"""


def mimo_v25_for_vllm(work: Path, *, kv: int = 1, chunks: int | None = None, window: int | None = None) -> Path:
    """`mimo_for_vllm`'s drafting copy (with `kv` full-attention KV heads) in MiMo-V2.5's layout (`fixtures.families.
    as_mimo_v2`): q/k/v fused into one `qkv_proj` pre-sharded in `kv` chunks (`chunks`: another count, e.g. 1, one
    unsharded [Q|K|V] under kv 2), only the release's config keys, model_type `mimo_v2` and MiMoV2ForCausalLM, with
    the stand-in config class vLLM loads by `auto_map`; `window` as `mimo_for_vllm`'s."""
    from fixtures.families import as_mimo_v2, write_tokenizer

    out = work / f"mimo_v2-drafting-kv{kv}-chunks{chunks or kv}-window{window or 4}"
    if (out / "config.json").is_file():
        return out
    fx = as_mimo_v2(mimo_drafting(kv=kv), chunks)
    fx.config["auto_map"] = {"AutoConfig": "configuration_mimo_v2.MiMoV2Config"}
    if window is not None:
        fx.config.update(sliding_window_size=window - 1, sliding_window=window)
    write_tokenizer(fx.write(out))
    (out / "configuration_mimo_v2.py").write_text(MIMO_V2_CONFIG, encoding="utf-8")
    return out


@dataclass
class NativeRow:
    """One target's own MTP modules in vLLM (method mtp, k=1) and in recycle (`bench --tree chain:1`)."""

    fixture: str
    error: str | None
    plain_equals_ar: bool | None  # vLLM plain == recycle AR
    lossless: bool | None  # vLLM speculative == vLLM plain
    vllm_accepted: int | None
    vllm_drafts: int | None
    recycle_accepted: int | None
    recycle_tried: int | None
    recycle_error: str | None = None  # where recycle cannot draft with the modules (Inkling: a recurrent block)


def native_k1(name: str, target: Path, *, drafter: Path | None = None, method: str = "mtp", prompts: int | list = 6,
              new_tokens: int = 48, tokenizer: bool = False, remote_code: bool = False) -> NativeRow:
    """vLLM's plain and speculative (k=1, `method`) runs of `target` (its own modules, or `drafter`: a Gemma 4
    assistant, a Medusa) on the interop's prompt ids (`prompts`: how many stdlib prompts, or (name, text) pairs;
    `tokenizer`: vLLM loads the target's; `remote_code`: vLLM loads the config class the target ships, as a
    release's own), and recycle's chain:1 on the same texts."""
    from transformers import AutoTokenizer

    ps = prompt_set("stdlib", prompts) if isinstance(prompts, int) else prompts
    tok = AutoTokenizer.from_pretrained(str(target), trust_remote_code=False)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for _, p in ps]
    spec = {"method": method, "num_speculative_tokens": 1} | ({"model": str(drafter)} if drafter else {})
    runs = [{"name": "plain"}, {"name": "mtp", "speculative_config": spec}]
    res = run_job({"target": str(target), "prompt_ids": ids, "max_new_tokens": new_tokens, "runs": runs,
                   "tokenizer": tokenizer, "parallel": {"trust_remote_code": True} if remote_code else {}})
    try:
        (acc, tried), mine = _recycle_chain1(target, drafter, ps, new_tokens), None
    except RecycleError as e:
        (acc, tried), mine = (None, None), str(e)
    plain, mtp = res["plain"], res["mtp"]
    err = mtp.get("error") or plain.get("error")
    ar = ar_tokens(target, ids, new_tokens) if "tokens" in plain else None
    return NativeRow(fixture=name, error=err, plain_equals_ar=None if ar is None else plain["tokens"] == ar,
                     lossless=None if err else mtp["tokens"] == plain["tokens"],
                     vllm_accepted=None if err else sum(mtp.get("accepted_per_pos") or [0]),
                     vllm_drafts=None if err else mtp.get("drafts"), recycle_accepted=acc, recycle_tried=tried,
                     recycle_error=mine)


def past_window_prompts(n: int = 6, joined: int = 6) -> list[tuple[str, str]]:
    """`n` prompts of `joined` stdlib prompts each (taken in turn, from every third): 444 to 707 tokens in the Gemma 4
    fixture's tokenizer, past its 512-token sliding window once 48 are generated."""
    base = prompt_set("stdlib")
    return [(base[3 * i][0], "\n".join(str(base[(3 * i + j) % len(base)][1]) for j in range(joined)))
            for i in range(n)]
