"""The reference engine is lossless: greedy token ids equal HF transformers' greedy decoding,
with a random head and with an oracle proposer that makes long accepted paths happen."""

from __future__ import annotations

import pytest
import torch

from helpers.hf import exact_joint, hf_greedy
from helpers.stats import joint_fit
from jetflow_sglang.accept import accept_tree
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
from jetflow_sglang.reference.proposer import HeadProposer
from jetflow_sglang.testing.oracle import OracleProposer
from jetflow_sglang.tree import build_tree

RANDOM_HEAD_NEW_TOKENS = 8
NEW_TOKENS = 48
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def greedy_runs(target, prompt_ids):
    """Per prompt: HF greedy (the oracle) and our plain greedy run past EOS and the limit."""
    runs = []
    for ids in prompt_ids:
        reference = hf_greedy(target, ids, NEW_TOKENS)
        continuation = generate_ar(target, ids, NEW_TOKENS + BLOCK_SIZE, ignore_eos=True).tokens
        runs.append((reference, ids + continuation))
    return runs


def test_plain_decoding_matches_hf_generate(target, prompt_ids, greedy_runs):
    for ids, (reference, continuation) in zip(prompt_ids, greedy_runs):
        assert generate_ar(target, ids, NEW_TOKENS).tokens == reference
        # Past EOS the run goes on; up to it, it is the same greedy sequence.
        assert continuation[len(ids) : len(ids) + len(reference)] == reference


@pytest.mark.parametrize("budget", [1, 16, 64, 256])
def test_random_head_is_lossless(target, random_head, prompt_ids, greedy_runs, budget):
    engine = ReferenceEngine(target, HeadProposer(random_head), budget=budget)
    for ids, (reference, _) in zip(prompt_ids, greedy_runs):
        assert engine.generate(ids, RANDOM_HEAD_NEW_TOKENS).tokens == reference[:RANDOM_HEAD_NEW_TOKENS]


@pytest.mark.parametrize("budget", [16, 64])
def test_random_head_with_lookup_is_lossless(target, random_head, prompt_ids, greedy_runs, budget):
    """The prompt-lookup chain merged into each tree (same budget) changes which drafts are
    verified, never what is committed."""
    engine = ReferenceEngine(target, HeadProposer(random_head), budget=budget, lookup=True)
    merged_rounds = 0

    def on_round(position, tree, acceptance):
        nonlocal merged_rounds
        assert tree.budget == budget
        # Lookup nodes score exactly lookup_scores[depth - 1] (in fp32); drafted ones never do.
        lookup_scores = torch.tensor([engine.lookup_scores[d - 1] if d else 0.0 for d in tree.depths[0].tolist()], dtype=torch.float32)
        merged_rounds += int((tree.scores[0, 1:] == lookup_scores[1:]).any())

    for ids, (reference, _) in zip(prompt_ids, greedy_runs):
        result = engine.generate(ids, RANDOM_HEAD_NEW_TOKENS, on_round=on_round)
        assert result.tokens == reference[:RANDOM_HEAD_NEW_TOKENS]
    assert merged_rounds > 0  # the lookup branch was really in some trees


def test_lookup_raises_tau_on_a_repetitive_prompt(target, random_head):
    ids = target.encode_prompt("1, 2, 3, 1, 2, 3, 1, 2, 3,", False)
    plain = ReferenceEngine(target, HeadProposer(random_head), budget=64).generate(ids, 24)
    lookup = ReferenceEngine(target, HeadProposer(random_head), budget=64, lookup=True).generate(ids, 24)
    alone = ReferenceEngine(target, HeadProposer(random_head), budget=64, lookup=True, head=False).generate(ids, 24)
    assert lookup.tokens == plain.tokens == alone.tokens == generate_ar(target, ids, 24).tokens
    assert lookup.tau > plain.tau
    assert lookup.tau > 2.0 and alone.tau > 2.0


def test_lookup_alone_is_lossless(target, random_head, prompt_ids, greedy_runs):
    """No head pass: each round verifies the root and the lookup chain (a plain step when there is
    none), never more nodes than the budget."""
    engine = ReferenceEngine(target, HeadProposer(random_head), budget=8, lookup=True, head=False)
    sizes = set()
    for ids, (reference, _) in zip(prompt_ids, greedy_runs):
        result = engine.generate(ids, RANDOM_HEAD_NEW_TOKENS, on_round=lambda position, tree, acc: sizes.add(tree.budget))
        assert result.tokens == reference[:RANDOM_HEAD_NEW_TOKENS]
    assert 1 in sizes and 1 < max(sizes) <= 8, sizes
    with pytest.raises(JetFlowError, match="nothing to draft"):
        ReferenceEngine(target, HeadProposer(random_head), budget=8, head=False)


@pytest.mark.parametrize("refresh", [False, True], ids=["one-pass", "refresh"])
def test_shipped_head_is_lossless(target, prompt_ids, greedy_runs, refresh):
    """The trained default head (the same target taps as the random one) accepts real
    drafts, in one pass and with the path-conditioned refresh: still token for token AR."""
    from jetflow_sglang.assets import SHIPPED_HEADS, DEFAULT_TARGET_NAME
    from jetflow_sglang.head import JetFlowHead

    head = JetFlowHead.load(SHIPPED_HEADS / DEFAULT_TARGET_NAME).float().eval().requires_grad_(False)
    head.bind_target(target.embedding, target.lm_head)
    assert head.config.target_layer_ids == target.tap_layers
    draft_vocab = set(head.draft_vocab.tolist()) if head.draft_vocab is not None else None

    def drafted_only_from_the_draft_vocabulary(position, tree, acceptance):
        if draft_vocab is not None:
            assert set(tree.tokens[0, 1:].tolist()) <= draft_vocab

    committed = rounds = 0
    for budget in (16, 64):
        engine = ReferenceEngine(target, HeadProposer(head), budget=budget, refresh=refresh)
        for ids, (reference, _) in zip(prompt_ids, greedy_runs):
            result = engine.generate(ids, NEW_TOKENS, on_round=drafted_only_from_the_draft_vocabulary)
            assert result.tokens == reference, (budget, ids)
            committed, rounds = committed + len(result.tokens), rounds + result.rounds
    assert committed / rounds > 1.2  # a trained head gets drafts accepted (a random one: 1.0)


@pytest.mark.parametrize("budget", [16, 64])
def test_pruned_vocabulary_head_is_lossless(prepared, target, prompt_ids, greedy_runs, budget):
    """A head drafting over 2,048 target ids (half of them the greedy runs' own tokens, so
    some drafts are right) only ever drafts those ids, and the output is still plain decoding."""
    from jetflow_sglang.assets import build_random_head

    head = build_random_head(prepared["target"], draft_vocab_size=2048).float().eval().requires_grad_(False)
    seen = sorted({t for reference, _ in greedy_runs for t in reference})
    rest = [t for t in range(target.config.vocab_size) if t not in set(seen)][: 2048 - len(seen)]
    head.set_draft_vocab(torch.tensor(sorted(seen + rest)))
    head.bind_target(target.embedding, target.lm_head)
    allowed = set(head.draft_vocab.tolist())

    def on_round(position, tree, acceptance):
        assert set(tree.tokens[0, 1:].tolist()) <= allowed

    engine = ReferenceEngine(target, HeadProposer(head), budget=budget)
    for ids, (reference, _) in zip(prompt_ids, greedy_runs):
        assert engine.generate(ids, RANDOM_HEAD_NEW_TOKENS, on_round=on_round).tokens == reference[:RANDOM_HEAD_NEW_TOKENS]


@pytest.mark.parametrize("refresh", [False, True], ids=["one-pass", "refresh"])
def test_fused_head_is_lossless(prepared, target, prompt_ids, greedy_runs, refresh):
    """A head with per-tap feature norms and the anchor fused with the last committed token's
    features (what `jetflow train` builds) drafts through the engine's incremental context and
    stays token-identical to plain decoding, with and without the refresh pass."""
    from jetflow_sglang.assets import build_random_head

    head = build_random_head(prepared["target"], tap_norm=True, anchor_fusion=True).float().eval().requires_grad_(False)
    head.bind_target(target.embedding, target.lm_head)
    engine = ReferenceEngine(target, HeadProposer(head), budget=32, refresh=refresh)
    for ids, (reference, _) in zip(prompt_ids, greedy_runs):
        assert engine.generate(ids, RANDOM_HEAD_NEW_TOKENS).tokens == reference[:RANDOM_HEAD_NEW_TOKENS]


def _longest_true_path(tree, truth: list[int]) -> int:
    """How deep the true continuation runs through the tree (a plain walk over parents)."""
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    node, depth = 0, 0
    while depth < len(truth):
        children = [j for j, p in enumerate(parents) if p == node and tokens[j] == truth[depth]]
        if not children:
            break
        node, depth = children[0], depth + 1
    return depth


def test_oracle_drafter_long_paths_are_lossless(target, prompt_ids, greedy_runs):
    """Accepted paths of every length, EOS and the token limit inside a path, deep KV compaction."""
    seen_accepts, eos_inside, limit_inside = set(), 0, 0
    for budget in (16, 64, 256):
        for index, (ids, (expected, continuation)) in enumerate(zip(prompt_ids, greedy_runs)):
            drafter = OracleProposer(continuation, target.config.vocab_size, block_size=BLOCK_SIZE, seed=1000 * budget + index)
            implied: list[int] = []

            def on_round(position, tree, acceptance):
                implied.append(_longest_true_path(tree, continuation[position + 1 : position + BLOCK_SIZE]))

            result = ReferenceEngine(target, drafter, budget=budget).generate(ids, NEW_TOKENS, on_round=on_round)
            assert result.tokens == expected, f"prompt {index} differs at budget {budget}"
            assert result.accept_lengths == implied
            seen_accepts.update(result.accept_lengths)
            # Committed per round = accepted drafts + bonus; if the last round committed more
            # than was kept, EOS or the token limit landed inside the accepted path.
            produced = 1 + sum(a + 1 for a in result.accept_lengths)
            if produced > len(result.tokens):
                if result.tokens[-1] in target.eos_token_ids:
                    eos_inside += 1
                else:
                    limit_inside += 1
    # Deep paths with lower-ranked tokens rarely fit a budget; one long run with the truth always
    # at rank 0 walks through every length 0..B-1 at least once (the oracle cycles through them).
    ids = prompt_ids[6]
    continuation = ids + generate_ar(target, ids, 10 * BLOCK_SIZE, ignore_eos=True).tokens
    drafter = OracleProposer(continuation, target.config.vocab_size, block_size=BLOCK_SIZE, top_rank_share=1.0)
    result = ReferenceEngine(target, drafter, budget=256).generate(ids, 9 * BLOCK_SIZE)
    expected = continuation[len(ids) : len(ids) + 9 * BLOCK_SIZE]
    eos_at = [i for i, token in enumerate(expected) if token in target.eos_token_ids]
    assert result.tokens == (expected[: eos_at[0] + 1] if eos_at else expected)
    seen_accepts.update(result.accept_lengths)
    assert seen_accepts == set(range(BLOCK_SIZE)), f"accepted lengths seen: {sorted(seen_accepts)}"
    assert eos_inside >= 1 and limit_inside >= 1, (eos_inside, limit_inside)


def test_oracle_tau_is_what_the_tree_implies(target, prompt_ids, greedy_runs):
    ids, (_, continuation) = prompt_ids[7], greedy_runs[7]
    drafter = OracleProposer(continuation, target.config.vocab_size, seed=7)
    result = ReferenceEngine(target, drafter, budget=64).generate(ids, NEW_TOKENS)
    assert result.rounds >= 2
    assert result.tau == pytest.approx(1 + sum(result.accept_lengths) / result.rounds)
    assert result.tau > 3.0  # the oracle gets about half of each block right on average


def _tree_forward(target, prefix: list[int], tree, mask):
    cache = target.new_cache()
    target.forward(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
    full = torch.cat([torch.ones(1, tree.budget, len(prefix), dtype=torch.bool), mask], -1)[:, None]
    logits, _ = target.forward(tree.tokens, tree.positions(torch.tensor([len(prefix)])), cache, full)
    return logits[0]


def test_tree_masked_forward_equals_each_path_alone(target, prompt_ids):
    prefix = prompt_ids[0]
    generator = torch.Generator().manual_seed(0)
    draft = (torch.randn(1, 5, target.config.vocab_size, generator=generator) * 4).log_softmax(-1)
    tree = build_tree(torch.tensor([prefix[-1]]), draft, budget=24, width=3)
    prefix = prefix[:-1]  # the anchor is the tree's root
    assert int(tree.depths.max()) >= 3 and len(set(tree.parents[0].tolist())) > 3  # a real branching tree
    tree_logits = _tree_forward(target, prefix, tree, tree.ancestors)
    worst = 0.0
    for node in range(tree.budget):
        path = tree.ancestors[0, node].nonzero()[:, 0]  # ancestors in topological order, then the node
        path_ids = prefix + tree.tokens[0, path].tolist()
        logits, _ = target.forward(torch.tensor([path_ids]), torch.arange(len(path_ids))[None], target.new_cache())
        worst = max(worst, (logits[0, -1] - tree_logits[node]).abs().max().item())
    assert worst < 1e-3
    causal = torch.ones(1, tree.budget, tree.budget, dtype=torch.bool).tril()
    causal_logits = _tree_forward(target, prefix, tree, causal)
    assert (causal_logits - tree_logits).abs().max().item() > 1.0  # the check bites


def test_acceptance_on_real_verify_walks_target_argmax(target, prompt_ids):
    """On a real tree forward, accepted drafts are exactly the target's argmax chain."""
    prefix = prompt_ids[1]
    generator = torch.Generator().manual_seed(1)
    draft = torch.randn(1, 7, target.config.vocab_size, generator=generator).log_softmax(-1)
    tree = build_tree(torch.tensor([prefix[-1]]), draft, budget=32, width=4)
    logits = _tree_forward(target, prefix[:-1], tree, tree.ancestors)
    acceptance = accept_tree(tree, logits.argmax(-1)[None])
    path = acceptance.path[0, : int(acceptance.num_accepted[0]) + 1].tolist()
    for parent, child in zip(path, path[1:]):
        assert int(tree.tokens[0, child]) == int(logits[parent].argmax())
    assert int(acceptance.bonus[0]) == int(logits[path[-1]].argmax())


SAMPLED_TOKENS = 3
SAMPLED_DRAWS = 240


def _top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 1, top-k 2: the two best tokens and their renormalized probabilities."""
    top_logits, top_ids = logits.topk(2, dim=-1)
    return top_ids, top_logits.softmax(-1)


def test_sampling_through_the_engine_follows_the_target_over_several_tokens(target, prompt_ids, greedy_runs):
    """Temperature 1, top-k 2: the reference engine's three-token continuations follow the joint
    law computed from the target's logits (chi-square goodness of fit). The oracle drafts the
    greedy continuation, so sampled tokens that match it commit multi-token paths, and the
    deeper nodes' draws are what is tested."""
    from collections import Counter

    from jetflow_sglang.reference.engine import Sampling

    index = 9  # "Write a haiku about rain.": several likely continuations
    ids, (_, continuation) = prompt_ids[index], greedy_runs[index]
    joint = exact_joint(target.model, ids, SAMPLED_TOKENS, _top2)  # by hand from HF's fp32 logits
    drafter = OracleProposer(continuation, target.config.vocab_size, block_size=BLOCK_SIZE, seed=5)
    engine = ReferenceEngine(target, drafter, budget=16)
    draws, accepted = Counter(), 0
    for seed in range(SAMPLED_DRAWS):
        result = engine.generate(ids, SAMPLED_TOKENS, Sampling(temperature=1.0, top_k=2, seed=seed))
        draws[tuple(result.tokens)] += 1
        accepted += sum(result.accept_lengths)
    assert all(outcome in joint for outcome in draws), [o for o in draws if o not in joint]
    p_value, observed, expected = joint_fit(draws, joint, SAMPLED_DRAWS)
    print(f"engine sampling: observed {observed} expected {[round(e, 1) for e in expected]} p={p_value:.3g}, accepted {accepted}")
    assert p_value > 1e-3, (observed, expected)
    assert accepted >= SAMPLED_DRAWS // 4, accepted
