"""Issue 50: which loss re-aligns a stale MTP drafter for sampled serving, per temperature, depth, domain and context.

Two targets whose MTP modules went stale, each re-aligned from its stale modules (`convert --to eagle`: the base
fixture's for the post-trained target, the chat target's own for the chat target, whose tokenizer has chat tokens):

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

The post-trained fixture's trunk was trained on 256-token windows, and its own loss rises past them, so phase `extend`
builds a third target, `long` (under --work, not bundled): the post-trained target trained further on 2,048-token
windows of its domain (EXTEND; its MTP tensors stay the base's, stale), on which the context buckets test whether a
drafter trained with long windows keeps its acceptance across the context.

    python benchmarks/sampling_realign.py distill --tokens 256k --work /tmp/s50
    python benchmarks/sampling_realign.py bench --work /tmp/s50
    python benchmarks/sampling_realign.py tables --work /tmp/s50      # BENCHMARKS.md's tables
    python benchmarks/sampling_realign.py trunk                       # the target's own loss by position
    python benchmarks/sampling_realign.py extend --extend-steps 150 --targets long --work /tmp/s50
    python benchmarks/sampling_realign.py trunk --targets deepseek,long --work /tmp/s50
    python benchmarks/sampling_realign.py distill --targets long --losses kl --long both --work /tmp/s50
    python benchmarks/sampling_realign.py bench --targets long --context-prompts 8 --work /tmp/s50
    python benchmarks/sampling_realign.py distill --tokens 1M --targets chat,deepseek --work /tmp/s50   # a lent H200
    python benchmarks/sampling_realign.py bench --targets chat --drafters kl-1M,tv-1M,kl+tv-1M --work /tmp/s50
    python benchmarks/sampling_realign.py distill --targets deepseek --losses kl --mix --work /tmp/s50
    python benchmarks/sampling_realign.py entropy          # the targets' own entropy on the two prompt sets
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from _common import FIXTURE, FIXTURES, POSTTRAINED, parser, stamp, write_json

CHAT = FIXTURES / "deepseek_v3_mtp_chat"
LOSSES = {"kl": "kl,ce=0.1", "tv": "tv,ce=0.1", "kl+tv": "kl,tv,ce=0.1"}
TARGETS = {"deepseek": POSTTRAINED, "chat": CHAT}
# the post-trained target extended to its whole context (phase `extend`): built under --work, not bundled
EXTENDED = "long"
# its extension: 2,048-token windows of the post-training domain, 2 rows per step (4,096 tokens per step, the
# post-training's), a lower peak LR than post-training's 1e-3; the trunk trains, the MTP tensors are copied as stored
EXTEND = {"seq": 2048, "batch": 2, "lr": 3e-4, "eval_windows": 16}
HELDOUT_DOMAIN = "py:pip"  # neither target nor drafter trained on it; chosen before any measurement, never tuned on
# whole-context windows: a 256, 1024 curriculum, then 2048; one row per step (2048 = 8 × 256 tokens per step, the short
# runs' schedule); 4 held-out rows (the target writes each row's last 192 tokens at 2048 positions: slow on a CPU)
LONG = {"seq_len": 2048, "curriculum": "256,1024", "batch": 1, "eval_rows": 4}


def target_dir(name: str, work: Path) -> Path:
    return work / "target-long" if name == EXTENDED else TARGETS[name]


def data_for(name: str, work: Path, mix: bool = False) -> str:
    if name in ("deepseek", EXTENDED) and mix:
        return mixed(work)
    if name in ("deepseek", EXTENDED):
        return "py:transformers"
    path = work / "chat_train.jsonl"
    if not path.is_file():
        from fixtures.build_chat import conversations, write_jsonl

        write_jsonl(path, conversations("train"))
    return str(path)


def mixed(work: Path) -> str:
    """--mix: the post-training domain and the base fixture's own (the stdlib), their train splits' files taken in
    turn, one JSONL row each: broader text at the same budget, pip still held out."""
    path = work / "mix_train.jsonl"
    if not path.is_file():
        from itertools import chain, zip_longest

        from recycle.corpus import documents

        pairs = zip_longest(documents("train", source="py:transformers"), documents("train"))
        rows = (json.dumps({"text": d.text}) for d in chain.from_iterable(pairs) if d is not None)
        path.write_text("\n".join(rows) + "\n")
    return str(path)


def stale(work: Path, target: str = "deepseek") -> Path:
    """The stale modules as an EAGLE drafter (what every run starts from): the base fixture's for the post-trained
    target (as the stale-MTP experiments of issue 13), the chat target's own for the chat target (its tokenizer has
    the chat template's tokens, the base's has not)."""
    base = target in ("deepseek", EXTENDED)  # both descend from the base fixture; its modules are their stale ones
    out = work / ("stale-eagle" if base else f"stale-eagle-{target}")
    if not (out / "config.json").is_file():
        from recycle.converters.api import convert_checkpoint

        convert_checkpoint(FIXTURE if base else TARGETS[target], "eagle", out)
    return out


def run_name(target: str, loss: str, tokens: str, long: bool, mix: bool = False) -> str:
    return f"{target}-{loss}-{tokens}" + ("-long" if long else "") + ("-mix" if mix else "")


def distill_all(a, work: Path) -> dict:
    from recycle.distill.train import DistillOptions, distill
    from recycle.options import LossConfig
    from recycle.preflight import parse_tokens

    done = {}
    for target in a.targets.split(","):
        start = stale(work, target)
        for loss in a.losses.split(","):
            for long in ([False, True] if a.long == "both" else [a.long == "only"]):
                name = run_name(target, loss, a.tokens, long, a.mix and target != "chat")
                out = work / name
                if (out / "recycle.json").is_file():
                    print(f"{name}: done before", flush=True)
                    continue
                extra = dict(LONG) if long else {}
                t0 = time.perf_counter()
                rec = distill(DistillOptions(drafter=str(start), target=str(target_dir(target, work)),
                                             tokens=parse_tokens(a.tokens), data=data_for(target, work, a.mix), out=str(out),
                                             loss=LossConfig(loss=LOSSES[loss]), threads=a.threads, overwrite=True,
                                             **extra))
                done[name] = {"wall_s": round(time.perf_counter() - t0, 1), "tokens_per_s": rec.get("tokens_per_s"),
                              "estimate": rec.get("final", {}).get("heldout_estimate_after")}
                print(f"{name}: {done[name]}", flush=True)
    return done


BUCKETS = ((0, 256), (256, 1024), (1024, 2048))


def drafters(target: str, a, work: Path) -> dict[str, tuple[str | None, Path]]:
    """name -> (drafter directory, or None for the target's own modules; the target it drafts for)."""
    tdir = target_dir(target, work)
    out: dict[str, tuple[str | None, Path]] = {"native": (None, tdir), "stale": (str(stale(work, target)), tdir)}
    if target != EXTENDED:  # the extended target is measured by context bucket only
        out["original"] = (None, FIXTURE)
    for d in sorted(work.glob(f"{target}-*")):  # every finished run: TARGET-LOSS-TOKENS[-long]
        if (d / "recycle.json").is_file():
            out[d.name.removeprefix(f"{target}-")] = (str(d), tdir)
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


CONTEXT_DRAFTERS = ("native", "stale", "kl-256k", "kl-256k-long")  # the buckets' rows (deepseek, long)


def bench_all(a, work: Path) -> dict:
    """Every drafter on the in-domain and held-out-domain prompt sets at every temperature; then, on the post-trained
    target and on its extension to the whole context, CONTEXT_DRAFTERS by context bucket at T = 0 and 1 (their sweep
    over the first in-domain prompt only)."""
    from recycle.prompts import prompt_set, read_jsonl

    sets = {"deepseek": {"in-domain": prompt_set("py:transformers", a.prompts)},
            "chat": {"in-domain": read_jsonl(CHAT / "chat_heldout.jsonl")[: a.prompts]}}
    held = prompt_set(HELDOUT_DOMAIN, a.prompts)
    path = work / f"bench-{a.targets}-{a.drafters or 'all'}.json".replace(",", "+")  # one file per process; all read
    results: dict = {}
    for f in sorted(work.glob("bench*.json")):
        results |= json.loads(f.read_text())

    def once(key: str, *args, **kw) -> None:
        if key in results:
            return
        results[key] = bench_one(*args, **kw)
        print(key, results[key]["seconds"], "s:",
              "; ".join(f"T={r['temperature']:g} α " + "/".join(f"{x:.3f}" for x in r["acceptance"])
                        + f" τ {r['tau']:.3f}" for r in results[key]["sweep"]), flush=True)
        write_json(path, results)

    for target in a.targets.split(","):
        if target == EXTENDED:
            continue
        for name, (drafter, tdir) in drafters(target, a, work).items():
            if a.drafters and name not in a.drafters.split(","):
                continue
            for pset, prompts in ({**sets[target], "held-out domain": held}).items():
                if name == "original" and target == "chat" and pset == "in-domain":
                    continue  # the base target has no chat template: its pairing is judged on the held-out domain
                once(f"{target}/{name}/{pset}", drafter, tdir, prompts, a, a.temperatures)
    for target in ("deepseek", EXTENDED):
        if target not in a.targets.split(","):
            continue
        found = drafters(target, a, work)
        for name in CONTEXT_DRAFTERS:
            if name in found and (not a.drafters or name in a.drafters.split(",")):
                drafter, tdir = found[name]
                once(f"{target}/{name}/contexts", drafter, tdir, sets["deepseek"]["in-domain"][:1], a, "0,1.0",
                     contexts=True)
    return results


def _iv(row: dict, d: int | None = None) -> str:
    """A figure with its 95% bootstrap interval: α at depth d+1, or τ (d None)."""
    if d is None:
        return f"{row['tau']:.3f} [{row['tau_interval']['low']:.2f}–{row['tau_interval']['high']:.2f}]"
    if d >= len(row["acceptance"]):
        return "–"
    iv = row["acceptance_interval"][d]
    return f"{row['acceptance'][d]:.3f} [{iv['low']:.2f}–{iv['high']:.2f}]"


def tables(work: Path) -> str:
    """BENCHMARKS.md's tables from every bench*.json in `work`: per target and prompt set, each drafter × temperature
    (α1, α2, τ with their intervals); then the context buckets and the decay."""
    results: dict = {}
    for f in sorted(work.glob("bench*.json")):
        results |= json.loads(f.read_text())
    out = []
    for target in TARGETS:
        for pset in ("in-domain", "held-out domain"):
            keys = [k for k in results if k.startswith(f"{target}/") and k.endswith(f"/{pset}")]
            if not keys:
                continue
            out += [f"\n{target}, {pset}:\n", "| drafter | T | α1 [95%] | α2 [95%] | τ [95%] |", "|---|---:|---|---|---|"]
            for k in keys:
                for row in results[k]["sweep"]:
                    out.append(f"| {k.split('/')[1]} | {row['temperature']:g} | {_iv(row, 0)} | {_iv(row, 1)} | "
                               f"{_iv(row)} |")
    keys = [k for k in results if k.endswith("/contexts")]
    if keys:
        out += ["\ncontext buckets (in-domain text; target `long`: the post-trained target extended to 2,048):\n",
                "| target | drafter | T | " + " | ".join(f"α1 {lo}-{hi}" for lo, hi in BUCKETS)
                + " | slope of α1 per 1k positions [95%] |", "|---|---|---:|" + "---|" * (len(BUCKETS) + 1)]
        for k in keys:
            for run in results[k]["contexts"]:
                d = run["decay"]
                cells = [f"{b['acceptance'][0]:.3f} ({b['accepted'][0]}/{b['tried'][0]})" if b["tried"] else "–"
                         for b in run["buckets"]]
                slope = (f"{d['slope_per_1k']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d["low"] is not None
                         else "–")
                out.append(f"| {k.split('/')[0]} | {k.split('/')[1]} | {run['temperature']:g} | " + " | ".join(cells) + f" | {slope} |")
    return "\n".join(out)


def entropy(prompts: int = 8, tokens: int = 256) -> dict:
    """The base and post-trained targets' own next-token entropy and loss (nats per token, T = 1) on the bench's
    prompt sets (each prompt's first `tokens`): whether the post-trained target is harder to draft on the held-out
    domain than the base target the original pairing drafts for."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recycle.prompts import prompt_set

    out = {}
    for source in (HELDOUT_DOMAIN, "py:transformers"):
        texts = [text for _, text in prompt_set(source, prompts)]
        for target in (FIXTURE, POSTTRAINED):
            tok = AutoTokenizer.from_pretrained(target)
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            ent = nll = n = 0.0
            with torch.no_grad():
                for text in texts:
                    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
                    logp = model(ids).logits[0, :-1].log_softmax(-1)
                    ent += -(logp.exp() * logp).sum().item()
                    nll += -logp.gather(-1, ids[0, 1:, None]).sum().item()
                    n += ids.shape[1] - 1
            out[f"{source} {target.name}"] = {"entropy": round(ent / n, 3), "loss": round(nll / n, 3), "tokens": int(n)}
            print(source, target.name, out[f"{source} {target.name}"], flush=True)
    return out


def trunk_by_position(target: Path = POSTTRAINED, windows: int = 8) -> dict:
    """Why acceptance may fall with position on these fixtures: the target's own held-out loss and its top-1
    agreement with the text, per context bucket, on `windows` windows of 2,048 py:transformers held-out tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recycle.corpus import documents

    tok = AutoTokenizer.from_pretrained(target)
    ids: list[int] = []
    for doc in documents("heldout", source="py:transformers"):
        ids += tok(doc.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) >= windows * 2048 + 1:
            break
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    x = torch.tensor(ids[: windows * 2048]).view(windows, 2048)
    with torch.no_grad():
        logits = model(x).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # [w, 2047]
    top1 = (logits.argmax(-1) == x[:, 1:]).float()
    out = {}
    for lo, hi in BUCKETS:
        sl = slice(max(lo, 1) - 1, hi - 1)
        out[f"{lo}-{hi}"] = {"loss": round(float(nll[:, sl].mean()), 3), "top1": round(float(top1[:, sl].mean()), 3)}
    return out


def extend(a, work: Path) -> dict:
    """The post-trained target trained further on whole-context windows (EXTEND, --extend-steps steps), so that its
    own loss no longer rises past the 256 positions the fixtures were trained on; its MTP tensors stay as stored
    (the base's: stale). Built beside, then renamed; kept when built before."""
    from fixtures.build_posttrained import main as posttrain

    out = target_dir(EXTENDED, work)
    if not (out / "build_report.json").is_file():
        part = out.with_name(out.name + ".part")
        posttrain(["--base", str(POSTTRAINED), "--out", str(part), "--steps", str(a.extend_steps),
                   "--seq", str(EXTEND["seq"]), "--batch", str(EXTEND["batch"]), "--lr", str(EXTEND["lr"]),
                   "--eval-windows", str(EXTEND["eval_windows"]), "--threads", str(a.threads)])
        part.rename(out)
    report = json.loads((out / "build_report.json").read_text())
    return {k: report[k] for k in ("steps", "tokens", "train_tokens_per_s", "wall_s", "before", "after")}


def main() -> None:
    ap = parser(__doc__, work="/tmp/s50", threads=2, json=True)
    ap.add_argument("phase", choices=("extend", "distill", "bench", "tables", "trunk", "entropy"))
    ap.add_argument("--tokens", default="256k")
    ap.add_argument("--extend-steps", type=int, default=300, help="phase extend: optimizer steps of 4,096 tokens")
    ap.add_argument("--targets", default="deepseek,chat")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--mix", action="store_true", help="phase distill, the post-trained targets: distil on "
                    "transformers' and the stdlib's train files in turn (run names end in -mix)")
    ap.add_argument("--long", choices=("no", "only", "both"), default="no",
                    help="also (both) or only distil with windows of the whole context (--seq-len 2048)")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--drafters", default="", help="bench only these (names as the tables give them)")
    ap.add_argument("--tree", default="chain:2")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context-prompts", type=int, default=4, help="long prompts per context bucket")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    result = {"phase": a.phase, "tokens": a.tokens}
    if a.phase == "tables":
        print(tables(work))
        return
    if a.phase == "trunk":
        result["trunk_by_position"] = {t: trunk_by_position(target_dir(t, work)) for t in a.targets.split(",")
                                       if t in ("deepseek", EXTENDED)}
    elif a.phase == "entropy":
        result["entropy"] = entropy(a.prompts)
    elif a.phase == "extend":
        result["extend"] = extend(a, work)
    elif a.phase == "distill":
        result["runs"] = distill_all(a, work)
    else:
        result["benches"] = bench_all(a, work)
    result = {**stamp(), **result}  # stamped after the runs: torch is imported by then, so the GPU is named if any
    if a.json:
        write_json(a.json, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
