"""The target's token at a tree node from its logits and one pre-drawn uniform.

`pick_token` (Triton, device function) processes one logits row like
`jetflow_sglang.accept.processed_probs` (temperature, top-k, then top-p) without sorting
the vocabulary: the top-k and top-p cut-offs are thresholds found by binary search over
the float bit patterns, with passes over the row in chunks. It then draws by inverse CDF.
`target_picks_from_uniforms` is its torch reference: `processed_probs` plus the same
inverse-CDF draw, i.e. `target_picks` with the randomness supplied.

Cut-offs fall between distinct values: where logits tie exactly at the top-k or top-p
boundary, the kernel keeps every tied token, while the reference keeps those its sort put
first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from jetflow_sglang.accept import greedy_picks, processed_probs


@triton.jit
def _ordered(x):
    """float32 -> int64 key with the same order (the bit pattern, flipped for negatives)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _scaled(row_ptr, start, offs, vocab, temperature):
    index = start + offs
    inside = index < vocab
    logits = tl.load(row_ptr + index, mask=inside, other=0.0).to(tl.float32)
    return tl.math.div_rn(logits, temperature), index, inside


@triton.jit
def _count_at_least(row_ptr, offs, vocab, temperature, threshold, BLOCK_V: tl.constexpr):
    count = 0
    for start in range(0, vocab, BLOCK_V):
        x, _, inside = _scaled(row_ptr, start, offs, vocab, temperature)
        count += tl.sum((inside & (_ordered(x) >= threshold)).to(tl.int32))
    return count


@triton.jit
def _mass_above(row_ptr, offs, vocab, temperature, x_max, threshold, BLOCK_V: tl.constexpr):
    """Unnormalized mass exp(x - x_max) of the tokens whose key is above threshold."""
    mass = 0.0
    for start in range(0, vocab, BLOCK_V):
        x, _, inside = _scaled(row_ptr, start, offs, vocab, temperature)
        mass += tl.sum(tl.where(inside & (_ordered(x) > threshold), tl.exp(x - x_max), 0.0))
    return mass


@triton.jit
def pick_token(row_ptr, vocab, uniform, temperature, top_k, top_p, BLOCK_V: tl.constexpr):
    """Argmax (first) when temperature <= 0, else an inverse-CDF draw with `uniform` in [0, 1)."""
    offs = tl.arange(0, BLOCK_V)
    sampling = temperature > 0
    temperature = tl.where(sampling, temperature, 1.0)
    x_max = -float("inf")
    x_min = float("inf")
    argmax = 0
    for start in range(0, vocab, BLOCK_V):
        x, index, inside = _scaled(row_ptr, start, offs, vocab, temperature)
        chunk_max = tl.max(tl.where(inside, x, -float("inf")))
        chunk_arg = tl.min(tl.where(inside & (x == chunk_max), index, vocab))
        argmax = tl.where(chunk_max > x_max, chunk_arg, argmax)
        x_max = tl.maximum(x_max, chunk_max)
        x_min = tl.minimum(x_min, tl.min(tl.where(inside, x, float("inf"))))
    token = argmax
    if sampling:
        # Top-k: the largest key with at least top_k tokens at or above it.
        kth = _ordered(x_min)
        hi = _ordered(x_max)
        if (top_k > 0) & (top_k < vocab):
            while kth < hi:
                mid = kth + (hi - kth + 1) // 2
                enough = _count_at_least(row_ptr, offs, vocab, temperature, mid, BLOCK_V) >= top_k
                kth = tl.where(enough, mid, kth)
                hi = tl.where(enough, hi, mid - 1)

        # Top-p: a token is kept when the top-k mass strictly above it is below top_p; the
        # kept keys are those at or above the smallest key where that holds.
        threshold = kth
        if top_p < 1.0:
            topk_mass = _mass_above(row_ptr, offs, vocab, temperature, x_max, kth - 1, BLOCK_V)
            hi = _ordered(x_max)
            while threshold < hi:
                mid = threshold + (hi - threshold) // 2
                below = _mass_above(row_ptr, offs, vocab, temperature, x_max, mid, BLOCK_V) < top_p * topk_mass
                hi = tl.where(below, mid, hi)
                threshold = tl.where(below, threshold, mid + 1)

        # Inverse CDF: the first kept token whose running mass exceeds uniform * total.
        total = _mass_above(row_ptr, offs, vocab, temperature, x_max, threshold - 1, BLOCK_V)
        target = uniform * total
        running = 0.0
        drawn = vocab
        last_kept = 0
        for start in range(0, vocab, BLOCK_V):
            x, index, inside = _scaled(row_ptr, start, offs, vocab, temperature)
            weights = tl.where(inside & (_ordered(x) >= threshold), tl.exp(x - x_max), 0.0)
            crossed = ((running + tl.cumsum(weights, 0)) > target) & (weights > 0)
            drawn = tl.minimum(drawn, tl.min(tl.where(crossed, index, vocab)))
            last_kept = tl.maximum(last_kept, tl.max(tl.where(weights > 0, index, 0)))
            running += tl.sum(weights)
        token = tl.where(drawn < vocab, drawn, last_kept)  # rounding left u * total unreached
    return token


def sample_inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One draw per row of probs [..., V] from uniforms [...] in [0, 1): the first token with
    mass whose running mass exceeds u * total (the last token with mass if rounding leaves none)."""
    cdf = probs.cumsum(-1)
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    has_mass = probs > 0
    crossed = (cdf > uniforms[..., None] * cdf[..., -1:]) & has_mass
    drawn = torch.where(crossed, vocab, probs.shape[-1]).amin(-1)
    last_kept = torch.where(has_mass, vocab, 0).amax(-1)
    return torch.where(drawn < probs.shape[-1], drawn, last_kept)


def target_picks_from_uniforms(
    logits: Tensor, uniforms: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor
) -> Tensor:
    """`target_picks` with its randomness supplied: the token at every node, argmax where the
    temperature is <= 0, else the inverse-CDF draw from `processed_probs`.

    logits: [b, N, V]; uniforms: [b, N]; temperature, top_k, top_p: [b] (per request).
    """
    greedy = (temperature <= 0)[:, None]
    safe_temperature = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    probs = processed_probs(logits, safe_temperature[:, None], top_k[:, None], top_p[:, None])
    return torch.where(greedy, greedy_picks(logits), sample_inverse_cdf(probs, uniforms))
