"""The free branch for the SGLang worker: each request's prompt-lookup continuation merged
into its draft tree (`jetflow_sglang.tree.merge_chain`, as in the reference engine).

The worker keeps each running request's committed token ids itself: under overlap
scheduling the scheduler appends a round's tokens to ``req.output_ids`` only after the
next round has been launched, and the last round's tokens are the suffix lookup matches.
Ids are seeded at the request's (last) extend chunk, extended with every accepted path,
and dropped when a decode batch no longer holds the request. A request whose ids are not
known (e.g. retracted and not yet re-extended) is drafted by the head alone that round.
On by default; ``JETFLOW_LOOKUP=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from jetflow_sglang.lookup import CHAIN_LOGPROB, lookup_draft
from jetflow_sglang.tree import DraftTree, merge_chain

LOOKUP_ENV = "JETFLOW_LOOKUP"


def lookup_enabled() -> bool:
    value = os.environ.get(LOOKUP_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{LOOKUP_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


class LookupBranch:
    def __init__(self, depths: int, chain_logprob: float = CHAIN_LOGPROB) -> None:
        self.depths, self.chain_logprob = depths, chain_logprob
        self.committed: dict[str, list[int]] = {}  # rid -> token ids that have target KV

    def on_extend(self, reqs: Sequence, seq_lens: Tensor) -> None:
        """After an extend: the first seq_len ids of each request's prompt (+ output, when a
        retracted request comes back) have KV now."""
        for req, seq_len in zip(reqs, seq_lens.tolist()):
            self.committed[req.rid] = list(req.full_untruncated_fill_ids[:seq_len])

    def merge(self, tree: DraftTree, reqs: Sequence, seq_lens: Tensor, anchors: Tensor) -> DraftTree:
        """Each request's tree with its lookup chain merged in (same budget)."""
        live = {req.rid for req in reqs}
        for rid in [rid for rid in self.committed if rid not in live]:
            del self.committed[rid]
        rows, changed = [], False
        for i, (req, seq_len, anchor) in enumerate(zip(reqs, seq_lens.tolist(), anchors.tolist())):
            row = _row(tree, i)
            ids = self.committed.get(req.rid)
            chain = lookup_draft(ids + [anchor], self.depths) if ids is not None and len(ids) == seq_len else []
            if chain:
                merged = merge_chain(row, torch.tensor(chain, device=tree.tokens.device), self.chain_logprob)
                changed = changed or merged is not row
                row = merged
            rows.append(row)
        if not changed:
            return tree
        return DraftTree(*(torch.cat([getattr(r, f) for r in rows]) for f in ("tokens", "parents", "depths", "scores", "ancestors")))

    def on_accept(self, reqs: Sequence, seq_lens: Tensor, anchors: Tensor, committed: Tensor, num_accepted: Tensor) -> None:
        """The anchor and the accepted drafts now have KV (the bonus token is the next anchor)."""
        rows = zip(reqs, seq_lens.tolist(), anchors.tolist(), committed.tolist(), num_accepted.tolist())
        for req, seq_len, anchor, tokens, accepted in rows:
            ids = self.committed.get(req.rid)
            if ids is not None and len(ids) == seq_len:
                ids.append(anchor)
                ids.extend(tokens[:accepted])
            else:
                self.committed.pop(req.rid, None)


def _row(tree: DraftTree, i: int) -> DraftTree:
    return DraftTree(tree.tokens[i : i + 1], tree.parents[i : i + 1], tree.depths[i : i + 1], tree.scores[i : i + 1], tree.ancestors[i : i + 1])
