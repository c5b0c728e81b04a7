"""The SGLang JETFLOW worker's proposer interface (`BatchProposer`): per-depth top-k draft lists
for a batch, and the JetFlow head behind it (`PagedHeadProposer`).

The worker never learns what is behind a proposer: the JetFlow head (keeping its
context K/V in buffers indexed by the target's KV slot ids, so radix-cache hits
reuse it), or, in tests, the oracle of :mod:`jetflow_sglang.testing.paged_oracle`. This is the
batch form of the reference engine's `Proposer` (:mod:`jetflow_sglang.reference.proposer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from jetflow_kernels import paged_block_attention, paged_context
from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.tree import Candidates

from .draft_graphs import DraftGraphRunner


@dataclass
class DraftRequest:
    """The batch as a proposer sees it; anchors sit at position seq_lens (not yet in the KV cache)."""

    anchors: Tensor  # [b] int64, last committed token
    seq_lens: Tensor  # [b] int64, committed tokens with target KV (and head context K/V)
    req_pool_indices: Tensor  # [b] rows of req_to_token
    prompts: Sequence[Sequence[int]]  # origin input ids per request
    rids: Sequence[str]
    round_index: int = 0  # the worker's decode round (rounds without a draft pass count too)
    # A hinted head's lookup hints per depth 1..B-1 (`hints.BatchHints`): [b, B-1] int64 on the
    # device, kind 0 where a request has none; None: no hints this round.
    hint_tokens: Optional[Tensor] = None
    hint_kinds: Optional[Tensor] = None


class BatchProposer(Protocol):
    block_size: int

    def write_context(self, features: Tensor, slots: Tensor, positions: Tensor) -> None:
        """Committed tokens' fused target features [n, F] at KV slots [n] and positions [n]."""

    def propose(self, request: DraftRequest) -> Candidates:
        """Per-depth top-k lists for positions seq_len + 1 ...: log-probs [b, block_size - 1, k]
        float32 and token ids [b, block_size - 1, k] (`tree.top_candidates`)."""


class PagedHeadProposer:
    """The JetFlow head; its context K/V live in [layers, slots, kv_heads, head_dim] buffers."""

    def __init__(self, head: JetFlowHead, req_to_token: Tensor, num_slots: int, device: torch.device | str,
                 width: int) -> None:  # fmt: skip
        """width: the tree's top-k per depth (`--speculative-eagle-topk`)."""
        config = head.config
        self.head, self.width = head, width
        self.block_size = config.block_size
        self.req_to_token = req_to_token
        dtype = head.fc.weight.dtype
        shape = (config.num_layers, num_slots, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # Heads with anchor fusion also read the projected features of the token before the
        # anchor: kept per KV slot too, so a radix-cache hit finds them.
        self.projected: Tensor | None = None
        if head.anchor_fuse is not None:
            self.projected = torch.zeros(num_slots, config.hidden_size, dtype=dtype, device=device)
        self.hint_depth = self.block_size - 1 if config.reads_hints else 0  # a hinted or copying head reads hints per depth
        self.runner = DraftGraphRunner(self.draft, (), device, "eager", self.hint_depth)

    @torch.inference_mode()
    def write_context(self, features: Tensor, slots: Tensor, positions: Tensor) -> None:
        if slots.numel() == 0:
            return
        projected = self.head.project_features(features[None])
        kv = self.head.projected_kv(projected, positions.long()[None])  # per layer [1, h, n, d]
        slots = slots.long()
        if self.projected is not None:
            self.projected[slots] = projected[0].to(self.projected.dtype)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer, slots] = k[0].transpose(0, 1).to(self.keys.dtype)
            self.values[layer, slots] = v[0].transpose(0, 1).to(self.values.dtype)

    def draft(
        self,
        anchors: Tensor,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        hint_tokens: Optional[Tensor] = None,
        hint_kinds: Optional[Tensor] = None,
    ) -> Candidates:
        """Top-`width` draft lists [b, B-1, k] (`JetFlowHead.draft_candidates`: no target-vocabulary
        logits); the head attends to its context K/V where the target's KV is
        (`req_to_token[row, :seq_len]`), through the paged kernel (no host sync: graph-capturable).
        hint_tokens, hint_kinds [b, B-1]: a hinted head's lookup hints (None, or a plain head: none)."""
        config = self.head.config
        context = paged_context(self.req_to_token, req_pool_indices, seq_lens, self.block_size)  # once per pass

        def attend(layer: int, q: Tensor, block_k: Tensor, block_v: Tensor) -> Tensor:
            return paged_block_attention(
                q, block_k, block_v, self.keys[layer], self.values[layer], self.req_to_token,
                req_pool_indices, seq_lens, config.layer_causal(layer), config.layer_window(layer), context,
            )  # fmt: skip

        anchor_context = None
        if self.projected is not None:
            last_slots = self.req_to_token[req_pool_indices, seq_lens - 1].long()
            anchor_context = self.projected[last_slots]
        hints = None
        if self.hint_depth and hint_tokens is not None and hint_kinds is not None:
            hints = (hint_tokens, hint_kinds)
        hidden = self.head.draft_hidden_with(anchors, seq_lens, attend, anchor_context, hints)
        return self.head.draft_candidates(hidden, self.width, hints)

    def use_graphs(self, batch_sizes: Sequence[int], mode: str) -> None:
        """Run the draft pass through `DraftGraphRunner` (mode "graph": CUDA graphs per batch size)."""
        self.runner = DraftGraphRunner(self.draft, batch_sizes, self.keys.device, mode, self.hint_depth)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Candidates:
        return self.runner.run(request.anchors.long(), request.seq_lens.long(), request.req_pool_indices.long(),
                               request.hint_tokens, request.hint_kinds)  # fmt: skip
