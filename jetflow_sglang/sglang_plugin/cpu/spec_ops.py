"""Torch versions of SGLang's speculative cache-location kernels, for the CPU platform.

SGLang 0.5.23 runs these as Triton kernels on GPUs and as ``sgl_kernel`` CPU ops
under its own CPU engine; an out-of-tree CPU platform gets neither:

* ``assign_extend_cache_locs``: ``out[off_i + j] = req_to_token[row_i, start_i + j]``
  for ``j < end_i - start_i`` (verify-window slots, read side).  Served through
  the platform seam ``SRTPlatform.get_speculative_cache_locs_fn``
  (``kernels/ops/speculative/cache_locs.py:assign_extend_cache_locs_func``).
* ``assign_req_to_token_pool``: the inverse write, used by
  ``mem_cache/allocation.py:alloc_for_spec_decode`` (every speculative decode
  step's over-allocation).  No platform seam: :mod:`.seams` wraps
  ``assign_req_to_token_pool_func``.

``off_i`` is the sum of the earlier rows' ``end - start`` (rows packed front to
back), exactly as in the Triton kernels.
"""

from __future__ import annotations

import torch


def _ragged(start: torch.Tensor, end: torch.Tensor, rows: torch.Tensor):
    lens = (end.to(torch.int64) - start.to(torch.int64)).clamp_min(0)
    total = int(lens.sum())
    dev = rows.device
    row_ids = rows.to(torch.int64).repeat_interleave(lens)
    first = torch.cumsum(lens, 0) - lens
    within = torch.arange(total, device=dev) - first.repeat_interleave(lens)
    cols = start.to(torch.int64).repeat_interleave(lens) + within
    return row_ids, cols, total


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device,
) -> torch.Tensor:
    """Signature of ``get_speculative_cache_locs_fn()``'s return value (keywords)."""
    out = torch.zeros((batch_size * draft_token_num,), dtype=torch.int64, device=device)
    rows, cols, total = _ragged(start_offset, end_offset, req_pool_indices)
    if total:
        out[:total] = req_to_token[rows, cols].to(torch.int64)
    return out


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Same arguments as ``mem_cache.allocation.assign_req_to_token_pool_func``."""
    rows, cols, total = _ragged(start_offset, end_offset, req_pool_indices)
    if total:
        req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)
