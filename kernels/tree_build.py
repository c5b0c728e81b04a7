"""Batched best-first tree build from per-depth top-k lists; reference: `jetflow_sglang.tree.build_tree_from_topk`.

One program per request. Depth by depth it keeps the `keep = budget - 1` best children of
the previous depth's kept nodes (the reference's per-depth pruning), and merges them into
a running best-`keep` list over all depths, which at the end is the reference's global
best-first selection. Orders are sorts of int64 keys (score bits, then a position), so
ties break exactly as the reference's stable sorts do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from jetflow_sglang.tree import DraftTree, check_budget
from jetflow_sglang.tree import build_tree_from_topk as tree_from_topk

from ._dispatch import next_power_of_2, use_triton
from ._sort import topk_descending
from .tree_masks import ancestor_mask

EMPTY_KEY = tl.constexpr(-(2**63))  # below every real key


@triton.jit
def _order_key(score, position):
    """int64 key, larger first: score descending, then position ascending."""
    score = tl.where(score == 0.0, 0.0, score)  # torch's sort ties -0.0 with +0.0
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed int order
    return (ordered.to(tl.int64) << 32) + 4294967296 - 1 - position.to(tl.int64)


@triton.jit
def _decode_key(key):
    ordered = key >> 32
    position = (ordered << 32) - key + 4294967296 - 1
    ordered = ordered.to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), position.to(tl.int32)


@triton.jit
def _tree_build_kernel(
    anchor_ptr,
    topk_logprobs_ptr,
    topk_tokens_ptr,
    tokens_ptr,
    parents_ptr,
    depths_ptr,
    scores_ptr,
    level_scores_ptr,  # scratch [b, KEEP_BLOCK]: kept scores of the previous depth, sorted
    pool_tokens_ptr,  # scratch [b, pool_capacity]: every kept node, depth by depth, root first
    pool_parents_ptr,
    pool_depths_ptr,
    new_index_ptr,  # scratch [b, pool_capacity]: pool index -> tree index
    num_depths,
    width,
    keep,
    pool_capacity,
    KEEP_BLOCK: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    slot = tl.arange(0, KEEP_BLOCK)
    cand = tl.arange(0, CAND_BLOCK)
    lists = req * num_depths * width
    level_scores_ptr += req * KEEP_BLOCK
    pool = req * pool_capacity

    # Child (parent position p, rank r) has (p+1)(r+1) - 1 children at least as good ahead of
    # it (both lists sorted), so only (p+1)(r+1) <= keep can be kept: candidates are laid out
    # as one segment per rank, holding the parents that pass.
    cand_rank = tl.zeros([CAND_BLOCK], tl.int32)
    cand_parent = tl.zeros([CAND_BLOCK], tl.int32)
    seg_start = 0
    for rank in range(width):
        seg_len = keep // (rank + 1)
        in_seg = (cand >= seg_start) & (cand < seg_start + seg_len)
        cand_rank = tl.where(in_seg, rank, cand_rank)
        cand_parent = tl.where(in_seg, cand - seg_start, cand_parent)
        seg_start += seg_len
    in_layout = cand < seg_start

    tl.store(level_scores_ptr, 0.0)
    best = tl.full([KEEP_BLOCK], EMPTY_KEY, tl.int64)
    level_size = 1
    level_offset = 0
    pool_size = 1
    for depth in range(1, num_depths + 1):
        tl.debug_barrier()
        row = lists + (depth - 1) * width
        valid = in_layout & (cand_parent < level_size)
        parent_scores = tl.load(level_scores_ptr + cand_parent, mask=valid, other=0.0)
        logprobs = tl.load(topk_logprobs_ptr + row + cand_rank, mask=valid, other=0.0)
        # Position parent-major, rank-minor: the reference's order among equal scores.
        child_keys = _order_key(parent_scores + logprobs, cand_parent * width + cand_rank)
        top = topk_descending(tl.where(valid, child_keys, EMPTY_KEY), KEEP_BLOCK)
        new_size = tl.minimum(level_size * width, keep)
        kept = slot < new_size
        scores, child = _decode_key(top)
        tokens = tl.load(topk_tokens_ptr + row + child % width, mask=kept, other=0)
        tl.debug_barrier()
        tl.store(level_scores_ptr + slot, scores, mask=kept)
        tl.store(pool_tokens_ptr + pool + pool_size + slot, tokens, mask=kept)
        tl.store(pool_parents_ptr + pool + pool_size + slot, level_offset + child // width, mask=kept)
        tl.store(pool_depths_ptr + pool + pool_size + slot, depth, mask=kept)
        # Pool position orders equal scores by depth, then by rank within the depth.
        level_keys = tl.where(kept, _order_key(scores, pool_size + slot), EMPTY_KEY)
        best = topk_descending(tl.reshape(tl.join(best, level_keys), [2 * KEEP_BLOCK]), KEEP_BLOCK)
        level_offset = pool_size
        pool_size += new_size
        level_size = new_size

    chosen = slot < keep
    scores, pool_index = _decode_key(best)
    tl.store(new_index_ptr + pool + pool_index, slot + 1, mask=chosen)
    tl.store(new_index_ptr + pool, 0)
    tl.debug_barrier()
    out = req * (keep + 1)
    tl.store(tokens_ptr + out, tl.load(anchor_ptr + req))
    tl.store(parents_ptr + out, -1)
    tl.store(depths_ptr + out, 0)
    tl.store(scores_ptr + out, 0.0)
    old_parents = tl.load(pool_parents_ptr + pool + pool_index, mask=chosen, other=0)
    out_slot = out + 1 + slot
    tl.store(tokens_ptr + out_slot, tl.load(pool_tokens_ptr + pool + pool_index, mask=chosen), mask=chosen)
    tl.store(parents_ptr + out_slot, tl.load(new_index_ptr + pool + old_parents, mask=chosen), mask=chosen)
    tl.store(depths_ptr + out_slot, tl.load(pool_depths_ptr + pool + pool_index, mask=chosen), mask=chosen)
    tl.store(scores_ptr + out_slot, scores, mask=chosen)


def _check_shapes(topk_logprobs: Tensor, topk_tokens: Tensor, budget: int) -> None:
    if topk_logprobs.dim() != 3 or topk_tokens.shape != topk_logprobs.shape:
        raise ValueError(
            f"expected top-k lists [b, D, k], got {tuple(topk_logprobs.shape)}, {tuple(topk_tokens.shape)}"
        )
    _, num_depths, width = topk_logprobs.shape
    check_budget(budget, num_depths, width)


def build_tree_from_topk(anchor_tokens: Tensor, topk_logprobs: Tensor, topk_tokens: Tensor, budget: int) -> DraftTree:
    """Best-first tree of `budget` nodes from per-depth top-k lists.

    anchor_tokens: [b]. topk_logprobs, topk_tokens: [b, D, k], each depth sorted by log-prob
    descending (as `Tensor.topk` returns them). Triton on CUDA or under TRITON_INTERPRET=1.
    """
    _check_shapes(topk_logprobs, topk_tokens, budget)
    if use_triton(topk_logprobs):
        return build_tree_triton(anchor_tokens, topk_logprobs, topk_tokens, budget)
    return build_tree_reference(anchor_tokens, topk_logprobs, topk_tokens, budget)


def build_tree_reference(anchor_tokens: Tensor, topk_logprobs: Tensor, topk_tokens: Tensor, budget: int) -> DraftTree:
    """The torch reference: `jetflow_sglang.tree.build_tree_from_topk`, shapes checked."""
    _check_shapes(topk_logprobs, topk_tokens, budget)
    return tree_from_topk(anchor_tokens, topk_logprobs, topk_tokens, budget)


def build_tree_triton(anchor_tokens: Tensor, topk_logprobs: Tensor, topk_tokens: Tensor, budget: int) -> DraftTree:
    _check_shapes(topk_logprobs, topk_tokens, budget)
    batch, num_depths, width = topk_logprobs.shape
    device = topk_logprobs.device
    keep = budget - 1
    keep_block = next_power_of_2(max(keep, 2))
    cand_block = max(next_power_of_2(sum(keep // (rank + 1) for rank in range(width))), keep_block)
    pool_capacity = 1 + num_depths * keep

    def empty(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    tokens, parents, depths = empty(batch, budget), empty(batch, budget), empty(batch, budget)
    scores = empty(batch, budget, dtype=torch.float32)
    _tree_build_kernel[(batch,)](
        anchor_tokens.to(device=device, dtype=torch.int64).contiguous(),
        topk_logprobs.float().contiguous(),
        topk_tokens.to(torch.int64).contiguous(),
        tokens,
        parents,
        depths,
        scores,
        empty(batch, keep_block, dtype=torch.float32),
        empty(batch, pool_capacity),
        empty(batch, pool_capacity, dtype=torch.int32),
        empty(batch, pool_capacity, dtype=torch.int32),
        empty(batch, pool_capacity, dtype=torch.int32),
        num_depths,
        width,
        keep,
        pool_capacity,
        KEEP_BLOCK=keep_block,
        CAND_BLOCK=cand_block,
        num_warps=8 if cand_block >= 2048 else 4,
    )
    return DraftTree(tokens, parents, depths, scores, ancestor_mask(parents))
