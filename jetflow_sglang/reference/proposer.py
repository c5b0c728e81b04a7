"""The proposer interface of the reference engine, and the JetFlow head behind it.

A proposer turns the committed context into per-depth draft logits for the
tokens after the anchor. The engine never learns what is behind it: the
trained head, a random head, or a test oracle.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from jetflow_sglang.head import Hints, JetFlowHead
from jetflow_sglang.tree import Candidates, DraftTree


class Proposer(Protocol):
    block_size: int
    hint_ngram: int  # > 0: propose reads lookup hints of suffixes up to this length (a hinted head)

    def reset(self, features: Tensor) -> None:
        """Start a request: target features [1, T, F] of the T prompt tokens (positions 0..T-1)."""

    def extend(self, features: Tensor) -> None:
        """Append target features [1, n, F] of n newly committed tokens (positions follow on)."""

    def propose(self, anchor: Tensor, position: int, hints: Hints | None = None) -> Tensor:
        """Draft logits [1, block_size - 1, V] for positions position+1.. after the anchor [1] at
        `position`; hints: lookup tokens and kinds [1, block_size - 1] (`lookup.lookup_hint`)."""

    def propose_topk(self, anchor: Tensor, position: int, width: int, hints: Hints | None = None) -> Candidates:
        """`propose` as its top-`width` lists [1, block_size - 1, k] (`tree.top_candidates`)."""


class HeadProposer:
    """Drafts with a JetFlow head; keeps the head's context K/V in preallocated buffers."""

    def __init__(self, head: JetFlowHead, capacity: int = 8192) -> None:
        self.head = head
        self.block_size = head.config.block_size
        self.hint_ngram = head.config.lookup_hint_ngram if head.config.reads_hints else 0
        self.capacity = capacity
        self.length = 0
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._last_projected: Tensor | None = None  # [1, H]: features of the last committed token, projected

    def reset(self, features: Tensor) -> None:
        self.length = 0
        self._keys, self._values = [], []
        self.extend(features)

    @torch.inference_mode()
    def extend(self, features: Tensor) -> None:
        n = features.shape[1]
        positions = torch.arange(self.length, self.length + n, device=features.device)[None]
        projected = self.head.project_features(features)
        new_kv = self.head.projected_kv(projected, positions)
        self._last_projected = projected[:, -1]
        if not self._keys:
            for k, v in new_kv:
                shape = (1, k.shape[1], max(self.capacity, n), k.shape[3])
                self._keys.append(k.new_empty(shape))
                self._values.append(v.new_empty(shape))
        if self.length + n > self._keys[0].shape[2]:
            grow = max(self.length + n, 2 * self._keys[0].shape[2])
            self._keys = [torch.cat([k, k.new_empty(*k.shape[:2], grow - k.shape[2], k.shape[3])], 2) for k in self._keys]
            self._values = [torch.cat([v, v.new_empty(*v.shape[:2], grow - v.shape[2], v.shape[3])], 2) for v in self._values]
        for (k, v), k_buf, v_buf in zip(new_kv, self._keys, self._values):
            k_buf[:, :, self.length : self.length + n] = k
            v_buf[:, :, self.length : self.length + n] = v
        self.length += n

    def _context(self) -> list[tuple[Tensor, Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self._keys, self._values)]

    def _draft_hidden(self, anchor: Tensor, position: int, hints: Hints | None) -> Tensor:
        positions = torch.tensor([position], device=anchor.device)
        return self.head.draft_hidden(anchor, positions, self._context(), anchor_context=self._last_projected, hints=hints)

    @torch.inference_mode()
    def propose(self, anchor: Tensor, position: int, hints: Hints | None = None) -> Tensor:
        return self.head.logits(self._draft_hidden(anchor, position, hints), hints)

    @torch.inference_mode()
    def propose_topk(self, anchor: Tensor, position: int, width: int, hints: Hints | None = None) -> Candidates:
        """The top-`width` lists over the draft vocabulary (`JetFlowHead.draft_candidates`): what the
        SGLang worker's proposer computes, so both engines build the same trees."""
        return self.head.draft_candidates(self._draft_hidden(anchor, position, hints), width, hints)

    @torch.inference_mode()
    def refresh(self, tree: DraftTree, position: int) -> Tensor:
        """Logits [1, N, V] of the token after each tree node, given the path to it (optional proposer method)."""
        return self.head.refresh(tree.tokens, tree.depths + position, tree.ancestors, self._context(),
                                 anchor_context=self._last_projected)  # fmt: skip
