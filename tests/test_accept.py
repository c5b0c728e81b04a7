"""Tests for lossless acceptance of a verified draft tree (jetflow_sglang/accept.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.stats import P_MIN, chi_square
from helpers.trees import hand_tree
from jetflow_sglang.accept import Acceptance, accept_tree, processed_probs, target_picks
from jetflow_sglang.tree import DraftTree, build_tree, max_tree_nodes

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def reference_walk(tokens: list[int], parents: list[int], picks: list[int]) -> tuple[list[int], int, int]:
    """From the root, follow the child whose token equals the pick at the current node."""
    node, path = 0, [0]
    while True:
        nxt = [c for c in range(len(tokens)) if parents[c] == node and tokens[c] == picks[node]]
        assert len(nxt) <= 1
        if not nxt:
            return path, len(path) - 1, picks[node]
        node = nxt[0]
        path.append(node)


def check_against_reference(tree: DraftTree, picks: torch.Tensor, acc: Acceptance, max_depth: int) -> None:
    batch, budget = tree.tokens.shape
    assert acc.path.shape == (batch, max_depth + 1)
    committed = acc.committed_tokens(tree)
    assert committed.shape == (batch, max_depth + 1)
    for b in range(batch):
        tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
        path, accepted, bonus = reference_walk(tokens, parents, picks[b].tolist())
        assert acc.path[b].tolist() == path + [-1] * (max_depth + 1 - len(path))
        assert int(acc.num_accepted[b]) == accepted
        assert int(acc.bonus[b]) == bonus
        expected = [tokens[n] for n in path[1:]] + [bonus]
        assert committed[b].tolist() == expected + [-1] * (max_depth + 1 - len(expected))


def ref_processed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference: temperature, then top-k, then the smallest top-p prefix of the
    top-k-renormalized distribution (always keeping the top token), renormalized."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape[-1], dtype=bool)
    k = z.shape[-1] if top_k <= 0 else min(top_k, z.shape[-1])
    keep[order[:k]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    sorted_p = p[order]
    before = np.cumsum(sorted_p) - sorted_p
    drop = np.zeros_like(keep)
    drop[order] = before >= top_p
    drop[order[0]] = False
    p = np.where(drop, 0.0, p)
    return p / p.sum()


# --------------------------------------------------------------------------- greedy


def test_greedy_hand_made():
    #            0   1  2  3  4  5  6
    tokens = [7, 3, 5, 1, 3, 2, 5]
    parents = [-1, 0, 0, 1, 1, 4, 2]
    tree = hand_tree(tokens, parents, batch=5)
    picks = torch.tensor(
        [
            [3, 3, 0, 0, 2, 9, 0],  # 0 -> 1 (3) -> 4 (3) -> 5 (2), bonus 9
            [5, 0, 5, 0, 0, 0, 4],  # 0 -> 2 (5) -> 6 (5), bonus 4
            [1, 0, 0, 0, 0, 0, 0],  # no child of the root holds 1 (node 3 is a grandchild): bonus 1
            [3, 1, 0, 8, 0, 0, 0],  # 0 -> 1 -> 3, bonus 8
            [3, 2, 0, 0, 0, 0, 0],  # 0 -> 1; node 5 holds 2 but is not a child of 1: bonus 2
        ]
    )
    acc = accept_tree(tree, picks, max_depth=3)
    assert acc.path.tolist() == [[0, 1, 4, 5], [0, 2, 6, -1], [0, -1, -1, -1], [0, 1, 3, -1], [0, 1, -1, -1]]
    assert acc.num_accepted.tolist() == [3, 2, 0, 2, 1]
    assert acc.bonus.tolist() == [9, 4, 1, 8, 2]
    assert acc.committed_tokens(tree).tolist() == [
        [3, 3, 2, 9],
        [5, 5, 4, -1],
        [1, -1, -1, -1],
        [3, 1, 8, -1],
        [3, 2, -1, -1],
    ]
    check_against_reference(tree, picks, acc, 3)
    # Default max_depth is budget - 1.
    acc_default = accept_tree(tree, picks)
    check_against_reference(tree, picks, acc_default, tree.budget - 1)


def test_greedy_root_only():
    tree = hand_tree([4], [-1], batch=2)
    picks = torch.tensor([[1], [4]])
    acc = accept_tree(tree, picks, max_depth=0)
    assert acc.path.tolist() == [[0], [0]]
    assert acc.num_accepted.tolist() == [0, 0]
    assert acc.bonus.tolist() == [1, 4]
    assert acc.committed_tokens(tree).tolist() == [[1], [4]]


def test_greedy_chain_fully_accepted():
    tokens = [0, 1, 2, 3, 4]
    tree = hand_tree(tokens, [-1, 0, 1, 2, 3])
    picks = torch.tensor([[1, 2, 3, 4, 5]])
    acc = accept_tree(tree, picks, max_depth=4)
    assert acc.path.tolist() == [[0, 1, 2, 3, 4]]
    assert acc.num_accepted.tolist() == [4]
    assert acc.committed_tokens(tree).tolist() == [[1, 2, 3, 4, 5]]


@st.composite
def greedy_case(draw):
    batch = draw(st.integers(1, 4))
    depths = draw(st.integers(1, 5))
    width = draw(st.integers(1, 4))
    vocab = draw(st.integers(width, 8))
    budget = draw(st.integers(1, min(max_tree_nodes(depths, width), 64)))
    follow = draw(st.floats(0.0, 1.0))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, depths, width, vocab, budget, follow, seed


@SETTINGS
@given(greedy_case())
def test_greedy_random_trees_match_reference_walk(case):
    batch, depths, width, vocab, budget, follow, seed = case
    gen = torch.Generator().manual_seed(seed)
    draft = torch.log_softmax(torch.randn(batch, depths, vocab, generator=gen), -1)
    anchors = torch.randint(0, vocab, (batch,), generator=gen)
    tree = build_tree(anchors, draft, budget, width)
    # Target logits whose argmax, with probability `follow`, is the token of one of the node's
    # children (so paths get deep), else a random token.
    logits = torch.randn(batch, budget, vocab, generator=gen)
    for b in range(batch):
        parents = tree.parents[b].tolist()
        for node in range(budget):
            kids = [c for c in range(budget) if parents[c] == node]
            if kids and torch.rand((), generator=gen).item() < follow:
                kid = kids[int(torch.randint(0, len(kids), (), generator=gen))]
                logits[b, node, tree.tokens[b, kid]] = 10.0
    picks = target_picks(logits, temperature=0.0)
    acc = accept_tree(tree, picks, max_depth=depths)
    check_against_reference(tree, picks, acc, depths)
    if budget > 1:  # (budget 1 with the default max_depth 0: see test_greedy_root_only)
        check_against_reference(tree, picks, accept_tree(tree, picks), budget - 1)
    assert torch.equal(acc.num_accepted, tree.depths.gather(1, acc.path.clamp(min=0)).max(1).values)


# --------------------------------------------------------------------------- sampling


# Hand-built tree over V = 5. Root anchor 4.
#   node 1: token 0 (child of 0)      node 4: token 2 (child of 1)    node 7: token 4 (child of 4)
#   node 2: token 1 (child of 0)      node 5: token 0 (child of 1)
#   node 3: token 3 (child of 0)      node 6: token 1 (child of 2)
SAMPLE_TOKENS = [4, 0, 1, 3, 2, 0, 1, 4]
SAMPLE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
SAMPLE_LOGITS = torch.tensor(
    [
        [1.2, 1.0, 0.6, -3.0, 0.2],  # root: token 3 is the lowest and goes with top_k=4
        [0.1, 0.4, 1.1, -1.0, 0.7],  # node 1
        [0.9, 1.0, 0.2, 0.5, -2.0],  # node 2
        [0.0, 0.0, 0.0, 0.0, 0.0],  # node 3 (never reached)
        [0.3, -0.5, 0.2, 0.1, 1.0],  # node 4
        [1.0, 0.9, 0.8, 0.7, 0.6],  # node 5
        [0.5, 0.4, 0.3, 0.2, 0.1],  # node 6
        [2.0, -1.0, 0.5, 0.0, 0.3],  # node 7
    ]
)
TEMPERATURE, TOP_K, TOP_P = 0.8, 4, 0.95
DRAWS = 40_000


@pytest.fixture(scope="module")
def sampled():
    tree = hand_tree(SAMPLE_TOKENS, SAMPLE_PARENTS, batch=DRAWS)
    logits = SAMPLE_LOGITS.expand(DRAWS, -1, -1)
    gen = torch.Generator().manual_seed(1234)
    picks = target_picks(logits, TEMPERATURE, TOP_K, TOP_P, generator=gen)
    acc = accept_tree(tree, picks, max_depth=3)
    probs = np.stack([ref_processed(row, TEMPERATURE, TOP_K, TOP_P) for row in SAMPLE_LOGITS.numpy()])
    return tree, acc, acc.committed_tokens(tree), probs


def test_sampling_reference_probs_have_zeros(sampled):
    _, _, _, probs = sampled
    # The test is only meaningful if top-k / top-p actually remove tokens somewhere.
    assert probs[0, 3] == 0.0  # top-k removes the root's lowest token
    assert (probs == 0).sum() >= len(SAMPLE_TOKENS)
    torch.testing.assert_close(
        processed_probs(SAMPLE_LOGITS, TEMPERATURE, TOP_K, TOP_P), torch.from_numpy(probs).float(), rtol=1e-5, atol=1e-6
    )


def test_sampling_first_token_is_target_distribution(sampled):
    _, _, committed, probs = sampled
    first = committed[:, 0].numpy()
    counts = np.bincount(first, minlength=5)
    assert chi_square(counts, probs[0]) > P_MIN


@pytest.mark.parametrize(("first", "node"), [(0, 1), (1, 2)])
def test_sampling_second_token_given_first(sampled, first, node):
    _, acc, committed, probs = sampled
    rows = committed[:, 0] == first
    # The first token is a draft child of the root here, so it was accepted.
    assert (acc.num_accepted[rows] >= 1).all()
    assert (acc.path[rows, 1] == node).all()
    counts = np.bincount(committed[rows, 1].numpy(), minlength=5)
    assert chi_square(counts, probs[node]) > P_MIN


def test_sampling_third_token_given_first_two(sampled):
    _, acc, committed, probs = sampled
    rows = (committed[:, 0] == 0) & (committed[:, 1] == 2)  # path 0 -> 1 -> 4
    assert (acc.path[rows, 2] == 4).all()
    counts = np.bincount(committed[rows, 2].numpy(), minlength=5)
    assert chi_square(counts, probs[4]) > P_MIN


def test_sampling_bonus_after_non_draft_first_token(sampled):
    _, acc, committed, _ = sampled
    rows = (committed[:, 0] == 2) | (committed[:, 0] == 4)  # not children of the root
    assert rows.any()
    assert (acc.num_accepted[rows] == 0).all()
    assert (committed[rows, 1:] == -1).all()


def test_sampling_never_emits_zero_probability_tokens(sampled):
    _, acc, committed, probs = sampled
    # Node 3 holds a token of zero probability at the root: it is never accepted.
    assert not (acc.path == 3).any()
    for j in range(committed.shape[1]):
        rows = acc.num_accepted >= j
        nodes = acc.path[rows, j].numpy()
        toks = committed[rows, j].numpy()
        assert (nodes >= 0).all() and (toks >= 0).all()
        assert (probs[nodes, toks] > 0).all()


def test_target_picks_seeded_is_deterministic():
    logits = SAMPLE_LOGITS.expand(64, -1, -1)
    a = target_picks(logits, 1.0, 0, 1.0, generator=torch.Generator().manual_seed(5))
    b = target_picks(logits, 1.0, 0, 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (64, len(SAMPLE_TOKENS))


# --------------------------------------------------------------------------- processed_probs


def test_temperature_matches_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen) * 2
    for t in (0.3, 0.7, 1.0, 1.5):
        torch.testing.assert_close(processed_probs(logits, t), torch.softmax(logits / t, -1), rtol=1e-5, atol=1e-7)
    out = processed_probs(logits.double(), 1.0)
    assert out.dtype == torch.float32


def test_top_k_keeps_exactly_k():
    gen = torch.Generator().manual_seed(1)
    vocab = 30
    logits = torch.randn(200, vocab, generator=gen)
    k = torch.randint(1, vocab + 5, (200,), generator=gen)
    probs = processed_probs(logits, 1.0, k)
    for row in range(200):
        kk = min(int(k[row]), vocab)
        kept = probs[row] > 0
        assert int(kept.sum()) == kk
        top = set(logits[row].topk(kk).indices.tolist())
        assert set(kept.nonzero().flatten().tolist()) == top
        expected = torch.softmax(logits[row][list(sorted(top))], -1)
        torch.testing.assert_close(probs[row][list(sorted(top))], expected, rtol=1e-5, atol=1e-7)
    # 0 disables top-k.
    torch.testing.assert_close(processed_probs(logits, 1.0, 0), torch.softmax(logits, -1))


def test_top_k_with_ties_keeps_k():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    probs = processed_probs(logits, 1.0, 2)
    assert int((probs > 0).sum()) == 2
    assert (probs[0, :3] > 0).sum() == 2


def test_top_p_smallest_prefix():
    # Sorted probs 0.5, 0.25, 0.15, 0.1 (token order shuffled).
    probs_in = torch.tensor([0.15, 0.5, 0.1, 0.25])
    logits = probs_in.log()[None]
    # mass before each sorted token: 0, 0.5, 0.75, 0.9 (cut points away from these values).
    cases = {0.3: {1}, 0.49: {1}, 0.6: {1, 3}, 0.8: {1, 3, 0}, 0.95: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for p, expected in cases.items():
        out = processed_probs(logits, 1.0, 0, p)[0]
        assert set((out > 0).nonzero().flatten().tolist()) == expected, p
        kept = sorted(expected)
        torch.testing.assert_close(out[kept], probs_in[kept] / probs_in[kept].sum())
    # Always the top token, however small top_p.
    for p in (1e-9, 1e-3, 0.1):
        out = processed_probs(logits, 1.0, 0, p)[0]
        assert out.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_p_matches_reference_random():
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        vocab = int(torch.randint(2, 50, (), generator=gen))
        logits = torch.randn(vocab, generator=gen) * 2
        t = float(torch.rand((), generator=gen)) * 1.5 + 0.2
        k = int(torch.randint(0, vocab + 2, (), generator=gen))
        p = float(torch.rand((), generator=gen)) * 0.99 + 0.01
        ref = ref_processed(logits.numpy(), t, k, p)
        out = processed_probs(logits, t, k, p).numpy()
        assert np.array_equal(out > 0, ref > 0), (vocab, t, k, p)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)


def test_per_row_parameters_broadcast():
    gen = torch.Generator().manual_seed(3)
    batch, nodes, vocab = 3, 4, 12
    logits = torch.randn(batch, nodes, vocab, generator=gen) * 2
    temperature = torch.tensor([0.5, 1.0, 1.7])
    top_k = torch.tensor([0, 3, 7])
    top_p = torch.tensor([0.9, 1.0, 0.5])
    # Per-request parameters, broadcast over the nodes: [b, 1].
    out = processed_probs(logits, temperature[:, None], top_k[:, None], top_p[:, None])
    for b in range(batch):
        single = processed_probs(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]))
        torch.testing.assert_close(out[b], single)
    # Full per-row parameters [b, N].
    t_full = torch.rand(batch, nodes, generator=gen) + 0.3
    k_full = torch.randint(0, vocab, (batch, nodes), generator=gen)
    p_full = torch.rand(batch, nodes, generator=gen) * 0.9 + 0.1
    out = processed_probs(logits, t_full, k_full, p_full)
    for b in range(batch):
        for n in range(nodes):
            single = processed_probs(logits[b, n], float(t_full[b, n]), int(k_full[b, n]), float(p_full[b, n]))
            torch.testing.assert_close(out[b, n], single)
            ref = ref_processed(logits[b, n].numpy(), float(t_full[b, n]), int(k_full[b, n]), float(p_full[b, n]))
            np.testing.assert_allclose(out[b, n].numpy(), ref, rtol=1e-4, atol=1e-6)
    # Mixed: scalar temperature, per-row top-k.
    out = processed_probs(logits, 1.0, k_full)
    torch.testing.assert_close(out, processed_probs(logits, torch.ones(batch, nodes), k_full, torch.ones(batch, nodes)))


def test_top_p_one_keeps_full_support():
    """top_p = 1.0 means no top-p filtering (SGLang skips it): every token with nonzero
    softmax probability must stay possible, or sampling is no longer lossless."""
    logits = torch.tensor([0.0, -20.0, -30.0])
    out = processed_probs(logits, 1.0, 0, 1.0)
    ref = torch.softmax(logits, -1)
    assert ((out > 0) == (ref > 0)).all(), (out, ref)
    # Realistic vocabulary: float32 cumsum rounding must not cut the tail.
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(0)) * 3
    out = processed_probs(logits, 1.0, 0, 1.0)
    ref = torch.softmax(logits, -1)
    assert int(((out == 0) & (ref > 0)).sum()) == 0
