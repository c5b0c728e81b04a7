"""A round's prompt lookups for the SGLang worker: the free branch's chains and a hinted head's hints.

A hinted head (``JetFlowConfig.lookup_hint``) reads, in each MASK slot, the lookup candidate for
that position and its kind (`jetflow_sglang.lookup.lookup_hint`), over exactly the context the
free branch and the reference engine match: the request's committed ids plus its anchor
(:meth:`.committed_ids.CommittedIds.contexts`). Requests whose ids are not known get kind 0 (plain
MASK). Hints are computed whenever the head is hinted, also with the branch off
(``JETFLOW_LOOKUP=0`` only stops the merge); where the branch matches suffixes of the same length,
its chains are read off the hints instead of being matched again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from jetflow_sglang.lookup import lookup_hint

from .committed_ids import CommittedIds
from .lookup_branch import LookupBranch


@dataclass
class BatchHints:
    """Host-side hints of a batch: tokens and kinds per request and depth 1..depth (kind 0: none)."""

    tokens: list[list[int]]
    kinds: list[list[int]]

    @classmethod
    def lookup(cls, contexts: Sequence[Optional[Sequence[int]]], depth: int, max_ngram: int) -> "BatchHints":
        """`lookup_hint` of each context (anchor last); None (ids not known): kind 0 throughout."""
        tokens, kinds = [], []
        for context in contexts:
            hint = lookup_hint(context, depth, max_ngram) if context is not None else ([0] * depth, [0] * depth)
            tokens.append(hint[0])
            kinds.append(hint[1])
        return cls(tokens, kinds)

    def chains(self) -> list[list[int]]:
        """Each request's lookup chain (`lookup_draft` of the same context and suffix length): its
        hint tokens where a match was found (every depth then has a kind), else []."""
        return [tokens if kinds[0] > 0 else [] for tokens, kinds in zip(self.tokens, self.kinds)]

    def tensors(self, device: torch.device | str) -> tuple[Tensor, Tensor]:
        """Tokens and kinds [b, depth] int64 on `device`, in one host-to-device copy."""
        both = torch.tensor([self.tokens, self.kinds], dtype=torch.int64).to(device)
        return both[0], both[1]


class RoundLookups:
    """Per decode round, from one pass over the committed ids: the free branch's chains (branch
    on) and the hints (hinted head)."""

    def __init__(self, branch: Optional[LookupBranch], depth: int, hint_ngram: int) -> None:
        """hint_ngram: the hinted head's `lookup_hint_ngram`, 0 for a head that reads no hints."""
        self.branch, self.depth, self.hint_ngram = branch, depth, hint_ngram

    @property
    def reads_ids(self) -> bool:
        """Whether a round reads the committed ids (the worker then keeps them up to date)."""
        return self.branch is not None or self.hint_ngram > 0

    def __call__(
        self, reqs: Sequence, seq_lens: Tensor, anchors: Tensor, committed: CommittedIds
    ) -> tuple[Optional[list[list[int]]], Optional[BatchHints]]:
        """(chains or None without the branch, hints or None for a plain head)."""
        if not self.reads_ids:
            return None, None
        contexts = committed.contexts(reqs, seq_lens, anchors)
        hints = BatchHints.lookup(contexts, self.depth, self.hint_ngram) if self.hint_ngram else None
        if self.branch is None:
            return None, hints
        if hints is not None and self.hint_ngram == self.branch.max_ngram and self.depth == self.branch.depths:
            return hints.chains(), hints
        return self.branch.chains_of(contexts), hints
