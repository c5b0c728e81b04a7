"""The free branch for the SGLang worker: each request's prompt-lookup continuation merged
into its draft tree (`jetflow_sglang.tree.merge_chain`, as in the reference engine).

The suffix it matches is the request's committed ids as the worker keeps them
(:class:`.committed_ids.CommittedIds`: under overlap scheduling ``req.output_ids`` lags a
round). A request whose ids are not known (e.g. retracted and not yet re-extended) is
drafted by the head alone that round. On by default; ``JETFLOW_LOOKUP=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from jetflow_sglang.lookup import CHAIN_SCORES, lookup_draft
from jetflow_sglang.tree import DraftTree, chain_tree, merge_chain

from .committed_ids import CommittedIds

LOOKUP_ENV = "JETFLOW_LOOKUP"
LOOKUP_MODES = ("0", "1", "only")


def lookup_mode() -> str:
    """`JETFLOW_LOOKUP`: 1 (default) merges each request's lookup chain into the head's tree, 0
    drafts with the head alone, `only` verifies the lookup chains alone and never runs the head
    (the training-free baseline, in the same server)."""
    value = os.environ.get(LOOKUP_ENV, "1")
    if value not in LOOKUP_MODES:
        raise ValueError(f"{LOOKUP_ENV} must be one of {', '.join(LOOKUP_MODES)}, got {value!r}")
    return value


def lookup_enabled() -> bool:
    return lookup_mode() != "0"


class LookupBranch:
    def __init__(self, depths: int, chain_scores: Sequence[float] = CHAIN_SCORES, max_ngram: int = 3) -> None:
        """max_ngram: the longest suffix a chain matches (`lookup.lookup_draft`)."""
        self.depths, self.chain_scores, self.max_ngram = depths, chain_scores, max_ngram

    def chains(self, reqs: Sequence, seq_lens: Tensor, anchors: Tensor, committed: CommittedIds) -> list[list[int]]:
        """Each request's prompt-lookup continuation after its anchor ([] when none or unknown)."""
        return self.chains_of(committed.contexts(reqs, seq_lens, anchors))

    def chains_of(self, contexts: Sequence[Optional[Sequence[int]]]) -> list[list[int]]:
        """The continuation after each context (`CommittedIds.contexts`; [] when none or None)."""
        return [lookup_draft(c, self.depths, self.max_ngram) if c is not None else [] for c in contexts]

    def merge(self, tree: DraftTree, chains: Sequence[Sequence[int]]) -> DraftTree:
        """Each request's tree with its lookup chain merged in (same budget)."""
        rows, changed = [], False
        for i, chain in enumerate(chains):
            row = _row(tree, i)
            if chain:
                merged = merge_chain(row, torch.tensor(chain, device=tree.tokens.device), self.chain_scores)
                changed = changed or merged is not row
                row = merged
            rows.append(row)
        if not changed:
            return tree
        return DraftTree(*(torch.cat([getattr(r, f) for r in rows]) for f in ("tokens", "parents", "depths", "scores", "ancestors")))

    def chain_tree(self, anchors: Tensor, chains: Sequence[Sequence[int]], cap: int) -> DraftTree:
        """A round without the head: the lookup chains alone (`tree.chain_tree`), at most `cap` nodes."""
        return chain_tree(anchors, chains, min(cap - 1, self.depths), self.chain_scores)


def _row(tree: DraftTree, i: int) -> DraftTree:
    return DraftTree(tree.tokens[i : i + 1], tree.parents[i : i + 1], tree.depths[i : i + 1], tree.scores[i : i + 1], tree.ancestors[i : i + 1])
