"""Penalties on the tree (sglang_plugin/tree_penalties.py) against the definition written out
node by node: walk the node's path to the root, count the request's output plus that path,
penalize as SGLang's penalizers do. The server test (test_sglang_jetflow.py) checks the same
against a no-spec SGLang server end to end."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from helpers.trees import random_tree
from jetflow_sglang.sglang_plugin.committed_ids import CommittedIds
from jetflow_sglang.sglang_plugin.tree_penalties import Penalties, apply_tree_penalties, penalize_tree

VOCAB, DEPTHS, BUDGET = 12, 5, 24  # a small vocabulary: paths repeat tokens of the output


def tree_and_logits(anchor: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree([anchor], DEPTHS, VOCAB, BUDGET, gen)
    return tree, 3 * torch.randn(1, BUDGET, VOCAB, generator=gen)


def by_hand(logits_row: torch.Tensor, path: list[int], outputs: list[int], p: Penalties) -> torch.Tensor:
    counts = Counter(outputs + path)
    row = logits_row.clone()
    for token in range(VOCAB):
        n = counts[token]
        row[token] -= p.frequency * n + (p.presence if n else 0.0)
        if token in p.stop_ids and len(outputs) + len(path) < p.min_new_tokens:
            row[token] = float("-inf")
        if n and p.repetition != 1.0:
            row[token] = row[token] * p.repetition if row[token] < 0 else row[token] / p.repetition
    return row


def path_of(tree, node: int) -> list[int]:
    tokens = []
    while node > 0:
        tokens.append(int(tree.tokens[0, node]))
        node = int(tree.parents[0, node])
    return tokens[::-1]


@pytest.mark.parametrize(
    "penalties",
    [
        Penalties(frequency=0.7),
        Penalties(presence=1.1),
        Penalties(repetition=1.4),
        Penalties(min_new_tokens=9, stop_ids=(2, 5)),
        Penalties(frequency=0.3, presence=0.5, repetition=1.25, min_new_tokens=8, stop_ids=(4,)),
    ],
    ids=["frequency", "presence", "repetition", "min_new_tokens", "all"],
)
def test_each_node_is_penalized_for_its_own_path(penalties):
    outputs = [3, 7, 3, 1, 0, 9]  # ends with the anchor
    tree, logits = tree_and_logits(outputs[-1], seed=1)
    want = torch.stack([by_hand(logits[0, j], path_of(tree, j), outputs, penalties) for j in range(BUDGET)])
    got = logits[0].clone()
    penalize_tree(got, tree.tokens[0], tree.ancestors[0], tree.depths[0], outputs, penalties)
    assert not torch.equal(got, logits[0])  # the penalties did something
    assert torch.allclose(got, want, atol=1e-5, equal_nan=False), (got - want).abs().max()
    # Nodes at depth >= 1 see different counts than the root: per-path, not one row for all.
    assert len({tuple(r.tolist()) for r in got}) > 1


def test_min_new_tokens_lifts_the_ban_at_the_right_depth():
    outputs = [1, 2, 3]  # three tokens out, anchor included
    tree, logits = tree_and_logits(outputs[-1], seed=2)
    got = logits[0].clone()
    penalize_tree(got, tree.tokens[0], tree.ancestors[0], tree.depths[0], outputs, Penalties(min_new_tokens=5, stop_ids=(0,)))
    banned = got[:, 0] == float("-inf")
    assert torch.equal(banned, (3 + tree.depths[0]) < 5)  # the root and depth-1 nodes only
    assert banned.any() and not banned.all()


def request(rid: str, prompt: list[int], **params):
    neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}
    sampling = SimpleNamespace(**{**neutral, "stop_token_ids": None, **params})
    tokenizer = SimpleNamespace(eos_token_id=11, additional_stop_token_ids=None)
    return SimpleNamespace(rid=rid, origin_input_ids=prompt, full_untruncated_fill_ids=prompt, output_ids=[],
                           sampling_params=sampling, eos_token_ids={10}, tokenizer=tokenizer)  # fmt: skip


def test_batch_reads_outputs_from_the_worker_record_and_skips_plain_requests():
    prompt = [4, 4, 4, 6]
    plain, penalized = request("a", prompt), request("b", prompt, frequency_penalty=0.5, min_new_tokens=4)
    assert Penalties.of(plain) is None
    assert Penalties.of(penalized).stop_ids == (10, 11)
    record = CommittedIds()
    record.on_extend([plain, penalized], torch.tensor([4, 4]))
    # One round: anchor 8 at position 4, drafts 6, 8 accepted (the scheduler's output_ids lag).
    record.on_accept([penalized], torch.tensor([4]), torch.tensor([8]), torch.tensor([[6, 8, 2]]), torch.tensor([2]))
    tree, logits = tree_and_logits(5, seed=3)
    batch_logits = torch.cat([logits, logits])
    trees = type(tree)(*(torch.cat([getattr(tree, f)] * 2) for f in ("tokens", "parents", "depths", "scores", "ancestors")))
    apply_tree_penalties(batch_logits, trees, [plain, penalized], torch.tensor([4, 7]), torch.tensor([5, 5]), record)
    assert torch.equal(batch_logits[0], logits[0])  # prompt tokens are not output: no penalty, no record needed
    outputs = [8, 6, 8, 5]  # output so far: the round's commit, then this round's anchor
    want = torch.stack([by_hand(logits[0, j], path_of(tree, j), outputs, Penalties.of(penalized)) for j in range(BUDGET)])
    assert torch.allclose(batch_logits[1], want, atol=1e-5)
