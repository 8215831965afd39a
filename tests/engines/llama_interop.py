"""recycle's GGUF side files run in llama.cpp and in recycle on the same prompt token ids.

For a fixture: its trunk GGUF made by llama.cpp's own converter (`--no-mtp`; DeepSeek-V3's converter drops MTP
anyway), recycle's side file (`convert --to gguf`), and `llama-server --spec-type draft-mtp` against plain
`llama-server` and `recycle bench` on the same prompt ids. `tests/engines/test_llama_cpp.py` asserts on the rows;
`benchmarks/llama_cpp_mtp.py` prints them (docs/engines.md, BENCHMARKS.md).

How the two count: llama.cpp's `draft_n` / `draft_n_accepted` are the tokens its MTP head drafted and the target
accepted over a request; recycle's are the same per depth (`tried`, `accepted`). Both verify every draft step with
the target, so at n_max = 1 each step drafts one token and the counts are the same quantity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recycle.bench import BenchOptions, run_bench
from recycle.converters.api import convert_checkpoint
from recycle.engines.llama_cpp import LlamaServer, convert_trunk
from recycle.prompts import prompt_set

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = {"DeepSeek-V3": ROOT / "fixtures" / "deepseek_v3_mtp", "GLM-4.5": ROOT / "fixtures" / "glm4_moe_mtp",
            "Qwen3.5": ROOT / "fixtures" / "qwen3_5_mtp"}
V4 = {"DeepSeek-V4": ROOT / "fixtures" / "deepseek_v4_mtp",
      "DeepSeek-V4 post-trained": ROOT / "fixtures" / "deepseek_v4_mtp_posttrained"}
# llama.cpp's V4 lightning indexer rotates each head with a Hadamard matrix of at least 64 dims (llama-kv-cache.cpp
# build_input_k_rot), and turns that rotation on for any cache whose head_dim equals the indexer's: the fixtures'
# 32-dim indexer heads fail a reshape, and 64 (their head_dim) divides by zero on the MTP's cache. 128 runs.
V4_INDEX_HEAD_DIM = 128


def v4_for_llama_cpp(source: Path, work: Path) -> Path:
    """A trained V4 fixture as llama.cpp's V4 converter and graph take it (fixtures/derive.py `fp4_experts`): routed
    experts in FP4 (the converter repacks FP4 experts and no other storage) and indexer heads widened to
    `V4_INDEX_HEAD_DIM` (the same logits: tests/engines/test_llama_cpp.py). recycle runs this copy too."""
    from fixtures.derive import fp4_experts

    out = work / f"{source.name}-fp4"
    if not (out / "config.json").is_file():
        fp4_experts(source, out, index_head_dim=V4_INDEX_HEAD_DIM)
    return out


STEP = "Step-3.7 (drafting copy)"


def step_for_llama_cpp(work: Path, *, shaped: bool = True, routed_experts: bool = True, trunk: float = 1.0,
                       variant: str = "step3p7", **opts) -> Path:
    """Step-3.7's layout generator (`fixtures.families.step3p7`, random weights, three modules) with the 256-token
    byte tokenizer llama.cpp's converter needs, and the end-of-generation rows (ids 1, 2, V-1) of every head zeroed:
    llama-server ignores EOS, recycle does not.

    `shaped` (the drafting copy): there is no trained Step fixture and random modules accept nothing (measured: 0-3
    of ~185 drafts), so the weights are shaped for acceptance:
    * the trunk's layer outputs (o_proj, down_proj) zeroed: the trunk is a bigram model, lm_head(norm(embed(t)));
    * each module's eh_proj = [I, 0.3·R]: the drafted token's embedding plus a little of the chained state, and its
      block's outputs at 0.2 of their values: a module then predicts the bigram of its input token, with its
      attention (gate, sliding window, rope), MLP and every norm still in the sum.
    That also keeps out a difference between llama.cpp's step35 trunk and transformers' Step3p7 that the routed
    experts carry (`benchmarks/step_trunk_agreement.py`). Unshaped: `trunk` scales the trunk's layer outputs,
    `routed_experts=False` zeroes the routed experts' outputs. `variant` "step3p5" writes the same tensors under
    Step-3.5-Flash's text-only config; `opts` go to the generator (vLLM's copy: `head_dim=32, moe_clamp=False`)."""
    import torch

    from fixtures.families import V, make, write_tokenizer

    out = work / (f"{variant}-{'drafting' if shaped else f'generator-trunk{trunk:g}'}"
                  f"{'' if routed_experts else '-no-routed'}{''.join(f'-{k}{v}' for k, v in sorted(opts.items()))}")
    if (out / "config.json").is_file():
        return out
    fx = make(variant, **opts)
    t = fx.tensors
    L = fx.config.get("text_config", fx.config)["num_hidden_layers"]
    for name in list(t):
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")) and name.startswith("model.layers."):
            in_trunk = int(name.split(".")[2]) < L
            scale = (0.0 if in_trunk else 0.2) if shaped else (trunk if in_trunk else 1.0)
            t[name] = (t[name].float() * scale).to(t[name].dtype)
        elif shaped and name.endswith("eh_proj.weight"):
            h = t[name].shape[0]
            rand = torch.randn(h, h, generator=torch.Generator().manual_seed(0)) / h ** 0.5
            t[name] = torch.cat([torch.eye(h), 0.3 * rand], 1).to(t[name].dtype)
        if not routed_experts and name.endswith(".moe.down_proj.weight"):
            t[name] = torch.zeros_like(t[name])
        if name == "lm_head.weight" or name.endswith("shared_head.output.weight"):
            t[name] = t[name].clone()
            t[name][[1, 2, V - 1]] = 0
    return write_tokenizer(fx.write(out))


def mimo_v25_for_llama_cpp(work: Path, *, fp8: bool = True, eh_seed: int = 0, flash: bool = False) -> Path:
    """MiMo-V2.5's layout in FP8 as released (`fixtures.families.as_mimo_v2`, `mimo_v2_fp8`: each pre-sharded chunk of
    a `qkv_proj` in blocks of its own) on the MiMo drafting copy (`interop.mimo_drafting`), in the shape llama.cpp's
    converter reads: 8 heads and 4 KV heads, so 4 chunks (the converter tells 4 from 8 by the scale rows: chunks of
    384 and 576 rows have 12 and 20 where 8 chunks would have 16 and 24), head dims 96; the end-of-generation rows of
    the head zeroed (llama-server ignores EOS, recycle does not); the byte tokenizer. `fp8=False`: in BF16;
    `eh_seed`: another random part of each module's eh_proj (modules that draft differently); `flash`: the same
    values in MiMo-V2-Flash's layout (separate q/k/v, BF16, transformers' keys beside the release's)."""
    import torch

    from fixtures.families import MIMO_TRANSFORMERS_KEYS, V, as_mimo_v2, mimo_v2_fp8, write_tokenizer
    from tests.engines.interop import mimo_drafting

    layout = "mimo_v2_flash" if flash else f"mimo_v2-{'fp8' if fp8 else 'bf16'}"
    out = work / f"{layout}-drafting-eh{eh_seed}"
    if (out / "config.json").is_file():
        return out
    fx = mimo_drafting(kv=4, heads=8)
    fx.config.update(bos_token_id=0, eos_token_id=1)  # the byte tokenizer's, which llama.cpp's converter takes
    fx.tensors["lm_head.weight"] = fx.tensors["lm_head.weight"].clone()
    fx.tensors["lm_head.weight"][[1, 2, V - 1]] = 0
    if eh_seed:
        for name in [n for n in fx.tensors if n.endswith("eh_proj.weight")]:
            h = fx.tensors[name].shape[0]
            rand = torch.randn(h, h, generator=torch.Generator().manual_seed(eh_seed)) / h ** 0.5
            fx.tensors[name] = torch.cat([torch.eye(h), 0.3 * rand], 1).to(fx.tensors[name].dtype)
    if flash:  # as the release's config.json, which llama.cpp's converter reads raw (`RAW_CONFIG`)
        for key in MIMO_TRANSFORMERS_KEYS:
            fx.config.pop(key)
        return write_tokenizer(fx.write(out))
    fx = as_mimo_v2(fx)
    return write_tokenizer((mimo_v2_fp8(fx) if fp8 else fx).write(out))


@dataclass
class Side:
    """One side file on one trunk: what llama.cpp and recycle did with it at each n_max."""

    name: str
    llama: dict  # n_max -> {"tokens": [[...]], "drafted": int, "accepted": int, "tau": float}
    recycle: dict  # n_max -> {"accepted": int, "tried": int, "tau": float}
    plain: list[list[int]]  # llama.cpp without a draft
    ar: list[list[int]]  # recycle's AR tokens


def prompt_ids(fixture: Path, n: int) -> tuple[list, list[list[int]]]:
    from transformers import AutoTokenizer

    ps = prompt_set("stdlib", n)
    tok = AutoTokenizer.from_pretrained(str(fixture))
    return ps, [tok(p, add_special_tokens=False)["input_ids"] for _, p in ps]


def llama_runs(trunk: Path, side: Path | None, ids: list[list[int]], new_tokens: int, n_max: int,
               embedded: bool = False) -> dict:
    """Greedy completions of every prompt; with a side file (or `embedded`: the MTP block inside the trunk file),
    the draft counts (in all, and `per_prompt`: {"accepted", "drafted"} each) and τ = 1 + accepted / verification
    steps (llama.cpp's own "mean len": the steps it drafted at, bonus token included)."""
    with LlamaServer(trunk, side, n_max=n_max, embedded=embedded) as server:
        outs = [server.complete(p, new_tokens) for p in ids]
        drafting = side is not None or embedded
        steps = int(server.metrics().get("spec_decode_num_drafts_total", 0)) if drafting else 0
    drafted, accepted = sum(o["drafted"] for o in outs), sum(o["accepted"] for o in outs)
    return {"tokens": [o["tokens"] for o in outs], "drafted": drafted, "accepted": accepted, "steps": steps,
            "tau": 1 + accepted / steps if steps else None,
            "per_prompt": [{"accepted": o["accepted"], "drafted": o["drafted"]} for o in outs]}


def recycle_run(target: Path, drafter: Path | None, prompts, new_tokens: int, n_max: int) -> dict:
    r = run_bench(BenchOptions(drafter=str(drafter) if drafter else None, native=drafter is None, target=str(target),
                               prompts=prompts, max_new_tokens=new_tokens, tree=f"chain:{n_max}", stop_at_eos=False,
                               warmup=False))
    spec = r.overall.spec
    return {"accepted": int(sum(spec.accepted)), "tried": int(sum(spec.tried)), "tau": spec.tau,
            "acceptance": list(spec.acceptance)}


def chain_heads(target: Path, ids: list[list[int]], new_tokens: int, n_max: int) -> list[dict]:
    """llama.cpp's drafting with several MTP heads (`common/speculative.cpp` draft-mtp, `chain_heads`: Step's and
    MiMo's graphs), re-run with recycle's modules (`MTP.from_checkpoint`) on recycle's greedy output, per prompt:
    {"accepted", "drafted", "steps"} as llama-server counts them. What the scheme does, read from that file:

    * every head's cache over the committed positions holds the rows its catch-up decode writes: the token at p with
      the trunk's state at p - 1 (its `t_h_nextn`: the last layer's output, before the final norm; zeros at p = 0),
      so heads 1 and 2 are fed there as head 0 is;
    * draft step i runs head i over the draft region again, row t holding the t-th token (the last sampled one, then
      the drafts) with `chain_h[t]`: the trunk's state for t = 0, else the output (before `final_layernorm`) that
      step t - 1 produced at its last row;
    * llama-server drafts min(n_max, tokens left - 1) (`get_n_draft_max`; the prefill samples the first token), and
      every draft is greedy (the top of its top-10 sampler).

    The cost is a whole forward per draft step: for short prompts only."""
    import torch

    from recycle.decoding.target import Target, load_target
    from recycle.mtp import MTP

    from tests.engines.interop import ar_tokens

    target_model = Target(load_target(str(target)), taps=("prenorm",))
    mtp = MTP.from_checkpoint(str(target)).eval()
    out = []
    for p, gen in zip(ids, ar_tokens(target, ids, new_tokens), strict=True):
        seq = p + gen
        with torch.no_grad():
            _, feats = target_model.forward(torch.tensor([seq]), torch.arange(len(seq))[None], None,
                                            target_model.new_cache())
            trunk = feats["prenorm"].float()
            rows = torch.cat([torch.zeros_like(trunk[:1]), trunk[:-1]])  # row p: the trunk's state at p - 1
            n, counts = len(p) + 1, {"accepted": 0, "drafted": 0, "steps": 0}
            while n < len(seq):
                room = min(n_max, len(seq) - n - 1)
                if room <= 0:
                    n += 1
                    continue
                states, tokens, drafts = list(rows[:n]), list(seq[:n]), []
                for i in range(room):
                    mtp.layer_for = lambda step, i=i: mtp.layers[i]  # head i over every row: one step of depth 1
                    run = mtp(torch.stack(states)[None], torch.tensor([[0] + tokens + drafts]), depth=1)
                    drafts.append(int(run.logits[0][0, -1].argmax()))
                    states.append(run.states[0][0, -1])
                hit = 0
                while hit < len(drafts) and drafts[hit] == seq[n + hit]:
                    hit += 1
                counts = {"accepted": counts["accepted"] + hit, "drafted": counts["drafted"] + len(drafts),
                          "steps": counts["steps"] + 1}
                n += hit + 1
        out.append(counts)
    return out


def trunk_gguf(target: Path, work: Path) -> Path:
    out = work / f"{target.name}-trunk-f32.gguf"
    return out if out.is_file() else convert_trunk(target, out, mtp="no")


def side_file(source: Path, work: Path, name: str, *, trunk: Path | None = None, module: int | None = 0) -> Path:
    """recycle's side file for `source` (a checkpoint or a distilled drafter), f32 like the trunk."""
    out = convert_checkpoint(source, "gguf", work / name, overwrite=True, dtype="fp32",
                             target=str(trunk) if trunk else None, module=module)["out"]
    return Path(out) / "mtp.gguf"
