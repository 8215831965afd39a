"""Which of a Gemma 4 assistant's layers carries its acceptance, and what the EAGLE-3 fold keeps at 0 tokens.

Teacher-forced top-1 agreement of draft step 1 with the target's greedy next token, on held-out stdlib
windows the target continues greedily (as distill's held-out estimate reads them): the assistant whole, the
assistant with a single one of its layers kept (the others skipped, the target's K/V as it cached them), and
its EAGLE-3 fold (`recycle convert --to eagle3`) at 0 distillation tokens, of each layer. This is why
converters/assistant.py folds the last full-attention layer.

    python benchmarks/assistant_fold.py --windows 16 --threads 2
"""

from __future__ import annotations

import copy

import torch

from recycle.checkpoint import Checkpoint
from recycle.converters import assistant as fold
from recycle.converters.roles import backbone, gather
from recycle.decoding.target import load_target
from recycle.drafters import load_drafter
from recycle.drafters.eagle3 import build_eagle3
from recycle.drafters.gemma4 import head, target_states_and_kv, teacher_forced

from _common import FIXTURES, parser


def windows(target: str, count: int, prompt: int, length: int) -> torch.Tensor:
    """Held-out stdlib windows: `prompt` tokens of text, then the target's own greedy continuation."""
    from transformers import AutoTokenizer

    from recycle.texts import data_source

    tok = AutoTokenizer.from_pretrained(target)
    rows = []
    for text in data_source(None).heldout():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt:
            rows.append(ids[:prompt])
        if len(rows) == count:
            break
    model = load_target(target)
    with torch.no_grad():
        out = model.generate(torch.tensor(rows), max_new_tokens=length - prompt, do_sample=False)
    return out[:, :length]


def only_layer(assistant, i: int):
    """A copy of the assistant with its layer i alone."""
    a = copy.deepcopy(assistant)
    text = a.config.get_text_config()
    a.model.layers = torch.nn.ModuleList([a.model.layers[i]])
    text.layer_types = [text.layer_types[i]]
    text.num_hidden_layers = 1
    return a


def main() -> None:
    ap = parser(__doc__, target=FIXTURES / "gemma4_target", threads=None)
    ap.add_argument("--assistant", default=str(FIXTURES / "gemma4_assistant"))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ids = windows(a.target, a.windows, a.prompt, a.length)
    model = load_target(a.target)
    assistant = load_drafter(a.assistant)
    rows = ids.shape[1] - 2
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
        last, kv = target_states_and_kv(model.get_decoder(), model.config, ids)
        want = ids[:, 2:2 + rows]
        scored = ids[:, :rows] >= 0
        scored[:, : a.prompt] = False  # only the target's own continuation
        result = {}

        def agree(logits: torch.Tensor) -> float:
            return float((logits.argmax(-1) == want)[scored].float().mean())

        result["assistant"] = agree(head(assistant, teacher_forced(assistant, model.get_input_embeddings(), ids, last,
                                                                   kv, 1, rows)[0]))
        types = assistant.config.get_text_config().layer_types
        for i, kind in enumerate(types):
            single = only_layer(assistant, i)
            logits = head(single, teacher_forced(single, model.get_input_embeddings(), ids, last, kv, 1, rows)[0])
            result[f"layer {i} ({kind}) alone"] = agree(logits)
        w, bb = gather(Checkpoint(a.assistant)), backbone(a.target)
        for i, kind in enumerate(types):
            plan = fold.convert(w, bb, layer=i)
            state = {k: lazy.make().float() for k, lazy in plan.tensors[fold.WEIGHTS].items()}
            config = plan.jsons["config.json"]
            d = build_eagle3(config, state)
            aux = torch.cat([out.hidden_states[j][:, :rows] for j in config["eagle_aux_hidden_state_layer_ids"]], -1)
            logits, _ = d(aux, inputs_embeds=model.get_input_embeddings()(ids[:, 1:1 + rows]))
            chosen = " (the default)" if i == fold.chosen_layer(w.config) else ""
            result[f"EAGLE-3 fold of layer {i} ({kind}){chosen}, 0 tokens"] = agree(logits)
    print(f"{a.windows} held-out windows, {int(scored.sum())} scored positions (the target's greedy continuation)")
    print("| drafter | step-1 agreement |\n|---|---:|")
    for k, v in result.items():
        print(f"| {k} | {v:.3f} |")


if __name__ == "__main__":
    main()
