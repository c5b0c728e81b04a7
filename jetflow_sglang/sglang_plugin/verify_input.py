"""JETFLOW's tree-verify input for SGLang, one builder for eager rounds, CUDA-graph capture and warmup.

JETFLOW verifies a tree exactly as EAGLE's tree verify does: an ``EagleVerifyInput`` whose
``custom_mask`` is the FULL_MASK tree mask (per request ``[Q, seq_len + Q]`` bytes), with
the tapped hidden states captured (``CaptureHiddenMode.FULL``). Every SGLang attention backend
consumes it as it is: FlashInfer packs the mask into its custom-mask buffer, Triton copies
it into its verify-mask buffer, ``jetflow_cpu`` reads it directly.

SGLang captures TARGET_VERIFY graphs (width Q per request) for any speculative algorithm,
but builds the capture-time verify input only for its own algorithms
(``DecodeCudaGraphRunner.get_spec_info`` and ``spec_info.create_dummy_verify_input``); for a
custom algorithm both return None and capture fails on the attention backend's
``prefix_lens`` assert. :func:`decode_graph_runner_cls` and :func:`dummy_verify_input` fill
that in for JETFLOW (installed by :mod:`.hooks`), so capture, warmup and every replay see the
same kind of input, built by :func:`verify_input`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import ALGORITHM


def is_jetflow(spec_algorithm) -> bool:
    return str(getattr(spec_algorithm, "name", "") or "").upper() == ALGORITHM


def verify_input(
    custom_mask: Tensor,
    budget: int,
    num_steps: int,
    width: int,
    *,
    draft_tokens: Optional[Tensor] = None,
    positions: Optional[Tensor] = None,
    seq_lens: Optional[Tensor] = None,
):
    """``EagleVerifyInput`` of a JETFLOW tree round; without the tree fields, the capture/warmup
    form (SGLang fills tokens, positions and the mask buffer at replay).

    custom_mask: FULL_MASK bytes (or SGLang's mask buffer); budget: Q nodes per request, root
    included; num_steps: draft depths D-1; draft_tokens, positions: [b * Q]; seq_lens: [b]
    committed lengths without the tree. The tree walk is JETFLOW's own (``accept_greedy``),
    so the EAGLE retrieve links stay empty (-1)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    retrieve_index = no_link = None
    if draft_tokens is not None:
        batch = draft_tokens.numel() // budget
        device = draft_tokens.device
        retrieve_index = torch.arange(batch * budget, device=device).view(batch, budget)
        no_link = torch.full((batch, budget), -1, dtype=torch.int64, device=device)
    return EagleVerifyInput(
        draft_token=draft_tokens,
        custom_mask=custom_mask,
        positions=positions,
        retrieve_index=retrieve_index,
        retrieve_next_token=no_link,
        retrieve_next_sibling=no_link,
        retrieve_cum_len=None,
        spec_steps=num_steps,
        topk=width,
        draft_token_num=budget,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=None if seq_lens is None else int(seq_lens.sum()),
        seq_lens_cpu=None if seq_lens is None else seq_lens.cpu(),
    )


@functools.cache
def _graph_runner_cls() -> type:
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_spec

    class JetFlowDecodeCudaGraphRunner(DecodeCudaGraphRunner):
        """SGLang's decode graph runner, capturing JETFLOW's tree verify (width Q, FULL_MASK)."""

        def get_spec_info(self, num_tokens: int):
            return verify_input(
                self.buffers.custom_mask,
                self.speculative_num_draft_tokens,
                self.speculative_num_steps,
                get_spec().speculative_eagle_topk,
            )

    return JetFlowDecodeCudaGraphRunner


def decode_graph_runner_cls(original, model_runner) -> type:
    """AROUND ``ModelRunner._decode_cuda_graph_runner_cls``."""
    if is_jetflow(model_runner.spec_algorithm) and not model_runner.is_draft_worker:
        return _graph_runner_cls()
    return original(model_runner)


def dummy_verify_input(original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs):
    """AROUND ``spec_info.create_dummy_verify_input`` (warmup and FlashInfer autotune runs)."""
    if not is_jetflow(spec_algorithm) or is_draft_worker:
        return original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs)
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    return verify_input(custom_mask, int(num_tokens_per_req), spec.speculative_num_steps, spec.speculative_eagle_topk)
