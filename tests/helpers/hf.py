"""HF transformers' own answers, the oracles of the losslessness and sampling tests."""

from __future__ import annotations

from typing import Callable

import torch

# logits [rows, V] -> (token ids [rows, k], their probabilities [rows, k]) under a sampler's cut
Cut = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def hf_greedy(target, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy decoding: the oracle for losslessness."""
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=target.tokenizer.pad_token_id or 0,
        )
    return out[0, len(ids) :].tolist()


def exact_joint(model, ids: list[int], tokens: int, cut: Cut) -> dict[tuple[int, ...], float]:
    """P(first `tokens` new tokens) by hand: at every prefix, the model's fp32 next-token logits
    cut to the tokens a sampler may draw, with their probabilities (`cut`)."""
    joint = {(): 1.0}
    with torch.inference_mode():
        for _ in range(tokens):
            prefixes = list(joint)
            logits = model(torch.tensor([ids + list(p) for p in prefixes])).logits[:, -1].float()
            token_ids, probs = cut(logits)
            joint = {
                prefix + (token,): joint[prefix] * prob
                for prefix, row_ids, row_probs in zip(prefixes, token_ids.tolist(), probs.tolist())
                for token, prob in zip(row_ids, row_probs)
                if prob > 0
            }
    return joint
