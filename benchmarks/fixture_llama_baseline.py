"""How far can a ~4M-parameter model get on the fixture's held-out split? A plain Llama as yardstick.

    python benchmarks/fixture_llama_baseline.py [--steps 400] [--lr 2e-3] [--eval-every 1000]

The trained fixture (issue 3) aims at held-out loss ≤ 2.6 nats/token. This trains transformers'
LlamaForCausalLM of the size environment.md's CPU table uses (hidden 256, 4 layers, ffn 688, tied
embeddings, 4.2M parameters) on the same corpus split and tokenizer, with the same batch (16 × 256),
AdamW and a cosine schedule, then reports held-out loss on 64 evenly spaced windows: the same
measurement as the fixture's history table, so the two curves can be compared step for step. A
wide, shallow, dense model runs several times more tokens per second here than the fixture's deep
MLA + MoE trunk, so a long run answers whether *any* model of this size reaches the target in the
fixture's 60 CPU minutes.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from fixture_loss_breakdown import CTX, mean_loss

from _common import FIXTURE, parser
from fixtures import build_trained

SEQ, BATCH = CTX, 16


def heldout_loss(model, held: torch.Tensor, windows: int = 64) -> float:
    """Mean next-token loss over build_trained.evaluate()'s windows."""
    model.eval()
    loss = mean_loss(model, held, build_trained.eval_starts(len(held), SEQ, windows), batch=BATCH)
    model.train()
    return loss


def main() -> None:
    ap = parser(__doc__, first_line=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=0, help="also report held-out loss every this many steps")
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    train, held = build_trained.token_stream(tok, "train"), build_trained.token_stream(tok, "heldout")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                                         max_position_embeddings=2048))
    print("params", sum(p.numel() for p in model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    for s in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1, (s + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
        starts = torch.randint(0, len(train) - SEQ - 2, (BATCH,), generator=gen)
        w = torch.stack([train[i : i + SEQ + 1] for i in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if s % 50 == 0:
            print(s, round(loss.item(), 3), round(time.time() - t0), flush=True)
        if args.eval_every and (s + 1) % args.eval_every == 0 and s + 1 < args.steps:
            print(f"eval step {s + 1}: held-out {heldout_loss(model, held):.3f}", flush=True)
    final = heldout_loss(model, held)
    print(f"held-out loss after {args.steps} steps ({args.steps * BATCH * SEQ:,} tokens): {final:.3f}; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
