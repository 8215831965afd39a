"""The tree-verification decoder: masks, KV gather, greedy losslessness per drafter, sampling losslessness."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recycle.decoding import DynamicTreeSpec, MaskCache, MTPStack, StaticTree, Target, generate, load_target
from recycle.decoding import cache as kv
from recycle.decoding.drafting import Drafter, load_engine
from recycle.decoding.tree import Expander, Tree, ancestor_matrix, parse_shape, validate_choices
from recycle.decoding.verify import verify
from recycle.errors import RecycleError

from tests.helpers import assert_target_law, chi2_sf, exact_marginals, sampled_counts, tiny_mtp_pair
from tests.trained import FIXTURE, GLM_FIXTURE, TRAINED


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(load_target(FIXTURE))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def drafter_dirs(converted) -> dict[str, Path]:
    return {fmt: converted(fmt) for fmt in ("eagle", "eagle3", "medusa")}


# -- trees and masks ----------------------------------------------------------------------------


def test_ancestor_matrix_and_mask():
    parents = [-1, 0, 0, 1, 1, 3]
    anc = ancestor_matrix(parents)
    assert anc[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert anc[2].nonzero().flatten().tolist() == [0, 2]
    masks = MaskCache(torch.float32, "cpu")
    mask, pos = masks.mask(parents, [0, 1, 1, 2, 2, 3], prefix=4)
    assert mask.shape == (1, 1, 6, 10) and pos.tolist() == [[4, 5, 5, 6, 6, 7]]
    allowed = mask[0, 0] == 0
    assert allowed[:, :4].all()  # everyone sees the prefix
    assert torch.equal(allowed[:, 4:], anc)
    assert masks.mask(parents, [0, 1, 1, 2, 2, 3], prefix=2)[0].shape == (1, 1, 6, 8)


def test_choices_validation_and_static_tree():
    tree = StaticTree.from_choices([[1], [0], [0, 0], [0, 1]])
    assert tree.parents == [-1, 0, 0, 1, 1] and tree.ranks == [0, 0, 1, 0, 1]
    for bad in ([], [[0, 0]], [[-1]], [[0], [0]], "x", [["a"]]):
        with pytest.raises(RecycleError):
            validate_choices(bad)
    assert parse_shape("chain:3", 2) == 3
    assert parse_shape("dynamic:2,3,5", 2) == DynamicTreeSpec(2, 3, 5)
    with pytest.raises(RecycleError):
        parse_shape("[[0], [0, 0], [0, 0, 0]]", 2, max_depth=2)


def test_dynamic_expander_keeps_best_and_is_ancestor_closed():
    ex = Expander(7, DynamicTreeSpec(depth=3, top_k=2, total_tokens=4))
    g = torch.Generator().manual_seed(0)
    while not ex.done():
        ex.expand(torch.randn(len(ex.frontier()), 10, generator=g))
    tree, keep = ex.tree()
    assert len(tree) == 5 and tree.tokens[0] == 7
    for i, p in enumerate(tree.parents[1:], start=1):
        assert 0 <= p < i
    dropped = set(range(1, len(ex.tok))) - set(keep)
    assert max(ex.score[c] for c in dropped) <= min(ex.score[c] for c in keep[1:])


@pytest.fixture(scope="module")
def glm_target() -> Target:
    return Target(load_target(GLM_FIXTURE))


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_target_honours_tree_mask(target: Target, glm_target: Target, family: str):
    """Every tree node's logits equal a plain causal forward over prefix + its root path (MLA and GQA with
    partial rotary; sdpa and eager)."""
    target = target if family == "deepseek_v3" else glm_target
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 4000, (1, 20), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    depths = [0, 1, 1, 2, 2, 2, 3]
    tokens = torch.randint(3, 4000, (1, len(parents)), generator=g)
    tree = Tree(tokens[0].tolist(), parents, depths)
    model = target.model
    for attn in ("sdpa", "eager"):
        model.set_attn_implementation(attn)
        with torch.inference_mode():
            cache = target.new_cache()
            target.forward(prefix, torch.arange(20)[None], None, cache)
            mask, pos = MaskCache(torch.float32, "cpu").mask(parents, depths, 20)
            logits, _ = target.forward(tokens, pos, mask, cache)
            for node in range(len(parents)):
                path = tokens[0, tree.path_to(node)]
                ref = model(torch.cat([prefix[0], path])[None]).logits[0, -1]
                torch.testing.assert_close(logits[node], ref, atol=2e-4, rtol=1e-4)
    model.set_attn_implementation("sdpa")


def test_kv_gather_equals_recomputation(target: Target):
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 4000, (1, 15), generator=g)
    parents, depths = [-1, 0, 0, 2, 2, 4], [0, 1, 1, 2, 2, 3]
    tokens = torch.randint(3, 4000, (1, 6), generator=g)
    path = [0, 2, 4, 5]
    with torch.inference_mode():
        cache = target.new_cache()
        target.forward(prefix, torch.arange(15)[None], None, cache)
        mask, pos = MaskCache(torch.float32, "cpu").mask(parents, depths, 15)
        target.forward(tokens, pos, mask, cache)
        kv.keep(cache, 15, path)
        ref = target.new_cache()
        full = torch.cat([prefix[0], tokens[0, path]])[None]
        target.forward(full, torch.arange(full.shape[1])[None], None, ref)
    assert kv.seq_length(cache) == full.shape[1]
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


# -- greedy losslessness ------------------------------------------------------------------------

ENGINES = [
    ("native", None, None),
    ("eagle", "eagle", "chain:2"),
    ("eagle", "eagle", None),
    ("eagle3", "eagle3", None),
    ("medusa", "medusa", None),
]


@pytest.fixture(scope="module")
def plain() -> Callable[[Target, list[int]], list[int]]:
    """Plain greedy decoding of 20 tokens, computed once per target and prompt for every engine compared to it."""
    seen: dict[tuple[int, tuple[int, ...]], list[int]] = {}

    def tokens(model: Target, ids: list[int]) -> list[int]:
        key = (id(model), tuple(ids))
        if key not in seen:
            seen[key] = generate(model, Drafter(), ids, 20, masks=MaskCache(torch.float32, "cpu")).tokens
        return seen[key]

    return tokens


@pytest.mark.parametrize("name,fmt,tree", ENGINES, ids=[f"{n}-{t or 'default'}" for n, _, t in ENGINES])
def test_greedy_identical_to_ar_on_default_prompts(target, tokenizer, drafter_dirs, plain, name, fmt, tree):
    from recycle.prompts import default_prompts

    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(str(drafter_dirs[fmt]) if fmt else None, target, masks, tree=tree, native=fmt is None,
                         target_dir=str(FIXTURE))
    target.set_taps(engine.taps)
    for _, text in default_prompts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sp = generate(target, engine, ids, 20, masks=masks)
        assert sp.tokens == plain(target, ids), (name, tree, text[:40])
        st = sp.stats
        assert st.forwards == st.steps + 1 and len(st.accept_lengths) == st.steps
        assert st.tau == pytest.approx((st.new_tokens - 1) / st.steps)
        assert sum(st.accept_lengths) >= st.new_tokens - 1  # the last step may be cut at max_new_tokens
        assert all(a <= t for a, t in zip(st.accepted, st.tried))
        assert all(st.tried[d + 1] <= st.accepted[d] for d in range(len(st.tried) - 1))


@pytest.mark.parametrize("fmt", [None, "eagle", "eagle3", "medusa"])
def test_glm_greedy_identical_to_ar(glm_target, tokenizer, plain, fmt, converted):
    """The second trained family (GQA target, one MTP module): every drafter kind is lossless on it too."""
    from recycle.prompts import default_prompts

    d = None
    if fmt:
        d = str(converted(fmt, source=GLM_FIXTURE))
    masks = MaskCache(torch.float32, "cpu")
    engine = load_engine(d, glm_target, masks, native=fmt is None, target_dir=str(GLM_FIXTURE))
    glm_target.set_taps(engine.taps)
    for _, text in default_prompts()[:4]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sp = generate(glm_target, engine, ids, 20, masks=masks)
        assert sp.tokens == plain(glm_target, ids), (fmt, text[:40])


def test_eagle_chain_matches_native_chain(target, tokenizer, drafter_dirs):
    """Before distillation `--to eagle` is the MTP computation itself: same drafts, same τ."""
    masks = MaskCache(torch.float32, "cpu")
    native = load_engine(None, target, masks, native=True, target_dir=str(FIXTURE))
    eagle = load_engine(str(drafter_dirs["eagle"]), target, masks, tree="chain:2")
    target.set_taps(("last",))
    ids = tokenizer("def f(x):\n    return x + 1\n\n\ndef g(y):\n", add_special_tokens=False)["input_ids"]
    a = generate(target, native, ids, 40, masks=masks).stats
    b = generate(target, eagle, ids, 40, masks=masks).stats
    assert a.accept_lengths == b.accept_lengths


# -- sampling losslessness ----------------------------------------------------------------------

V = 8


@pytest.fixture(scope="module")
def tiny():
    """A random-init tiny DeepSeek-V3 target (vocab 8) with two random MTP modules as the drafter."""
    return tiny_mtp_pair(V)


@pytest.mark.parametrize("shape", [2, StaticTree.from_choices([[0], [1], [2], [0, 0], [1, 0], [0, 1]])],
                         ids=["sampled-chain", "topk-tree"])
def test_speculative_sampling_follows_target_distribution(tiny, shape):
    model, mtp = tiny
    target = Target(model)
    masks = MaskCache(torch.float32, "cpu")
    engine = MTPStack(mtp, shape, masks)
    target.set_taps(engine.taps)
    prompt, temperature, runs = [1, 5, 2, 7, 3], 1.0, 1200
    exact = exact_marginals(model, prompt, temperature)
    counts, accepted = sampled_counts(target, engine, prompt, runs, V, masks, temperature)
    assert accepted > runs // 10  # the drafts are exercised, not all rejected
    assert_target_law(counts, exact, runs)


def test_verify_sampling_rejects_to_residual():
    """One node, one deterministic child: token law = p exactly (child w.p. p(x), else residual)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    tree = Tree([0, 1], [-1, 0], [0, 1])
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    first = torch.zeros(4)
    n = 20000
    for _ in range(n):
        path, tok = verify(tree, logits, 1.0, rng, gen)
        first[tree.tokens[1] if len(path) == 2 else tok] += 1
    p = torch.softmax(logits[0], -1)
    stat = float(((first - n * p) ** 2 / (n * p)).sum())
    assert chi2_sf(stat, 3) > 1e-3


def test_cached_drafts_equal_uncached_reference(target, tokenizer, drafter_dirs):
    """The engine's per-step caches (committed rows kept, draft rows cropped) give the same drafts as
    the drafter's own cache-free reference recomputed over the whole sequence, every step."""
    from recycle.drafters import load_drafter

    model = load_drafter(drafter_dirs["eagle"])
    masks = MaskCache(torch.float32, "cpu")
    seen = []

    class Checked(MTPStack):
        def propose(self, root, temperature=0.0, gen=None):
            tree = super().propose(root, temperature, gen)
            ids = torch.tensor([self.ids])
            hidden = target.model.model(ids[:, :-1]).last_hidden_state
            ref = model.draft(hidden, ids, steps=self.steps)[0].tolist()
            seen.append(ref == tree.tokens[1:])
            return tree

    engine = Checked(model, 3, masks, kind="eagle", reuse="last")
    target.set_taps(engine.taps)
    ids = tokenizer("class Point:\n    def __init__(self, x, y):\n        self.x = x\n", add_special_tokens=False)["input_ids"]
    generate(target, engine, ids, 30, masks=masks)
    assert seen and all(seen)
