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
    min-p against the top probability). With top-k set only the k largest are sorted, as
    SGLang's own sampler does (``max_top_k``)."""
    probs = (logits.float() / temperature).softmax(-1)
    vocab = probs.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        if top_p >= 1.0:  # min-p alone: no sort needed
            return logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))
        top_k = vocab
    probs_sort, order = probs.topk(top_k, dim=-1, sorted=True)
    drop = (probs_sort.cumsum(-1) - probs_sort) > top_p
    if min_p > 0:
        drop = drop | (probs_sort < probs_sort[:, :1] * min_p)
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, ~drop)
    return logits.masked_fill(~kept, float("-inf"))
