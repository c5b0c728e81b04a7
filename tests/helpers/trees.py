"""Small draft trees for the tests (by hand, from random drafts, or with a confident draft), and
budget-policy rounds over one."""

from __future__ import annotations

import math

import numpy as np
import torch

from jetflow_sglang.tree import DraftTree, ancestor_mask, build_tree, prune_tree


def hand_tree(tokens: list[int], parents: list[int], batch: int = 1, scores: list[float] | None = None) -> DraftTree:
    """The tree of parent indices `parents` (-1 for the root) holding `tokens`, `batch` times over;
    scores 0 unless given."""
    depths = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    par = torch.tensor([parents] * batch)
    return DraftTree(
        tokens=torch.tensor([tokens] * batch),
        parents=par,
        depths=torch.tensor([depths] * batch),
        scores=torch.tensor([scores] * batch) if scores is not None else torch.zeros(batch, len(tokens)),
        ancestors=ancestor_mask(par, max(depths)),
    )


def walk_ancestors(parents: list[int]) -> np.ndarray:
    """[n, n] ancestor-or-self mask of a tree given parent indices (-1 = root), walked by hand."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_tree(anchors: list[int], depths: int, vocab: int, budget: int, gen: torch.Generator,
                path: list[int] = ()) -> DraftTree:  # fmt: skip
    """A best-first tree over random drafts (`gen`), with `path` forced to the top of its depths."""
    logits = torch.randn(len(anchors), depths, vocab, generator=gen)
    for depth, token in enumerate(path[:depths]):
        logits[:, depth, token] = 10.0
    return build_tree(torch.tensor(anchors), logits.log_softmax(-1), budget)


def confident_tree(batch: int, depths: int, prob: float, budget: int, width: int = 4) -> DraftTree:
    """A tree whose depth-d top token (0) has probability `prob` (the rest spread over 63 tokens)."""
    vocab = 64
    logits = torch.full((batch, depths, vocab), math.log((1 - prob) / (vocab - 1)))
    logits[:, :, 0] = math.log(prob)
    return build_tree(torch.zeros(batch, dtype=torch.long), logits, budget, width)


def serve_rounds(policy, tree: DraftTree, rounds: int) -> list[int]:
    """Rounds as the worker runs them over `tree`: the budget policy chooses a size, the verify
    takes 20 ms + 1 ms a node (draft 1 ms), the policy observes; the sizes chosen."""
    chosen = []
    for _ in range(rounds):
        size, priority = policy.choose(tree)
        chosen.append(size)
        no_path = torch.zeros(tree.tokens.shape[0], tree.budget, dtype=torch.long)
        policy.observe(prune_tree(tree, size, priority), no_path, 0.02 + 0.001 * size, 0.001)
    return chosen
