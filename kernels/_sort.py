"""Bitonic top-k (descending) of a power-of-two block, built from min/max reductions.

Same network as `tl.topk`, whose compare-and-swap uses an xor reduction that the Triton
interpreter runs element by element in Python (minutes per tree at N=512); min/max run
as numpy reductions there and compile to the same kind of code on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _compare_swap(x, BIT: tl.constexpr, DIR_BIT: tl.constexpr):
    """Order each pair of elements whose flat indices differ only in bit BIT: descending where
    bit DIR_BIT (> BIT) of the index is 0, ascending where it is 1."""
    N: tl.constexpr = x.numel
    INNER: tl.constexpr = 1 << BIT
    OUTER: tl.constexpr = N // (2 * INNER)
    pairs = tl.reshape(x, [OUTER, 2, INNER])
    high = tl.max(pairs, axis=1)[:, None, :]
    low = tl.min(pairs, axis=1)[:, None, :]
    is_left = (tl.arange(0, 2) == 0)[None, :, None]
    if OUTER == 1:  # DIR_BIT is beyond the index: descending
        return tl.reshape(tl.where(is_left, high, low), [N])
    descending = (((tl.arange(0, OUTER) >> (DIR_BIT - BIT - 1)) & 1) == 0)[:, None, None]
    return tl.reshape(tl.where(is_left == descending, high, low), [N])


@triton.jit
def topk_descending(x, K: tl.constexpr):
    """The K largest elements of the 1-D block x, largest first. K and x.numel powers of two, K >= 2."""
    LOG_K: tl.constexpr = _log2(K)
    LOG_N: tl.constexpr = _log2(x.numel)
    # Sort runs of K elements, alternating direction (all descending when K == N).
    for stage in tl.static_range(1, LOG_K + 1):
        for step in tl.static_range(stage):
            x = _compare_swap(x, stage - 1 - step, stage)
    # Halve: the pairwise max of an ascending and a descending run holds the top K of both as
    # a bitonic sequence, which one merge sorts (alternating again, all descending at the end).
    for level in tl.static_range(LOG_K + 1, LOG_N + 1):
        x = tl.reshape(tl.max(tl.reshape(x, [x.numel // (2 * K), 2, K]), axis=1), [x.numel // 2])
        for step in tl.static_range(LOG_K):
            x = _compare_swap(x, LOG_K - 1 - step, LOG_K)
    return x
