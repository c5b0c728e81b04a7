"""Seeded sampling on the tree: SGLang's deterministic inference, node by node.

Under ``--enable-deterministic-inference`` SGLang draws each token with the Gumbel-max trick,
its noise hashed from (request seed, token position, column) (``multinomial_with_seed``), so
a request's output is a function of its seed (42 when it sets none). Here every tree node's
target token is drawn by SGLang's own sampler functions at the node's own position
(``seq_len + depth``, the position of the node's query, as plain decoding passes the
position of its input token): on the accepted path each node sits where plain decoding
would have sampled, with the same logits, so the output equals the target alone's with the
same seed, token for token. Without deterministic inference SGLang's sampler never reads
``sampling_seed`` (it is not put in the batch), and neither does JETFLOW.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetflow_sglang.tree import DraftTree


def seeded_picks(logits: Tensor, tree: DraftTree, seq_lens: Tensor, sampling_info) -> Tensor:
    """[b, N] target token at every node. logits: [b, N, V] (penalties and bias applied);
    sampling_info: SGLang's SamplingBatchInfo with ``sampling_seed`` set."""
    from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch

    batch, nodes, vocab = logits.shape

    def per_node(values: Tensor) -> Tensor:
        return values.reshape(-1).repeat_interleave(nodes)

    temperatures = per_node(sampling_info.temperatures.float())
    probs = (logits.reshape(-1, vocab).float() / temperatures[:, None]).softmax(-1)
    positions = (seq_lens.to(torch.int64)[:, None] + tree.depths).reshape(-1)
    seeds = per_node(sampling_info.sampling_seed)
    filtered = sampling_info.need_top_p_sampling or sampling_info.need_top_k_sampling or sampling_info.need_min_p_sampling
    if not filtered:
        picks = sampling_from_probs_torch(probs, sampling_seed=seeds, positions=positions)
    else:
        picks = top_k_top_p_min_p_sampling_from_probs_torch(
            probs, per_node(sampling_info.top_ks), per_node(sampling_info.top_ps), per_node(sampling_info.min_ps),
            sampling_info.need_min_p_sampling, seeds, positions,
        )  # fmt: skip
    return picks.view(batch, nodes).to(torch.int64)
