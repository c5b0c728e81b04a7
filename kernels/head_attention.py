"""The draft head's attention in SGLang: block queries over paged context K/V plus the block itself.

The head's context K/V live in per-layer ``[slots, kv_heads, head_dim]`` buffers indexed by the
target's KV slot ids, so a request's context is ``req_to_token[row, :seq_len]``, as for the
target's own paged attention (page size 1). Each block query sees the whole context and the
block keys the head allows (causal for JetFlow, all for a bidirectional DFlash-style head);
in a sliding-window layer only keys fewer than `window` positions back (context slot j is at
position j, block slot i at seq_len + i).

The kernel reads lengths and slots on the device (no host sync, fixed grid), so a draft pass
made of it can be captured in a CUDA graph. Reference: ``paged_block_attention_reference``,
a padded gather feeding the head's own dense attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from jetflow_sglang.head import dense_attention, window_mask

from ._dispatch import next_power_of_2, use_triton

BLOCK_N = 64  # context keys per step


@triton.jit
def _paged_block_attention_kernel(
    q_ptr,  # [b, H, B, D]
    block_k_ptr,  # [b, Hkv, B, D]
    block_v_ptr,
    key_cache_ptr,  # [slots, Hkv, D]
    value_cache_ptr,
    req_to_token_ptr,  # [rows, max_context]
    req_pool_indices_ptr,  # [b]
    seq_lens_ptr,  # [b]
    out_ptr,  # [b, H, B, D]
    block,
    heads,
    kv_heads,
    req_to_token_stride,
    scale,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,  # 0: no window
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), else "tf32" (unused by bf16)
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (heads // kv_heads)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < block

    q_base = ((req * heads + head) * block) * HEAD_DIM
    q = tl.load(q_ptr + q_base + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    table = req_to_token_ptr + tl.load(req_pool_indices_ptr + req).to(tl.int64) * req_to_token_stride
    # Row i sees context keys j > seq_len + i - window: start at the first one row 0 sees.
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW + 1, 0)
    for start in range(first, seq_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        slots = tl.load(table + cols, mask=col_ok, other=0).to(tl.int64)
        kv_offsets = (slots[:, None] * kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=col_ok[:, None], other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets, mask=col_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
        visible = col_ok[None, :]
        if WINDOW > 0:
            visible = visible & (cols[None, :] > seq_len + rows[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no key yet
        weights = tl.exp(scores - safe_max[:, None])
        rescale = tl.exp(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        row_max = new_max

    # The block's own keys: one tile (BLOCK_M >= block).
    block_base = ((req * kv_heads + kv_head) * block) * HEAD_DIM
    cols = tl.arange(0, BLOCK_M)
    col_ok = cols < block
    k = tl.load(block_k_ptr + block_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(block_v_ptr + block_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
    visible = col_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    if WINDOW > 0:
        visible = visible & (cols[None, :] > rows[:, None] - WINDOW)
    scores = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    new_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # padding rows see nothing
    weights = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(weights, 1)
    acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(out_ptr + q_base + rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_block_attention(
    q: Tensor,
    block_k: Tensor,
    block_v: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    causal: bool,
    window: int = 0,
    context: "PagedContext | None" = None,
) -> Tensor:
    """Attention of block queries q [b, H, B, D] over each request's context (slots
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` of key/value_cache [slots, Hkv, D]) and
    the block keys block_k/v [b, Hkv, B, D] (causal or all), only keys fewer than `window`
    positions back if window > 0. Returns [b, H, B, D]; softmax scale 1/sqrt(D). Triton on
    CUDA or under TRITON_INTERPRET=1, else the torch reference, over `context` when given
    (`paged_context`: the layers of one pass share it)."""
    if not use_triton(q):
        if context is not None:
            return context.attend(q, block_k, block_v, key_cache, value_cache, causal, window)
        return paged_block_attention_reference(
            q, block_k, block_v, key_cache, value_cache, req_to_token, req_pool_indices, seq_lens, causal, window
        )
    batch, heads, block, head_dim = q.shape
    kv_heads = block_k.shape[1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"paged_block_attention: head_dim must be a power of two >= 16, got {head_dim}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _paged_block_attention_kernel[(batch, heads)](
        q.contiguous(),
        block_k.contiguous(),
        block_v.contiguous(),
        key_cache,
        value_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out,
        block,
        heads,
        kv_heads,
        req_to_token.stride(0),
        head_dim**-0.5,
        CAUSAL=causal,
        WINDOW=window,
        BLOCK_M=max(16, next_power_of_2(block)),
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def paged_block_attention_reference(
    q: Tensor,
    block_k: Tensor,
    block_v: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    causal: bool,
    window: int = 0,
) -> Tensor:
    """The head's own dense attention (`jetflow_sglang.head.dense_attention`) over each request's
    context gathered from the cache, padded to the longest and masked."""
    context = PagedContext(req_to_token, req_pool_indices, seq_lens, q.shape[2])
    return context.attend(q, block_k, block_v, key_cache, value_cache, causal, window)


def paged_context(req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, block: int) -> "PagedContext | None":
    """What a pass's layers share for `paged_block_attention`: the reference's padded context
    (`PagedContext`), or None where the Triton kernel runs (it reads the slots itself)."""
    return None if use_triton(seq_lens) else PagedContext(req_to_token, req_pool_indices, seq_lens, block)


class PagedContext:
    """The reference's view of a batch's context: each request's slots
    (``req_to_token[row, :seq_len]``) padded to the longest, and the masks over them. Built once
    per draft pass, it serves every layer (one host read of the longest length, not one per layer)."""

    def __init__(self, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, block: int) -> None:
        batch, device = seq_lens.shape[0], seq_lens.device
        self.seq_lens, self.block = seq_lens.long(), block
        width = max(int(self.seq_lens.max()), 1) if batch else 1
        self.valid = torch.arange(width, device=device)[None, :] < self.seq_lens[:, None]  # [b, C]
        rows = req_to_token[req_pool_indices.long()][:, :width].long()
        self.slots = torch.where(self.valid, rows, torch.zeros_like(rows))
        self._masks: dict[tuple[bool, int], Tensor] = {}

    def mask(self, causal: bool, window: int = 0) -> Tensor:
        """[b, 1, B, C + B] bool over (context, block) keys."""
        key = (causal, window)
        if key not in self._masks:
            batch, block, device = self.valid.shape[0], self.block, self.valid.device
            within = torch.ones(block, block, dtype=torch.bool, device=device)
            if causal:
                within = within.tril()
            mask = torch.cat([self.valid[:, None, :].expand(-1, block, -1), within.expand(batch, -1, -1)], -1)
            if window:
                width = self.valid.shape[1]
                query_positions = self.seq_lens[:, None] + torch.arange(block, device=device)
                key_positions = torch.cat([torch.arange(width, device=device).expand(batch, -1), query_positions], 1)
                mask = window_mask(mask, query_positions, key_positions, window)
            self._masks[key] = mask[:, None]
        return self._masks[key]

    def attend(self, q: Tensor, block_k: Tensor, block_v: Tensor, key_cache: Tensor, value_cache: Tensor,
               causal: bool, window: int = 0) -> Tensor:  # fmt: skip
        """`paged_block_attention` over this context: [b, H, B, D]."""
        keys = key_cache[self.slots].permute(0, 2, 1, 3).to(q.dtype)
        values = value_cache[self.slots].permute(0, 2, 1, 3).to(q.dtype)
        return dense_attention([(keys, values)], self.mask(causal, window))(0, q, block_k, block_v)
