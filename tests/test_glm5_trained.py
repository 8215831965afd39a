"""The tree decoder on a sparse-attention (DSA) target: the trained GLM-5 fixture (`fixtures/glm5_mtp`,
GlmMoeDsaForCausalLM: MLA + the DSA indexer with index_topk 64 + MoE, one MTP layer).

transformers keeps the indexer's keys in `DynamicIndexedLayer.indexer_keys` beside keys and values; recycle's
`crop`/`keep` must cut them with the keys (else the next verification indexes stale rows), and the native MTP
engine's per-step caches must hold the MTP block's own cache kind. The prompts are longer than index_topk, so the
indexer's top-k is engaged in every forward of the target and of the MTP block.

Ties: this fixture's 4 indexer heads leave many keys with an index score of exactly 0 (every head's ReLU'd score
zero), and `torch.topk` returns equal values in an order that depends on the row's length and layout. A tree puts a
node's ancestors at other columns than plain decoding does, so with the tie at the top-k boundary the two select
different keys: both are the target's computation, neither is wrong, but they are not bit-equal (a chain too: its
rows are longer than one decoding step's). The tests run the target with a stable tie-break (`stable_topk`: equal
scores, lowest column first; a tree keeps the prefix and a node's ancestors in position order, so the stable order is
the same as plain decoding's), which makes greedy decoding a function of the prompt alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer
from transformers.masking_utils import create_sliding_window_causal_mask

import recycle.decoding.cache as kv
from recycle.decoding import MaskCache, Target, generate, load_target
from recycle.decoding.drafting import Drafter, load_engine
from recycle.decoding.tree import windowed
from recycle.errors import RecycleError
from recycle.mtp import MTP
from recycle.prompts import default_prompts

from tests.helpers import stable_topk
from tests.trained import FIXTURE

GLM5 = FIXTURE.parent / "glm5_mtp"
TREE = "[[0], [1], [0, 0], [1, 0], [0, 0, 0]]"  # branching at depth 1, three deep (the module chained again)
NEW = 16


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(load_target(GLM5))


@pytest.fixture(scope="module")
def prompts(target: Target) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(GLM5)
    out = [tok(text, add_special_tokens=False)["input_ids"] for _, text in default_prompts()[:2]]
    assert all(len(ids) > target.config.index_topk for ids in out)  # the top-k selects from the first forward on
    return out


@pytest.fixture(scope="module", autouse=True)
def stable_ties():
    """torch.topk with equal values returned lowest index first (see the module docstring)."""
    with stable_topk():
        yield


@pytest.fixture(scope="module")
def plain(target: Target, prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy decoding of each prompt, once for every test that compares with it."""
    return [generate(target, Drafter(), ids, NEW, masks=MaskCache(torch.float32, "cpu")).tokens for ids in prompts]


def _decode(target: Target, prompts: list[list[int]], plain: list[list[int]], tree: str | None) -> list:
    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(None, target, masks, tree=tree, native=True, target_dir=str(GLM5))
    target.set_taps(engine.taps)
    return [(ref, generate(target, engine, ids, NEW, masks=masks)) for ids, ref in zip(prompts, plain)]


def test_native_chain_is_lossless_on_the_dsa_target(target, prompts, plain):
    runs = _decode(target, prompts, plain, "chain:2")
    for plain, sp in runs:
        assert sp.tokens == plain
    assert sum(sp.stats.accepted[0] for _, sp in runs) > 0  # trained: the MTP layer's drafts are taken


def test_native_tree_is_lossless_and_gathers(target, prompts, plain, monkeypatch):
    gathered = []
    keep = kv.keep

    def watched(cache, prefix, nodes, index=None):
        gathered.append(list(nodes) != list(range(len(nodes))))
        keep(cache, prefix, nodes, index)
        layers = [lyr for lyr in cache.layers if lyr.keys is not None and lyr.keys.numel()]
        assert {lyr.indexer_keys.shape[1] for lyr in layers} == {prefix + len(nodes)} == {kv.seq_length(cache)}

    monkeypatch.setattr(kv, "keep", watched)
    runs = _decode(target, prompts, plain, TREE)
    for plain, sp in runs:
        assert sp.tokens == plain
    assert any(gathered)  # a path through a second child: keep() moved rows, indexer keys with them
    assert sum(sp.stats.accepted[0] for _, sp in runs) > 0


def test_crop_and_keep_cut_the_indexer_keys_with_the_keys(target):
    """After a tree forward, keep(path) leaves keys, values and indexer keys equal to a plain forward over
    prefix + path; crop cuts all three to the same length."""
    g = torch.Generator().manual_seed(5)
    p = 80
    prefix = torch.randint(3, 4000, (1, p), generator=g)
    parents, depths = [-1, 0, 0, 2, 2, 4], [0, 1, 1, 2, 2, 3]
    tokens = torch.randint(3, 4000, (1, 6), generator=g)
    path = [0, 2, 4, 5]
    with torch.inference_mode():
        cache = target.new_cache()
        target.forward(prefix, torch.arange(p)[None], None, cache)
        mask, pos = MaskCache(torch.float32, "cpu").mask(parents, depths, p)
        target.forward(tokens, pos, mask, cache)
        assert isinstance(cache.layers[0], DynamicIndexedLayer) and cache.layers[0].indexer_keys.shape[1] == p + 6
        kv.keep(cache, p, path)
        ref = target.new_cache()
        full = torch.cat([prefix[0], tokens[0, path]])[None]
        target.forward(full, torch.arange(full.shape[1])[None], None, ref)
        for a, b in zip(cache.layers, ref.layers):
            for name in ("keys", "values", "indexer_keys"):
                torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)
        kv.crop(cache, p + 1)
        for a, b in zip(cache.layers, ref.layers):
            assert a.keys.shape[-2] == a.indexer_keys.shape[1] == p + 1
            torch.testing.assert_close(a.indexer_keys, b.indexer_keys[:, : p + 1])


def test_native_mtp_steps_hold_the_blocks_cache_kind(target, prompts):
    """Each MTP step's cache gives the block's layer index transformers' DSA layer, and the cached drafts equal the
    MTP runtime's cache-free forward over the whole sequence at every step."""
    mtp = MTP.from_checkpoint(GLM5)
    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(None, target, masks, tree="chain:1", native=True, target_dir=str(GLM5))
    target.set_taps(engine.taps)
    seen = []
    propose = engine.propose

    def checked(root, temperature=0.0, gen=None):
        tree = propose(root, temperature, gen)
        ids = torch.tensor([engine.ids])
        hidden = target.model.model(ids[:, :-1]).last_hidden_state
        seen.append(int(mtp(hidden, ids).logits[0][0, -1].argmax()) == tree.tokens[1])
        layer = engine.caches[0].layers[engine.slots[0]]
        assert isinstance(layer, DynamicIndexedLayer) and layer.indexer_keys.shape[1] == layer.keys.shape[-2]
        return tree

    engine.propose = checked
    with torch.inference_mode():
        generate(target, engine, prompts[0], 8, masks=masks)
    assert seen and all(seen)


def test_a_layer_with_state_crop_cannot_cut_is_refused():
    class Compressing(DynamicLayer):  # a running summary, as DeepSeek-V4's compressed-attention layers keep
        def __init__(self):
            super().__init__()
            self.compressed = {"compressor": None}

    with pytest.raises(RecycleError, match="compressed"):
        kv.token_state(Compressing())
    assert kv.token_state(DynamicIndexedLayer()) == (("indexer_keys", 1), ("indexer_position_ids", -1))


def test_windowed_mask_is_transformers_sliding_mask():
    """A sliding-window MTP block keeps a whole cache; the window goes into the mask, as transformers draws it."""
    from transformers import LlamaConfig

    w, s, n = 5, 9, 4
    config = LlamaConfig(hidden_size=8, num_attention_heads=1, sliding_window=w)
    config._attn_implementation = "sdpa"
    masks = MaskCache(torch.float32, "cpu")
    ours = windowed(masks.causal(n, s), list(range(s, s + n)), s, w)[0, 0] == 0
    ref = create_sliding_window_causal_mask(config=config, inputs_embeds=torch.zeros(1, s + n, 8), attention_mask=None,
                                            past_key_values=None, position_ids=torch.arange(s + n)[None],
                                            allow_is_causal_skip=False)
    assert torch.equal(ours, ref[0, 0, s:].bool() if ref.dtype == torch.bool else ref[0, 0, s:] == 0)


def test_sliding_window_mtp_block_drafts_as_its_uncached_forward(family_dir):
    """Mellum's MTP block is a sliding-window layer (window 4 in the generator): past the window, each chained step's
    cached draft logits equal the MTP runtime's own forward over the whole sequence (its sliding mask)."""
    from recycle.decoding.drafting.native_mtp import MTPStack

    mtp = MTP.from_checkpoint(family_dir("mellum")).eval()
    assert mtp.layers[0].layer_type == "sliding_attention"
    engine = MTPStack(mtp, 1, MaskCache(torch.float32, "cpu"))
    assert engine.windows == [4]
    got = []
    step = engine._step

    def recorded(*args):
        out, logits = step(*args)
        got.append(logits)
        return out, logits

    engine._step = recorded
    g = torch.Generator().manual_seed(7)
    n, h = 16, mtp.config.hidden_size
    ids, hidden = torch.randint(0, 250, (n + 1,), generator=g), torch.randn(n, h, generator=g)
    with torch.inference_mode():
        engine.start(ids[:9].tolist(), {"last": hidden[:9]})
        for c in range(9, n):  # the root at position c; the draft reads the state at c - 1 and the root
            engine.propose(int(ids[c]))
            ref = mtp(hidden[None, :c], ids[None, : c + 1]).logits[0][0, -1]
            torch.testing.assert_close(got[-1][0], ref, atol=1e-4, rtol=1e-4)
            engine.commit([int(ids[c])], {"last": hidden[c : c + 1]})
