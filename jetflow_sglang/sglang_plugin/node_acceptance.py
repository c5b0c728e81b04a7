"""The tree walk of one verify round, with everything a request asks of its logits.

Each node's verify logits are first made what SGLang's sampler would see at that position,
in place (returned logprobs see them too, as in SGLang): the node's penalties for its own
path (:mod:`.tree_penalties`), its grammar mask (:mod:`.tree_grammar`), then the request's
``logit_bias``. Then the walk: greedy over the argmax, or, with any sampling request in the
batch, each path node's target token drawn from its processed distribution (temperature,
top-k, top-p, min-p as SGLang cuts them: :mod:`.sampling_filters`) with a fresh uniform, so
committed tokens follow the target's own sampling law. Greedy requests in a mixed batch
(top-k 1) take the argmax. Under SGLang's deterministic inference each node's token is
SGLang's seeded draw at the node's position (:mod:`.seeded_sampling`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow_kernels import accept_greedy, accept_sampling
from jetflow_sglang.accept import Acceptance, greedy_picks
from jetflow_sglang.tree import DraftTree

from .committed_ids import CommittedIds
from .sampling_filters import needs_sglang_cut, sglang_cut
from .seeded_sampling import seeded_picks
from .tree_grammar import apply_grammar, grammar_mask
from .tree_penalties import apply_tree_penalties


def accept_round(
    tree: DraftTree, logits: Tensor, batch, seq_lens: Tensor, anchors: Tensor, committed: CommittedIds, max_depth: int
) -> Acceptance:
    """logits: [b, N, V] verify logits (modified in place); batch: the SGLang ScheduleBatch."""
    sampling_info = batch.sampling_info
    apply_tree_penalties(logits, tree, batch.reqs, seq_lens, anchors, committed)
    apply_grammar(logits, grammar_mask(tree, batch))
    if sampling_info is not None and sampling_info.logit_bias is not None:
        logits.add_(sampling_info.logit_bias[:, None, : logits.shape[-1]].to(logits.dtype))
    if sampling_info is None or sampling_info.is_all_greedy:
        return accept_greedy(tree, greedy_picks(logits), max_depth=max_depth)
    if sampling_info.sampling_seed is not None:  # --enable-deterministic-inference
        return accept_greedy(tree, seeded_picks(logits, tree, seq_lens, sampling_info), max_depth=max_depth)
    top_ks = sampling_info.top_ks.view(-1).to(torch.int64)
    temperatures = torch.where(top_ks == 1, 0.0, sampling_info.temperatures.view(-1).float())
    top_ps = sampling_info.top_ps.view(-1).float()
    min_ps = sampling_info.min_ps.view(-1).float() if sampling_info.need_min_p_sampling else torch.zeros_like(top_ps)
    if sampling_info.need_min_p_sampling or (sampling_info.need_top_k_sampling and sampling_info.need_top_p_sampling):
        cut = needs_sglang_cut(top_ks, top_ps, min_ps, logits.shape[-1]) & (temperatures > 0)
        for i in cut.nonzero().flatten().tolist():  # host sync, only for these options
            logits[i] = sglang_cut(logits[i], float(temperatures[i]), int(top_ks[i]), float(top_ps[i]), float(min_ps[i]))
        top_ks = torch.where(cut, 0, top_ks)
        top_ps = torch.where(cut, 1.0, top_ps)
    uniforms = torch.rand(tree.tokens.shape, device=logits.device)
    return accept_sampling(tree, logits, uniforms, temperatures, top_ks, top_ps, max_depth=max_depth)
