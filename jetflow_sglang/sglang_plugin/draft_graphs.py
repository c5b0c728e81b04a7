"""CUDA graphs of the head's draft pass, one per batch-size bucket (the target's verify buckets).

The draft pass (``PagedHeadProposer.draft``: embeddings, a few decoder layers whose attention is
``jetflow_kernels.paged_block_attention``, the lm_head) reads request lengths and KV slots on
the device and launches a fixed grid, so it is captured as it is. At replay the batch's
anchors, lengths and request rows are copied into static buffers padded to the next bucket
(padding rows: length 0, row 0, whose outputs are dropped). A hinted head's draft pass also reads
lookup hint tokens and kinds [b, depth] (``hint_depth`` > 0): two more static buffers, kind 0 (no
hint) in padding rows and for a batch given no hints; the pass is branch-free in their values.

Modes: ``eager`` calls the draft pass directly (CPU, or graphs disabled); ``padded`` runs the
replay bookkeeping without capture (so the padding and slicing are tested on CPU); ``graph``
captures with ``torch.cuda.graph``.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# (anchors, seq_lens, req_pool_indices[, hint_tokens, hint_kinds]) -> top-k log-probs and tokens [b, D, k]
DraftFn = Callable[..., tuple[Tensor, Tensor]]
MODES = ("eager", "padded", "graph")


class DraftGraphRunner:
    def __init__(
        self, draft: DraftFn, batch_sizes: Sequence[int], device: torch.device | str, mode: str, hint_depth: int = 0
    ) -> None:
        """hint_depth: depths a hinted head reads hints for (its block size - 1); 0: no hints, and
        `draft` takes the first three inputs only."""
        if mode not in MODES:
            raise ValueError(f"draft graph mode must be one of {MODES}, got {mode!r}")
        if mode == "graph" and torch.device(device).type != "cuda":
            raise ValueError("draft CUDA graphs need a CUDA device")
        self.draft, self.mode = draft, mode
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes)) if mode != "eager" else []
        if mode != "eager" and not self.batch_sizes:
            raise ValueError("draft graphs need at least one batch size")
        max_bs = self.batch_sizes[-1] if self.batch_sizes else 0
        self.anchors = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.hint_depth = hint_depth
        self.hint_tokens = torch.zeros(max_bs, hint_depth, dtype=torch.int64, device=device) if hint_depth else None
        self.hint_kinds = torch.zeros(max_bs, hint_depth, dtype=torch.int64, device=device) if hint_depth else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture()

    def _inputs(self, bs: int) -> tuple[Tensor, ...]:
        inputs = (self.anchors[:bs], self.seq_lens[:bs], self.req_pool_indices[:bs])
        if self.hint_tokens is None or self.hint_kinds is None:
            return inputs
        return (*inputs, self.hint_tokens[:bs], self.hint_kinds[:bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory
                for _ in range(2):  # compile the kernels and settle allocations before capture
                    self.draft(*self._inputs(bs))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self.draft(*self._inputs(bs))
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("JETFLOW: captured the draft pass for batch sizes %s", self.batch_sizes)

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size that holds `batch`, or None (run eagerly)."""
        index = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None

    @torch.inference_mode()
    def run(
        self,
        anchors: Tensor,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        hint_tokens: Tensor | None = None,
        hint_kinds: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Top-k draft log-probs and tokens [b, D, k]; hint_tokens, hint_kinds [b, hint_depth] (None: no hints; a runner
        without hint buffers ignores them)."""
        batch = anchors.shape[0]
        values: tuple[Tensor | None, ...] = (anchors, seq_lens, req_pool_indices)
        if self.hint_depth:
            values = (*values, hint_tokens, hint_kinds)
        bs = self.bucket(batch)
        if bs is None:
            return self.draft(*values)
        for static, value in zip(self._inputs(bs), values):
            if value is None:  # no hints: kind 0 everywhere
                static.zero_()
                continue
            static[:batch].copy_(value)
            static[batch:].zero_()
        if self.mode == "graph":
            self.graphs[bs].replay()
            logprobs, tokens = self.outputs[bs]
        else:
            logprobs, tokens = self.draft(*self._inputs(bs))
        return logprobs[:batch], tokens[:batch]
