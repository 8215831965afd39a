"""The 2026 releases' own MTP modules, and Gemma 4's assistant past its window, in vLLM's CPU build (method mtp, k=1)
against recycle's chain:1.

No trained fixture exists for these rows, so each runs a copy of its layout generator made to draft and put in the
shape vLLM's CPU build takes (`tests/engines/interop.py`, `tests/engines/llama_interop.py`):
* MiMo-V2-Flash (`mimo_for_vllm`): equal q/v head dims; at the generator's window (4 keys: `sliding_window_size` 3)
  and recycle again at vLLM's (3 keys), which vLLM's counts match;
* Step-3.5-Flash (`step_for_llama_cpp(variant="step3p5", head_dim=32, moe_clamp=False, router="softmax")`): the copy
  that gets past vLLM's CPU MoE; its MTP path then fails on every device (vllm#49642); and recycle's Medusa from its
  module 0 (`convert --to medusa --calibrate 8k`), which vLLM feeds Step's pre-norm state;
* Inkling (the generator, with the byte tokenizer the multimodal renderer asks for);
* the trained Gemma 4 assistant on its target past the 512-token sliding window (`past_window_prompts`: 444-707
  prompt tokens), which recycle refused before 2026-11-28;
* MiMo-V2.5's layout (`mimo_v25_for_vllm`: the MiMo copy with q/k/v fused in `num_key_value_heads` pre-sharded
  chunks and the release's config keys alone, vLLM loading a stand-in of the release's config class), in one chunk
  and in two, and with two KV heads stored as one unsharded [Q|K|V] (`--only mimo_v2`: these rows alone).
The table rows go to docs/engines.md; `--json` keeps every count.

    python benchmarks/vllm_2026.py --json /tmp/vllm-2026.json
    python benchmarks/vllm_2026.py --only mimo_v2
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from recycle.distill.calibrate import convert_calibrated

from _common import parser, write_json
from tests.engines.interop import ENGINE, FIXTURES, mimo_for_vllm, mimo_v25_for_vllm, native_k1, past_window_prompts
from tests.engines.llama_interop import step_for_llama_cpp

GEMMA4 = FIXTURES["Gemma 4"]
HEADER = ("| copy | vLLM plain = recycle AR | vLLM mtp k=1 | lossless | accepted/drafted: vLLM vs recycle |\n"
          "|---|---|---|---|---|")


def inkling(work: Path) -> Path:
    from fixtures.families import make, write_tokenizer

    out = work / "inkling"
    return out if (out / "config.json").is_file() else write_tokenizer(make("inkling").write(out))


def mimo_v25_rows(work: Path) -> list:
    """MiMo-V2.5's layout (`mimo_v25_for_vllm`, vLLM loading the stand-in config class by `auto_map`): one chunk at
    both windows, as V2-Flash's; two chunks (num_key_value_heads 2) at both; and kv 2 stored as one unsharded [Q|K|V],
    how vLLM's BF16 MTP loader reads a fused qkv_proj at tensor-parallel size 1."""
    return [native_k1(f"MiMo-V2.5 layout, {what}", mimo_v25_for_vllm(work, **opts), remote_code=True)
            for what, opts in (("1 chunk (window 4)", {}), ("1 chunk (window 3)", {"window": 3}),
                               ("2 chunks (window 4)", {"kv": 2}), ("2 chunks (window 3)", {"kv": 2, "window": 3}),
                               ("kv 2 stored unsharded (window 4)", {"kv": 2, "chunks": 1}))]


def main() -> None:
    ap = parser(__doc__, work="/tmp/recycle-vllm-2026", json=True)
    ap.add_argument("--only", choices=("all", "mimo_v2"), default="all", help="mimo_v2: MiMo-V2.5's rows alone")
    args = ap.parse_args()
    work, t0 = Path(args.work), time.time()
    rows = mimo_v25_rows(work) if args.only == "mimo_v2" else all_rows(work)
    print(f"{ENGINE}, {time.time() - t0:.0f} s\n{HEADER}")
    for r in rows:
        same = "–" if r.plain_equals_ar is None else "yes" if r.plain_equals_ar else "NO"
        mine = f"{r.recycle_accepted}/{r.recycle_tried}" if r.recycle_error is None else "recycle does not draft"
        if r.error:
            print(f"| {r.fixture} | {same} | no: {r.error[:200]} | – | – vs {mine} |")
        else:
            print(f"| {r.fixture} | {same} | yes | {'yes' if r.lossless else 'NO'} | {r.vllm_accepted}/{r.vllm_drafts} "
                  f"vs {mine} |")
    if args.json:
        write_json(args.json, [asdict(r) for r in rows])


def all_rows(work: Path) -> list:
    step = step_for_llama_cpp(work, variant="step3p5", head_dim=32, moe_clamp=False, router="softmax")
    medusa = convert_calibrated(step, "medusa", work / "step-medusa", overwrite=True, calibrate=8_000)["out"]
    return [native_k1("MiMo-V2-Flash (window 4)", mimo_for_vllm(work)),
            native_k1("MiMo-V2-Flash (window 3)", mimo_for_vllm(work, window=3)),
            native_k1("Step-3.5-Flash", step),
            native_k1("Step-3.5-Flash, recycle's Medusa (calibrated on 8k tokens), method medusa", step,
                      drafter=Path(medusa), method="medusa"),
            native_k1("Inkling (generator)", inkling(work), tokenizer=True),
            native_k1("Gemma 4 assistant, past its 512-token window (fixtures/gemma4_*)", GEMMA4,
                      drafter=GEMMA4.parent / "gemma4_assistant", prompts=past_window_prompts()),
            *mimo_v25_rows(work)]


if __name__ == "__main__":
    main()
