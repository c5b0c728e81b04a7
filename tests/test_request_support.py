"""Which requests JETFLOW serves (sglang_plugin/request_support.py::request_error), on SGLang's
own `Req` and `SamplingParams`, built as the scheduler builds them (SamplingParams normalizes
temperature 0 to top_k 1 itself). Every branch: the served features, each refusal with its own
message, the temperature > 0 with top_k 1 request that is greedy, and prefill-only requests
(max_new_tokens 0), which decode nothing and so are never refused."""

from __future__ import annotations

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

from jetflow_sglang.sglang_plugin.request_support import request_error

PROCESSOR = DisallowedTokensLogitsProcessor.to_str()  # what a client sends as custom_logit_processor
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


def req(params: dict | None = None, **fields) -> Req:
    """SGLang's Req over SamplingParams(**params); fields are Req's own arguments."""
    return Req("rid", "prompt", [1, 2, 3], SamplingParams(**(params or {})), **fields)


def test_sampling_params_normalize_as_the_branches_assume():
    """request_error reads the normalized params: temperature 0 arrives as (1.0, top_k 1), and
    top_k -1 as the whole vocabulary. If SGLang changed that, the greedy test would be wrong."""
    greedy = SamplingParams(temperature=0.0)
    assert (greedy.temperature, greedy.top_k) == (1.0, 1)
    assert SamplingParams(temperature=0.7, top_k=-1).top_k == TOP_K_ALL


@pytest.mark.parametrize(
    "params",
    [
        {},  # SGLang's defaults: temperature 1, whole vocabulary
        GREEDY,
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.8, "min_p": 0.05},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.95, "min_p": 0.05},
        {"temperature": 0.8, "sampling_seed": 7},  # a seed without min_p
        {"temperature": 0.0, "min_p": 0.05, "sampling_seed": 7},  # min_p with a seed, greedy
        {"temperature": 0.8, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2},
        {"temperature": 0.8, "min_new_tokens": 4, "max_new_tokens": 16},
        {"temperature": 0.8, "logit_bias": {"5": 2.0}},
        {"temperature": 0.8, "regex": "[a-z]+"},
        {"temperature": 0.8, "stop": ["\n"], "stop_token_ids": [2]},
        {"temperature": 0.8, "max_new_tokens": None},
    ],
)
def test_served_requests_get_no_error(params):
    assert request_error(req(params)) is None


def test_greedy_requests_may_ask_for_output_logprobs():
    assert request_error(req(GREEDY, return_logprob=True)) is None


def test_logprob_details_without_return_logprob_are_not_refused():
    """top_logprobs_num / token_ids_logprob mean nothing unless return_logprob is set."""
    assert request_error(req(GREEDY, top_logprobs_num=3, token_ids_logprob=[4, 5])) is None


def test_hidden_states_off_is_served():
    assert request_error(req(GREEDY, return_hidden_states=False)) is None


REFUSALS = {
    # name: (params, Req fields, words the message must carry)
    "custom processor, greedy": (GREEDY, {"custom_logit_processor": PROCESSOR}, "custom logit processors"),
    "custom processor, sampled": (SAMPLED, {"custom_logit_processor": PROCESSOR}, "custom logit processors"),
    "hidden states": (GREEDY, {"return_hidden_states": True}, "return_hidden_states"),
    "hidden states, last": (GREEDY, {"return_hidden_states": "last"}, "return_hidden_states"),
    "sampled logprobs": (SAMPLED, {"return_logprob": True}, "logprobs of sampled tokens"),
    "top logprobs": (GREEDY, {"return_logprob": True, "top_logprobs_num": 5}, "top_logprobs_num"),
    "token ids logprob": (GREEDY, {"return_logprob": True, "token_ids_logprob": [4, 5]}, "token_ids_logprob"),
    "min_p with a seed": ({"temperature": 0.8, "min_p": 0.1, "sampling_seed": 3}, {}, "min_p with sampling_seed"),
    "min_p with seed 0": ({"temperature": 0.8, "min_p": 0.1, "sampling_seed": 0}, {}, "min_p with sampling_seed"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_each_refusal_names_what_is_not_supported(name):
    params, fields, words = REFUSALS[name]
    error = request_error(req(params, **fields))
    assert error is not None and words in error, (name, error)


def test_refusal_messages_differ_by_cause():
    """A branch that returned another branch's message would tell the client the wrong thing."""
    causes = {}
    for params, fields, words in REFUSALS.values():
        causes.setdefault(words, set()).add(request_error(req(params, **fields)))
    assert all(len(messages) == 1 for messages in causes.values()), causes
    assert len({next(iter(m)) for m in causes.values()}) == len(causes)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_above_zero_with_top_k_one_is_greedy(temperature):
    """top_k 1 keeps only the argmax: the request is greedy whatever its temperature, so the
    refusals that hold for sampling only (logprobs of sampled tokens, min_p with a seed) do
    not apply, while those that hold for every request still do."""
    params = {"temperature": temperature, "top_k": 1}
    assert request_error(req(params, return_logprob=True)) is None
    assert request_error(req(dict(params, min_p=0.1, sampling_seed=3))) is None
    assert "top_logprobs_num" in request_error(req(params, return_logprob=True, top_logprobs_num=2))
    assert "custom logit processors" in request_error(req(params, custom_logit_processor=PROCESSOR))
    # The same temperature with a wider top_k samples: those refusals apply again.
    assert "sampled tokens" in request_error(req(dict(params, top_k=2), return_logprob=True))
    assert "min_p" in request_error(req(dict(params, top_k=2, min_p=0.1, sampling_seed=3)))


def test_temperature_zero_before_normalization_is_greedy():
    """Params that skipped SGLang's normalization (is_normalized) may keep temperature 0 with
    the whole vocabulary: that is still greedy, not sampling."""
    params = SamplingParams(temperature=0.0, top_k=TOP_K_ALL, min_p=0.1, sampling_seed=3, is_normalized=True)
    assert (params.temperature, params.top_k) == (0.0, TOP_K_ALL)
    assert request_error(Req("rid", "p", [1], params, return_logprob=True)) is None


@pytest.mark.parametrize("name", list(REFUSALS))
def test_prefill_only_requests_are_never_refused(name):
    """max_new_tokens 0 (scoring, the frontend's `select`): nothing is decoded, so nothing
    JETFLOW does can change the answer; the same request with one new token is refused."""
    params, fields, _ = REFUSALS[name]
    assert request_error(req(dict(params, max_new_tokens=0), **fields)) is None
    assert request_error(req(dict(params, max_new_tokens=1), **fields)) is not None
