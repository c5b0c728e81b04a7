"""Lossless acceptance of a verified draft tree.

Both modes are one tree walk: at each accepted node the target picks a token
(its argmax when greedy, a draw from its processed distribution when
sampling); the walk moves to the child holding that token, and stops at the
first node that has no such child, where the picked token is the bonus. Every
committed token is therefore exactly what the target alone would have chosen
at that context, so the output is identical (greedy) or identically
distributed (sampling) to decoding with the target alone. A draw is made at
every node up front so the walk is vectorized; only the draws along the path
are used and they are independent, which keeps the sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from jetflow_sglang.tree import DraftTree


@dataclass
class Acceptance:
    path: Tensor  # [b, max_depth + 1] node indices from the root, -1 padded
    num_accepted: Tensor  # [b] accepted draft tokens (path length - 1)
    bonus: Tensor  # [b] the target's token after the last accepted node

    def committed_tokens(self, tree: DraftTree) -> Tensor:
        """[b, max_depth + 1]: accepted drafts then the bonus, -1 padded; num_accepted + 1 valid."""
        drafts = tree.tokens.gather(1, self.path.clamp(min=0))[:, 1:]
        committed = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], 1)
        committed.scatter_(1, self.num_accepted[:, None], self.bonus[:, None])
        valid = torch.arange(committed.shape[1], device=committed.device)[None, :] <= self.num_accepted[:, None]
        return torch.where(valid, committed, torch.full_like(committed, -1))


def accept_tree(tree: DraftTree, target_tokens: Tensor, max_depth: int | None = None) -> Acceptance:
    """Walk the tree following the target's pick at each node. target_tokens: [b, N]."""
    batch, budget = tree.tokens.shape
    if max_depth is None:
        max_depth = budget - 1
    picked_at_parent = target_tokens.gather(1, tree.parents.clamp(min=0))
    matches = tree.tokens == picked_at_parent
    matches[:, 0] = True
    # Node i is on the accepted path iff it and all its ancestors match. Siblings hold
    # distinct tokens, so the accepted nodes form one path from the root.
    accepted = ~(tree.ancestors & ~matches[:, None, :]).any(-1)
    last = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1)).argmax(1)
    num_accepted = tree.depths.gather(1, last[:, None])[:, 0]
    on_path = tree.ancestors[torch.arange(batch, device=last.device), last]  # [b, N]
    slot = torch.where(on_path, tree.depths, torch.full_like(tree.depths, max_depth + 1))
    path = torch.full((batch, max_depth + 2), -1, dtype=torch.long, device=last.device)
    path.scatter_(1, slot, torch.arange(budget, device=last.device).expand(batch, -1))
    return Acceptance(path=path[:, :-1], num_accepted=num_accepted, bonus=target_tokens.gather(1, last[:, None])[:, 0])


def processed_probs(logits: Tensor, temperature: Tensor | float, top_k: Tensor | int = 0, top_p: Tensor | float = 1.0) -> Tensor:
    """Target distribution after temperature, top-k (0 = off) and top-p, fp32. logits: [..., V];
    the parameters are scalars or tensors broadcastable to logits.shape[:-1]."""
    logits = logits.float()
    shape = logits.shape[:-1]
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(shape)
    top_k = torch.as_tensor(top_k, dtype=torch.long, device=logits.device).expand(shape)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(shape)
    logits = logits / temperature[..., None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    drop = (top_k[..., None] > 0) & (rank >= top_k[..., None])
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # Keep the smallest prefix reaching top_p (always rank 0). top_p = 1 keeps everything: the
    # fp32 running sum can reach 1.0 before the tail and would otherwise cut it.
    drop |= (mass_before >= top_p[..., None]) & (top_p[..., None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits).softmax(-1)


def greedy_picks(logits: Tensor) -> Tensor:
    """The first maximal index of each row, as `argmax` (ties and NaN alike): `max`'s indices,
    which on CPU cost a fifth of `argmax`'s over a verify's [b * N, V] logits."""
    return logits.max(-1).indices


def target_picks(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The target's token at every node: argmax when temperature is 0, else one draw. logits: [b, N, V]."""
    if temperature <= 0:
        return greedy_picks(logits)
    probs = processed_probs(logits, temperature, top_k, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
