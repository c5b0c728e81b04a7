"""CUDA graphs of the head's draft pass, one per batch-size bucket (the target's verify buckets).

The draft pass (``HeadProposer.draft``: embeddings, a few decoder layers whose attention is
``jetflow_kernels.paged_block_attention``, the lm_head) reads request lengths and KV slots on
the device and launches a fixed grid, so it is captured as it is. At replay the batch's
anchors, lengths and request rows are copied into static buffers padded to the next bucket
(padding rows: length 0, row 0, whose outputs are dropped).

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

DraftFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (anchors, seq_lens, req_pool_indices) -> logits [b, D, V]
MODES = ("eager", "padded", "graph")


class DraftGraphRunner:
    def __init__(self, draft: DraftFn, batch_sizes: Sequence[int], device: torch.device | str, mode: str) -> None:
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        if mode == "graph":
            self._capture()

    def _inputs(self, bs: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.anchors[:bs], self.seq_lens[:bs], self.req_pool_indices[:bs]

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
    def run(self, anchors: Tensor, seq_lens: Tensor, req_pool_indices: Tensor) -> Tensor:
        batch = anchors.shape[0]
        bs = self.bucket(batch)
        if bs is None:
            return self.draft(anchors, seq_lens, req_pool_indices)
        for static, value in zip(self._inputs(bs), (anchors, seq_lens, req_pool_indices)):
            static[:batch].copy_(value)
            static[batch:].zero_()
        if self.mode == "graph":
            self.graphs[bs].replay()
            return self.outputs[bs][:batch]
        return self.draft(*self._inputs(bs))[:batch]
