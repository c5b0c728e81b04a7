"""Penalties on the tree: frequency, presence, repetition and min_new_tokens, node by node.

Plain decoding penalizes the logits that pick output token n+1 with the counts of output
tokens 1..n. A tree node's verify logits pick the token after the node, so they are
penalized with the request's output so far (up to and including the anchor, the root) plus
the drafted tokens on the node's own path: what plain decoding would have counted had it
produced that path. The accepted path is therefore scored exactly as the target alone would
score it, for greedy and sampled requests alike.

Order and arithmetic follow SGLang's sampler: the additive penalties (frequency, presence,
min_new_tokens' ban on stop tokens) summed into one buffer and added, then the repetition
scaling; ``logit_bias`` comes after (the worker adds it). Counts are the request's *output*
tokens, as SGLang's penalizers count them.

SGLang's own overlap scheduler feeds its penalizers one round late (at the first decode step
it counts the prompt's last token; later it misses the newest output token). JETFLOW counts
from the worker's own record (:class:`.committed_ids.CommittedIds`), so it equals SGLang
without overlap (``--disable-overlap-schedule``) — the exact definition.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from jetflow_sglang.tree import DraftTree

from .committed_ids import CommittedIds

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Penalties:
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # banned while fewer than min_new_tokens are out

    @property
    def active(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0 or self.min_new_tokens > 0

    @classmethod
    def of(cls, req) -> Optional["Penalties"]:
        """The request's penalties (None when it has none), with SGLang's stop-token set for
        min_new_tokens (BatchedMinNewTokensPenalizer: stop_token_ids, the request's and the
        tokenizer's EOS ids)."""
        params = req.sampling_params
        min_new_tokens = int(getattr(params, "min_new_tokens", 0) or 0)
        stop_ids: set[int] = set()
        if min_new_tokens > 0:
            tokenizer = getattr(req, "tokenizer", None)
            stop_ids |= set(getattr(params, "stop_token_ids", None) or ())
            stop_ids |= set(getattr(req, "eos_token_ids", None) or ())
            if tokenizer is not None:
                stop_ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
                if tokenizer.eos_token_id is not None:
                    stop_ids.add(tokenizer.eos_token_id)
        penalties = cls(
            frequency=float(getattr(params, "frequency_penalty", 0.0) or 0.0),
            presence=float(getattr(params, "presence_penalty", 0.0) or 0.0),
            repetition=float(getattr(params, "repetition_penalty", 1.0) or 1.0),
            min_new_tokens=min_new_tokens,
            stop_ids=tuple(sorted(i for i in stop_ids if i is not None)),
        )
        return penalties if penalties.active else None


def penalize_tree(
    logits: Tensor, tokens: Tensor, ancestors: Tensor, depths: Tensor, outputs: Sequence[int], penalties: Penalties
) -> None:
    """Penalize one request's verify logits in place.

    logits: [N, V] (row j picks the token after node j); tokens, depths: [N]; ancestors: [N, N]
    bool ([j, k]: node k is node j or one of its ancestors); outputs: the request's output ids
    so far, ending with the anchor (the root)."""
    num_nodes, vocab = logits.shape
    device = logits.device
    output_ids = torch.tensor(list(outputs), dtype=torch.int64, device=device)
    on_path = ancestors.clone()
    on_path[:, 0] = False  # the root is outputs[-1], already counted
    nodes, path_nodes = on_path.nonzero(as_tuple=True)
    path_ids = tokens[path_nodes]

    def per_node(value: float) -> Tensor:
        """[N, V]: `value` summed once per occurrence, outputs first then the path in order
        (SGLang's scatter_add order)."""
        base = torch.zeros(vocab, dtype=torch.float32, device=device)
        base.scatter_add_(0, output_ids, torch.full(output_ids.shape, value, device=device))
        out = base.repeat(num_nodes, 1)
        out.index_put_((nodes, path_ids), torch.full(nodes.shape, value, device=device), accumulate=True)
        return out

    present = per_node(1.0) > 0 if (penalties.presence or penalties.repetition != 1.0) else None
    additive = torch.zeros((num_nodes, vocab), dtype=torch.float32, device=device)
    if penalties.frequency:
        additive.sub_(per_node(penalties.frequency))
    if penalties.presence:
        additive.sub_(torch.where(present, penalties.presence, 0.0))
    if penalties.min_new_tokens > 0 and penalties.stop_ids:
        too_early = (len(outputs) + depths) < penalties.min_new_tokens  # [N]
        stop = torch.tensor(penalties.stop_ids, dtype=torch.int64, device=device)
        stop = stop[stop < vocab]
        banned = torch.zeros((num_nodes, vocab), dtype=torch.bool, device=device)
        banned[:, stop] = True
        additive.add_(torch.where(banned & too_early[:, None], float("-inf"), 0.0))
    logits.add_(additive.to(logits.dtype))
    if penalties.repetition != 1.0:
        scaled = torch.where(logits < 0, logits * penalties.repetition, logits / penalties.repetition)
        logits.copy_(torch.where(present, scaled, logits))


def any_penalized(reqs: Sequence) -> bool:
    return any(Penalties.of(req) is not None for req in reqs)


def apply_tree_penalties(
    logits: Tensor, tree: DraftTree, reqs: Sequence, seq_lens: Tensor, anchors: Tensor, committed: CommittedIds
) -> None:
    """logits: [b, N, V] verify logits of the batch, penalized in place for the requests that
    ask for penalties."""
    wanted = [(i, p) for i, req in enumerate(reqs) if (p := Penalties.of(req)) is not None]
    if not wanted:
        return
    lens, anchor_ids = seq_lens.tolist(), anchors.tolist()
    for i, penalties in wanted:
        req = reqs[i]
        ids = committed.get(req, lens[i])
        if ids is None:  # not expected: every decoding request was seen at its extend
            logger.warning("JETFLOW: no token record for request %s; penalties from its output ids", req.rid)
            outputs = list(req.output_ids)
        else:
            outputs = ids[len(req.origin_input_ids) :] + [anchor_ids[i]]
        penalize_tree(logits[i], tree.tokens[i], tree.ancestors[i], tree.depths[i], outputs, penalties)
