"""Grammars on the tree, through SGLang's own grammar backend and tree-bitmask helpers.

SGLang fills one token bitmask per tree node by walking the tree with each request's matcher
(advanced along the node's path, rolled back between branches: ``generate_token_bitmask``
over first-child / next-sibling links, as for EAGLE and NGRAM trees); the mask goes on the
node's verify logits after the penalties and before ``logit_bias``, as SGLang's sampler
orders them. A drafted token the grammar forbids is masked out of its parent's row, so no
path through it is accepted. The scheduler then advances the real matcher over exactly the
committed tokens and cuts the commit where the grammar terminates (its batch result
processor, shared by all speculative algorithms). JETFLOW does not advance matchers inside
verify, so SGLang resolves the previous round first for batches with a grammar
(``supports_grammar_overlap`` is False).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from jetflow_sglang.tree import DraftTree


def tree_links(parents: Tensor) -> tuple[Tensor, Tensor]:
    """[b, N] parent indices (-1 for the root) -> (first child, next sibling), -1 where none;
    children in node order (best-first trees list a parent before its children)."""
    batch, nodes = parents.shape
    first_child = torch.full((batch, nodes), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, nodes), -1, dtype=torch.int64)
    for b, row in enumerate(parents.tolist()):
        last_child: dict[int, int] = {}
        for node, parent in enumerate(row):
            if parent < 0:
                continue
            if parent in last_child:
                next_sibling[b, last_child[parent]] = node
            else:
                first_child[b, parent] = node
            last_child[parent] = node
    return first_child, next_sibling


def grammar_mask(tree: DraftTree, batch):
    """SGLang's GrammarMask over the batch's trees (rows b * N + node), or None when no request
    in the batch has a grammar."""
    if not batch.has_grammar:
        return None
    from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

    first_child, next_sibling = tree_links(tree.parents.cpu())
    host_tree = GrammarTree.from_host(first_child, next_sibling, tree.tokens.cpu())
    return build_grammar_vocab_mask(
        reqs=batch.reqs, tree=host_tree, sampling_info=batch.sampling_info, device=tree.tokens.device, barrier=None
    )


def apply_grammar(logits: Tensor, mask: Optional[object]) -> None:
    """logits: [b, N, V], masked in place (forbidden tokens to -inf)."""
    if mask is not None:
        mask.apply(logits.view(-1, logits.shape[-1]))
