"""Chat-tuned target (issue 32): does re-aligning on conversations, with the assistant mask, and with the target's
own regenerated answers, pay over re-aligning on plain text?

On `fixtures/deepseek_v3_mtp_chat` (the DeepSeek fixture's trunk instruction-tuned on stdlib conversations, MTP
tensors stale), judged on held-out chat prompts (the fixture's `chat_heldout.jsonl`: functions from files neither
side trained on, each rendered with the chat template through the assistant's generation prompt):

  native       the stale MTP modules as the engines chain them (bench --native-mtp)
  plain        convert --to eagle, distilled on plain text (the stdlib corpus: today's path)
  chat-text    the training conversations rendered to text, every token counted (no mask)
  chat         the training conversations, assistant tokens only (the mask)
  chat-regen   the same conversations with every assistant turn written by the target (greedy), regenerated once
               in vLLM (`recycle harvest --self-distill`'s generator), saved as JSONL and reused as --data
  chat-sd      distill --self-distill in process (transformers' generate, regenerated as training reads them):
               slow on a CPU, not in the default list

Every distilled drafter gets the same token budget(s); each budget is a separate run from the converted drafter.
Reports α per depth and τ (chain:3 by default), and each run's held-out estimate (over its own held-out rows, so
compare those only within a variant).

    python benchmarks/chat_realign.py --tokens 256k,1M --json /tmp/chat_realign.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.distill.train import DistillOptions, distill
from recycle.preflight import parse_tokens
from recycle.prompts import read_jsonl

from _common import FIXTURES, parser, stamp, write_json
from fixtures.build_chat import conversations, write_jsonl

TARGET = FIXTURES / "deepseek_v3_mtp_chat"
VARIANTS = ("native", "plain", "chat-text", "chat", "chat-regen")


def bench(drafter: str | None, prompts: list, tree: str, tokens: int) -> dict:
    r = run_bench(BenchOptions(drafter=drafter, target=str(TARGET), prompts=prompts, max_new_tokens=tokens, tree=tree,
                               native=drafter is None))
    o = r.overall
    return {"tau": o.spec.tau, "acceptance": list(o.spec.acceptance), "speedup": o.speedup,
            "greedy_match": o.greedy_match}


def rendered_text(convs, path: Path) -> None:
    """The conversations as the template renders them, as plain text rows: every token counts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    path.write_text("".join(json.dumps({"text": tok.apply_chat_template(list(c.messages), tokenize=False)}) + "\n"
                            for c in convs))


def regenerated(data: Path, out: Path, tokens: int, seq_len: int) -> dict:
    """Every assistant turn the windows of a `tokens` budget read, written by the target in vLLM (greedy), as harvest
    --self-distill writes them (its planner and generator, without the feature extraction), saved as JSONL."""
    from transformers import AutoTokenizer

    from recycle.distill.harvest import plan, vllm_generate
    from recycle.options import HarvestOptions

    t0 = time.perf_counter()
    opts = HarvestOptions(target=str(TARGET), out=str(out.parent / "unused"), tokens=tokens, data=str(data),
                          seq_len=seq_len, self_distill=True)
    _, regen = plan(opts, AutoTokenizer.from_pretrained(TARGET), vllm_generate(str(TARGET.resolve())))
    order = {i: n for n, i in enumerate(regen.stream.order(0))}
    rows = [regen.done[i] for i in sorted(regen.done, key=order.__getitem__)]
    out.write_text("".join(json.dumps(d.to_json()) + "\n" for d in rows))
    return {"conversations": len(rows), "engine_runs": regen.runs, "wall_s": round(time.perf_counter() - t0, 1)}


def summarize(files: list[str], work: Path) -> None:
    """Runs of several --json files (one per seed) side by side: τ per seed, mean and sd, α by depth (mean), the
    differences paired by seed; and how the regenerated set differs from the conversations it came from."""
    import statistics as st

    runs: dict[str, dict[int, dict]] = {}
    for f in files:
        for key, row in json.loads(Path(f).read_text())["variants"].items():
            name, _, seed = key.partition("/seed")
            runs.setdefault(name, {})[int(seed or 0)] = row["bench"]
    print("| variant | seeds | τ per seed | mean (sd) | α by depth (mean) |")
    for name, by_seed in runs.items():
        taus = [by_seed[s]["tau"] for s in sorted(by_seed)]
        depths = len(next(iter(by_seed.values()))["acceptance"])
        alpha = [st.mean(by_seed[s]["acceptance"][d] for s in by_seed) for d in range(depths)]
        sd = f"{st.stdev(taus):.3f}" if len(taus) > 1 else "-"
        print(f"| {name} | {sorted(by_seed)} | {' / '.join(f'{t:.3f}' for t in taus)} | {st.mean(taus):.3f} ({sd}) "
              f"| {' / '.join(f'{x:.3f}' for x in alpha)} |")
    for a, b in (("chat-text", "plain"), ("chat", "chat-text"), ("chat-regen", "chat")):
        for budget in sorted({k.split("@")[1] for k in runs if k.startswith(a + "@")}):
            x, y = runs.get(f"{a}@{budget}", {}), runs.get(f"{b}@{budget}", {})
            diffs = [x[s]["tau"] - y[s]["tau"] for s in sorted(set(x) & set(y))]
            if diffs:
                print(f"{a} − {b} @{budget}: " + " ".join(f"{d:+.3f}" for d in diffs) + f", mean {st.mean(diffs):+.3f}")
    if (work / "chat_regen.jsonl").is_file():
        original = {json.dumps([m for m in r["messages"] if m["role"] != "assistant"]): r
                    for r in map(json.loads, (work / "chat_train.jsonl").read_text().splitlines())}
        same = turns = chars_a = chars_b = unmatched = 0
        for r in map(json.loads, (work / "chat_regen.jsonl").read_text().splitlines()):
            o = original.get(json.dumps([m for m in r["messages"] if m["role"] != "assistant"]))
            if o is None:  # its user/system turns are not an original conversation's, byte for byte
                unmatched += 1
                continue
            for m, n in zip((m for m in o["messages"] if m["role"] == "assistant"),
                            (m for m in r["messages"] if m["role"] == "assistant")):
                turns, same = turns + 1, same + (m["content"].strip() == n["content"].strip())
                chars_a, chars_b = chars_a + len(m["content"]), chars_b + len(n["content"])
        print(f"regenerated: {turns} assistant turns, {same} equal to the original, {chars_b:,} characters against "
              f"{chars_a:,}; conversations whose other turns match no original: {unmatched}")


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-chat", prompts=16, max_new_tokens=96, threads=None, json=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", default="256k", help="one budget or several, comma-separated")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--tree", default="chain:3")
    ap.add_argument("--reuse", action="store_true", help="reuse WORK/chat_regen.jsonl from an earlier run")
    ap.add_argument("--seed", type=int, default=0,
                    help="distillation seed (the order training reads the data in): repeat a run to see its spread")
    ap.add_argument("--summarize", default=None, metavar="A.json,B.json",
                    help="print runs of earlier --json files side by side (seeds paired) and exit")
    a = ap.parse_args()
    if a.summarize:
        return summarize(a.summarize.split(","), Path(a.work))
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    budgets = [parse_tokens(t) for t in a.tokens.split(",")]
    variants = a.variants.split(",")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = read_jsonl(TARGET / "chat_heldout.jsonl")[:a.prompts]
    train = conversations("train")
    write_jsonl(work / "chat_train.jsonl", train)
    rendered_text(train, work / "chat_text.jsonl")
    out: dict = {**stamp(), "budgets": budgets, "tree": a.tree, "prompts": len(prompts),
                 "max_new_tokens": a.max_new_tokens, "seq_len": a.seq_len, "variants": {}}
    if "chat-regen" in variants and not (a.reuse and (work / "chat_regen.jsonl").is_file()):
        out["regenerated"] = regenerated(work / "chat_train.jsonl", work / "chat_regen.jsonl", max(budgets), a.seq_len)
        print("regenerated", json.dumps(out["regenerated"]), flush=True)
    data = {"plain": ("stdlib", False), "chat-text": (str(work / "chat_text.jsonl"), False),
            "chat": (str(work / "chat_train.jsonl"), False), "chat-regen": (str(work / "chat_regen.jsonl"), False),
            "chat-sd": (str(work / "chat_train.jsonl"), True)}
    eagle = convert_checkpoint(TARGET, "eagle", work / "eagle", overwrite=True, layouts="recycle")["out"]
    runs = [(name, 0) for name in variants if name == "native"]
    runs += [(name, budget) for budget in budgets for name in variants if name != "native"]  # every variant per budget
    for name, budget in runs:
        t0 = time.perf_counter()
        row: dict = {"tokens": budget}
        if name == "native":
            row["bench"] = bench(None, prompts, a.tree, a.max_new_tokens)
        else:
            src, sd = data[name]
            rec = distill(DistillOptions(drafter=eagle, target=str(TARGET), tokens=budget, data=src,
                                         self_distill=sd, seq_len=a.seq_len, seed=a.seed,
                                         out=str(work / f"eagle-{name}-{budget}-s{a.seed}"),
                                         overwrite=True, threads=a.threads, checkpoint_every=10**9, eval_every=25))
            row["distill"] = {"tokens_per_s": rec.get("tokens_per_s"), "train_s": rec.get("train_s"),
                              "heldout_estimate_before": rec["final"]["heldout_estimate_before"],
                              "heldout_estimate_after": rec["final"]["heldout_estimate_after"],
                              "selected_step": rec["selected"]["step"], "steps": rec["steps"],
                              "counted": rec["heldout"]["counted"], "generate_s": rec["timing"].get("generate_s"),
                              "rows": rec["data"].get("rows"), "skipped": rec["data"].get("skipped")}
            row["bench"] = bench(rec["out"], prompts, a.tree, a.max_new_tokens)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        out["variants"][f"{name}@{budget}" + (f"/seed{a.seed}" if a.seed else "")] = row
        print(name, json.dumps(row), flush=True)
        if a.json:  # after every run, so a long benchmark leaves what it measured
            write_json(a.json, out)
    print("| variant | tokens | τ | α by depth | held-out estimate before → after |")
    for key, row in out["variants"].items():
        b, d = row["bench"], row.get("distill") or {}
        est = f"{d['heldout_estimate_before']} → {d['heldout_estimate_after']}" if d else "—"
        print(f"| {key.split('@')[0]} | {row['tokens']:,} | {b['tau']:.3f} | "
              f"{' / '.join(f'{x:.3f}' for x in b['acceptance'])} | {est} |")


if __name__ == "__main__":
    main()
