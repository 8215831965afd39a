"""Peak host memory per rank of an EAGLE drafter sharded from the start (issue 49), at DeepSeek-V3's real widths.

The drafter: one MTP module of DeepSeek-V3 (hidden 7168, MLA, 8 routed experts of width 2048 and the shared one,
the vocabulary `--vocab`, 129,280 at full width), random bf16 weights written as a drafter directory under --dir.
Then `--ranks` gloo ranks (torch.multiprocessing, one thread each), each:

  1. builds it on the meta device and shards it (`distill.sharding.shard`: the routed experts split by expert, then
     FSDP2), then allocates and reads only its own shards (`recycle.drafters.sharded.materialize`);
  2. makes the drafter's frozen embedding and head a stand-in teacher's (whole on every rank, as a harvested cache's
     teacher holds them; the drafter's own copies dropped, as `adopt_target_io` does), then runs `--steps` AdamW
     steps of distill's own unroll and chunked loss (`distill.losses.distill_loss`) on random features: one
     sequence of `--seq-len` tokens per rank, fp32 as this CPU computes (what a harvested cache feeds);
  3. writes the best snapshot as a distillation does (`distill.state.save_best_sharded`: DCP, each rank its shards);
  4. writes the drafter from the shards (`converters.rewrite.write_drafter_sharded`).

Each rank samples its RSS (psutil, every 20 ms) and records the peak of every phase, with ru_maxrss at the end.
The teacher's embedding and head are held in fp32, or in bf16 with `--frozen-bf16`. The result holds the distill
plan's per-rank figure for the same run (`distill.memory.plan`, harvested teacher, FSDP2) beside the measured peaks.

    python benchmarks/width_true_ranks.py --dir /tmp/wt --vocab 129280 --seq-len 256 --steps 3 --json out.json
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _common


def config(vocab: int, experts: int, narrower: dict | None = None) -> dict:
    """DeepSeek-V3's config, one trunk layer, `experts` routed experts, as an EAGLE drafter directory's config.json
    (`narrower`: widths replaced, for a run the machine cannot hold at full width)."""
    c = json.loads((_common.CONFIGS / "deepseek_v3" / "config.json").read_text())
    c.pop("quantization_config", None)
    c.update({k: v for k, v in (narrower or {}).items() if v})
    # 8 experts cannot make DeepSeek-V3's 8 routing groups of 2 or more: one group, as the fixture routes
    c.update(num_hidden_layers=1, n_routed_experts=experts, first_k_dense_replace=1, vocab_size=vocab, n_group=1,
             topk_group=1,
             num_nextn_predict_layers=1, model_type="recycle_eagle", architectures=["RecycleEagleDrafter"],
             torch_dtype="bfloat16")
    c["recycle"] = {"format": "eagle", "model_type": "deepseek_v3", "family": "deepseek_v3", "depth": 1,
                    "chained_state": "pre_norm", "zero_embed_at_pos0": True,
                    "block_class": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer",
                    "norm": "w", "concat_order": "eh", "source_num_hidden_layers": 1}
    return c


def write_drafter_dir(out: Path, cfg: dict) -> int:
    """The drafter directory with random bf16 weights, one tensor made at a time; returns its weight bytes."""
    from recycle.distill.unroll import EagleUnroller
    from recycle.drafters.eagle import EagleDrafter, canonical_family, source_model_type
    from recycle.io.writer import Lazy, OutputDir
    from recycle.mtp import family_config

    rc = cfg["recycle"]
    fam = canonical_family(rc["family"], rc["chained_state"], rc["zero_embed_at_pos0"])
    block_cfg = family_config({k: v for k, v in cfg.items() if k != "recycle"} | {"model_type": source_model_type(cfg)},
                              fam)
    with torch.device("meta"):
        model = EagleDrafter(block_cfg, fam, 1, ("embed_norm", "hidden_norm", "proj", "final_norm"))
    names = EagleUnroller(model, 1).file_state()

    def make(name: str, shape: tuple[int, ...]):
        def f() -> torch.Tensor:
            if len(shape) == 1:
                return torch.zeros(shape) if "bias" in name else torch.ones(shape)
            g = torch.Generator().manual_seed(hash(name) % (1 << 31))
            return (torch.randn(shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        return f

    lazies = {n: Lazy(tuple(t.shape), make(n, tuple(t.shape)), (n,), "fresh", dtype=torch.bfloat16)
              for n, t in names.items()}
    shutil.rmtree(out, ignore_errors=True)
    with OutputDir(out) as d:
        d.write_safetensors({"model.safetensors": lazies}, torch.bfloat16,
                            metadata={"recycle_format": "eagle"})
        d.write_json("config.json", cfg)
    return sum(t.numel() * 2 for t in names.values())


def _rank(rank: int, world: int, init: str, args: dict, queue) -> None:
    from recycle.converters.rewrite import write_drafter_sharded
    from recycle.distill.losses import distill_loss
    from recycle.distill.sharding import shard
    from recycle.distill.state import save_best_sharded
    from recycle.distill.unroll import EagleUnroller
    from recycle.drafters.sharded import materialize, meta_drafter
    from recycle.formats import of_directory
    from recycle.io.writer import OutputDir
    from recycle.options import LossConfig

    torch.set_num_threads(1)
    sampler = _common.Sampler()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sampler.mark("imports")
    try:
        src = args["dir"]
        t0 = time.perf_counter()
        model = meta_drafter(src)
        unroller = EagleUnroller(model, args["steps_k"])
        shard(model, True, torch.device("cpu"), world, "fp32", lambda _: None)
        read = materialize(model, src, torch.device("cpu"))
        sampler.mark("materialise")
        # the teacher's embedding and head, whole on every rank (a harvested cache's teacher holds them, fp32 on
        # this CPU): the drafter's frozen copies become them (`EagleUnroller.adopt_target_io`), its own dropped
        low = torch.bfloat16 if args["frozen_bf16"] else torch.float32
        teacher = {}
        for role in ("embed", "head"):
            w = getattr(model, role).weight
            teacher[role] = torch.nn.Parameter(w.detach().to(low), requires_grad=False)
            getattr(model, role).weight = teacher[role]
        del w
        sampler.mark("teacher's embedding and head")
        times = {"materialise_s": round(time.perf_counter() - t0, 1)}
        opt = torch.optim.AdamW(unroller.trainable(), lr=1e-5, foreach=True)
        g = torch.Generator().manual_seed(rank)
        hidden = model.config.hidden_size
        t = args["seq_len"]
        head = teacher["head"]
        t0 = time.perf_counter()
        for _ in range(args["steps"]):  # distill's step on a harvested cache: features in, the chunked loss
            last = torch.randn(1, t, hidden, generator=g)
            ids = torch.randint(0, model.config.vocab_size, (1, t), generator=g)
            steps = unroller.unroll(ids, last, None, lambda rows: rows.to(head.dtype) @ head.T)
            loss, _ = distill_loss(steps, LossConfig())
            (loss * world).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sampler.mark("steps")
        times["step_s"] = round((time.perf_counter() - t0) / args["steps"], 1)
        state = Path(args["state"])
        t0 = time.perf_counter()
        save_best_sharded(state, 1, model)
        sampler.mark("best snapshot")
        times["snapshot_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        write_drafter_sharded(src, OutputDir(args["out"], overwrite=True), of_directory(src), model,
                              {"benchmark": "width_true_ranks"}, rank, world)
        sampler.mark("write")
        times["write_s"] = round((time.perf_counter() - t0), 1)
        sampler.stop.set()
        queue.put({"rank": rank, "read_gib": round(read / 2**30, 3), "phases": sampler.phases, **times,
                   "ru_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)})
    finally:
        dist.destroy_process_group()


def expected(src: str, world: int, frozen_bf16: bool) -> dict:
    """What each rank should hold, counted from the drafter's shapes: the frozen embedding and head whole, and
    1/world of the trained weights with their gradients and AdamW's two moments (fp32)."""
    from recycle.distill.unroll import EagleUnroller
    from recycle.drafters.sharded import meta_drafter

    model = meta_drafter(src)
    EagleUnroller(model, 1)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) * (2 if frozen_bf16 else 4)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    return {"frozen_whole_gib": round(frozen / 2**30, 3), "trained_fp32_gib": round(trained / 2**30, 3),
            "per_rank_states_gib": round((frozen + 4 * trained / world) / 2**30, 3),
            "whole_drafter_fp32_gib": round((frozen + trained) / 2**30, 3)}


def planned(src: str, world: int, seq_len: int, steps: int) -> dict:
    """`recycle distill --plan`'s per-rank figure for this run (a harvested teacher, fp32, FSDP2, one row per rank),
    the target's config beside the drafter (`target/config.json`: DeepSeek-V3's, as the drafter's widths)."""
    from recycle.distill.memory import plan

    cfg = json.loads((Path(src) / "config.json").read_text())
    target = Path(src).parent / "target"
    target.mkdir(exist_ok=True)
    body = {k: v for k, v in cfg.items() if k != "recycle"}
    (target / "config.json").write_text(json.dumps({**body, "model_type": "deepseek_v3",
                                                    "architectures": ["DeepseekV3ForCausalLM"]}))
    p = plan(src, target, batch=1, seq_len=seq_len, draft_steps=steps, world=world, precision="fp32",
             cached_teacher=True, fsdp=True, eval_rows=0)
    return {"per_rank_gib": round(p.per_rank_bytes / 2**30, 3),
            "parts_gib": {k: round(v / 2**30, 3) for k, v in p.parts.items()}}


def main() -> None:
    p = _common.parser(__doc__, first_line=True, json=True)
    p.add_argument("--dir", default="/tmp/wt", help="where the drafter, the states and the output go")
    p.add_argument("--vocab", type=int, default=129280, help="vocabulary (DeepSeek-V3: 129280)")
    p.add_argument("--experts", type=int, default=8, help="routed experts (DeepSeek-V3: 256)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--draft-steps", type=int, default=1, help="draft steps unrolled per optimizer step")
    p.add_argument("--hidden", type=int, help="hidden size (default DeepSeek-V3's 7168)")
    p.add_argument("--moe-width", type=int, help="routed and shared experts' width (default 2048)")
    p.add_argument("--heads", type=int, help="attention heads (default 128)")
    p.add_argument("--frozen-bf16", action="store_true", help="the frozen embedding and head held in bf16")
    args = p.parse_args()
    root = Path(args.dir)
    src = root / "drafter"
    t0 = time.perf_counter()
    narrower = {"hidden_size": args.hidden, "moe_intermediate_size": args.moe_width, "num_attention_heads": args.heads,
                "num_key_value_heads": args.heads}
    weight_bytes = write_drafter_dir(src, config(args.vocab, args.experts, narrower))
    made = time.perf_counter() - t0
    state, out = root / "state", root / "out"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    init = root / "init"
    init.unlink(missing_ok=True)
    queue = mp.get_context("spawn").SimpleQueue()
    spec = {"dir": str(src), "state": str(state), "out": str(out), "seq_len": args.seq_len, "steps": args.steps,
            "steps_k": args.draft_steps, "frozen_bf16": args.frozen_bf16}
    mp.spawn(_rank, args=(args.ranks, f"file://{init}", spec, queue), nprocs=args.ranks, join=True)
    ranks = sorted((queue.get() for _ in range(args.ranks)), key=lambda r: r["rank"])
    result = {**_common.stamp(), "widths": {k: v for k, v in narrower.items() if v} or "DeepSeek-V3's",
              "vocab": args.vocab, "experts": args.experts, "ranks": args.ranks,
              "seq_len": args.seq_len, "frozen_bf16": args.frozen_bf16, "drafter_bf16_gib": round(weight_bytes / 2**30, 3),
              "drafter_written_s": round(made, 1), "expected": expected(str(src), args.ranks, args.frozen_bf16),
              "plan": planned(str(src), args.ranks, args.seq_len, args.draft_steps),
              "per_rank": ranks}
    print(json.dumps(result, indent=1))
    if args.json:
        _common.write_json(args.json, result)
    os.sync()


if __name__ == "__main__":
    main()
