"""Calibrated EAGLE-3 fold (issue 34): how much of the MTP module's drafting an EAGLE-3 drafter keeps, before and
after distillation, against the same EAGLE-3 trained from scratch.

Per fixture, on held-out code prompts of a domain the fixtures never saw (`py:transformers`), greedy, chain:3,
64 new tokens:
  - the MTP module itself, chained (`convert --to eagle`, no training): the prior;
  - the plain fold (`convert --to eagle3`);
  - the calibrated fold (`convert --to eagle3 --calibrate TOKENS`), then distilled on the stdlib text with
    snapshots at the marks (`benchmarks/experiment.py`), against `--init scratch` for a budget many times larger.

    python benchmarks/eagle3_calibrated.py --fixtures glm4_moe_mtp,deepseek_v3_mtp --calibrate 32k \\
        --tokens 1M --marks 0,64k,256k,1M --scratch-tokens 4M --scratch-marks 0,256k,640k,1M,2M,2560k,4M --threads 2

The fold's own choices at 0 distillation tokens (the midlayer's MLP width, and on MLA sources the block's own
attention), each calibrated the same way:

    python benchmarks/eagle3_calibrated.py --variants --calibrate 32k --threads 2

A fit made elsewhere (e.g. `recycle convert ... --calibrate 1M` on a GPU) is distilled and benched here with
`--converted DIR`; one long scratch run serves every calibrated fold of a fixture in the tables and the plot:

    python benchmarks/eagle3_calibrated.py --summaries A/summary.json,B/summary.json --scratch-from S/summary.json

What the calibration costs at DeepSeek-V3's widths (the real config; the drafter built on the meta device):

    python benchmarks/eagle3_calibrated.py --scale --calibrate 64k

Trained on a lent GPU, benched here (`--train-only` writes the calibrated fold, the runs and their snapshots; the
second run distils nothing again and benches every snapshot):

    python benchmarks/eagle3_calibrated.py --fixtures glm5_mtp --train-only --work W ...
    python benchmarks/eagle3_calibrated.py --fixtures glm5_mtp --converted W/glm5_mtp/eagle3-converted --work W ...

Writes WORK/<fixture>/experiment.json and WORK/summary.json, the plot, and prints the tables BENCHMARKS.md holds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from recycle.converters.api import convert_checkpoint
from recycle.distill.calibrate import convert_calibrated
from recycle.preflight import parse_tokens
from recycle.prompts import code_prompts

from _common import BENCHMARKS, CONFIGS, FIXTURES, parser, write_json
from experiment import ExperimentOptions, bench_tau, run_experiment, tokens_to_reach


def counts(text: str) -> tuple[int, ...]:
    return tuple(0 if m.strip() == "0" else parse_tokens(m) for m in text.split(","))


def fixture_run(name: str, a, work: Path) -> dict:
    target = str(FIXTURES / name)
    prompts = [("code", p) for p in code_prompts(a.prompts, source=a.prompt_source)]
    out: dict = {"fixture": name, "tree": a.tree}
    for fmt, label in (("eagle", "module"), ("eagle3", "fold")) if not a.train_only else ():
        d = work / f"{label}"
        convert_checkpoint(target, fmt, d, overwrite=True)
        out[label] = bench_tau(str(d), target, prompts, a.max_new_tokens, tree=a.tree)
        print(f"{name} {label}: tau {out[label]['tau']:.3f} acc {out[label]['acceptance']}", flush=True)
    opts = ExperimentOptions(target=target, work=str(work), tokens=parse_tokens(a.tokens), marks=counts(a.marks),
                             formats=("eagle3",), prompt_source=a.prompt_source, prompts=a.prompts,
                             max_new_tokens=a.max_new_tokens, threads=a.threads, calibrate=parse_tokens(a.calibrate),
                             convert_options=({"eagle3_mlp": a.mlp} if a.mlp else {})
                             | ({"calibrate_steps": a.calibrate_steps} if a.calibrate_steps else {}),
                             tree=a.tree, inits=("recycled",),
                             lr=a.lr, scratch_tokens=parse_tokens(a.scratch_tokens) if a.scratch_tokens != "0" else None,
                             scratch_marks=counts(a.scratch_marks),
                             converted={"eagle3": a.converted} if a.converted else {}, bench=not a.train_only)
    out["experiment"] = run_experiment(opts, log=lambda s: print(s, flush=True))
    return out


EXACT_COPIES = ("lm_head.weight", "norm.weight", "midlayer.input_layernorm.weight",
                "midlayer.post_attention_layernorm.weight")  # what the fold copies exactly from a MoE block
MLA_EXACT = tuple(f"midlayer.self_attn.{n}.weight" for n in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj",
                                                            "o_proj"))  # and, in the MLA midlayer, these


def scale(a) -> str:
    """Fitted parameters, Adam state and the feature cache for DeepSeek-V3's EAGLE-3 fold (both MLP widths, both
    midlayer attentions), from the real config on the meta device."""
    import torch

    from recycle.converters.eagle3 import MLA_CONFIG_KEYS
    from recycle.converters.eagle3_layout import llama_config
    from recycle.drafters.eagle3 import eagle3_module

    cfg = json.loads((CONFIGS / "deepseek_v3" / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    tokens, steps = parse_tokens(a.calibrate), 3
    lines = ["| midlayer | MLP width | parameters | fitted | Adam fit (fp32 weights, grads, 2 moments) | "
             f"feature cache for {tokens:,} tokens (fp32 / bf16) |", "|---|---:|---:|---:|---:|---:|"]
    for attention in ("llama", "mla"):
        for width in (cfg["moe_intermediate_size"] * cfg["n_shared_experts"], cfg["intermediate_size"]):
            if attention == "llama":
                conf = llama_config(hidden=h, intermediate=width, heads=heads, kv_heads=heads, head_dim=qk,
                                    vocab=cfg["vocab_size"], draft_vocab=cfg["vocab_size"], eps=cfg["rms_norm_eps"],
                                    max_positions=4096, theta=10000.0, aux=[2, 30, 60], dtype_name="bfloat16",
                                    norm_before_residual=False, verifier="deepseek-ai/DeepSeek-V3",
                                    verifier_architectures=None)
            else:
                conf = {k: cfg[k] for k in MLA_CONFIG_KEYS if k in cfg} | {
                    "model_type": "deepseek_v2", "hidden_size": h, "intermediate_size": width,
                    "num_attention_heads": heads, "vocab_size": cfg["vocab_size"], "rms_norm_eps": cfg["rms_norm_eps"],
                    "max_position_embeddings": 4096, "hidden_act": "silu"}
            with torch.device("meta"):
                model = eagle3_module(conf)
            total = sum(p.numel() for n, p in model.named_parameters())
            exact = EXACT_COPIES + (MLA_EXACT if attention == "mla" else ())
            fitted = sum(p.numel() for n, p in model.named_parameters() if n not in exact)
            cache = tokens * (3 + steps) * h
            lines.append(f"| {attention} | {width:,} | {total / 1e9:.2f}B | {fitted / 1e9:.2f}B | "
                         f"{fitted * 16 / 2**30:.1f} GiB | {cache * 4 / 2**30:.1f} / {cache * 2 / 2**30:.1f} GiB |")
    return "\n".join(lines)


def variants(a) -> str:
    """τ at 0 distillation tokens of each calibrated variant (MLP width × midlayer attention) per fixture."""
    lines = ["| fixture | midlayer attention | MLP | width | calibration s | held-out KL to the module by step "
             "(fold → calibrated) | τ (" + a.tree + ") | acceptance by depth |", "|---|---|---|---:|---:|---|---:|---|"]
    rows = []
    prompts = [("code", p) for p in code_prompts(a.prompts, source=a.prompt_source)]
    for combo in a.combos.split(","):
        name, attention, mlp = combo.split(":")
        target = FIXTURES / name
        d = Path(a.work) / "variants" / f"{name}-{attention}-{mlp}-{a.calibrate_steps or 'default'}"
        conv = convert_calibrated(target, "eagle3", d, overwrite=True, calibrate=parse_tokens(a.calibrate),
                                  eagle3_mlp=mlp, eagle3_attention=attention,
                                  **({"calibrate_steps": a.calibrate_steps} if a.calibrate_steps else {}))
        cal = json.loads((d / "recycle.json").read_text())["calibration"]
        width = json.loads((d / "config.json").read_text())["intermediate_size"]
        tau = bench_tau(str(d), str(target), prompts, a.max_new_tokens, tree=a.tree)
        rep = cal["report"]
        kl = " / ".join(f"{x:.2f} → {y:.2f}" for x, y in zip(rep["folded"]["kl"], rep["calibrated"]["kl"]))
        row = (f"| {name} | {attention} | {mlp} | {width} | {conv['seconds']:.0f} | {kl} | {tau['tau']:.3f} | "
               + " / ".join(f"{x:.3f}" for x in tau["acceptance"]) + " |")
        print(row, flush=True)
        rows.append(row)
    return "\n".join(lines + rows)


def midlayer(ex: dict) -> str:
    """" (MLA midlayer)" where the distilled EAGLE-3 used the block's own attention; read from the conversion's
    options, or (runs recorded before they were kept) from the converted directory's recycle.json if still there."""
    options = ex["conversions"]["eagle3"].get("options")
    if options is None:
        made = Path(ex["runs"]["eagle3-recycled"]["record"]["from"]) / "recycle.json"
        options = json.loads(made.read_text())["target"]["options"] if made.is_file() else {}
    return " (MLA midlayer)" if options.get("eagle3_attention") == "mla" else ""


def markdown(results: list[dict]) -> str:
    lines = []
    marks = sorted({p["tokens"] for r in results for p in r["experiment"]["runs"]["eagle3-recycled"]["curve"]})
    lines += ["| fixture | module, chained (0 tokens) | plain fold | calibration (tokens, s) | distillation schedule | "
              + " | ".join(f"calibrated + {m:,}" for m in marks) + " | calibrated @ 0 / module |",
              "|---|---:|---:|---:|---:|" + "---:|" * (len(marks) + 1)]
    for r in results:
        ex = r["experiment"]
        curve = {p["tokens"]: p["tau"] for p in ex["runs"]["eagle3-recycled"]["curve"]}
        conv = ex["conversions"]["eagle3"]
        lines.append(f"| {r['fixture']}{midlayer(ex)} | {r['module']['tau']:.3f} | {r['fold']['tau']:.3f} | "
                     f"{conv['calibration']['tokens']:,}, "
                     + (f"{conv['seconds']:.0f} | " if conv["seconds"] is not None else "converted before | ")
                     + f"{ex['tokens']:,} | "
                     + " | ".join(f"{curve[m]:.3f}" if m in curve else "" for m in marks)
                     + f" | {curve[0] / r['module']['tau']:.0%} |")
    lines += ["", "| fixture | scratch τ at its marks | scratch × tokens to match calibrated @ "
              + " / ".join(f"{m:,}" for m in marks if m) + " |", "|---|---|---|"]
    for r in results:
        ex = r["experiment"]
        if "eagle3-scratch-long" not in ex["runs"]:
            continue
        sc = [(p["tokens"], p["tau"]) for p in ex["runs"]["eagle3-scratch-long"]["curve"]]
        rc = {p["tokens"]: p["tau"] for p in ex["runs"]["eagle3-recycled"]["curve"]}
        mult = []
        for m in marks:
            if not m:
                continue
            if m not in rc:  # a run without this mark (several runs in one table)
                mult.append("–")
                continue
            need = tokens_to_reach(sc, rc[m])
            mult.append(f"{need / m:.1f}×" if need is not None else f"> {sc[-1][0] / m:.1f}× (never)")
        cal = ex["conversions"]["eagle3"]["calibration"] or {}
        which = f" (calibrated on {cal.get('tokens', 0):,}; schedule {ex['tokens']:,})"
        lines.append(f"| {r['fixture']}{midlayer(ex)}{which} | " + ", ".join(f"{t:,}: {tau:.3f}" for t, tau in sc)
                     + " | " + " / ".join(mult) + " |")
    return "\n".join(lines)


def borrow(results: list[dict], donors: list[dict], source: str) -> None:
    """Give each result without a long scratch run the donor's for the same fixture, if its recipe is the same
    (data, prompts, tree, new tokens, learning rate); the run keeps a note of where it came from."""
    keys = ("data", "prompt_source", "prompts", "max_new_tokens")

    def lr(runs: dict, name: str) -> float:
        return runs[name]["record"]["optimizer"]["lr"]

    long = "eagle3-scratch-long"
    for r in results:
        runs = r["experiment"]["runs"]
        for d in donors:
            given = d["experiment"]["runs"]
            if (long not in runs and long in given and d["fixture"] == r["fixture"] and d["tree"] == r["tree"]
                    and all(d["experiment"].get(k) == r["experiment"].get(k) for k in keys)
                    and lr(given, long) == lr(runs, "eagle3-recycled")):
                runs[long] = given[long] | {"from": source}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        ex = r["experiment"]
        for run, style, label in (("eagle3-recycled", "o-", "calibrated fold, distilled"),
                                  ("eagle3-scratch-long", "s--", "scratch (--init scratch)")):
            if run not in ex["runs"]:
                continue
            c = ex["runs"][run]["curve"]
            ax.plot([p["tokens"] for p in c], [p["tau"] for p in c], style, label=label)
        ax.axhline(r["module"]["tau"], color="grey", ls=":", label="MTP module, chained (0 tokens)")
        ax.axhline(r["fold"]["tau"], color="C3", ls=":", label="plain fold (0 tokens)")
        ax.set_xscale("symlog", linthresh=64000)
        ax.set_xlim(left=0)
        ax.set_xlabel("distillation tokens")
        ax.set_ylabel(f"held-out τ ({r['tree']})")
        cal = (ex.get("conversions", {}).get("eagle3") or {}).get("calibration") or {}
        ax.set_title(r["fixture"] + (f" (calibrated on {cal['tokens']:,} tokens)" if cal.get("tokens") else ""),
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("EAGLE-3 from MTP modules: calibrated fold vs scratch", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-eagle3-calibrated", prompts=8, max_new_tokens=64, threads=None)
    ap.add_argument("--fixtures", default="glm4_moe_mtp,deepseek_v3_mtp")
    ap.add_argument("--summaries", default=None, help="comma list of WORK/summary.json files: plot and tabulate "
                    "them together, running nothing")
    ap.add_argument("--scratch-from", default=None, help="with --summaries: a summary.json whose long scratch run "
                    "(same fixture, same recipe) stands beside each result that has none (scratch does not depend on "
                    "the calibration, so one long run serves every calibrated fold)")
    ap.add_argument("--combos", default="glm4_moe_mtp:llama:shared,glm4_moe_mtp:llama:wide,deepseek_v3_mtp:llama:wide,"
                    "deepseek_v3_mtp:mla:wide", help="with --variants: FIXTURE:ATTENTION:MLP, comma-separated")
    ap.add_argument("--scale", action="store_true", help="only the DeepSeek-V3 cost table (no model runs)")
    ap.add_argument("--variants", action="store_true", help="only the calibrated variants at 0 tokens (MLP width, "
                    "MLA attention)")
    ap.add_argument("--calibrate", default="32k")
    ap.add_argument("--mlp", default=None, choices=("shared", "wide"), help="--eagle3-mlp (default: convert's)")
    ap.add_argument("--calibrate-steps", type=int, default=None, help="--calibrate-steps (default: convert's)")
    ap.add_argument("--converted", default=None, help="an EAGLE-3 directory calibrated already (e.g. by --variants): "
                    "distilled as it is, one fixture")
    ap.add_argument("--train-only", action="store_true", help="convert and distill only, no bench (on a lent GPU); "
                    "a later run with the same --work and --converted WORK/FIXTURE/eagle3-converted benches the "
                    "snapshots and distils nothing again")
    ap.add_argument("--tokens", default="1M")
    ap.add_argument("--marks", default="0,64k,256k,1M")
    ap.add_argument("--scratch-tokens", default="4M")
    ap.add_argument("--scratch-marks", default="0,256k,640k,1M,2M,2560k,4M")
    ap.add_argument("--tree", default="chain:3")
    ap.add_argument("--lr", type=float, default=5e-4, help="distillation learning rate (recycled and scratch)")
    ap.add_argument("--prompt-source", default="py:transformers")
    ap.add_argument("--plot", default=str(BENCHMARKS / "eagle3_calibrated.png"))
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    if a.scale:
        print(scale(a))
        return
    if a.summaries:  # runs done (e.g. one invocation per fixture): one plot and one set of tables for them all
        results = [r for f in a.summaries.split(",") for r in json.loads(Path(f).read_text())]
        if a.scratch_from:
            borrow(results, json.loads(Path(a.scratch_from).read_text()), a.scratch_from)
        plot(results, a.plot)
        print(markdown(results))
        return
    if a.variants:
        table = variants(a)
        print(f"\nwall time {time.perf_counter() - t0:.0f} s\n\n{table}")
        return
    results = []
    for name in a.fixtures.split(","):
        results.append(fixture_run(name, a, Path(a.work) / name))
        write_json(Path(a.work, "summary.json"), results)
    if a.train_only:
        print(f"\nwall time {time.perf_counter() - t0:.0f} s; trained, nothing benched")
        return
    plot(results, a.plot)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; plot {a.plot}\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
