"""The worker's top-k / top-p / min-p cut (sglang_plugin/sampling_filters.py) against SGLang's
own sampler function on the same logits: same kept tokens, same distribution over them. And
that the cut is needed: with top-k and top-p both set, the kernels' (Hugging Face's) rule keeps
a different set on some rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch  # noqa: E402

from jetflow_sglang.accept import processed_probs  # noqa: E402
from jetflow_sglang.sglang_plugin.sampling_filters import needs_sglang_cut, sglang_cut  # noqa: E402

VOCAB = 40


def sglang_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """SGLang's filtered distribution, [N, V] in token order, renormalized."""
    rows = logits.shape[0]
    probs = (logits / temperature).softmax(-1)
    _, probs_sort, probs_idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), torch.full((rows,), top_k), torch.full((rows,), top_p), torch.full((rows,), min_p),
        need_min_p_sampling=min_p > 0, sampling_seed=None, positions=torch.zeros(rows, dtype=torch.long),
        return_filtered_probs=True,
    )  # fmt: skip
    out = torch.zeros_like(probs).scatter_(-1, probs_idx.long(), probs_sort)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 8, 0.7, 0.0), (0.7, 20, 0.9, 0.05), (1.3, 0, 1.0, 0.2), (1.0, 5, 1.0, 0.3), (0.8, 0, 0.6, 0.1)],
)
def test_cut_equals_sglang_sampler(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = 2.5 * torch.randn(64, VOCAB, generator=gen)
    cut = sglang_cut(logits, temperature, top_k, top_p, min_p)
    ours = (cut / temperature).softmax(-1)
    theirs = sglang_probs(logits, temperature, top_k if top_k > 0 else 1 << 30, top_p, min_p)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert (ours == 0).any()  # something was cut


def test_kernel_rule_differs_where_the_cut_is_applied():
    gen = torch.Generator().manual_seed(0)
    logits = 2.5 * torch.randn(256, VOCAB, generator=gen)
    hf_style = processed_probs(logits, 1.0, 8, 0.7) > 0
    sglang_style = sglang_cut(logits, 1.0, 8, 0.7, 0.0) > float("-inf")
    assert (hf_style != sglang_style).any(dim=-1).sum() > 10
    flags = needs_sglang_cut(torch.tensor([8, 0, 8, 1 << 30, 3]), torch.tensor([0.7, 0.7, 1.0, 0.7, 1.0]),
                             torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1]), VOCAB)  # fmt: skip
    assert flags.tolist() == [True, False, False, False, True]
