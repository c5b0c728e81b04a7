"""Fused tree acceptance, greedy and sampling; reference: `jetflow_sglang.accept.accept_tree`
over the target's picks (given argmax tokens, or `sampling.target_picks_from_uniforms`).

One program per request walks the tree from the root: at each accepted node it takes the
target's pick there (loaded, or drawn from that node's logits by `sampling.pick_token`),
moves to the child holding it, and stops where there is none: that pick is the bonus.
Sampling therefore processes only the rows on the accepted path, not all N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from jetflow_sglang.accept import Acceptance, accept_tree
from jetflow_sglang.tree import DraftTree

from ._dispatch import next_power_of_2, use_triton
from .sampling import pick_token, target_picks_from_uniforms

MAX_VOCAB_CHUNK = 4096


@triton.jit
def _accept_kernel(
    tokens_ptr,
    parents_ptr,
    picks_ptr,  # [b, N] target tokens (greedy)
    logits_ptr,  # [b, N, V] target logits (sampling)
    uniforms_ptr,  # [b, N] (sampling)
    temperature_ptr,  # [b] (sampling), and top_k, top_p
    top_k_ptr,
    top_p_ptr,
    path_ptr,
    num_accepted_ptr,
    bonus_ptr,
    budget,
    vocab,
    path_len,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SAMPLING: tl.constexpr,
):
    req = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    inside = offs < budget
    row = req * budget
    tokens = tl.load(tokens_ptr + row + offs, mask=inside, other=-1)
    parents = tl.load(parents_ptr + row + offs, mask=inside, other=-2)
    if SAMPLING:
        temperature = tl.load(temperature_ptr + req)
        top_k = tl.load(top_k_ptr + req)
        top_p = tl.load(top_p_ptr + req)
    path_ptr += req * path_len

    node = 0
    depth = 0
    bonus = 0
    while node >= 0:
        tl.store(path_ptr + depth, node)
        if SAMPLING:
            logits_row = logits_ptr + (row + node).to(tl.int64) * vocab
            uniform = tl.load(uniforms_ptr + row + node)
            pick = pick_token(logits_row, vocab, uniform, temperature, top_k, top_p, BLOCK_V).to(tl.int32)
        else:
            pick = tl.load(picks_ptr + row + node).to(tl.int32)
        bonus = pick
        # Siblings hold distinct tokens, so at most one child matches.
        child = tl.min(tl.where((parents == node) & (tokens == pick), offs, BLOCK_N))
        go_on = (child < BLOCK_N) & (depth + 1 < path_len)
        node = tl.where(go_on, child, -1)
        depth += go_on.to(tl.int32)
    tl.store(num_accepted_ptr + req, depth)
    tl.store(bonus_ptr + req, bonus)


def _launch(
    tree: DraftTree,
    max_depth: int | None,
    picks: Tensor | None = None,
    sampling: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Acceptance:
    """Greedy with picks [b, N], or sampling with (logits, uniforms, temperature, top_k, top_p)."""
    batch, budget = tree.tokens.shape
    device = tree.tokens.device
    path_len = (budget - 1 if max_depth is None else max_depth) + 1
    path = torch.full((batch, path_len), -1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=torch.int64, device=device)
    placeholder = tree.tokens  # for the pointers the other mode never reads
    if sampling is None:
        picks, sampling_args, vocab = picks.contiguous(), (placeholder,) * 5, 1
    else:
        picks, sampling_args, vocab = placeholder, sampling, sampling[0].shape[-1]
    _accept_kernel[(batch,)](
        tree.tokens.contiguous(),
        tree.parents.contiguous(),
        picks,
        *sampling_args,
        path,
        num_accepted,
        bonus,
        budget,
        vocab,
        path_len,
        BLOCK_N=next_power_of_2(budget),
        BLOCK_V=min(next_power_of_2(vocab), MAX_VOCAB_CHUNK),
        SAMPLING=sampling is not None,
    )
    return Acceptance(path=path, num_accepted=num_accepted, bonus=bonus)


def accept_greedy(tree: DraftTree, target_tokens: Tensor, max_depth: int | None = None) -> Acceptance:
    """Greedy acceptance; target_tokens: [b, N], the target's argmax at every node."""
    if not use_triton(tree.tokens):
        return accept_tree(tree, target_tokens, max_depth)
    return _launch(tree, max_depth, picks=target_tokens)


def _per_request(value: Tensor | float, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.as_tensor(value, dtype=dtype, device=device).expand(batch).contiguous()


def accept_sampling(
    tree: DraftTree,
    logits: Tensor,
    uniforms: Tensor,
    temperature: Tensor | float,
    top_k: Tensor | int = 0,
    top_p: Tensor | float = 1.0,
    max_depth: int | None = None,
) -> Acceptance:
    """Sampling acceptance: at each node on the path, the target's token is drawn from its
    processed distribution (argmax where temperature <= 0) by inverse CDF with that node's
    uniform. logits: [b, N, V]; uniforms: [b, N] in [0, 1); temperature, top_k (0 = off),
    top_p: scalars or [b]."""
    batch, device = logits.shape[0], logits.device
    temperature = _per_request(temperature, batch, torch.float32, device)
    top_k = _per_request(top_k, batch, torch.int64, device)
    top_p = _per_request(top_p, batch, torch.float32, device)
    if not use_triton(logits):
        return accept_sampling_reference(tree, logits, uniforms, temperature, top_k, top_p, max_depth)
    inputs = (logits.contiguous(), uniforms.float().contiguous(), temperature, top_k, top_p)
    return _launch(tree, max_depth, sampling=inputs)


def accept_sampling_reference(
    tree: DraftTree,
    logits: Tensor,
    uniforms: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    max_depth: int | None = None,
) -> Acceptance:
    """`accept_tree` over `target_picks_from_uniforms`; the per-request parameters are [b] tensors."""
    return accept_tree(tree, target_picks_from_uniforms(logits, uniforms, temperature, top_k, top_p), max_depth)
