"""Prompt lookup: a training-free drafter that copies what followed an earlier occurrence
of the context's last tokens (the baseline every trained head is measured against)."""

from __future__ import annotations

import math
from collections.abc import Sequence

# P(a found chain's first d tokens are all right), d = 1..15, measured on target-written ShareGPT
# answers of the training split (`benchmarks/lookup_acceptance.py --first 128 --limit 128`):
# a run of matched tokens predicts more, so the chance to continue rises with depth. A merged
# chain node at depth d scores log CHAIN_ACCEPT[d-1] (both engines): it displaces the head's
# weakest leaves only where it is likelier.
CHAIN_ACCEPT = (0.530, 0.417, 0.354, 0.312, 0.278, 0.254, 0.234, 0.218, 0.205, 0.194, 0.186, 0.181, 0.175, 0.170, 0.167)
CHAIN_SCORES = tuple(math.log(p) for p in CHAIN_ACCEPT)


def geometric_scores(logprob: float, depths: int) -> tuple[float, ...]:
    """Chain scores d * logprob for d = 1..depths (each chain token as likely as the last)."""
    return tuple(d * logprob for d in range(1, depths + 1))


def lookup_match(context: Sequence[int], max_ngram: int = 3) -> int:
    """End index j < len(context) - 1 of the latest earlier occurrence of the longest suffix
    of `context` (max_ngram tokens down to 1); -1 when even the last token never occurred before."""
    last = len(context) - 1
    for n in range(min(max_ngram, last), 0, -1):
        suffix = list(context[last - n + 1 :])
        for j in range(last - 1, n - 2, -1):
            if context[j] == suffix[-1] and list(context[j - n + 1 : j + 1]) == suffix:
                return j
    return -1


def lookup_draft(context: Sequence[int], depth: int, max_ngram: int = 3) -> list[int]:
    """Up to `depth` tokens after the context: what followed the latest earlier occurrence of its
    suffix, continued periodically past the context's end; [] when there is no occurrence."""
    j = lookup_match(context, max_ngram)
    if j < 0:
        return []
    extended = list(context)
    for k in range(1, depth + 1):
        extended.append(extended[j + k])
    return extended[len(context) :]
