"""Prompt lookup: a training-free drafter that copies what followed an earlier occurrence
of the context's last tokens (the baseline every trained head is measured against)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

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


HINT_NGRAM = 3  # the longest suffix a lookup hint matches (heads store theirs: `lookup_hint_ngram`)


def hint_kind_count(max_ngram: int = HINT_NGRAM) -> int:
    """Rows of a hinted head's kind embedding: 0 (no hint), then (match length n, copied or wrapped)."""
    return 1 + 2 * max_ngram


def hint_kind(ngram: int, wrapped: bool) -> int:
    """The kind of a hinted slot: 1 + 2 (n - 1) + wrapped (0 is reserved for "no hint")."""
    return 1 + 2 * (ngram - 1) + int(wrapped)


def lookup_match_length(context: Sequence[int], max_ngram: int = 3) -> tuple[int, int]:
    """(j, n): the end index j < len(context) - 1 of the latest earlier occurrence of the longest
    suffix of `context` (n = max_ngram tokens down to 1); (-1, 0) when even the last token never
    occurred before."""
    last = len(context) - 1
    for n in range(min(max_ngram, last), 0, -1):
        suffix = list(context[last - n + 1 :])
        for j in range(last - 1, n - 2, -1):
            if context[j] == suffix[-1] and list(context[j - n + 1 : j + 1]) == suffix:
                return j, n
    return -1, 0


def lookup_match(context: Sequence[int], max_ngram: int = 3) -> int:
    """End index j of the latest earlier occurrence of the longest suffix (`lookup_match_length`)."""
    return lookup_match_length(context, max_ngram)[0]


def lookup_draft(context: Sequence[int], depth: int, max_ngram: int = 3) -> list[int]:
    """Up to `depth` tokens after the context: what followed the latest earlier occurrence of its
    suffix, continued periodically past the context's end; [] when there is no occurrence."""
    tokens, kinds = lookup_hint(context, depth, max_ngram)
    return tokens if kinds and kinds[0] > 0 else []


def lookup_hint(context: Sequence[int], depth: int, max_ngram: int = HINT_NGRAM) -> tuple[list[int], list[int]]:
    """A hinted head's input for the `depth` slots after the context's last token (the anchor):
    the lookup chain (`lookup_draft`) and each slot's kind (`hint_kind`: match length, and
    whether the token is copied from the context, d <= period, or wrapped past its end).
    No match: tokens 0 and kinds 0 (plain MASK)."""
    j, n = lookup_match_length(context, max_ngram)
    if j < 0:
        return [0] * depth, [0] * depth
    period = len(context) - 1 - j
    tokens = [int(context[j + (d - 1) % period + 1]) for d in range(1, depth + 1)]
    return tokens, [hint_kind(n, d > period) for d in range(1, depth + 1)]


def lookup_hints_batched(input_ids: Tensor, rows: Tensor, anchors: Tensor, depth: int,
                         max_ngram: int = HINT_NGRAM) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`lookup_hint` for many anchors at once (training): the hint of anchor a of row r reads
    input_ids[r, :a + 1] only. input_ids [b, T]; rows, anchors [nb]. Returns tokens, kinds
    [nb, depth] (int64). Per n-gram length, positions with equal (row, n-gram ending there)
    are grouped and sorted by position, so each position's latest earlier match is its left
    neighbour: O(T log T) for all anchors together, on any device."""
    b, seq_len = input_ids.shape
    device = input_ids.device
    positions = torch.arange(seq_len, device=device)
    match = torch.full((b, seq_len), -1, dtype=torch.long, device=device)
    length = torch.zeros((b, seq_len), dtype=torch.long, device=device)
    for n in range(1, max_ngram + 1):  # longer matches overwrite shorter ones
        if seq_len < n:
            break
        ends = positions[n - 1 :]  # [T - n + 1]
        grams = torch.stack([input_ids[:, ends - k] for k in range(n)], -1)  # [b, T-n+1, n]
        keys = torch.cat([torch.arange(b, device=device)[:, None, None].expand(-1, len(ends), 1), grams], -1)
        _, group = torch.unique(keys.reshape(-1, n + 1), dim=0, return_inverse=True)
        order = torch.sort(group, stable=True).indices  # flat index = row * len(ends) + e: by row, then position
        same = group[order[1:]] == group[order[:-1]]
        previous = torch.full_like(group, -1)
        previous[order[1:]] = torch.where(same, order[:-1], torch.full_like(order[:-1], -1))
        found = previous >= 0
        prev_end = (previous % len(ends)) + n - 1  # the earlier occurrence's end position
        found = found.view(b, -1)
        prev_end = prev_end.view(b, -1)
        match[:, n - 1 :] = torch.where(found, prev_end, match[:, n - 1 :])
        length[:, n - 1 :] = torch.where(found, torch.full_like(prev_end, n), length[:, n - 1 :])
    j, n = match[rows, anchors], length[rows, anchors]  # [nb]
    found = j >= 0
    period = (anchors - j).clamp(min=1)
    d = torch.arange(1, depth + 1, device=device)
    source = j[:, None] + (d[None, :] - 1) % period[:, None] + 1
    tokens = input_ids[rows[:, None], source.clamp(0, seq_len - 1)]
    kinds = 1 + 2 * (n[:, None] - 1) + (d[None, :] > period[:, None]).long()
    return torch.where(found[:, None], tokens, 0), torch.where(found[:, None], kinds, 0)
