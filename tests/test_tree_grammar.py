"""The first-child / next-sibling links SGLang's grammar walk reads (sglang_plugin/tree_grammar.py
::tree_links), against a brute-force walk over the parent array, and through SGLang's own tree
traversal (`traverse_tree`): it must fill each node's mask exactly once, with the matcher
advanced over exactly that node's path."""

from __future__ import annotations

import random

import torch
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
from sglang.srt.speculative.spec_utils import traverse_tree

from jetflow_sglang.sglang_plugin.tree_grammar import tree_links
from jetflow_sglang.tree import build_tree


def brute_force_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """For every node, its children in node order: the first is its first child, and each
    child's next sibling is the child listed after it."""
    n = len(parents)
    first_child, next_sibling = [-1] * n, [-1] * n
    for node in range(n):
        children = [c for c in range(n) if parents[c] == node]
        if children:
            first_child[node] = children[0]
        for older, younger in zip(children, children[1:]):
            next_sibling[older] = younger
    return first_child, next_sibling


def random_parents(rng: random.Random, n: int, best_first: bool) -> list[int]:
    """A random tree on n nodes, root 0. best_first: every parent before its child (as the draft
    trees are); otherwise the non-root nodes are labelled in random order."""
    if best_first:
        return [-1] + [rng.randrange(node) for node in range(1, n)]
    order = [0] + rng.sample(range(1, n), n - 1)  # order[i]: the label of the i-th node built
    parents = [-1] * n
    for i in range(1, n):
        parents[order[i]] = order[rng.randrange(i)]
    return parents


def check_against_brute_force(rows: list[list[int]]) -> None:
    first_child, next_sibling = tree_links(torch.tensor(rows))
    assert first_child.dtype == next_sibling.dtype == torch.int64
    assert first_child.shape == next_sibling.shape == (len(rows), len(rows[0]))
    for b, parents in enumerate(rows):
        want_first, want_next = brute_force_links(parents)
        assert first_child[b].tolist() == want_first, (parents, first_child[b].tolist(), want_first)
        assert next_sibling[b].tolist() == want_next, (parents, next_sibling[b].tolist(), want_next)


def test_tree_links_match_a_brute_force_walk_on_random_trees():
    rng = random.Random(0)
    for best_first in (True, False):
        for _ in range(300):
            n, batch = rng.randint(1, 14), rng.randint(1, 3)
            check_against_brute_force([random_parents(rng, n, best_first) for _ in range(batch)])


def test_tree_links_hand_made():
    #        0
    #      / | \
    #     1  2  4
    #     |     |
    #     3     5
    first_child, next_sibling = tree_links(torch.tensor([[-1, 0, 0, 1, 0, 4], [-1, 0, 1, 2, 3, 4]]))
    assert first_child.tolist() == [[1, 3, -1, -1, 5, -1], [1, 2, 3, 4, 5, -1]]
    assert next_sibling.tolist() == [[-1, 2, 4, -1, -1, -1], [-1] * 6]  # a chain has no siblings


class PathRecorder(BaseGrammarObject):
    """A grammar that allows every token and records, at each mask it fills, the tokens it has
    been advanced over: SGLang's traversal calls accept_token / rollback along the links."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[int] = []
        self.filled: list[tuple[int, tuple[int, ...]]] = []

    def accept_token(self, token: int) -> None:
        self.stack.append(token)

    def rollback(self, k: int) -> None:
        del self.stack[len(self.stack) - k :]

    def is_terminated(self) -> bool:
        return False

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        vocab_mask[idx] = -1  # all bits set: every token allowed
        self.filled.append((idx, tuple(self.stack)))


def test_sglang_traversal_over_the_links_fills_each_node_once_with_its_own_path():
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        vocab, depths = 6, 4
        logprobs = torch.randn(2, depths, vocab, generator=gen).log_softmax(-1)
        tree = build_tree(torch.randint(0, vocab, (2,), generator=gen), logprobs, budget=12, width=3)
        first_child, next_sibling = tree_links(tree.parents)
        for b in range(2):
            parents, tokens = tree.parents[b].tolist(), tree.tokens[b]
            grammar = PathRecorder()
            mask = torch.zeros(len(parents), 1, dtype=torch.int32)  # vocab < 32: one word per node
            traverse_tree(first_child[b], next_sibling[b], tokens, grammar, mask, vocab_size=vocab)
            want = {}
            for node in range(len(parents)):
                path, at = [], node
                while at > 0:  # the root (anchor) is already committed: not on the path
                    path.append(int(tokens[at]))
                    at = parents[at]
                want[node] = tuple(reversed(path))
            assert sorted(idx for idx, _ in grammar.filled) == list(range(len(parents))), (seed, b)
            assert dict(grammar.filled) == want, (seed, b)
            assert grammar.stack == []  # rolled back to the committed state
