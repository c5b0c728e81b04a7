"""Reference engine on HF transformers: speculative generation with a draft tree, batch size 1.

Per round: one draft pass (the proposer) -> best-first tree (optionally with the prompt-lookup
continuation merged in as a free branch, and optionally re-expanded after a
path-conditioned refresh pass) -> one target forward over the tree
with the ancestor mask at positions prefix+depth -> acceptance -> keep the accepted
path's target KV (cache compacted to it) and hand its features to the proposer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from jetflow_sglang.accept import Acceptance, accept_tree, target_picks
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.lookup import CHAIN_SCORES, lookup_draft, lookup_hint
from jetflow_sglang.reference.proposer import Proposer
from jetflow_sglang.reference.target import Target, compact_cache
from jetflow_sglang.tree import (DraftTree, budget_error, build_tree_from_topk, chain_tree, merge_chain,
                                 refreshed_tree, top_candidates)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def generator(self) -> torch.Generator | None:
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per verify round
    seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Committed tokens per verify forward (accepted drafts + the bonus)."""
        return 1.0 + sum(self.accept_lengths) / self.rounds if self.rounds else 1.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


RoundHook = Callable[[int, DraftTree, Acceptance], None]  # (anchor position, tree, acceptance)


def _finish(tokens: list[int], new: list[int], eos: set[int], max_new_tokens: int) -> bool:
    """Append `new` to `tokens` up to EOS or the token limit; True when generation is over."""
    for token in new:
        tokens.append(token)
        if token in eos or len(tokens) >= max_new_tokens:
            return True
    return False


def check_prompt(target: Target, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise JetFlowError("prompt is empty")
    if max_new_tokens < 1:
        raise JetFlowError(f"max new tokens must be at least 1, got {max_new_tokens}")
    context = getattr(target.config, "max_position_embeddings", None)
    if context and len(prompt_ids) + max_new_tokens > context:
        raise JetFlowError(
            f"prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new tokens exceeds the target's context of {context}"
        )


@torch.inference_mode()
def generate_ar(
    target: Target,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    ignore_eos: bool = False,
) -> GenerationResult:
    """Plain decoding with the target alone: the baseline and the losslessness oracle."""
    check_prompt(target, prompt_ids, max_new_tokens)
    start = time.perf_counter()
    generator = sampling.generator()
    cache = target.new_cache()
    ids = torch.tensor([prompt_ids])
    positions = torch.arange(len(prompt_ids))[None]
    tokens: list[int] = []
    while True:
        logits, _ = target.forward(ids, positions, cache)
        token = int(target_picks(logits[:, -1:], sampling.temperature, sampling.top_k, sampling.top_p, generator)[0, 0])
        if _finish(tokens, [token], set() if ignore_eos else target.eos_token_ids, max_new_tokens):
            break
        ids, positions = torch.tensor([[token]]), positions[:, -1:] + 1
    return GenerationResult(tokens=tokens, seconds=time.perf_counter() - start)


class ReferenceEngine:
    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        budget: int = 64,
        width: int = 7,
        refresh: bool = False,
        lookup: bool = False,
        lookup_scores: Sequence[float] = CHAIN_SCORES,
        head: bool = True,
    ) -> None:
        """lookup: merge the prompt-lookup continuation of the committed tokens into each tree
        (tree.merge_chain), its depth-d node scored lookup_scores[d-1], within the same budget.
        head=False (with lookup): verify the lookup chain alone each round, no head pass (the
        training-free baseline)."""
        error = budget_error(budget, proposer.block_size - 1, width)
        if error is not None:
            raise JetFlowError(error)
        if refresh and not hasattr(proposer, "refresh"):
            raise JetFlowError(f"{type(proposer).__name__} has no path-conditioned refresh pass")
        self.target, self.proposer, self.budget, self.width = target, proposer, budget, width
        self.refresh = refresh
        if not head and not lookup:
            raise JetFlowError("without the head there is nothing to draft: turn prompt lookup on")
        self.lookup, self.lookup_scores, self.head = lookup, lookup_scores, head

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        on_round: RoundHook | None = None,
        ignore_eos: bool = False,
    ) -> GenerationResult:
        target, eos = self.target, set() if ignore_eos else self.target.eos_token_ids
        check_prompt(target, prompt_ids, max_new_tokens)
        start = time.perf_counter()
        generator = sampling.generator()
        pick = lambda logits: target_picks(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)  # noqa: E731

        cache = target.new_cache()
        position = len(prompt_ids)
        logits, features = target.forward(torch.tensor([prompt_ids]), torch.arange(position)[None], cache)
        if self.head:
            self.proposer.reset(features)
        result = GenerationResult(tokens=[])
        done = _finish(result.tokens, [int(pick(logits[:, -1:])[0, 0])], eos, max_new_tokens)
        context = list(prompt_ids) + result.tokens  # prompt + committed tokens, anchor last
        while not done:
            anchor = torch.tensor([result.tokens[-1]])
            depths = self.proposer.block_size - 1
            chain = lookup_draft(context, depth=depths) if self.lookup else []
            if not self.head:
                tree = chain_tree(anchor, [chain], self.budget - 1, self.lookup_scores)
            else:
                hints = None
                if self.proposer.hint_ngram:  # a hinted or copying head reads the lookup's candidate
                    hint_tokens, kinds = lookup_hint(context, depths, self.proposer.hint_ngram)
                    hints = (torch.tensor([hint_tokens]), torch.tensor([kinds]))
                draft_top = self.proposer.propose_topk(anchor, position, self.width, hints)
                tree = build_tree_from_topk(anchor, *draft_top, self.budget)
                if self.refresh:  # second head pass over the tree: branch-specific children (method §3)
                    node_top = top_candidates(self.proposer.refresh(tree, position), self.width)
                    tree = refreshed_tree(tree, node_top, draft_top)
                if chain:  # after the refresh, which rebuilds the tree from the head's log-probs
                    tree = merge_chain(tree, torch.tensor(chain), self.lookup_scores)
            prefix_visible = torch.ones(1, tree.budget, position, dtype=torch.bool)
            mask = torch.cat([prefix_visible, tree.ancestors], -1)[:, None]
            logits, features = target.forward(tree.tokens, tree.positions(torch.tensor([position])), cache, mask)
            acceptance = accept_tree(tree, pick(logits), max_depth=self.proposer.block_size - 1)
            if on_round is not None:
                on_round(position, tree, acceptance)
            accepted = int(acceptance.num_accepted[0])
            path = acceptance.path[0, : accepted + 1]
            compact_cache(cache, torch.cat([torch.arange(position), position + path]))
            if self.head:
                self.proposer.extend(features[:, path])
            result.accept_lengths.append(accepted)
            committed = acceptance.committed_tokens(tree)[0, : accepted + 1].tolist()
            done = _finish(result.tokens, committed, eos, max_new_tokens)
            context.extend(committed)
            position += accepted + 1
        result.seconds = time.perf_counter() - start
        return result
