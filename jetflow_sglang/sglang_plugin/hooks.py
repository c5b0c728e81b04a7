"""General SGLang plugin (entry point group ``sglang.srt.plugins``) of jetflow-sglang.

Runs in every SGLang process (``sglang.srt.plugins.load_plugins``):

* registers the CPU platform's attention backend and its two wraps of SGLang's KV-slot code
  (:mod:`.cpu.seams`), which act only while the ``jetflow_cpu`` platform is active;
* registers ``--speculative-algorithm JETFLOW`` (:mod:`.spec_algo`) through
  ``SpeculativeAlgorithm.register``;
* wraps ``speculative_hook._resolve_speculative_algorithm_alias``, which loads the
  draft directory with ``AutoConfig`` for every algorithm (to spot Gemma4 drafts)
  before any algorithm's validator runs: for JETFLOW it returns the name untouched,
  so a missing head directory is reported by the JETFLOW validator by name rather
  than as a Hugging Face hub lookup error;
* wraps the scheduler's request check ``validate_input_length`` (the one place
  every generate request passes before it is queued; SGLang has no request
  validation seam for speculative algorithms) so that, only while JETFLOW is the
  speculative algorithm, a request the tree walk cannot serve exactly as the target alone
  would is refused with a 400 and a message saying why (``request_support.request_error``:
  custom logit processors, hidden states, logprobs of sampled tokens, top logprobs and
  token-id logprobs, min_p with a seed). Everything else is served, grammars (regex, JSON
  schema, EBNF) included: penalties, grammars, logit bias, the sampling cut and seeds apply per
  tree node (:mod:`.node_acceptance`);
* wraps ``allocation_sizing.get_alloc_len_per_decode`` so that, while JETFLOW is the
  speculative algorithm, a decode step allocates KV for the tree budget per request: a
  JETFLOW round writes target K/V for its verified nodes alone (the head's context K/V live
  in the proposer's own buffers), not the ``speculative_num_steps x topk`` (15 x 7 = 105) of an
  EAGLE draft model, which SGLang's formula reserves twice over for every running request
  (3,360 slots of an 8,192-token pool at 16 requests, at any budget), evicting the radix cache;
* wraps ``ModelRunner._decode_cuda_graph_runner_cls`` and
  ``spec_info.create_dummy_verify_input`` (SGLang's own seams for per-algorithm graph
  runners and warmup inputs) so that JETFLOW's tree verify is captured in CUDA graphs
  (:mod:`.verify_input`).
"""

from __future__ import annotations

from . import ALGORITHM, spec_algo, verify_input
from .cpu import seams as cpu_seams
from .request_support import request_error

RESOLVE_ALIAS = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
VALIDATE_REQUEST = "sglang.srt.managers.utils.validate_input_length"
GRAPH_RUNNER_CLS = "sglang.srt.model_executor.model_runner.ModelRunner._decode_cuda_graph_runner_cls"
DUMMY_VERIFY_INPUT = "sglang.srt.speculative.spec_info.create_dummy_verify_input"
ALLOC_LEN_PER_DECODE = "sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode"


def _resolve_alias_around(original, algorithm, *args, **kwargs):
    if str(algorithm or "").upper() == ALGORITHM:
        return ALGORITHM
    return original(algorithm, *args, **kwargs)


def _jetflow_active() -> bool:
    from sglang.srt.runtime_context import get_spec

    try:
        name = get_spec().speculative_algorithm
    except Exception:  # runtime context not initialised (not a scheduler process)
        return False
    return str(name or "").upper() == ALGORITHM


def _validate_request_around(original, req, *args, **kwargs):
    error = original(req, *args, **kwargs)
    if error is None and _jetflow_active():
        error = request_error(req)
    return error


def _alloc_len_per_decode_around(original, *args, **kwargs):
    if _jetflow_active():
        from sglang.srt.runtime_context import max_speculative_num_draft_tokens

        return max(1, int(max_speculative_num_draft_tokens() or 1))  # the tree budget (the adaptive cap)
    return original(*args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    cpu_seams.register()
    spec_algo.register()
    HookRegistry.register(RESOLVE_ALIAS, _resolve_alias_around, HookType.AROUND)
    HookRegistry.register(VALIDATE_REQUEST, _validate_request_around, HookType.AROUND)
    HookRegistry.register(GRAPH_RUNNER_CLS, verify_input.decode_graph_runner_cls, HookType.AROUND)
    HookRegistry.register(DUMMY_VERIFY_INPUT, verify_input.dummy_verify_input, HookType.AROUND)
    HookRegistry.register(ALLOC_LEN_PER_DECODE, _alloc_len_per_decode_around, HookType.AROUND)
