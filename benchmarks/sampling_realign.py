"""Issue 50: which loss re-aligns a stale MTP drafter for sampled serving, per temperature, depth, domain and context.

Two targets whose MTP modules went stale, each re-aligned from the base fixture's modules (`convert --to eagle`):

  deepseek   fixtures/deepseek_v3_mtp_posttrained (trunk post-trained on py:transformers); --data py:transformers
  chat       fixtures/deepseek_v3_mtp_chat (trunk instruction-tuned on stdlib conversations); --data: the training
             conversations (fixtures/build_chat.py), assistant tokens only

Each is distilled at equal tokens with every loss of --losses (`kl` = `kl,ce=0.1`, today's default; `tv` =
`tv,ce=0.1`; `kl+tv` = `kl,tv,ce=0.1`: the same CE anchor in all three) and, with --long, once more with windows
that reach the fixture's whole context (--seq-len 2048 after a 256, 1024 curriculum). Phase `bench` then decodes
every drafter, the stale drafter (converted, not distilled), the target's own stale modules (native) and the original
pairing (the base fixture with its own modules), at each temperature of --temperatures with probabilistic drafts,
on two prompt sets: in-domain held-out prompts and a held-out domain neither side trained on (py:pip's held-out
files); and, on the post-trained target, context buckets (0-256, 256-1k, 1k-2k) of long prompts cut from the
in-domain held-out text (paired across buckets: recycle/contexts.py).

    python benchmarks/sampling_realign.py distill --tokens 256k --work /tmp/s50
    python benchmarks/sampling_realign.py bench --tokens 256k --work /tmp/s50 --json /tmp/s50/bench.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from _common import FIXTURE, FIXTURES, POSTTRAINED, parser, stamp, write_json

CHAT = FIXTURES / "deepseek_v3_mtp_chat"
LOSSES = {"kl": "kl,ce=0.1", "tv": "tv,ce=0.1", "kl+tv": "kl,tv,ce=0.1"}
TARGETS = {"deepseek": POSTTRAINED, "chat": CHAT}
HELDOUT_DOMAIN = "py:pip"  # neither target nor drafter trained on it; chosen before any measurement, never tuned on
# whole-context windows: a 256, 1024 curriculum, then 2048; one row per step (2048 = 8 × 256 tokens per step, the short
# runs' schedule); 4 held-out rows (the target writes each row's last 192 tokens at 2048 positions: slow on a CPU)
LONG = {"seq_len": 2048, "curriculum": "256,1024", "batch": 1, "eval_rows": 4}


def data_for(name: str, work: Path) -> str:
    if name == "deepseek":
        return "py:transformers"
    path = work / "chat_train.jsonl"
    if not path.is_file():
        from fixtures.build_chat import conversations, write_jsonl

        write_jsonl(path, conversations("train"))
    return str(path)


def stale(work: Path) -> Path:
    """The base fixture's modules as an EAGLE drafter (what every run starts from)."""
    out = work / "stale-eagle"
    if not (out / "config.json").is_file():
        from recycle.converters.api import convert_checkpoint

        convert_checkpoint(FIXTURE, "eagle", out)
    return out


def run_name(target: str, loss: str, tokens: str, long: bool) -> str:
    return f"{target}-{loss}-{tokens}" + ("-long" if long else "")


def distill_all(a, work: Path) -> dict:
    from recycle.distill.train import DistillOptions, distill
    from recycle.options import LossConfig
    from recycle.preflight import parse_tokens

    start = stale(work)
    done = {}
    for target in a.targets.split(","):
        for loss in a.losses.split(","):
            for long in ([False, True] if a.long == "both" else [a.long == "only"]):
                name = run_name(target, loss, a.tokens, long)
                out = work / name
                if (out / "recycle.json").is_file():
                    print(f"{name}: done before", flush=True)
                    continue
                extra = dict(LONG) if long else {}
                t0 = time.perf_counter()
                rec = distill(DistillOptions(drafter=str(start), target=str(TARGETS[target]),
                                             tokens=parse_tokens(a.tokens), data=data_for(target, work), out=str(out),
                                             loss=LossConfig(loss=LOSSES[loss]), threads=a.threads, overwrite=True,
                                             **extra))
                done[name] = {"wall_s": round(time.perf_counter() - t0, 1), "tokens_per_s": rec.get("tokens_per_s"),
                              "estimate": rec.get("final", {}).get("heldout_estimate_after")}
                print(f"{name}: {done[name]}", flush=True)
    return done


BUCKETS = ((0, 256), (256, 1024), (1024, 2048))


def drafters(target: str, a, work: Path) -> dict[str, tuple[str | None, Path]]:
    """name -> (drafter directory, or None for the target's own modules; the target it drafts for)."""
    out: dict[str, tuple[str | None, Path]] = {"original": (None, FIXTURE), "native": (None, TARGETS[target]),
                                               "stale": (str(stale(work)), TARGETS[target])}
    for d in sorted(work.glob(f"{target}-*")):  # every finished run: TARGET-LOSS-TOKENS[-long]
        if (d / "recycle.json").is_file():
            out[d.name.removeprefix(f"{target}-")] = (str(d), TARGETS[target])
    return out


def bench_one(drafter: str | None, target: Path, prompts, a, temperatures: str, contexts: bool = False) -> dict:
    from recycle.bench import BenchOptions, run_bench

    opts = BenchOptions(drafter=drafter, target=str(target), native=drafter is None, prompts=prompts, tree=a.tree,
                        max_new_tokens=a.max_new_tokens, temperatures=tuple(map(float, temperatures.split(","))),
                        draft_samples=("probabilistic",), context_buckets=BUCKETS if contexts else (),
                        context_prompts=a.context_prompts)
    t0 = time.perf_counter()
    r = run_bench(opts)
    out = {"seconds": round(time.perf_counter() - t0, 1), "sweep": [row.to_json() for row in r.sweep or ()]}
    if r.contexts is not None:
        out["contexts"] = [{"temperature": run.temperature, "buckets": [b.to_json() for b in run.buckets],
                            "decay": run.decay.to_json()} for run in r.contexts.runs]
    return out


CONTEXT_DRAFTERS = ("native", "stale", "kl-256k", "kl-256k-long")  # the buckets' rows (deepseek)


def bench_all(a, work: Path) -> dict:
    """Every drafter on the in-domain and held-out-domain prompt sets at every temperature; then, on the post-trained
    target, CONTEXT_DRAFTERS by context bucket at T = 0 and 1 (their sweep over the first in-domain prompt only)."""
    from recycle.prompts import prompt_set, read_jsonl

    sets = {"deepseek": {"in-domain": prompt_set("py:transformers", a.prompts)},
            "chat": {"in-domain": read_jsonl(CHAT / "chat_heldout.jsonl")[: a.prompts]}}
    held = prompt_set(HELDOUT_DOMAIN, a.prompts)
    path = work / "bench.json"
    results: dict = json.loads(path.read_text()) if path.is_file() else {}

    def once(key: str, *args, **kw) -> None:
        if key in results:
            return
        results[key] = bench_one(*args, **kw)
        print(key, results[key]["seconds"], "s:",
              "; ".join(f"T={r['temperature']:g} α " + "/".join(f"{x:.3f}" for x in r["acceptance"])
                        + f" τ {r['tau']:.3f}" for r in results[key]["sweep"]), flush=True)
        write_json(path, results)

    for target in a.targets.split(","):
        for name, (drafter, tdir) in drafters(target, a, work).items():
            for pset, prompts in ({**sets[target], "held-out domain": held}).items():
                if name == "original" and target == "chat" and pset == "in-domain":
                    continue  # the base target has no chat template: its pairing is judged on the held-out domain
                once(f"{target}/{name}/{pset}", drafter, tdir, prompts, a, a.temperatures)
    if "deepseek" in a.targets.split(","):
        found = drafters("deepseek", a, work)
        for name in CONTEXT_DRAFTERS:
            if name in found:
                drafter, tdir = found[name]
                once(f"deepseek/{name}/contexts", drafter, tdir, sets["deepseek"]["in-domain"][:1], a, "0,1.0",
                     contexts=True)
    return results


def main() -> None:
    ap = parser(__doc__, work="/tmp/s50", threads=2, json=True)
    ap.add_argument("phase", choices=("distill", "bench"))
    ap.add_argument("--tokens", default="256k")
    ap.add_argument("--targets", default="deepseek,chat")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--long", choices=("no", "only", "both"), default="no",
                    help="also (both) or only distil with windows of the whole context (--seq-len 2048)")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--tree", default="chain:2")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context-prompts", type=int, default=4, help="long prompts per context bucket")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    result = {**stamp(), "phase": a.phase, "tokens": a.tokens}
    if a.phase == "distill":
        result["runs"] = distill_all(a, work)
    else:
        result["benches"] = bench_all(a, work)
    if a.json:
        write_json(a.json, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
