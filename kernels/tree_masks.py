"""Tree attention masks; references: `ancestor_mask`, `full_mask`, `packed_mask` and
`DraftTree.positions` in `jetflow_sglang.tree`.

Two kernels: the ancestor mask by pointer chasing (one program per request and tile), then
one pass over each request's flat [N, prefix_len + N] mask that writes the SGLang
FULL_MASK bytes and, from the same bits, FlashInfer's little-endian packed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from jetflow_sglang import tree as reference
from jetflow_sglang.tree import DraftTree

from ._dispatch import use_triton

ANCESTOR_TILE = 32
MASK_BLOCK = 4096  # mask bits per program; a multiple of 8 so bytes never straddle programs


@dataclass
class TreeMasks:
    ancestors: Tensor  # [b, N, N] bool, [b, i, j]: node j is node i or one of its ancestors
    positions: Tensor  # [b, N] int64, prefix_len + depth
    full_mask: Tensor  # flat bool, per request a row-major [N, prefix_len + N] block (SGLang FULL_MASK)
    packed_mask: Tensor | None  # uint8, each request's block bit-packed little-endian (FlashInfer)
    packed_indptr: Tensor | None  # [b + 1] int64, byte offsets of the requests in packed_mask


@triton.jit
def _ancestor_kernel(parents_ptr, ancestors_ptr, budget, TILE: tl.constexpr):
    req = tl.program_id(0)
    rows = tl.program_id(1) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(2) * TILE + tl.arange(0, TILE)
    parents_ptr += req * budget
    current = tl.where(rows < budget, rows, 0)
    is_ancestor = current[:, None] == cols[None, :]
    steps = 0
    # Parents precede children, so every chain reaches the root (0) within budget - 1 steps;
    # the step bound only guards against malformed input.
    while (tl.max(current) > 0) & (steps < budget):
        current = tl.maximum(tl.load(parents_ptr + current).to(tl.int32), 0)
        is_ancestor |= current[:, None] == cols[None, :]
        steps += 1
    inside = (rows[:, None] < budget) & (cols[None, :] < budget)
    offsets = req * budget * budget + rows[:, None] * budget + cols[None, :]
    tl.store(ancestors_ptr + offsets, is_ancestor.to(tl.uint8), mask=inside)


@triton.jit
def _mask_kernel(
    ancestors_ptr,
    depths_ptr,
    prefix_lens_ptr,
    mask_offsets_ptr,
    packed_offsets_ptr,
    positions_ptr,
    full_ptr,
    packed_ptr,
    budget,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    block = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    prefix = tl.load(prefix_lens_ptr + req).to(tl.int32)

    nodes = block * BLOCK + offs
    node_ok = nodes < budget
    depths = tl.load(depths_ptr + req * budget + nodes, mask=node_ok, other=0)
    tl.store(positions_ptr + req * budget + nodes, prefix + depths, mask=node_ok)

    width = prefix + budget
    bit_index = block * BLOCK + offs
    in_block = bit_index < budget * width
    row = bit_index // width
    col = bit_index % width - prefix
    in_tree = in_block & (col >= 0)
    tree_bit = tl.load(ancestors_ptr + req * budget * budget + row * budget + col, mask=in_tree, other=0)
    bits = (in_block & (col < 0)) | (tree_bit != 0)
    tl.store(full_ptr + tl.load(mask_offsets_ptr + req) + bit_index, bits.to(tl.uint8), mask=in_block)

    weights = 1 << tl.arange(0, 8)
    packed = tl.sum(tl.reshape(bits.to(tl.int32), [BLOCK // 8, 8]) * weights[None, :], axis=1)
    byte_index = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    byte_ok = byte_index < (budget * width + 7) // 8
    tl.store(packed_ptr + tl.load(packed_offsets_ptr + req) + byte_index, packed.to(tl.uint8), mask=byte_ok)


def ancestor_mask(parents: Tensor) -> Tensor:
    """[b, N, N] bool ancestor-or-self mask from parents [b, N] (-1 at the root, parent < child)."""
    if not use_triton(parents):
        return reference.ancestor_mask(parents, parents.shape[1] - 1)
    batch, budget = parents.shape
    ancestors = torch.empty(batch, budget, budget, dtype=torch.uint8, device=parents.device)
    tiles = triton.cdiv(budget, ANCESTOR_TILE)
    _ancestor_kernel[(batch, tiles, tiles)](parents.contiguous(), ancestors, budget, TILE=ANCESTOR_TILE)
    return ancestors.view(torch.bool)


def tree_masks(parents: Tensor, depths: Tensor, prefix_lens: Tensor, packed: bool = True,
               ancestors: Tensor | None = None) -> TreeMasks:  # fmt: skip
    """Masks and positions of a batch of trees over ragged prefixes. parents, depths: [b, N];
    prefix_lens: [b], tokens already in the target's KV cache before the tree. packed=False
    leaves the FlashInfer packed mask out (None); the kernel writes it from the same pass, the
    torch reference would spend as long again packing it. ancestors: the trees' ancestor masks
    where the caller has them (`DraftTree.ancestors`), which the reference then reuses."""
    if not use_triton(parents):
        return tree_masks_reference(parents, depths, prefix_lens, packed, ancestors)
    batch, budget = parents.shape
    device = parents.device
    prefix_lens = prefix_lens.to(device=device, dtype=torch.int64)
    bit_counts = budget * (prefix_lens + budget)
    mask_offsets = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    mask_offsets[1:] = bit_counts.cumsum(0)
    packed_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    packed_indptr[1:] = ((bit_counts + 7) // 8).cumsum(0)
    total_bits, total_bytes, max_bits = torch.stack(
        [mask_offsets[-1], packed_indptr[-1], bit_counts.max() if batch else mask_offsets[0]]
    ).tolist()

    ancestors = ancestor_mask(parents)
    positions = torch.empty(batch, budget, dtype=torch.int64, device=device)
    full = torch.empty(total_bits, dtype=torch.uint8, device=device)
    packed_bytes = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    if batch:
        _mask_kernel[(batch, triton.cdiv(max_bits, MASK_BLOCK))](
            ancestors,
            depths.contiguous(),
            prefix_lens,
            mask_offsets,
            packed_indptr,
            positions,
            full,
            packed_bytes,
            budget,
            BLOCK=MASK_BLOCK,
        )
    if not packed:
        return TreeMasks(ancestors, positions, full.view(torch.bool), None, None)
    return TreeMasks(ancestors, positions, full.view(torch.bool), packed_bytes, packed_indptr)


def tree_masks_reference(parents: Tensor, depths: Tensor, prefix_lens: Tensor, packed: bool = True,
                         ancestors: Tensor | None = None) -> TreeMasks:  # fmt: skip
    if ancestors is None:
        ancestors = reference.ancestor_mask(parents, int(depths.max()) if depths.numel() else 0)
    # full_mask and packed_mask read only the ancestors, the budget and the device.
    shape_only = DraftTree(tokens=parents, parents=parents, depths=depths, scores=depths.float(), ancestors=ancestors)
    prefix_lens = prefix_lens.to(device=parents.device, dtype=torch.int64)
    packed_bytes, indptr = reference.packed_mask(shape_only, prefix_lens) if packed else (None, None)
    return TreeMasks(
        ancestors, shape_only.positions(prefix_lens), reference.full_mask(shape_only, prefix_lens), packed_bytes, indptr
    )
