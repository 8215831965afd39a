"""What every EAGLE-3 converter writes, whatever it folds (MTP module 0 in `converters/eagle3.py`, a Gemma 4
assistant's layer in `converters/assistant.py`): the weight file's name, the Llama-midlayer config.json with the
speculators keys, and the LM head over the draft vocabulary with its d2t/t2d maps."""

from __future__ import annotations

import torch

from recycle.converters.roles import APPROX, EXACT
from recycle.errors import RecycleError
from recycle.io.writer import Lazy

WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release the output is validated against
DEFAULT_SPEC_TOKENS = 3


def vocab_maps(draft_ids: torch.Tensor | None, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets [Vd], t2d mask [V]) for ascending target ids; None means the full vocabulary."""
    if draft_ids is None:
        return torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    ids = draft_ids.to(torch.long)
    if ids.numel() and (not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab):
        raise RecycleError("draft vocabulary ids must be distinct, ascending and inside the target vocabulary")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def draft_head(head: Lazy, draft_ids: torch.Tensor | None, vocab: int) -> dict[str, Lazy]:
    """lm_head over the draft vocabulary (rows of `head` in d2t order) and, for a reduced one, d2t and t2d."""
    if draft_ids is None:  # a full vocabulary carries no maps (vLLM refuses them there)
        return {"lm_head.weight": head}
    d2t, t2d = vocab_maps(draft_ids, vocab)
    vd, sel = d2t.numel(), draft_ids.clone()
    note = f"top-{vd} tokens by corpus frequency"
    return {"lm_head.weight": head.derive((vd, head.shape[1]), lambda t: t.index_select(0, sel), EXACT,
                                          f"rows of the {vd} draft-vocabulary ids"),
            "d2t": Lazy((vd,), lambda: d2t, (), APPROX, f"{note}: int64 offsets", dtype=torch.long),
            "t2d": Lazy((vocab,), lambda: t2d, (), APPROX, f"{note}: kept-token mask", dtype=torch.bool)}


def llama_config(*, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 draft_vocab: int, eps: float, max_positions: int, theta: float, aux: list[int], dtype_name: str,
                 norm_before_residual: bool, verifier: str, verifier_architectures: list | None,
                 speculative_tokens: int = DEFAULT_SPEC_TOKENS, target_hidden: int | None = None) -> dict:
    """config.json of a Llama-midlayer EAGLE-3 drafter: the flat keys vLLM/SGLang read and the speculators ones."""
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "rms_norm_eps": eps,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden or hidden,
        "norm_before_residual": norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "torch_dtype": dtype_name,
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
    }
