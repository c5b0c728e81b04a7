"""The oracle proposer's synthetic mode (jetflow_sglang/testing/oracle.py, `accept_prob`): a proposer of set
quality for measuring serving policies apart from head quality. Each round the true token leads
depth 1, 2, ... while coin flips of probability p come up heads, so the chain a greedy tree walk
accepts has P(length >= d) = p**d."""

from __future__ import annotations

import pytest
import torch

from jetflow_sglang.testing.oracle import OracleProposer

VOCAB, BLOCK = 64, 16
ROUNDS = 3000


def accepted_chain(oracle: OracleProposer, continuation: list[int], position: int) -> int:
    """Leading depths whose argmax is the true token (what a chain verify would accept)."""
    oracle.length = position
    picks = oracle.propose(torch.tensor([continuation[position]]), position)[0].argmax(-1).tolist()
    length = 0
    for depth, token in enumerate(picks, start=1):
        if token != continuation[position + depth]:
            break
        length += 1
    return length


@pytest.mark.parametrize("p", [0.6, 0.8])
def test_accepted_length_is_geometric_in_p(p):
    gen = torch.Generator().manual_seed(0)
    continuation = torch.randint(VOCAB, (ROUNDS + 2 * BLOCK,), generator=gen).tolist()
    oracle = OracleProposer(continuation, VOCAB, block_size=BLOCK, seed=1, accept_prob=p)
    lengths = torch.tensor([accepted_chain(oracle, continuation, i) for i in range(ROUNDS)], dtype=torch.float64)
    depths = BLOCK - 1
    for d in (1, 2, 4, 8):
        observed = (lengths >= d).double().mean().item()
        assert observed == pytest.approx(p**d, abs=4 * (p**d * (1 - p**d) / ROUNDS) ** 0.5 + 1e-3), (d, observed)
    expected_mean = sum(p**d for d in range(1, depths + 1))
    assert lengths.mean().item() == pytest.approx(expected_mean, rel=0.06)


def test_accept_prob_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="accept_prob"):
        OracleProposer([1, 2, 3], VOCAB, accept_prob=1.5)


def test_server_positions_must_advance_by_what_the_rounds_since_could_commit():
    """`advance_to` (the SGLang proposer's check): one verify round commits 1..BLOCK tokens, and
    an adaptive server may run rounds without a draft pass in between, so after r rounds the
    position moves 1..r*BLOCK; standing still, going back or jumping further is out of step."""
    oracle = OracleProposer(list(range(200)), VOCAB, block_size=BLOCK)
    oracle.length = 10
    oracle.advance_to(10 + BLOCK)
    oracle.advance_to(26 + 2 * BLOCK, rounds=2)  # a round without the draft pass in between
    assert oracle.length == 58
    for position, rounds in ((58, 1), (57, 3), (59 + BLOCK, 1), (59 + 3 * BLOCK, 3)):
        with pytest.raises(AssertionError, match="out of step"):
            oracle.advance_to(position, rounds=rounds)
