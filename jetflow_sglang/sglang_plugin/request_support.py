"""Which requests JETFLOW serves exactly as the target alone would (`request_error`); the
scheduler's request check (hooks.py) and the worker refuse the others with its message."""

from __future__ import annotations

from typing import Optional

UNSUPPORTED = "JETFLOW speculative decoding does not support {what} yet"


def request_error(req) -> Optional[str]:
    """Why JETFLOW cannot serve this request exactly as the target alone would, or None.

    Served: greedy decoding and sampling (temperature, top-k, top-p, min-p, cut as SGLang cuts
    them; sampling_seed under deterministic inference: seeded_sampling.py), logit bias (the
    same at every node), frequency / presence / repetition penalties and min_new_tokens (per
    node, from its own path: tree_penalties.py), grammars (a bitmask per node: tree_grammar.py),
    stop conditions, output logprobs. Refused: custom logit processors, which the tree walk does
    not apply, and min_p with a seed, which SGLang's seeded sampler asserts against."""
    params = req.sampling_params
    if getattr(params, "max_new_tokens", None) == 0:
        return None  # prefill only (scoring, frontend `select`): nothing is ever decoded
    temperature = getattr(params, "temperature", 0.0) or 0.0
    sampling = temperature > 0 and getattr(params, "top_k", 1) != 1
    if sampling and getattr(params, "sampling_seed", None) is not None and (getattr(params, "min_p", 0.0) or 0.0) > 0:
        return "SGLang's seeded sampler does not support min_p with sampling_seed"
    if getattr(req, "custom_logit_processor", None):
        return UNSUPPORTED.format(what="custom logit processors")
    if getattr(req, "return_hidden_states", False):
        return UNSUPPORTED.format(what="return_hidden_states")
    logprob = getattr(req, "logprob", None)
    if sampling and getattr(req, "return_logprob", False):
        return UNSUPPORTED.format(what="logprobs of sampled tokens (greedy requests have them)")
    if getattr(req, "return_logprob", False) and logprob is not None:
        if getattr(logprob, "top_logprobs_num", 0):
            return UNSUPPORTED.format(what="top_logprobs_num (output token logprobs are supported)")
        if getattr(logprob, "token_ids_logprob", None):
            return UNSUPPORTED.format(what="token_ids_logprob (output token logprobs are supported)")
    return None
