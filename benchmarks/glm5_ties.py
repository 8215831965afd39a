"""GLM-5's calibrated EAGLE-3 experiment (issue 47) benched again with `torch.topk` breaking ties lowest index first.

The GLM-5 fixture's indexer scores tie at exactly 0 for many keys, and `torch.topk` orders equal values differently
for a row of several tokens (a chain's verification) than for one token, so the target itself picks other keys
under verification than in plain decoding, and greedy outputs part (BENCHMARKS.md's GLM-5 section). With ties broken
by index (tests/test_glm5_trained.py does the same to the target) every drafter's greedy output must equal plain
decoding. Reads what `eagle3_calibrated.py --fixtures glm5_mtp --work WORK` wrote (the converted module, the
snapshots) and benches each with the same prompts, tree and new tokens:

    python benchmarks/glm5_ties.py --work /tmp/b47 --threads 2
"""

from __future__ import annotations

import torch

from recycle.prompts import code_prompts

from _common import FIXTURES, parser, stamp, write_json
from experiment import bench_tau


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    values, idx = self.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), idx.narrow(dim, 0, k)))


def main() -> None:
    ap = parser(__doc__, work="/tmp/b47", prompts=8, max_new_tokens=64, threads=None, json=True)
    ap.add_argument("--tree", default="chain:3")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.Tensor.topk = stable_topk  # this process only: the measurement's condition
    prompts = [("code", p) for p in code_prompts(a.prompts, source="py:transformers")]
    w = f"{a.work}/glm5_mtp"
    runs = {"native MTP (chain:1)": (None, None), "module, chained": (f"{w}/module", a.tree),
            "plain fold": (f"{w}/fold", a.tree)}
    for init, marks in (("recycled", (0, 64_000, 256_000, 1_000_000)), ("scratch-long", (0, 256_000, 640_000, 1_000_000))):
        for m in marks:
            runs[f"{init} + {m:,}"] = (f"{w}/eagle3-{init}-snapshots/tokens_{m}", a.tree)
    result = {}
    for name, (drafter, tree) in runs.items():
        r = bench_tau(drafter, str(FIXTURES / "glm5_mtp"), prompts, a.max_new_tokens, tree=tree)
        result[name] = r
        print(f"| {name} | {r['tau']:.3f} | {' / '.join(f'{x:.3f}' for x in r['acceptance'])} | {r['greedy_match']} |",
              flush=True)
    if a.json:
        write_json(a.json, {**stamp(), "runs": result})


if __name__ == "__main__":
    main()
