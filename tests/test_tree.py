"""Tests for the best-first draft tree and its attention masks (jetflow_sglang/tree.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.trees import hand_tree, walk_ancestors
from jetflow_sglang.lookup import CHAIN_SCORES
from jetflow_sglang.tree import (
    MAX_BUDGET,
    DraftTree,
    ancestor_mask,
    budget_error,
    build_tree,
    chain_depth_scores,
    full_mask,
    max_tree_nodes,
    merge_chain,
    pack_bits,
    packed_mask,
    path_scores,
    prune_tree,
    refreshed_tree,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-5


# --------------------------------------------------------------------------- helpers


def make_logprobs(seed: int, batch: int, depths: int, vocab: int, mode: str) -> torch.Tensor:
    """[batch, depths, vocab] draft log-probs. mode: continuous (no ties), quantized (many
    tied log-probs), uniform (everything tied), or peaked (some depth has a prob-1 token)."""
    gen = torch.Generator().manual_seed(seed)
    if mode == "continuous":
        logits = torch.randn(batch, depths, vocab, generator=gen) * 2
    elif mode == "quantized":
        logits = torch.randint(0, 3, (batch, depths, vocab), generator=gen).float()
    elif mode == "uniform":
        logits = torch.zeros(batch, depths, vocab)
    elif mode == "peaked":
        logits = torch.randn(batch, depths, vocab, generator=gen)
        hot = torch.randint(0, vocab, (batch, depths), generator=gen)
        peaked = torch.rand(batch, depths, generator=gen) < 0.5
        onehot = torch.full((batch, depths, vocab), -1e4).scatter(2, hot[..., None], 0.0)
        logits = torch.where(peaked[..., None], onehot, logits)
    else:  # pragma: no cover
        raise AssertionError(mode)
    return torch.log_softmax(logits, -1)


@st.composite
def tree_inputs(draw, max_batch: int = 3, max_depths: int = 4, max_width: int = 3, max_vocab: int = 6):
    batch = draw(st.integers(1, max_batch))
    depths = draw(st.integers(1, max_depths))
    width = draw(st.integers(1, max_width))
    vocab = draw(st.integers(1, max_vocab))
    mode = draw(st.sampled_from(["continuous", "quantized", "uniform", "peaked"]))
    seed = draw(st.integers(0, 2**31 - 1))
    eff_width = min(width, vocab)
    budget = draw(st.integers(1, min(max_tree_nodes(depths, eff_width), MAX_BUDGET)))
    logprobs = make_logprobs(seed, batch, depths, vocab, mode)
    anchors = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(seed + 1))
    return anchors, logprobs, budget, width


def built(inputs) -> tuple[DraftTree, tuple]:
    """The tree of `tree_inputs`, and the inputs."""
    anchors, logprobs, budget, width = inputs
    return build_tree(anchors, logprobs, budget, width), inputs


def prefix_lens(batch: int):
    """Committed lengths (0..20) of `batch` requests."""
    return st.lists(st.integers(0, 20), min_size=batch, max_size=batch)


def check_structure(tree: DraftTree, anchors: torch.Tensor, logprobs: torch.Tensor, budget: int, width: int) -> None:
    batch, depths, vocab = logprobs.shape
    width = min(width, vocab)
    assert tree.tokens.shape == (batch, budget)
    for name in ("tokens", "parents", "depths", "scores"):
        assert getattr(tree, name).shape == (batch, budget), name
    assert tree.tokens.dtype == torch.int64 and tree.parents.dtype == torch.int64 and tree.depths.dtype == torch.int64
    assert tree.scores.dtype == torch.float32
    assert tree.ancestors.shape == (batch, budget, budget) and tree.ancestors.dtype == torch.bool
    assert tree.budget == budget
    topk_tokens = logprobs.float().topk(width, dim=-1).indices
    for b in range(batch):
        tokens = tree.tokens[b].tolist()
        parents = tree.parents[b].tolist()
        node_depths = tree.depths[b].tolist()
        scores = tree.scores[b].tolist()
        assert tokens[0] == int(anchors[b])
        assert parents[0] == -1 and node_depths[0] == 0 and scores[0] == 0.0
        children: dict[int, list[int]] = {}
        for i in range(1, budget):
            p = parents[i]
            assert 0 <= p < i, (b, i, p)
            d = node_depths[i]
            assert d == node_depths[p] + 1
            assert 1 <= d <= depths
            # The child's token is one of the width best draft tokens at its depth.
            assert tokens[i] in topk_tokens[b, d - 1].tolist()
            expected = scores[p] + float(logprobs[b, d - 1, tokens[i]])
            assert scores[i] == float(np.float32(scores[p]) + np.float32(logprobs[b, d - 1, tokens[i]])), (scores[i], expected)
            assert math.isclose(scores[i], expected, rel_tol=1e-6, abs_tol=TOL)
            assert scores[i] <= scores[p] + 1e-6
            children.setdefault(p, []).append(tokens[i])
        for p, toks in children.items():
            assert len(toks) == len(set(toks)), f"siblings under {p} share a token: {toks}"
            assert len(toks) <= width
        assert np.array_equal(tree.ancestors[b].numpy(), walk_ancestors(parents))


def brute_force_scores(logprobs_b: torch.Tensor, width: int) -> list[tuple[float, tuple[int, ...]]]:
    """Every non-root node of the full width-ary tree over the per-depth top-width lists:
    (cumulative score accumulated in float32 as the tree does, token path)."""
    depths, vocab = logprobs_b.shape
    width = min(width, vocab)
    vals, toks = logprobs_b.float().topk(width, dim=-1)
    vals = vals.numpy()
    toks = toks.numpy()
    out = []
    for d in range(1, depths + 1):
        for ranks in itertools.product(range(width), repeat=d):
            s = np.float32(0.0)
            for depth, r in enumerate(ranks):
                s = np.float32(s + vals[depth, r])
            out.append((float(s), tuple(int(toks[depth, r]) for depth, r in enumerate(ranks))))
    return out


def token_paths(tree: DraftTree, b: int) -> list[tuple[int, ...]]:
    tokens = tree.tokens[b].tolist()
    parents = tree.parents[b].tolist()
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return paths


def assert_trees_equal(a: DraftTree, b: DraftTree) -> None:
    for name in ("tokens", "parents", "depths", "scores", "ancestors"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def reference_full_mask(tree: DraftTree, prefix_lens: list[int]) -> np.ndarray:
    blocks = []
    budget = tree.budget
    for b, prefix in enumerate(prefix_lens):
        block = np.zeros((budget, prefix + budget), dtype=bool)
        block[:, :prefix] = True
        block[:, prefix:] = walk_ancestors(tree.parents[b].tolist())
        blocks.append(block.reshape(-1))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=bool)


def reference_pack(bits: np.ndarray, lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    packed, indptr, start = [], [0], 0
    for n in lens:
        seg = np.packbits(bits[start : start + n].astype(np.uint8), bitorder="little")
        packed.append(seg)
        indptr.append(indptr[-1] + math.ceil(n / 8))
        start += n
    flat = np.concatenate(packed) if packed else np.zeros(0, dtype=np.uint8)
    return flat, np.asarray(indptr, dtype=np.int64)


# --------------------------------------------------------------------------- structure


@SETTINGS
@given(tree_inputs())
def test_structure_invariants(inputs):
    tree, (anchors, logprobs, budget, width) = built(inputs)
    check_structure(tree, anchors, logprobs, budget, width)


@SETTINGS
@given(tree_inputs())
def test_best_subtree_under_cumulative_score(inputs):
    """The tree's nodes are the root plus the N-1 best nodes of the full width-ary tree."""
    tree, (anchors, logprobs, budget, width) = built(inputs)
    for b in range(logprobs.shape[0]):
        every = brute_force_scores(logprobs[b], width)
        best = sorted((s for s, _ in every), reverse=True)[: budget - 1]
        got = sorted(tree.scores[b, 1:].tolist(), reverse=True)
        assert tree.scores[b, 0].item() == 0.0
        np.testing.assert_allclose(got, best, rtol=1e-6, atol=TOL)
        # Token paths are distinct real nodes of the full tree.
        paths = token_paths(tree, b)
        assert len(set(paths)) == budget
        known = {p: s for s, p in every}
        for path, score in zip(paths[1:], tree.scores[b, 1:].tolist()):
            assert path in known
            assert math.isclose(known[path], score, rel_tol=1e-6, abs_tol=TOL)
        # Without ties at the cut, the chosen set is unique: compare it exactly.
        ranked = sorted(every, key=lambda e: -e[0])
        cut_gap = ranked[budget - 2][0] - ranked[budget - 1][0] if 1 < budget <= len(ranked) else math.inf
        if budget == 1 or cut_gap > 1e-4:
            assert set(paths[1:]) == {p for _, p in ranked[: budget - 1]}


@SETTINGS
@given(tree_inputs())
def test_deterministic(inputs):
    first, (anchors, logprobs, budget, width) = built(inputs)
    second = build_tree(anchors.clone(), logprobs.clone(), budget, width)
    assert_trees_equal(first, second)


@SETTINGS
@given(tree_inputs())
def test_batch_equals_single(inputs):
    batched, (anchors, logprobs, budget, width) = built(inputs)
    for b in range(logprobs.shape[0]):
        alone = build_tree(anchors[b : b + 1], logprobs[b : b + 1], budget, width)
        for name in ("tokens", "parents", "depths", "scores", "ancestors"):
            assert torch.equal(getattr(batched, name)[b : b + 1], getattr(alone, name)), (b, name)


@SETTINGS
@given(tree_inputs())
def test_ancestor_mask_matches_parent_walk(inputs):
    tree, (anchors, logprobs, budget, width) = built(inputs)
    recomputed = ancestor_mask(tree.parents, logprobs.shape[1])
    assert torch.equal(recomputed, tree.ancestors)
    for b in range(logprobs.shape[0]):
        assert np.array_equal(tree.ancestors[b].numpy(), walk_ancestors(tree.parents[b].tolist()))
        # The root is everyone's ancestor; the diagonal is set; nothing above it (topological order).
        assert tree.ancestors[b, :, 0].all()
        assert tree.ancestors[b].diagonal().all()
        assert not torch.triu(tree.ancestors[b], diagonal=1).any()
        # Row sums are depth + 1.
        assert torch.equal(tree.ancestors[b].sum(-1), tree.depths[b] + 1)


def test_ancestor_mask_hand_made():
    # 0 -> 1 -> 3 -> 5 ; 0 -> 2 -> 4
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    mask = ancestor_mask(parents, 3)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0], expected)


def test_positions():
    anchors = torch.tensor([3, 1])
    tree = build_tree(anchors, make_logprobs(0, 2, 3, 5, "continuous"), 9, 3)
    prefix = torch.tensor([10, 0])
    assert torch.equal(tree.positions(prefix), prefix[:, None] + tree.depths)


# --------------------------------------------------------------------------- hand-made trees


def test_hand_made_tree():
    # depth 1: p = .6 .3 .1 ; depth 2: p = .7 .2 .1 ; tokens are the vocab indices.
    probs = torch.tensor([[[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]])
    logprobs = probs.log()
    # Node probabilities: (0)=.6, (0,0)=.42, (1)=.3, (1,0)=.21, (0,1)=.12, (2)=.1, ...
    tree = build_tree(torch.tensor([9]), logprobs, 4, width=3)
    assert tree.tokens.tolist() == [[9, 0, 0, 1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0]]
    assert tree.depths.tolist() == [[0, 1, 2, 1]]
    np.testing.assert_allclose(tree.scores[0].numpy(), np.log([1.0, 0.6, 0.42, 0.3]), atol=1e-6)

    tree = build_tree(torch.tensor([9]), logprobs, 6, width=3)
    assert tree.tokens.tolist() == [[9, 0, 0, 1, 0, 1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3, 1]]
    assert tree.depths.tolist() == [[0, 1, 2, 1, 2, 2]]

    # Width 2 drops token 2 everywhere.
    tree = build_tree(torch.tensor([9]), logprobs, 7, width=2)
    assert 2 not in tree.tokens[0, 1:].tolist()
    assert sorted(token_paths(tree, 0)) == sorted([(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)])


def test_uniform_ties_fill_depth_by_depth():
    """Uniform draft: all nodes of a depth tie; best-first takes shallower nodes first,
    and ties are broken deterministically (same tree every call)."""
    logprobs = make_logprobs(0, 1, 3, 4, "uniform")
    budget = 1 + 3 + 5
    tree = build_tree(torch.tensor([0]), logprobs, budget, width=3)
    check_structure(tree, torch.tensor([0]), logprobs, budget, 3)
    assert tree.depths.tolist() == [[0, 1, 1, 1, 2, 2, 2, 2, 2]]
    # Depths never decrease in best-first order under uniform scores.
    assert_trees_equal(tree, build_tree(torch.tensor([0]), logprobs, budget, width=3))


def test_prob_one_child_ties_its_parent():
    """A depth with a prob-1 token gives children whose score equals their parent's; the
    parent must still come first."""
    logprobs = torch.full((1, 3, 4), -1e4)
    logprobs[0, 0] = torch.tensor([0.5, 0.3, 0.2, 1e-9]).log()
    logprobs[0, 1, 2] = 0.0  # prob 1
    logprobs[0, 2] = torch.tensor([0.25, 0.25, 0.25, 0.25]).log()
    tree = build_tree(torch.tensor([1]), logprobs, 6, width=2)
    check_structure(tree, torch.tensor([1]), logprobs, 6, 2)
    assert tree.depths[0, :3].tolist() == [0, 1, 2]
    assert tree.tokens[0, :3].tolist() == [1, 0, 2]


def test_root_only():
    logprobs = make_logprobs(1, 2, 4, 8, "continuous")
    tree = build_tree(torch.tensor([5, 6]), logprobs, 1)
    assert tree.tokens.tolist() == [[5], [6]]
    assert tree.parents.tolist() == [[-1], [-1]]
    assert tree.depths.tolist() == [[0], [0]]
    assert tree.scores.tolist() == [[0.0], [0.0]]
    assert tree.ancestors.tolist() == [[[True]], [[True]]]
    prefix = torch.tensor([3, 0])
    assert full_mask(tree, prefix).tolist() == [True] * 4 + [True]


def test_budget_512_block_16_width_7():
    """Maximum budget, 15 draft depths (block 16), default width 7, realistic vocab."""
    batch, depths, vocab, budget = 2, 15, 64, MAX_BUDGET
    logprobs = make_logprobs(7, batch, depths, vocab, "continuous")
    anchors = torch.tensor([1, 2])
    tree = build_tree(anchors, logprobs, budget)  # default width 7
    check_structure(tree, anchors, logprobs, budget, 7)
    # Optimality certificate: the chosen set is ancestor-closed (checked above), and no
    # unchosen child (within the top-7 lists) of a chosen node beats the worst chosen node.
    topk_vals, topk_toks = logprobs.topk(7, dim=-1)
    for b in range(batch):
        worst = tree.scores[b, 1:].min().item()
        tokens, parents, node_depths = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.depths[b].tolist()
        kids: dict[int, set[int]] = {}
        for i in range(1, budget):
            kids.setdefault(parents[i], set()).add(tokens[i])
        for i in range(budget):
            d = node_depths[i]
            if d == depths:
                continue
            for val, tok in zip(topk_vals[b, d].tolist(), topk_toks[b, d].tolist()):
                if tok not in kids.get(i, set()):
                    assert tree.scores[b, i].item() + val <= worst + TOL
                    break  # the best unchosen child bounds the rest
    prefix = torch.tensor([100, 3])
    mask = full_mask(tree, prefix)
    assert mask.numel() == budget * (100 + budget) + budget * (3 + budget)
    assert np.array_equal(mask.numpy(), reference_full_mask(tree, [100, 3]))


def test_width_one_is_a_chain():
    depths = 5
    logprobs = make_logprobs(3, 2, depths, 10, "continuous")
    anchors = torch.tensor([4, 4])
    assert max_tree_nodes(depths, 1) == depths + 1
    tree = build_tree(anchors, logprobs, depths + 1, width=1)
    check_structure(tree, anchors, logprobs, depths + 1, 1)
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3, 4]] * 2
    assert tree.depths.tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert torch.equal(tree.tokens[:, 1:], logprobs.argmax(-1))
    np.testing.assert_allclose(tree.scores[:, 1:].numpy(), logprobs.max(-1).values.cumsum(-1).numpy(), atol=TOL)
    assert torch.equal(tree.ancestors[0], torch.ones(6, 6, dtype=torch.bool).tril())
    # A shorter chain is a prefix of the long one.
    short = build_tree(anchors, logprobs, 3, width=1)
    assert torch.equal(short.tokens, tree.tokens[:, :3])
    with pytest.raises(ValueError):
        build_tree(anchors, logprobs, depths + 2, width=1)


def test_width_larger_than_vocab_is_clipped():
    logprobs = make_logprobs(4, 1, 2, 3, "continuous")
    tree = build_tree(torch.tensor([0]), logprobs, 13, width=7)  # 1 + 3 + 9
    check_structure(tree, torch.tensor([0]), logprobs, 13, 7)
    with pytest.raises(ValueError):
        build_tree(torch.tensor([0]), logprobs, 14, width=7)


@pytest.mark.parametrize("budget", [0, -1, MAX_BUDGET + 1, 1000])
def test_invalid_budget(budget):
    logprobs = make_logprobs(0, 1, 15, 64, "continuous")
    with pytest.raises(ValueError):
        build_tree(torch.tensor([0]), logprobs, budget)


@pytest.mark.parametrize(("depths", "width"), [(1, 1), (1, 7), (2, 2), (3, 3), (4, 2)])
def test_budget_beyond_tree_capacity(depths, width):
    vocab = 8
    capacity = sum(width**d for d in range(depths + 1))
    assert max_tree_nodes(depths, width) == capacity
    logprobs = make_logprobs(0, 1, depths, vocab, "continuous")
    build_tree(torch.tensor([0]), logprobs, capacity, width)  # fits exactly
    with pytest.raises(ValueError):
        build_tree(torch.tensor([0]), logprobs, capacity + 1, width)


def test_one_budget_check_with_one_message():
    """The tree builders (reference and kernel) and the reference engine all refuse a budget with
    `budget_error`'s message."""
    from jetflow_kernels import build_tree_from_topk

    assert budget_error(0) == f"tree budget must be between 1 and {MAX_BUDGET}, got 0"
    assert budget_error(16, 15, 7) is None and budget_error(13, 2, 3) is None
    too_big = budget_error(14, 2, 3)
    assert too_big == "tree budget 14 exceeds the 13 nodes that 2 draft depths of width 3 can hold"
    logprobs = make_logprobs(0, 1, 2, 8, "continuous")
    with pytest.raises(ValueError, match=too_big):
        build_tree(torch.tensor([0]), logprobs, 14, width=3)
    with pytest.raises(ValueError, match=too_big):
        build_tree_from_topk(torch.tensor([0]), *logprobs.topk(3, dim=-1), 14)
    with pytest.raises(ValueError, match=budget_error(0)):
        build_tree(torch.tensor([0]), logprobs, 0, width=3)


def test_max_tree_nodes_caps_above_max_budget():
    assert max_tree_nodes(15, 7) > MAX_BUDGET
    assert max_tree_nodes(0, 7) == 1
    assert max_tree_nodes(3, 2) == 15


def test_zero_width_rejected():
    with pytest.raises(ValueError):
        build_tree(torch.tensor([0]), make_logprobs(0, 1, 2, 4, "continuous"), 1, width=0)


# --------------------------------------------------------------------------- masks


@SETTINGS
@given(tree_inputs(), st.data())
def test_full_mask_layout(inputs, data):
    tree, (anchors, logprobs, budget, width) = built(inputs)
    prefix = data.draw(prefix_lens(logprobs.shape[0]))
    mask = full_mask(tree, torch.tensor(prefix))
    assert mask.dtype == torch.bool and mask.dim() == 1
    assert mask.numel() == sum(budget * (p + budget) for p in prefix)
    assert np.array_equal(mask.numpy(), reference_full_mask(tree, prefix))


def test_full_mask_hand_made():
    # Tree 0 -> 1, 0 -> 2; prefix 2 for request 0 and 0 for request 1.
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
    tree = DraftTree(
        tokens=torch.zeros(2, 3, dtype=torch.long),
        parents=parents,
        depths=torch.tensor([[0, 1, 1], [0, 1, 2]]),
        scores=torch.zeros(2, 3),
        ancestors=ancestor_mask(parents, 2),
    )
    mask = full_mask(tree, torch.tensor([2, 0])).int().tolist()
    block0 = [1, 1, 1, 0, 0] + [1, 1, 1, 1, 0] + [1, 1, 1, 0, 1]
    block1 = [1, 0, 0] + [1, 1, 0] + [1, 1, 1]
    assert mask == block0 + block1


@SETTINGS
@given(st.lists(st.integers(0, 40), min_size=0, max_size=6), st.integers(0, 2**31 - 1))
def test_pack_bits_matches_numpy(lens, seed):
    total = sum(lens)
    bits = torch.rand(total, generator=torch.Generator().manual_seed(seed)) < 0.5
    packed, indptr = pack_bits(bits, torch.tensor(lens, dtype=torch.long))
    ref_packed, ref_indptr = reference_pack(bits.numpy(), lens)
    assert packed.dtype == torch.uint8
    assert np.array_equal(indptr.numpy(), ref_indptr)
    assert np.array_equal(packed.numpy(), ref_packed)


def test_pack_bits_hand_made():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1] + [0, 1, 1], dtype=torch.bool)
    packed, indptr = pack_bits(bits, torch.tensor([9, 3]))
    assert packed.tolist() == [1, 1, 6]
    assert indptr.tolist() == [0, 2, 3]
    bits = torch.ones(8, dtype=torch.bool)
    packed, indptr = pack_bits(bits, torch.tensor([8]))
    assert packed.tolist() == [255] and indptr.tolist() == [0, 1]


@SETTINGS
@given(tree_inputs(), st.data())
def test_packed_mask_matches_numpy(inputs, data):
    tree, (anchors, logprobs, budget, width) = built(inputs)
    prefix = data.draw(prefix_lens(logprobs.shape[0]))
    packed, indptr = packed_mask(tree, torch.tensor(prefix))
    lens = [budget * (p + budget) for p in prefix]
    ref_packed, ref_indptr = reference_pack(reference_full_mask(tree, prefix), lens)
    assert np.array_equal(indptr.numpy(), ref_indptr)
    assert np.array_equal(packed.numpy(), ref_packed)


@pytest.mark.gpu
def test_pack_bits_matches_flashinfer_on_cuda():
    """Our packing (the FlashInfer custom-mask layout) against FlashInfer's own
    `segment_packbits`, which runs on CUDA only: segments of every length mod 8, empty ones, and
    the packed mask of real trees over prefixes."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    flashinfer = pytest.importorskip("flashinfer")
    cuda = torch.device("cuda")

    def flashinfer_pack(bits: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        bit_indptr = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=cuda)
        return flashinfer.segment_packbits(bits, bit_indptr, bitorder="little")

    gen = torch.Generator().manual_seed(0)
    for lens in ([13, 0, 8, 21, 5], [1], [0, 0, 7], list(range(17)), [64, 9, 1000]):
        bits = (torch.rand(sum(lens), generator=gen) < 0.5).to(cuda)
        ref_packed, ref_indptr = flashinfer_pack(bits, lens)
        packed, indptr = pack_bits(bits, torch.tensor(lens, device=cuda))
        assert packed.device.type == "cuda" and packed.dtype == torch.uint8
        assert torch.equal(packed, ref_packed.to(torch.uint8)), lens
        assert indptr.tolist() == ref_indptr.tolist(), lens
    anchors, logprobs = torch.tensor([3, 1]), make_logprobs(1, 2, 4, 6, "continuous")
    tree = build_tree(anchors, logprobs, 9, 3)
    tree = DraftTree(*(t.to(cuda) for t in (tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors)))
    prefix = torch.tensor([5, 11], device=cuda)
    packed, indptr = packed_mask(tree, prefix)
    lens = [9 * (p + 9) for p in prefix.tolist()]
    ref_packed, ref_indptr = flashinfer_pack(full_mask(tree, prefix).reshape(-1), lens)
    assert torch.equal(packed, ref_packed.to(torch.uint8)) and indptr.tolist() == ref_indptr.tolist()


# --------------------------------------------------------------------------- refresh re-expansion


def topk_lists(logprobs: torch.Tensor, width: int):
    return logprobs.float().topk(min(width, logprobs.shape[-1]), dim=-1)


@SETTINGS
@given(tree_inputs())
def test_refresh_with_unchanged_logprobs_rebuilds_the_same_node_set(inputs):
    """When every node's path-conditioned log-probs equal its depth's one-pass log-probs,
    the re-expanded tree is the one-pass tree: same paths, same scores."""
    tree, (anchors, logprobs, budget, width) = built(inputs)
    depth_rows = tree.depths.clamp(max=logprobs.shape[1] - 1)
    node_logprobs = logprobs.gather(1, depth_rows[..., None].expand(-1, -1, logprobs.shape[-1]))
    again = refreshed_tree(tree, topk_lists(node_logprobs, width), topk_lists(logprobs, width))
    assert again.tokens.shape == tree.tokens.shape
    for b in range(anchors.shape[0]):
        first = dict(zip(token_paths(tree, b), tree.scores[b].tolist()))
        second = dict(zip(token_paths(again, b), again.scores[b].tolist()))
        # Ties at the budget's edge may pick other equal-score nodes: compare the score multisets,
        # and the paths wherever scores are not tied at the cut.
        assert sorted(first.values()) == pytest.approx(sorted(second.values()), rel=1e-6, abs=TOL)
        cut = min(first.values())
        margin = TOL + 1e-6 * abs(cut)
        assert {p for p, s in first.items() if s > cut + margin} == {p for p, s in second.items() if s > cut + margin}


@SETTINGS
@given(tree_inputs(), st.integers(0, 2**31 - 1))
def test_refreshed_tree_is_best_first_under_node_logprobs(inputs, seed):
    """Structure invariants hold, and each node's score is its parent's plus the log-prob its
    parent's distribution (refreshed row if the parent was in the first tree, else its depth's
    one-pass row) gives its token."""
    tree, (anchors, logprobs, budget, width) = built(inputs)
    gen = torch.Generator().manual_seed(seed)
    node_logprobs = torch.log_softmax(torch.randn(*tree.tokens.shape, logprobs.shape[-1], generator=gen) * 2, -1)
    again = refreshed_tree(tree, topk_lists(node_logprobs, width), topk_lists(logprobs, width))
    for b in range(anchors.shape[0]):
        first_paths = {p: i for i, p in enumerate(token_paths(tree, b))}
        paths = token_paths(again, b)
        parents, scores = again.parents[b].tolist(), again.scores[b].tolist()
        assert again.tokens[b, 0] == anchors[b] and parents[0] == -1 and scores[0] == 0
        for i in range(1, len(paths)):
            parent = parents[i]
            assert 0 <= parent < i and again.depths[b, i] == again.depths[b, parent] + 1
            source = first_paths.get(paths[parent])
            row = node_logprobs[b, source] if source is not None else logprobs[b, int(again.depths[b, parent])]
            assert scores[i] == pytest.approx(scores[parent] + float(row[again.tokens[b, i]]), rel=1e-6, abs=TOL)
            assert int(again.tokens[b, i]) in row.topk(min(width, row.numel())).indices.tolist()
        assert len(set(paths)) == len(paths)  # no duplicate branch
        assert torch.equal(again.ancestors[b], ancestor_mask(again.parents[b : b + 1], logprobs.shape[1])[0])


# --------------------------------------------------------------------------- merge_chain (lookup free branch)


def shared_prefix_len(tree: DraftTree, chain: list[int]) -> int:
    """How many chain tokens the tree already holds as a root path."""
    paths = set(token_paths(tree, 0))
    k = 0
    while k < len(chain) and tuple(chain[: k + 1]) in paths:
        k += 1
    return k


def removable_leaves(tree: DraftTree, chain: list[int]) -> list[int]:
    """Leaves that are neither the root nor a node on the chain's root path."""
    parents = tree.parents[0].tolist()
    on_chain = {tuple(chain[:k]) for k in range(len(chain) + 1)}
    paths = token_paths(tree, 0)
    has_child = set(parents[1:])
    return [i for i in range(1, len(parents)) if i not in has_child and paths[i] not in on_chain]


def check_merged_structure(merged: DraftTree, budget: int) -> None:
    for name in ("tokens", "parents", "depths", "scores"):
        assert getattr(merged, name).shape == (1, budget), name
    assert merged.tokens.dtype == merged.parents.dtype == merged.depths.dtype == torch.int64
    assert merged.scores.dtype == torch.float32 and merged.ancestors.dtype == torch.bool
    parents, depths, tokens = merged.parents[0].tolist(), merged.depths[0].tolist(), merged.tokens[0].tolist()
    assert parents[0] == -1 and depths[0] == 0 and merged.scores[0, 0].item() == 0.0
    siblings: set[tuple[int, int]] = set()
    for i in range(1, budget):
        assert 0 <= parents[i] < i  # topological
        assert depths[i] == depths[parents[i]] + 1
        assert (parents[i], tokens[i]) not in siblings  # siblings hold distinct tokens
        siblings.add((parents[i], tokens[i]))
    assert np.array_equal(merged.ancestors[0].numpy(), walk_ancestors(parents))
    assert torch.equal(merged.ancestors.sum(-1), merged.depths + 1)


@st.composite
def merge_inputs(draw):
    anchors, logprobs, budget, width = draw(tree_inputs(max_batch=1, max_depths=5))
    tree = build_tree(anchors, logprobs, budget, width)
    depths, vocab = logprobs.shape[1:]
    # Start the chain on a prefix of one of the tree's own root paths, then continue freely.
    path = draw(st.sampled_from(token_paths(tree, 0)))
    start = list(path[: draw(st.integers(0, len(path)))])
    tail = draw(st.integers(1 if len(start) < depths else 0, depths - len(start)))
    chain = start + draw(st.lists(st.integers(0, vocab - 1), min_size=tail, max_size=tail))
    # One log-prob per depth (geometric), or the measured per-depth table of prompt lookup.
    geometric = st.sampled_from([0.0, math.log(0.999), math.log(0.9), math.log(0.6), math.log(0.2), -1e3]).map(lambda x: [x])
    chain_scores = draw(st.one_of(geometric, st.just(list(CHAIN_SCORES))))
    return tree, chain, chain_scores, budget


@SETTINGS
@given(merge_inputs())
def test_merge_chain_keeps_budget_and_structure(inputs):
    tree, chain, chain_scores, budget = inputs
    merged = merge_chain(tree, torch.tensor(chain), chain_scores)
    check_merged_structure(merged, budget)
    assert merged.tokens[0, 0] == tree.tokens[0, 0]
    shared = shared_prefix_len(tree, chain)
    by_depth = chain_depth_scores(chain_scores, len(chain))
    new_scores = [float(np.float32(by_depth[d])) for d in range(shared, len(chain))]
    leaves = removable_leaves(tree, chain)
    if merged is tree:
        # Nothing got in: the chain is already there, no leaf can go, or the first new node loses.
        assert not new_scores or not leaves or new_scores[0] <= min(tree.scores[0, i].item() for i in leaves)
        return
    taken = shared_prefix_len(merged, chain) - shared
    assert taken >= 1
    # Kept nodes in their old order, then the new chain nodes with their depth-scaled scores.
    old = list(zip(token_paths(tree, 0), tree.scores[0].tolist()))
    new = list(zip(token_paths(merged, 0), merged.scores[0].tolist()))
    kept, added = new[: budget - taken], new[budget - taken :]
    assert [p for p, _ in added] == [tuple(chain[:k]) for k in range(shared + 1, shared + taken + 1)]
    assert [s for _, s in added] == new_scores[:taken]
    kept_set = set(kept)
    assert [e for e in old if e in kept_set] == kept
    removed = sorted(s for p, s in old if (p, s) not in kept_set)
    assert len(removed) == taken
    # Every replaced leaf is beaten by the chain node that took its place.
    assert all(r < n for r, n in zip(removed, new_scores))
    # As many as beat the weakest leaves: the next chain node (if any) would not.
    if shared + taken < len(chain):
        rest = removable_leaves(merged, chain)
        assert not rest or new_scores[taken] <= min(merged.scores[0, i].item() for i in rest)


@SETTINGS
@given(merge_inputs())
def test_merge_chain_winning_chain_is_a_root_path(inputs):
    """A chain that beats every drafted node and has room gets in whole; merging is deterministic."""
    tree, chain, _, budget = inputs
    shared = shared_prefix_len(tree, chain)
    if budget - 1 - shared < len(chain) - shared:
        return  # not enough non-chain nodes to give up
    merged = merge_chain(tree, torch.tensor(chain), [0.0])  # score 0 beats every leaf unless tied at 0
    if tree.scores[0, 1:].numel() and tree.scores[0, 1:].max().item() < 0:
        assert shared_prefix_len(merged, chain) == len(chain)
    assert_trees_equal(merged, merge_chain(tree, torch.tensor(chain), [0.0]))


@SETTINGS
@given(tree_inputs(max_batch=1, max_depths=5), st.data())
def test_merge_chain_inside_the_tree_changes_nothing(inputs, data):
    tree, (anchors, logprobs, budget, width) = built(inputs)
    path = data.draw(st.sampled_from(token_paths(tree, 0)[1:] or [()]))
    for chain_scores in ([0.0], [math.log(0.6)], CHAIN_SCORES):
        assert merge_chain(tree, torch.tensor(path, dtype=torch.long), chain_scores) is tree


def test_merge_chain_hand_made():
    # Tree of test_hand_made_tree at budget 4: 9 -> 0 (.6) -> 0 (.42), 9 -> 1 (.3).
    probs = torch.tensor([[[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]])
    tree = build_tree(torch.tensor([9]), probs.log(), 4, width=3)
    assert tree.tokens.tolist() == [[9, 0, 0, 1]]
    # Chain (1, 2): shares node 3; its depth-2 node at .5^2 = .25 loses to the leaf at .42.
    assert merge_chain(tree, torch.tensor([1, 2]), [math.log(0.5)]) is tree
    # At .9^2 = .81 it replaces that leaf; node 1 becomes a leaf and stays.
    merged = merge_chain(tree, torch.tensor([1, 2]), [math.log(0.9)])
    assert merged.tokens.tolist() == [[9, 0, 1, 2]]
    assert merged.parents.tolist() == [[-1, 0, 0, 2]]
    assert merged.depths.tolist() == [[0, 1, 1, 2]]
    np.testing.assert_allclose(merged.scores[0].numpy(), np.log([1.0, 0.6, 0.3, 0.81]), atol=1e-6)
    # Chain (2, 0) shares nothing: it takes the .3 leaf, then the .42 leaf (node 1 is now a leaf too).
    merged = merge_chain(tree, torch.tensor([2, 0]), [math.log(0.9)])
    assert merged.tokens.tolist() == [[9, 0, 2, 0]]
    assert merged.parents.tolist() == [[-1, 0, 0, 2]]
    assert merged.depths.tolist() == [[0, 1, 1, 2]]
    np.testing.assert_allclose(merged.scores[0].numpy(), np.log([1.0, 0.6, 0.9, 0.81]), atol=1e-6)
    # Only as many as win: (2, 0) at .35 beats the .3 leaf, but .35^2 loses to .42.
    merged = merge_chain(tree, torch.tensor([2, 0]), [math.log(0.35)])
    assert merged.tokens.tolist() == [[9, 0, 0, 2]] and merged.parents.tolist() == [[-1, 0, 1, 0]]
    # Scores per depth need not be geometric: (2, 0) at .35 then .35 * .97 gets in whole only if
    # its depth-2 score beats .42 (here it does not); at .9 then .45 it does.
    assert merge_chain(tree, torch.tensor([2, 0]), [math.log(0.35), math.log(0.34)]).tokens.tolist() == [[9, 0, 0, 2]]
    merged = merge_chain(tree, torch.tensor([2, 0]), [math.log(0.9), math.log(0.45)])
    assert merged.tokens.tolist() == [[9, 0, 2, 0]]
    np.testing.assert_allclose(merged.scores[0].numpy(), np.log([1.0, 0.6, 0.9, 0.45]), atol=1e-6)
    with pytest.raises(ValueError, match="never rise"):
        merge_chain(tree, torch.tensor([2, 0]), [math.log(0.3), math.log(0.4)])
    # A tie with the weakest leaf does not get in.
    assert merge_chain(tree, torch.tensor([2]), [float(tree.scores[0, 3])]) is tree
    # The root is never removed: a root-only tree takes nothing.
    root_only = build_tree(torch.tensor([9]), probs.log(), 1, width=3)
    assert merge_chain(root_only, torch.tensor([2, 0]), [0.0]) is root_only
    with pytest.raises(ValueError):
        merge_chain(build_tree(torch.tensor([9, 9]), probs.log().expand(2, -1, -1), 4, width=3), torch.tensor([1]), [0.0])


# --------------------------------------------------------------------------- pruning (adaptive budget)


def _row(tree: DraftTree, b: int) -> DraftTree:
    return DraftTree(*(getattr(tree, f)[b : b + 1] for f in ("tokens", "parents", "depths", "scores", "ancestors")))


@SETTINGS
@given(tree_inputs(), st.data())
def test_prune_head_tree_is_the_smaller_best_first_tree(inputs, data):
    """A head tree pruned to n nodes holds the same token paths as the tree built at budget n."""
    tree, (anchors, logprobs, budget, width) = built(inputs)
    n = data.draw(st.integers(1, budget))
    pruned = prune_tree(tree, n)
    small = build_tree(anchors, logprobs, n, width)
    assert torch.equal(path_scores(tree), tree.scores)  # head scores never rise along a path
    for b in range(tree.tokens.shape[0]):
        check_merged_structure(_row(pruned, b), n)
        assert set(token_paths(pruned, b)) <= set(token_paths(tree, b))
        np.testing.assert_allclose(sorted(pruned.scores[b].tolist()), sorted(small.scores[b].tolist()), atol=TOL)
        ranked = sorted(tree.scores[b, 1:].tolist(), reverse=True)
        if n == 1 or n == budget or ranked[n - 2] - ranked[n - 1] > 1e-4:  # no tie at the cut: same set
            assert set(token_paths(pruned, b)) == set(token_paths(small, b))


@SETTINGS
@given(merge_inputs(), st.data())
def test_prune_merged_tree_keeps_ancestors_and_best_capped_scores(inputs, data):
    """After a lookup merge (chain nodes may outscore their parents) every pruned tree is still a
    tree: closed under ancestors, topological, and it keeps the n best nodes by capped score."""
    tree, chain, chain_scores, budget = inputs
    merged = merge_chain(tree, torch.tensor(chain), chain_scores)
    n = data.draw(st.integers(1, budget))
    pruned = prune_tree(merged, n)
    check_merged_structure(pruned, n)
    paths = token_paths(merged, 0)
    kept = set(token_paths(pruned, 0))
    assert kept <= set(paths)
    assert all(p[:-1] in kept for p in kept if p)  # every kept node's parent is kept
    capped = path_scores(merged)[0].tolist()
    assert all(capped[i] <= capped[p] + 0.0 for i, p in enumerate(merged.parents[0].tolist()) if p >= 0)
    kept_scores = sorted((c for c, p in zip(capped[1:], paths[1:]) if p in kept), reverse=True)
    dropped = [c for c, p in zip(capped[1:], paths[1:]) if p not in kept]
    assert not dropped or not kept_scores or min(kept_scores) >= max(dropped)


def test_prune_hand_made_chain_beats_its_parent():
    """A lookup node scored above its parent is capped at the parent's score, so pruning to 3
    keeps root, parent and that child, not the head's second-best depth-1 sibling alone."""
    tree = hand_tree([5, 1, 2, 3], [-1, 0, 0, 1], scores=[0.0, -0.5, -0.75, -0.25])
    assert path_scores(tree).tolist() == [[0.0, -0.5, -0.75, -0.5]]
    pruned = prune_tree(tree, 3)
    assert pruned.tokens.tolist() == [[5, 1, 3]] and pruned.parents.tolist() == [[-1, 0, 1]]
    assert prune_tree(tree, 4) is tree
    assert prune_tree(tree, 1).tokens.tolist() == [[5]]
    with pytest.raises(ValueError, match="between 1 and"):
        prune_tree(tree, 0)


@SETTINGS
@given(merge_inputs(), st.data())
def test_prune_by_any_priority_is_a_tree_of_the_best_capped_nodes(inputs, data):
    """The adaptive budget prunes by calibrated probabilities, in any order relative to the
    scores: the kept nodes are still a topological tree holding the best capped priorities."""
    tree, chain, chain_scores, budget = inputs
    merged = merge_chain(tree, torch.tensor(chain), chain_scores)
    seed = data.draw(st.integers(0, 2**16))
    priority = torch.rand(merged.scores.shape, generator=torch.Generator().manual_seed(seed))
    n = data.draw(st.integers(1, budget))
    pruned = prune_tree(merged, n, priority)
    check_merged_structure(pruned, n)
    kept = set(token_paths(pruned, 0))
    paths = token_paths(merged, 0)
    capped = path_scores(merged, priority)[0].tolist()
    kept_values = [c for c, p in zip(capped[1:], paths[1:]) if p in kept]
    dropped = [c for c, p in zip(capped[1:], paths[1:]) if p not in kept]
    assert not dropped or not kept_values or min(kept_values) >= max(dropped)


def test_top_candidates_in_cpu_chunks_equal_one_pass():
    """On CPU `top_candidates` takes a batch's rows 16 at a time: the same lists, bit for bit, as
    one log-softmax and top-k over all rows (ties included), mapped through a pruned vocabulary."""
    from jetflow_sglang.tree import CPU_CANDIDATE_ROWS, top_candidates

    gen = torch.Generator().manual_seed(11)
    vocab_ids = torch.randperm(1000, generator=gen)[:300]
    for shape in [(1, 15, 300), (3, 15, 300), (2, 16, 300), (CPU_CANDIDATE_ROWS + 1, 300)]:
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randint(0, 40, shape, generator=gen).float() / 4).to(dtype)  # many ties
            logprobs, tokens = top_candidates(logits, 8, vocab_ids)
            want = logits.float().log_softmax(-1).topk(8, dim=-1)
            assert torch.equal(logprobs, want.values) and torch.equal(tokens, vocab_ids[want.indices]), (shape, dtype)
