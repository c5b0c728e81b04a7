"""The training objective: the target's top-k soft labels and the true tokens of every
draft slot, the draft vocabulary, and the losses over the draft lm_head (the forward KL
with its gradient written analytically over row chunks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow_sglang.head import JetFlowHead

LOSSES = ("fkl", "rkl", "sft")
LOSS_CHUNK_ROWS = 4096  # draft-lm_head rows per chunk of the loss


def soft_label_loss(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, labels: Tensor, loss: str,
                    row_weights: Tensor | None = None) -> Tensor:  # fmt: skip
    """Summed loss over slots (each times its row weight, if given). draft_logits: [n, K] over the draft vocabulary; topk_ids: [n, k]
    the target's top-k tokens as draft-vocabulary ids (-1: outside it); topk_logprobs: [n, k]
    their target log-probs; labels: [n] the true next token as a draft id (-1: outside it or
    ignored). Rows with topk_ids all -2 are ignored (no target distribution there).

    fkl is KL(p || q) and rkl KL(q || p) over k+1 buckets: the target's top-k tokens that
    the draft vocabulary holds, and the tail (every other token); sft is cross-entropy on
    the label."""
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    log_q = F.log_softmax(draft_logits.to(dtype), -1)
    if row_weights is None:
        row_weights = torch.ones(len(draft_logits), dtype=dtype, device=draft_logits.device)
    if loss == "sft":
        valid = labels >= 0
        return -(log_q.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * valid * row_weights).sum()
    valid = (topk_ids > -2).any(-1)
    in_draft = (topk_ids >= 0).to(dtype)
    log_p = topk_logprobs.to(dtype)
    log_q_top = log_q.gather(-1, topk_ids.clamp(min=0))
    p_top, q_top = log_p.exp() * in_draft, log_q_top.exp() * in_draft
    p_tail = (1 - p_top.sum(-1)).clamp(min=1e-6)
    q_tail = (1 - q_top.sum(-1)).clamp(min=1e-6)
    if loss == "fkl":
        per_slot = (p_top * (log_p - log_q_top)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    else:
        per_slot = (q_top * (log_q_top - log_p)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    return (per_slot * valid * row_weights).sum()


def _response_counts(store, vocab_size: int) -> Tensor:
    is_response = torch.zeros(store.num_tokens, dtype=torch.bool)
    for index in range(len(store)):
        rows = store.sequence(index)
        is_response[rows.start + int(store.prompt_lens[index]) : rows.stop] = True
    return torch.bincount(store.input_ids[is_response], minlength=vocab_size).double()


def vocab_coverage(store, ids: Tensor, vocab_size: int) -> float:
    """Share of the store's response tokens whose id is among `ids` (a draft vocabulary)."""
    counts = _response_counts(store, vocab_size)
    return float(counts[ids.long()].sum() / counts.sum()) if counts.sum() > 0 else 0.0


def most_frequent_tokens(store, size: int, vocab_size: int) -> tuple[Tensor, float]:
    """The `size` most frequent response tokens of the store (ties: prompt counts, then id), sorted
    by id, and the share of response tokens they cover."""
    counts = _response_counts(store, vocab_size)
    tie_break = 1e-9 * torch.bincount(store.input_ids, minlength=vocab_size).double()
    order = torch.sort(counts + tie_break, descending=True, stable=True).indices[:size]
    coverage = float(counts[order].sum() / counts.sum()) if counts.sum() > 0 else 0.0
    return order.sort().values, coverage


def slot_targets(store, seq_index: Tensor, label_positions: Tensor, to_draft: Tensor, reveal: Tensor):
    """Soft and hard labels of every slot [nb, B-1]: the target's top-k at position a+d-1
    (as draft ids) and the token at a+d. Revealed slots and slots past the end get none."""
    block = label_positions.shape[1] + 1
    invalid = (label_positions < 0) | (torch.arange(1, block)[None, :] <= reveal[:, None])
    token_rows = store.offsets[seq_index][:, None] + label_positions.clamp(min=1)
    topk_ids = to_draft[store.topk_ids[token_rows - 1]]
    topk_ids = topk_ids.masked_fill(invalid[..., None], -2)
    labels = to_draft[store.input_ids[token_rows]].masked_fill(invalid, -1)
    return topk_ids, store.topk_logprobs[token_rows - 1], labels



def slot_tokens(store, seq_index: Tensor, label_positions: Tensor) -> Tensor:
    """The true token (target id) of every slot [nb, B-1]; -1 past the end."""
    rows = store.offsets[seq_index][:, None] + label_positions.clamp(min=0)
    return store.input_ids[rows].masked_fill(label_positions < 0, -1)


COPY_BLOCKS = 256  # blocks per step whose slots train the copy gate


def copy_gate_loss(head: JetFlowHead, hidden: Tensor, hints: tuple[Tensor, Tensor], labels: Tensor,
                   generator: torch.Generator, max_blocks: int = COPY_BLOCKS) -> Tensor:  # fmt: skip
    """Mean -log q_mix(true token) (`CopyGate.nll`) over the hinted, labelled slots of at most
    `max_blocks` blocks drawn at random; the head's log-probs are held fixed, so the gradient
    reaches the copy gate only. hidden [nb, D, H]; hints (tokens, kinds) and labels (target ids,
    -1: none) [nb, D]."""
    tokens, kinds = hints
    valid = (kinds > 0) & (labels >= 0)
    blocks = valid.any(1).nonzero().squeeze(1)
    if len(blocks) > max_blocks:
        blocks = blocks[torch.randperm(len(blocks), generator=generator)[:max_blocks].to(blocks.device)]
    if len(blocks) == 0:
        return hidden.new_zeros((), dtype=torch.float32)
    chosen = hidden.detach()[blocks]
    with torch.no_grad():
        log_q = head.draft_vocab_logits(chosen).float().log_softmax(-1)
    loss = head.copy_gate.nll(chosen, log_q, (tokens[blocks], kinds[blocks]), labels[blocks], head._to_draft)
    return loss.sum() / valid[blocks].sum()


def fkl_value_and_grad(logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """`soft_label_loss(..., "fkl")` per row [n] and its gradient with respect to the logits,
    written into `logits` (whose values are consumed). With S the target's top-k tokens in
    the draft vocabulary and t the tail bucket: dL/dz_j = q_j - p_j for j in S and
    q_j (1 - p_t / q_t) elsewhere, so no autograd graph over [n, K] is kept."""
    valid = (topk_ids > -2).any(-1)
    in_draft = (topk_ids >= 0).to(logits.dtype)
    ids = topk_ids.clamp(min=0)
    log_norm = torch.logsumexp(logits, -1, keepdim=True)
    log_q_top = logits.gather(-1, ids) - log_norm
    log_p = topk_logprobs.to(logits.dtype)
    p_top, q_top = log_p.exp() * in_draft, log_q_top.exp() * in_draft
    p_tail = (1 - p_top.sum(-1)).clamp(min=1e-6)
    q_tail = (1 - q_top.sum(-1)).clamp(min=1e-6)
    per_row = (p_top * (log_p - log_q_top)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    tail_ratio = p_tail / q_tail
    grad = logits.sub_(log_norm).exp_().mul_((1 - tail_ratio)[:, None])
    grad.scatter_add_(-1, ids, (q_top * tail_ratio[:, None] - p_top) * in_draft)
    return per_row * valid, grad.mul_(valid[:, None].to(grad.dtype))


def draw_slots(topk_ids: Tensor, labels: Tensor, weights: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Keep slot d of each block with probability weights[d-1] (<= 1) and drop the targets of
    the rest: the uniform mean over kept slots has the weighted loss's expected gradient, and
    the draft lm_head runs on the kept slots only (with decay 4 over 15 depths, ~27% of them)."""
    drawn = torch.rand(labels.shape, generator=generator) < weights[None, :]
    return topk_ids.masked_fill(~drawn[..., None], -2), labels.masked_fill(~drawn, -1)


def depth_weights(depths: int, decay: float) -> Tensor:
    """Loss weight per draft depth 1..depths: uniform (decay 0) or exp(-(d-1)/decay), which
    puts the gradient where a prefix-accepted draft earns most (DFlash's loss decay)."""
    if decay <= 0:
        return torch.ones(depths)
    return torch.exp(-torch.arange(depths, dtype=torch.float32) / decay)


def loss_and_backward(head: JetFlowHead, hidden: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, labels: Tensor,
                      loss: str, weights: Tensor | None = None) -> tuple[float, Tensor, float]:  # fmt: skip
    """Weighted mean loss over valid slots (`weights` [B-1] per depth; None: uniform), its
    gradient sent back through `hidden`, per-slot top-1 hits [nb, B-1] (draft argmax == the
    true token; False where a slot has no target) and the total weight of valid slots. The
    draft lm_head runs over chunks of the valid rows only, so the logits of all slots never
    exist at once; for fkl the logits' gradient is written analytically (`fkl_value_and_grad`)."""
    flat = hidden.detach().flatten(0, 1)
    ids, logprobs, flat_labels = topk_ids.flatten(0, 1), topk_logprobs.flatten(0, 1), labels.flatten()
    if weights is None:
        weights = torch.ones(labels.shape[1])
    row_weights = weights.to(flat.device, torch.float32)[None, :].expand(labels.shape[0], -1).flatten()
    valid = (ids > -2).any(-1) if loss != "sft" else flat_labels >= 0
    count = max(1e-6, float((row_weights * valid).sum()))
    lm_head = head._target_lm_head if head._draft_lm_head is None else head._draft_lm_head
    total, hits = 0.0, torch.zeros(len(flat_labels), dtype=torch.bool)
    grad_flat = torch.zeros_like(flat)
    kept = valid.nonzero().squeeze(1)  # slots without a target (past the end, revealed, not drawn) cost nothing
    for first in range(0, len(kept), LOSS_CHUNK_ROWS):
        rows = kept[first : first + LOSS_CHUNK_ROWS]
        chunk_labels = flat_labels[rows]
        if loss == "fkl":
            logits = head.draft_vocab_logits(flat[rows]).float()
            hits[rows.cpu()] = ((logits.argmax(-1) == chunk_labels) & (chunk_labels >= 0)).cpu()
            value, grad_logits = fkl_value_and_grad(logits, ids[rows], logprobs[rows])
            scale = row_weights[rows] / count
            value = (value * scale).sum()
            grad_flat[rows] = (grad_logits.mul_(scale[:, None]) @ lm_head.to(grad_logits.dtype)).to(flat.dtype)
        else:
            chunk = flat[rows].clone().requires_grad_()
            logits = head.draft_vocab_logits(chunk)
            hits[rows.cpu()] = ((logits.detach().argmax(-1) == chunk_labels) & (chunk_labels >= 0)).cpu()
            value = soft_label_loss(logits, ids[rows], logprobs[rows], chunk_labels, loss, row_weights[rows]) / count
            value.backward()
            grad_flat[rows] = chunk.grad
        total += value.detach().item()
    hidden.backward(grad_flat.view_as(hidden).to(hidden.dtype))
    return total, hits.view_as(labels), count
