"""Where the trained fixture's held-out loss comes from: train vs held-out, context, and file by file.

    python benchmarks/fixture_loss_breakdown.py [--fixture fixtures/deepseek_v3_mtp] [--top 12]

Issue 3 aims at held-out loss ≤ 2.6 nats/token. This measures the committed trunk three ways, to
tell "too few training tokens" from "the held-out files are unlike the training files":

- the build's own protocol (256 evenly spaced 256-token windows) on the train stream and on the
  held-out stream: the gap between the two is what more epochs over the same data cannot close;
- held-out with a sliding window (256 context, stride 128, only the last 128 positions scored), so
  every scored token has at least 128 tokens of context;
- each held-out file on its own (from its first token, 256-token chunks), with its share of the
  held-out tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from recycle.corpus import documents

from _common import FIXTURE, parser, write_json
from fixtures import build_trained

CTX = 256


@torch.no_grad()
def token_losses(model, windows: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy (nats) of next-token prediction for a [B, T+1] batch of ids."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=windows[:, :-1]).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(len(windows), -1)


def mean_loss(model, ids: torch.Tensor, starts: list[int], scored_from: int = 0, batch: int = 16) -> float:
    """Mean loss over the CTX-token windows at `starts`, scoring positions from `scored_from` on."""
    total, count = 0.0, 0
    for i in range(0, len(starts), batch):
        w = torch.stack([ids[s : s + CTX + 1] for s in starts[i : i + batch]])
        kept = token_losses(model, w)[:, scored_from:]
        total, count = total + kept.sum().item(), count + kept.numel()
    return total / count


def main() -> None:
    ap = parser(__doc__, first_line=True, json=True)
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--top", type=int, default=12, help="held-out files to list, largest first")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # the MTP layers are "unexpected" to the trunk class, by design
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.fixture)
    model = AutoModelForCausalLM.from_pretrained(args.fixture, dtype=torch.float32).eval()
    train, held = build_trained.token_stream(tok, "train"), build_trained.token_stream(tok, "heldout")
    out = {
        "train_windows": mean_loss(model, train, build_trained.eval_starts(len(train), CTX, 256)),
        "heldout_windows": mean_loss(model, held, build_trained.eval_starts(len(held), CTX, 256)),
        "heldout_sliding_128": mean_loss(model, held, list(range(0, len(held) - CTX - 1, CTX // 2)), scored_from=CTX // 2),
        "files": [],
    }
    for doc in documents("heldout"):
        ids = torch.tensor(tok(doc.text)["input_ids"] + [tok.eos_token_id])
        total = sum(token_losses(model, ids[s : s + CTX + 1][None]).sum().item() for s in range(0, len(ids) - 1, CTX))
        out["files"].append({"path": doc.path, "tokens": len(ids) - 1, "loss": total / (len(ids) - 1)})
    n_held = sum(f["tokens"] for f in out["files"])
    out["files"].sort(key=lambda f: -f["tokens"])

    print(f"train stream, 256 windows × {CTX}:    {out['train_windows']:.3f} nats/token")
    print(f"held-out stream, 256 windows × {CTX}: {out['heldout_windows']:.3f}")
    print(f"held-out, sliding (≥{CTX // 2} context):  {out['heldout_sliding_128']:.3f}")
    print(f"\n{'held-out file':44s} {'tokens':>7s} {'share':>6s} {'loss':>6s}")
    for f in out["files"][: args.top]:
        print(f"{f['path']:44s} {f['tokens']:7d} {f['tokens'] / n_held:6.1%} {f['loss']:6.3f}")
    if args.json:
        write_json(args.json, out, indent=2)


if __name__ == "__main__":
    main()
