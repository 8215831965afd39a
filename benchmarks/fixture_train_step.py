"""Where the fixture's training step spends its time on this CPU, piece by piece.

    python benchmarks/fixture_train_step.py [--batch 16] [--seq 256] [--steps 5] [--dtype bf16|fp32]

The fixture must rebuild in 60 CPU minutes, so tokens per second bounds how far it can train. This
times the compiled step of `fixtures/build_trained.py` (forward, backward, clipping, AdamW; random ids) and,
separately and compiled the same way, the two pieces whose size the issue fixes rather than we do:
causal attention at vLLM's MLA dims (q/k head 32 + 64 rope, v head 32, 4 heads) and the vocabulary
projection + cross-entropy (vocab 4096). Each piece's share is its time × how often a step runs it.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from _common import parser
from fixtures import build_trained


def seconds_per_call(fn, *args, calls: int, bf16: bool, after=None) -> float:
    """Mean wall time of fn(*args) forward + backward (+ after()), under bf16 autocast or in fp32, after two warm-ups."""

    def once():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = fn(*args)
        out.backward()
        if after is not None:
            after()

    for _ in range(2):
        once()
    start = time.perf_counter()
    for _ in range(calls):
        once()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = parser(__doc__, first_line=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="bf16 autocast (the build's) or plain fp32")
    args = ap.parse_args()
    bf16 = args.dtype == "bf16"
    torch.set_num_threads(2)
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; {args.dtype}")
    cfg, trunk, mtp = build_trained.build_models(0)
    build_trained.grouped_experts(trunk, mtp)
    params = list(trunk.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    window = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + mtp.depth + 1))
    compiled = torch.compile(build_trained.losses)

    def step() -> torch.Tensor:
        main_loss, per_depth, _, _ = compiled(trunk, mtp, window, args.seq)
        opt.zero_grad(set_to_none=True)
        return main_loss + build_trained.MTP_WEIGHT * torch.stack(per_depth).mean()

    start = time.perf_counter()
    full = seconds_per_call(step, calls=args.steps, bf16=bf16, after=lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0), opt.step()))
    warm = time.perf_counter() - start

    n, heads, rope, nope, v = args.batch, cfg.num_attention_heads, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    q, k = (torch.randn(n, heads, args.seq, nope + rope, requires_grad=True) for _ in range(2))
    val = torch.randn(n, heads, args.seq, v, requires_grad=True)
    attention = seconds_per_call(
        torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()),
        q, k, val, calls=10, bf16=bf16,
    )
    hidden = torch.randn(n * args.seq, cfg.hidden_size, requires_grad=True)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size).mul(0.02).requires_grad_()
    target = torch.randint(0, cfg.vocab_size, (n * args.seq,))
    vocab = seconds_per_call(torch.compile(lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y)), hidden, head, target, calls=10, bf16=bf16)

    layers = cfg.num_hidden_layers + mtp.depth  # every trunk layer and every MTP block attends
    heads_out = 1 + mtp.depth  # the trunk's head and one per MTP depth
    tokens = n * args.seq
    print(f"compiled step (fwd + bwd + clip + AdamW), {n} × {args.seq}: {full * 1000:.0f} ms = {tokens / full:,.0f} tokens/s"
          f"  (compile + warm-up + timing {warm:.0f} s)")
    print(f"attention fwd+bwd per layer: {attention * 1000:.1f} ms × {layers} layers = {attention * layers / full:.0%} of the step")
    print(f"vocab projection + CE fwd+bwd per head: {vocab * 1000:.1f} ms × {heads_out} heads = {vocab * heads_out / full:.0%} of the step")


if __name__ == "__main__":
    main()
