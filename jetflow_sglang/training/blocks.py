"""Every draft block of a batch of sequences in one head pass: what training and the held-out
metrics (`validate.py`) both run.

Block n of a batch starts at anchor a of its row: [x_a, MASK x (B-1)] (a revealed prefix holds
true tokens instead) attends to the context K/V of its row's positions < a, computed once per
sequence for all its blocks, then within the block causally or bidirectionally. A hinted head's
MASK slots read the lookup hints of their anchor, from the row's ids up to a only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.lookup import lookup_hints_batched


def sequence_attention(context: list[tuple[Tensor, Tensor]], rows: Tensor, anchors: Tensor, causal: bool):
    """Attention for blocks packed from several sequences (blocks sorted by row): block n
    reads the context K/V of its row (per layer [b, kv_heads, T, d]) at positions <
    anchors[n], then its own block under the causal or bidirectional mask. One joint
    softmax per sequence over (context, block) keys; no block-by-block copy of the context."""
    counts = torch.bincount(rows, minlength=context[0][0].shape[0]).tolist()
    seq_len = context[0][0].shape[2]
    block = None

    def attend(layer: int, q: Tensor, block_k: Tensor, block_v: Tensor) -> Tensor:
        nonlocal block
        context_k, context_v = context[layer]
        nb, heads, width, dim = q.shape
        kv_heads = block_k.shape[1]
        group = heads // kv_heads
        if block is None:
            block = torch.ones(width, width, dtype=torch.bool, device=q.device)
            block = block.tril() if causal else block
        block_rows = block.repeat(group, 1)  # rows ordered (g, slot)
        ones = context_v.new_ones(*context_v.shape[:3], 1)
        ones_block = block_v.new_ones(*block_v.shape[:3], 1)
        outs, first = [], 0
        for row, count in enumerate(counts):
            if count == 0:
                continue
            blocks = slice(first, first + count)
            first += count
            # kv-head-major layout, so the [kv, n*g*B, T] scores are made and consumed by plain
            # bmm (no permuted copies forward or backward); a ones column in V yields the softmax
            # normalizer from the same bmm. Softmax over (context, block) keys: shared max.
            rows_q = group * width
            q_row = (q[blocks] * dim**-0.5).reshape(count, kv_heads, rows_q, dim).transpose(0, 1)  # [kv, n, gB, d]
            q_flat = q_row.reshape(kv_heads, count * rows_q, dim)
            scores_context = torch.bmm(q_flat, context_k[row].transpose(1, 2)).view(kv_heads, count, rows_q, seq_len)
            hidden_context = torch.arange(seq_len, device=q.device)[None, :] >= anchors[blocks, None]  # [n, T]
            scores_context.masked_fill_(hidden_context[None, :, None, :], float("-inf"))
            keys_block = block_k[blocks].transpose(0, 1)  # [kv, n, B, d]
            scores_block = torch.matmul(q_row, keys_block.transpose(-1, -2)).masked_fill_(~block_rows, float("-inf"))
            top = torch.maximum(scores_context.amax(-1, keepdim=True), scores_block.amax(-1, keepdim=True)).detach()
            weights_context = scores_context.sub_(top).exp_().view(kv_heads, count * rows_q, seq_len)
            weights_block = scores_block.sub_(top).exp_()
            values_context = torch.cat([context_v[row], ones[row]], -1)  # [kv, T, d+1]
            values_block = torch.cat([block_v[blocks], ones_block[:count]], -1).transpose(0, 1)  # [kv, n, B, d+1]
            out = torch.bmm(weights_context, values_context).view(kv_heads, count, rows_q, dim + 1)
            out = out + torch.matmul(weights_block, values_block)
            out = out[..., :dim] / out[..., dim:]
            outs.append(out.view(kv_heads, count, group, width, dim).permute(1, 0, 2, 3, 4).reshape(count, heads, width, dim))
        return torch.cat(outs)

    return attend


def head_forward_sequences(head: JetFlowHead, features: Tensor, input_ids: Tensor, rows: Tensor, anchors: Tensor,
                           lengths: Tensor, reveal: Tensor, width: int = 0, hint_keep: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """All blocks of a batch in one pass. features: [b, T, F]; input_ids: [b, T]; rows,
    anchors, reveal: [nb] (sorted by row); width: block slots run (0: the block size; under
    the causal mask the first slots of a block do not depend on later ones, so a shorter
    width gives them exactly). A hinted head's MASK slots read the lookup hints of their
    anchor (`lookup_hints_batched`: from input_ids[row, :a+1] only, as the engines compute
    them), except in blocks whose hint_keep [nb] is False (hint dropout). Returns the final hidden states of slots 1..width-1
    [nb, width-1, H] and the sequence position each slot predicts (-1 past the end)."""
    if head.config.sliding_layers:
        raise JetFlowError("training heads with sliding-window layers is not supported (published heads only serve)")
    batch, seq_len, _ = features.shape
    block = width or head.config.block_size
    device = features.device
    offsets = torch.arange(block, device=device)
    positions = anchors[:, None] + offsets  # [nb, B]
    in_range = positions < lengths[rows][:, None]
    true_tokens = input_ids[rows[:, None], positions.clamp(max=seq_len - 1)]
    revealed = (offsets[None, :] <= reveal[:, None]) & in_range
    block_tokens = torch.where(revealed, true_tokens, torch.full_like(true_tokens, head.config.mask_token_id))
    block_tokens[:, 0] = true_tokens[:, 0]
    projected = head.project_features(features)
    context = head.projected_kv(projected, torch.arange(seq_len, device=device).expand(batch, -1))
    anchor_context = None
    if head.anchor_fuse is not None:  # index_select: its backward accumulates in a fixed order (a resume repeats exactly)
        anchor_context = projected.flatten(0, 1).index_select(0, rows * seq_len + anchors - 1)
    hints = None
    if head.config.lookup_hint:
        hint_tokens, kinds = lookup_hints_batched(input_ids, rows, anchors, block - 1, head.config.lookup_hint_ngram)
        keep = offsets[None, 1:] > reveal[:, None]  # a revealed slot holds its true token, no hint
        if hint_keep is not None:
            keep = keep & hint_keep[:, None]
        hints = head.block_hints((hint_tokens, kinds * keep))
    attention = sequence_attention(context, rows, anchors, head.config.causal)
    hidden = head.run_block(block_tokens, positions, attention, anchor_context, hints)
    label_positions = torch.where(in_range, positions, torch.full_like(positions, -1))[:, 1:]
    return hidden[:, 1:], label_positions


class BlockDrafter(torch.nn.Module):
    """`head_forward_sequences` as a module, so DistributedDataParallel can wrap it."""

    def __init__(self, head: JetFlowHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, *args) -> tuple[Tensor, Tensor]:
        return head_forward_sequences(self.head, *args)
