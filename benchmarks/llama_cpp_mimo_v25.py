"""MiMo-V2.5 in llama.cpp: a target in the release's FP8 layout (q/k/v fused in 4 pre-sharded chunks, scales tiled per
chunk), as stored and after `recycle stitch` of other modules into it, through llama.cpp's own converter
(`convert_hf_to_gguf.py`, which reads MiMoV2ForCausalLM's FP8 chunks itself; trunk `--no-mtp`, the modules `--mtp`)
and `llama-server --spec-type draft-mtp --spec-draft-n-max 1`, against `recycle bench --tree chain:1` on the same
prompt ids (6 stdlib prompts × 48 new tokens), prompt by prompt.

The copies: `tests/engines/llama_interop.py` `mimo_v25_for_llama_cpp` (the MiMo drafting copy with 8 heads, 4 KV
heads, head dims 96; no trained MiMo fixture exists); the stitched modules come from its BF16 twin with another
random part in each `eh_proj` (`eh_seed=7`), converted `--to eagle`, stitched and re-quantized chunk by chunk. A
third row runs the same values in MiMo-V2-Flash's layout (separate q/k/v) with recycle's own side file (`--to gguf`:
q/k/v stacked into the `attn_qkv` the mimo2 graph asserts), where llama.cpp's own export does not draft.

    python benchmarks/llama_cpp_mimo_v25.py --work /tmp/llama-mimo-v25
"""

from __future__ import annotations

import time
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.converters.overlay import stitch
from recycle.engines.llama_cpp import convert_trunk

from _common import parser
from tests.engines.interop import ar_tokens
from tests.engines.llama_interop import LlamaServer, mimo_v25_for_llama_cpp, prompt_ids, side_file


def row(name: str, model: Path, work: Path, ours: bool = False) -> None:
    """`ours`: the modules from recycle's side file (`convert --to gguf`), not llama.cpp's own `--mtp` export."""
    t0 = time.perf_counter()
    trunk = convert_trunk(model, work / f"{name}-trunk.gguf", mtp="no")
    side = side_file(model, work, f"{name}-ours", module=None) if ours else \
        convert_trunk(model, work / f"{name}-side.gguf", mtp="only")
    converted = time.perf_counter() - t0
    prompts, ids = prompt_ids(model, 6)
    with LlamaServer(trunk) as server:
        plain = [server.complete(p, 48)["tokens"] for p in ids]
    with LlamaServer(trunk, side, n_max=1) as server:
        drafted = [server.complete(p, 48) for p in ids]
    ours = []
    for p in prompts:
        spec = run_bench(BenchOptions(drafter=None, native=True, target=str(model), prompts=[p], max_new_tokens=48,
                                      tree="chain:1", stop_at_eos=False, warmup=False)).overall.spec
        ours.append(f"{int(sum(spec.accepted))}/{int(sum(spec.tried))}")
    theirs = [f"{d['accepted']}/{d['drafted']}" for d in drafted]
    lossless = [d["tokens"] for d in drafted] == plain
    print(f"| {name} | {'yes' if plain == ar_tokens(model, ids, 48) else 'NO'} | {'yes' if lossless else 'NO'} | "
          f"{', '.join(theirs)} | {', '.join(ours)} | {converted:.1f} s |")


def main() -> None:
    ap = parser(__doc__, work="/tmp/llama-mimo-v25")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = mimo_v25_for_llama_cpp(work)
    donor = mimo_v25_for_llama_cpp(work, fp8=False, eh_seed=7)
    overlay = Path(convert_checkpoint(donor, "eagle", work / "donor", overwrite=True)["out"]) / "mtp_overlay"
    done = stitch(overlay, target, work / "stitched", overwrite=True)
    q = done["quantization"]
    print(f"stitch: {q['requantized']} weights re-quantized, max relative error {q['max_rel_error']}")
    print("| target | llama.cpp plain = recycle AR | lossless at n_max 1 | llama.cpp accepted/drafted, per prompt | "
          "recycle accepted/tried, per prompt | the GGUF files' conversion |\n|---|---|---|---|---|---|")
    row("V2.5 layout, FP8 as stored", target, work)
    row("the same, other modules stitched (FP8, re-quantized by chunk)", work / "stitched", work)
    # MiMo-V2-Flash's layout (separate q/k/v): llama.cpp's own export does not draft (the mimo2 graph asserts a fused
    # attn_qkv); recycle's side file stacks them
    row("V2-Flash layout, recycle's side file", mimo_v25_for_llama_cpp(work, flash=True), work, ours=True)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
