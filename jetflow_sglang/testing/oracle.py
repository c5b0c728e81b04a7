"""A test proposer for the reference engine that knows the target's greedy continuation.

(`jetflow_sglang.reference.proposer.Proposer`.) A random head accepts almost nothing, which leaves long accepted paths, EOS and the
token limit inside a path, and deep KV compaction untested. The oracle drafts
logits in which the target's true next tokens sit at chosen ranks of each depth's
top-k: per round it picks how many depths to get right (cycling through 0..D), puts the
true token at rank 0 or a random lower rank up to that depth, and pushes it out of
the top-k just after. Whether a path survives into the tree still depends on the
budget, so the accepted length is whatever the tree holds, and a test can check the
engine against it.

With ``accept_prob`` p it is a synthetic proposer of set quality instead: each round the true
token sits at rank 0 of depth 1, 2, ... while independent coin flips of probability p come up
heads, and is out of the top-k from the first tails on, so P(accepted length >= d) = p**d
for greedy decoding wherever the tree holds the top-ranked chain (for benchmarking a serving
policy apart from head quality).
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow_sglang.tree import Candidates, top_candidates

RANK_LOGITS = (12.0, 9.0, 8.5, 8.0, 7.5, 7.0, 6.5, 6.0)


class OracleProposer:
    def __init__(
        self,
        continuation: list[int],
        vocab_size: int,
        block_size: int = 16,
        width: int = 7,
        seed: int = 0,
        top_rank_share: float = 0.93,
        accept_prob: float | None = None,
    ) -> None:
        """continuation: prompt + the target's greedy tokens (run past EOS and the token limit)."""
        if accept_prob is not None and not 0.0 <= accept_prob <= 1.0:
            raise ValueError(f"accept_prob must be within [0, 1], got {accept_prob}")
        self.continuation = continuation
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.hint_ngram = 0  # knows the continuation: reads no lookup hints
        self.width = min(width, len(RANK_LOGITS))
        self.accept_prob = accept_prob
        self.top_rank_share = 1.0 if accept_prob is not None else top_rank_share
        self.generator = torch.Generator().manual_seed(seed)
        self.length = 0
        self._lengths: list[int] = []

    def reset(self, features: Tensor) -> None:
        self.length = features.shape[1]

    def extend(self, features: Tensor) -> None:
        self.length += features.shape[1]

    def advance_to(self, position: int, rounds: int = 1) -> None:
        """Server use (no per-request features reach a proposer): a verify round commits 1..block_size
        tokens, so after `rounds` rounds (an adaptive server runs some without a draft pass) the
        position must lie 1..rounds * block_size past this one's."""
        step = position - self.length
        if not 1 <= step <= self.block_size * rounds:
            raise AssertionError(f"oracle context out of step: position {self.length} then {position}")
        self.length = position

    def _randint(self, high: int) -> int:
        return int(torch.randint(high, (1,), generator=self.generator))

    def propose(self, anchor: Tensor, position: int, hints=None) -> Tensor:
        assert position == self.length, "oracle context out of step with the engine"
        depths = self.block_size - 1
        logits = torch.randn(depths, self.vocab_size, generator=self.generator)
        if self.accept_prob is not None:  # leading heads of coin flips with P(heads) = accept_prob
            flips = torch.rand(depths, generator=self.generator) < self.accept_prob
            right_until = int(flips.long().cumprod(0).sum())
        else:
            if not self._lengths:  # cycle through every length 0..D in a random order
                self._lengths = torch.randperm(depths + 1, generator=self.generator).tolist()
            right_until = self._lengths.pop()  # depths 1..right_until hold the true token
        for depth in range(1, depths + 1):
            index = position + depth
            truth = self.continuation[index] if index < len(self.continuation) else None
            candidates = torch.randperm(self.vocab_size, generator=self.generator)[: self.width + 1].tolist()
            if truth is not None:
                candidates = [c for c in candidates if c != truth][: self.width]
                if depth <= right_until:
                    share = torch.rand(1, generator=self.generator).item()
                    rank = 0 if share < self.top_rank_share else 1 + self._randint(self.width - 1) if self.width > 1 else 0
                    candidates.insert(rank, truth)
                else:
                    logits[depth - 1, truth] = -20.0  # out of the top-k
            for rank, token in enumerate(candidates[: self.width]):
                logits[depth - 1, token] = RANK_LOGITS[rank]
        return logits[None]

    def propose_topk(self, anchor: Tensor, position: int, width: int, hints=None) -> Candidates:
        return top_candidates(self.propose(anchor, position, hints), width)
