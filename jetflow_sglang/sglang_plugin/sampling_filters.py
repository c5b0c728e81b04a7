"""SGLang's own top-k / top-p / min-p cut, for the requests where it differs from ours.

The acceptance kernels (`jetflow_kernels.accept_sampling`, like Hugging Face and vLLM) apply
top-p to the distribution renormalized after top-k, and know no min-p. SGLang's sampler
(`top_k_top_p_min_p_sampling_from_probs_torch`) cuts top-p on the cumulative mass of the full
distribution and drops tokens below ``min_p`` times the top probability. The two agree when
only one of top-k and top-p is set and min-p is off; for the other requests the worker cuts
each node's logits here, as SGLang would (-inf where SGLang zeroes the probability), and
hands them to the kernels with top-k and top-p off: the draw then follows SGLang's law.
"""

from __future__ import annotations

import torch
from torch import Tensor


def needs_sglang_cut(top_k: Tensor, top_p: Tensor, min_p: Tensor, vocab: int) -> Tensor:
    """[b] bool: the requests whose cut differs from the kernels' (both top-k and top-p, or min-p)."""
    return ((top_k > 0) & (top_k < vocab) & (top_p < 1.0)) | (min_p > 0)


def sglang_cut(logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> Tensor:
    """logits: [N, V] of one request -> the same with -inf where SGLang's sampler gives zero
    probability (its order: temperature, softmax, top-k, top-p on the full cumulative mass,
    min-p against the top probability)."""
    probs = (logits.float() / temperature).softmax(-1)
    probs_sort, order = probs.sort(dim=-1, descending=True)
    mass_through = probs_sort.cumsum(-1)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    drop = rank[None, :] >= top_k if top_k > 0 else torch.zeros_like(probs_sort, dtype=torch.bool)
    drop = drop | ((mass_through - probs_sort) > top_p)
    if min_p > 0:
        kept_sort = probs_sort.masked_fill(drop, 0.0)
        drop = drop | (kept_sort < (kept_sort[:, :1] * min_p))
    dropped = torch.empty_like(drop).scatter_(-1, order, drop)
    return logits.masked_fill(dropped, float("-inf"))
