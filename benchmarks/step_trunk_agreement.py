"""Step-3.7's trunk in llama.cpp against transformers (issue 47): where the two engines' greedy outputs part.

On Step-3.7's layout generator (random weights, the end-of-generation rows of the head zeroed, since llama-server
ignores EOS) as it is and with its trunk's layer outputs (o_proj, down_proj) at 0.3, each with its routed experts
live and with their outputs zeroed: llama.cpp's plain greedy continuation of
each held-out prompt (trunk GGUF from its own converter, f32) against transformers' (`recycle bench`'s AR decoder,
fp32), and at each first difference transformers' logit for its own token minus its logit for llama.cpp's; and
the smallest margin between the 2nd and 3rd experts' selection scores (sigmoid + bias, top 2 of 4 chosen) over
every position of each prompt and its continuation, in transformers: how near a tie the routing comes. The
side file is not involved: the releases' MTP blocks are dense (docs/llama-cpp.md, "Step-3.5 / 3.7-Flash").

    python benchmarks/step_trunk_agreement.py --json /tmp/step_trunk.json

Needs the managed llama.cpp (`recycle.engines.llama_cpp`: built on first use, 15-26 min on two cores).
"""

from __future__ import annotations

from pathlib import Path

import torch

from recycle.decoding.target import load_target

from _common import parser, stamp, write_json
from tests.engines.interop import ar_tokens
from tests.engines.llama_interop import llama_runs, prompt_ids, step_for_llama_cpp, trunk_gguf


def router_margins(model) -> tuple[list, object]:
    """A hook on every MoE router of `model` recording, per call, the smallest 2nd-minus-3rd selection score."""
    seen: list[float] = []

    def hook(gate, args, _out) -> None:
        x = args[0].reshape(-1, gate.hidden_dim)
        scores = torch.sigmoid(torch.nn.functional.linear(x, gate.weight).float()) + gate.e_score_correction_bias
        top = torch.topk(scores, 3, dim=-1).values
        seen.append(float((top[:, 1] - top[:, 2]).min()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    return seen, handles


def compare(target: Path, work: Path, n_prompts: int, new_tokens: int) -> list[dict]:
    _, ids = prompt_ids(target, n_prompts)
    plain = llama_runs(trunk_gguf(target, work), None, ids, new_tokens, 1)["tokens"]
    model = load_target(target)
    rows = []
    for p, got, want in zip(ids, plain, ar_tokens(target, ids, new_tokens)):
        i = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        seen, handles = router_margins(model)
        with torch.no_grad():
            model(torch.tensor([p + want]))
        for h in handles:
            h.remove()
        row = {"prompt_tokens": len(p), "equal": i is None, "router_margin": min(seen)}
        if i is not None:
            with torch.no_grad():
                logits = model(torch.tensor([p + want[:i]])).logits[0, -1]
            row.update(first_difference=i, gap=round(float(logits[want[i]] - logits[got[i]]), 4))
        rows.append(row)
    return rows


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-step-trunk", prompts=4, max_new_tokens=48, json=True)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = {**stamp(), "prompts": a.prompts, "max_new_tokens": a.max_new_tokens}
    variants = {f"trunk x{scale:g}, routed experts {'live' if routed else 'zeroed'}": (scale, routed)
                for scale in (1.0, 0.3) for routed in (True, False)}
    for name, (scale, routed) in variants.items():
        target = step_for_llama_cpp(work, shaped=False, routed_experts=routed, trunk=scale)
        out[name] = compare(target, work, a.prompts, a.max_new_tokens)
        print(name, out[name], flush=True)
    if a.json:
        write_json(a.json, out)
    print("| trunk | prompts with equal greedy output | gaps at the first difference | smallest router margin |")
    for name in variants:
        rows = out[name]
        gaps = ", ".join(f"{r['gap']:.3f}" for r in rows if not r["equal"]) or "-"
        print(f"| {name} | {sum(r['equal'] for r in rows)} of {len(rows)} | {gaps} | "
              f"{min(r['router_margin'] for r in rows):.2e} |")


if __name__ == "__main__":
    main()
