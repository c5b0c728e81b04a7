"""The SGLang worker's free branch (sglang_plugin/lookup_branch.py) and its own record of each
request's committed ids across extend and accepted paths (committed_ids.py), and the
per-request merge into a batch of trees. The server tests (test_sglang_jetflow.py) check it end to end against the
no-spec server."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from helpers.trees import random_tree
from jetflow_sglang.lookup import lookup_draft
from jetflow_sglang.sglang_plugin.committed_ids import CommittedIds
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV, LookupBranch, lookup_enabled, lookup_mode
from jetflow_sglang.tree import merge_chain

DEPTHS = 6


def request(rid: str, ids: list[int]):
    """What the branch reads of an SGLang Req: its id and origin + output ids."""
    return SimpleNamespace(rid=rid, full_untruncated_fill_ids=array("q", ids))


def trees(anchors: list[int], budget: int = 12, seed: int = 0):
    return random_tree(anchors, DEPTHS, 50, budget, torch.Generator().manual_seed(seed))


def test_each_row_gets_its_own_chain_and_the_rest_stay():
    repeating = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # anchor 3: lookup continues 4, 5, 1, 2, ...
    no_repeat = [10, 11, 12, 13]  # anchor 14 never occurred: no chain
    reqs = [request("a", repeating), request("b", no_repeat)]
    branch, record = LookupBranch(DEPTHS), CommittedIds()
    seq_lens = torch.tensor([len(repeating), len(no_repeat)])
    record.on_extend(reqs, seq_lens)
    anchors = torch.tensor([3, 14])
    tree = trees([3, 14])
    chains = branch.chains(reqs, seq_lens, anchors, record)
    merged = branch.merge(tree, chains)
    chain = lookup_draft(repeating + [3], DEPTHS)
    assert chains == [chain, []] and chain == [4, 5, 1, 2, 3, 4]
    want = merge_chain(trees([3]), torch.tensor(chain), branch.chain_scores)
    for field in ("tokens", "parents", "depths", "scores", "ancestors"):
        assert torch.equal(getattr(merged, field)[0], getattr(want, field)[0]), field
        assert torch.equal(getattr(merged, field)[1], getattr(tree, field)[1]), field


def test_accepted_paths_extend_the_record_and_feed_the_next_round():
    ids = [7, 8, 9, 7, 8]
    reqs = [request("a", ids)]
    branch, record = LookupBranch(DEPTHS), CommittedIds()
    record.on_extend(reqs, torch.tensor([5]))
    # Round: anchor 9 at position 5; two drafts accepted (7, 8), bonus 9.
    committed = torch.tensor([[7, 8, 9, -1]])
    record.on_accept(reqs, torch.tensor([5]), torch.tensor([9]), committed, torch.tensor([2]))
    assert record.ids["a"] == [7, 8, 9, 7, 8, 9, 7, 8]
    # The scheduler's output ids lag (overlap): the branch uses the worker's own record, so the
    # next round's chain continues after the newest tokens.
    merged = branch.merge(trees([9]), branch.chains(reqs, torch.tensor([8]), torch.tensor([9]), record))
    assert path_tokens(merged) == lookup_draft(record.ids["a"] + [9], DEPTHS) == [7, 8, 9, 7, 8, 9]


def path_tokens(tree) -> list[int]:
    """Tokens from the root (excluded) down to the deepest node of row 0."""
    node = int(tree.depths[0].argmax())
    tokens = []
    while node > 0:
        tokens.append(int(tree.tokens[0, node]))
        node = int(tree.parents[0, node])
    return tokens[::-1]


def test_unknown_or_out_of_step_requests_draft_alone_and_dead_ones_are_dropped():
    branch, record = LookupBranch(DEPTHS), CommittedIds()
    a, b = request("a", [1, 2, 1, 2]), request("b", [5, 6, 5, 6])
    record.on_extend([a, b], torch.tensor([4, 4]))
    tree = trees([1])
    # seq_len disagrees with the record (e.g. retracted and re-admitted): head alone this round.
    record.keep_only([a])
    assert branch.chains([a], torch.tensor([6]), torch.tensor([1]), record) == [[]]
    assert branch.merge(tree, [[]]) is tree
    assert "b" not in record.ids  # not in the decode batch any more
    record.on_accept([a], torch.tensor([6]), torch.tensor([1]), torch.tensor([[2, 1]]), torch.tensor([1]))
    assert "a" not in record.ids  # out of step: forgotten until its next extend
    fresh = trees([1], seed=3)
    assert branch.chains([request("c", [1, 2, 1])], torch.tensor([3]), torch.tensor([2]), record) == [[]]
    assert branch.merge(fresh, [[]]) is fresh


def test_switch_reads_zero_or_one(monkeypatch):
    monkeypatch.delenv(LOOKUP_ENV, raising=False)
    assert lookup_enabled()
    monkeypatch.setenv(LOOKUP_ENV, "0")
    assert not lookup_enabled()
    monkeypatch.setenv(LOOKUP_ENV, "only")
    assert lookup_enabled() and lookup_mode() == "only"
    monkeypatch.setenv(LOOKUP_ENV, "yes")
    with pytest.raises(ValueError, match=LOOKUP_ENV):
        lookup_enabled()


def test_chain_tree_holds_each_chain_below_its_anchor_and_prunes_filler_first():
    """A round without the head: each request's chain is a path under its anchor, scored as a
    merged chain would be; shorter chains are padded with filler that pruning removes first."""
    from jetflow_sglang.tree import chain_depth_scores, prune_tree

    branch = LookupBranch(DEPTHS)
    tree = branch.chain_tree(torch.tensor([3, 14, 7]), [[4, 5, 1], [], [8]], cap=16)
    assert tree.tokens.tolist() == [[3, 4, 5, 1], [14, 14, 14, 14], [7, 8, 7, 7]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 3 and tree.depths.tolist() == [[0, 1, 2, 3]] * 3
    scores = [0.0, *chain_depth_scores(branch.chain_scores, 3)]
    torch.testing.assert_close(tree.scores[0], torch.tensor(scores))
    assert tree.scores[1, 1:].max() < -1e3 and tree.scores[2, 1] == scores[1] and tree.scores[2, 2:].max() < -1e3
    assert torch.equal(tree.ancestors[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert prune_tree(tree, 2).tokens.tolist() == [[3, 4], [14, 14], [7, 8]]
    # The cap and the head's depth bound the chain.
    assert branch.chain_tree(torch.tensor([3]), [[4, 5, 1, 2, 3, 4, 5, 1]], cap=4).tokens.tolist() == [[3, 4, 5, 1]]
    assert branch.chain_tree(torch.tensor([3]), [list(range(20))], cap=64).budget == DEPTHS + 1
