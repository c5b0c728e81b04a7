"""JETFLOW's tree verify under SGLang's CUDA-graph machinery, checked through SGLang's own code on CPU.

SGLang builds capture-time and warmup verify inputs only for its own algorithms; the plugin's
hooks (``sglang_plugin.verify_input``) must hand it JETFLOW's ``EagleVerifyInput`` with the
tree-mask buffer, and the validator must bound the batch so that a large budget does not
multiply the verify graphs' buffers. Server args are resolved by SGLang itself (the JETFLOW
validator runs inside), the hooked functions are SGLang's, installed by ``load_plugins``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def sglang_with_plugins():
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture(scope="module")
def assets(sglang_with_plugins) -> dict:
    from jetflow_sglang.assets import prepare

    return prepare("default")


def _context(assets: dict, budget: int, **extra):
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(assets["target"]),
        speculative_algorithm="JETFLOW",
        speculative_draft_model_path=str(assets["head"]),
        speculative_num_draft_tokens=budget,
        max_total_tokens=4096,
        **extra,
    )
    return runtime_context.create_context(args, role="scheduler")


def _jetflow_algorithm():
    from sglang.srt.speculative.spec_registry import get_spec

    return get_spec("JETFLOW")


def test_decode_graph_runner_is_jetflows_for_the_target_only(sglang_with_plugins):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    def runner_cls(algorithm, is_draft_worker=False):
        # The hooked method reads only these two attributes of the model runner.
        return ModelRunner._decode_cuda_graph_runner_cls(
            SimpleNamespace(spec_algorithm=algorithm, is_draft_worker=is_draft_worker)
        )

    jetflow = runner_cls(_jetflow_algorithm())
    assert issubclass(jetflow, DecodeCudaGraphRunner) and jetflow is not DecodeCudaGraphRunner
    assert jetflow.get_spec_info is not DecodeCudaGraphRunner.get_spec_info
    assert runner_cls(SpeculativeAlgorithm.NONE) is DecodeCudaGraphRunner
    assert runner_cls(SpeculativeAlgorithm.EAGLE) is DecodeCudaGraphRunner


@pytest.mark.parametrize("budget", [16, 256])
def test_capture_and_warmup_verify_inputs_carry_the_tree_mask(assets, budget):
    from sglang.srt import runtime_context
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative import spec_info
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    from jetflow_sglang.head import JetFlowConfig

    depths = JetFlowConfig.from_json_dict(json.loads(Path(assets["head"], "config.json").read_text())).block_size - 1
    mask_buffer = torch.ones(1000, dtype=torch.bool)
    with runtime_context.use_context(_context(assets, budget)):
        spec = runtime_context.get_spec()
        assert (spec.speculative_num_draft_tokens, spec.speculative_num_steps, spec.speculative_eagle_topk) == (budget, depths, 7)
        # Warmup / FlashInfer autotune input (SGLang's function, hooked).
        warmup = spec_info.create_dummy_verify_input(_jetflow_algorithm(), mask_buffer, budget, False)
        # Capture input: the runner's get_spec_info reads its mask buffer and tree shape.
        runner_cls = ModelRunner._decode_cuda_graph_runner_cls(SimpleNamespace(spec_algorithm=_jetflow_algorithm(), is_draft_worker=False))
        runner = object.__new__(runner_cls)
        runner.buffers = SimpleNamespace(custom_mask=mask_buffer)
        runner.speculative_num_draft_tokens, runner.speculative_num_steps = budget, depths
        capture = runner.get_spec_info(num_tokens=budget * 4)
    for verify in (warmup, capture):
        assert isinstance(verify, EagleVerifyInput)
        assert verify.custom_mask is mask_buffer  # FlashInfer/Triton allocate their graph mask buffers from this
        assert verify.draft_token_num == verify.num_tokens_per_req == budget
        assert (verify.spec_steps, verify.topk) == (depths, 7)
        assert verify.capture_hidden_mode == CaptureHiddenMode.FULL  # the head's tap features


@pytest.mark.parametrize("budget, given, expected", [(16, None, 128), (64, None, 32), (256, None, 8), (512, None, 4), (256, 3, 3)])
def test_batch_cap_bounds_verify_tokens(assets, budget, given, expected, monkeypatch):
    """A static budget (and every budget under verify graphs) caps the running requests at
    VERIFY_TOKENS_PER_BATCH // budget unless the user gives a cap; the CPU platform's adaptive
    budget leaves SGLang's own cap and bounds each round's tree instead (tests/test_budget.py)."""
    from sglang.srt import runtime_context

    monkeypatch.setenv("JETFLOW_BUDGET", "static")

    from jetflow_sglang.sglang_plugin.spec_algo import VERIFY_TOKENS_PER_BATCH

    extra = {} if given is None else {"max_running_requests": given}
    with runtime_context.use_context(_context(assets, budget, **extra)):
        assert runtime_context.get_schedule().max_running_requests == expected
    if given is None:
        assert expected * budget <= VERIFY_TOKENS_PER_BATCH
        monkeypatch.delenv("JETFLOW_BUDGET")  # adaptive, the default, on this CPU platform
        with runtime_context.use_context(_context(assets, budget, **extra)):
            assert runtime_context.get_schedule().max_running_requests != expected


def test_round_verify_input_matches_the_capture_form(sglang_with_plugins):
    from jetflow_kernels import build_tree_from_topk, tree_masks
    from jetflow_sglang.sglang_plugin.verify_input import verify_input

    gen = torch.Generator().manual_seed(0)
    logprobs = torch.randn(3, 5, 50, generator=gen).log_softmax(-1)
    seq_lens = torch.tensor([4, 11, 7])
    tree = build_tree_from_topk(torch.tensor([1, 2, 3]), *logprobs.topk(4, dim=-1), 20)
    masks = tree_masks(tree.parents, tree.depths, seq_lens, packed=False)
    verify = verify_input(
        masks.full_mask, 20, 5, 4, draft_tokens=tree.tokens.flatten(), positions=masks.positions.flatten(), seq_lens=seq_lens
    )
    capture = verify_input(torch.ones(8, dtype=torch.bool), 20, 5, 4)
    for field in ("spec_steps", "topk", "draft_token_num", "num_tokens_per_req", "capture_hidden_mode"):
        assert getattr(verify, field) == getattr(capture, field), field
    assert verify.custom_mask.numel() == 20 * int((seq_lens + 20).sum())  # FULL_MASK
    assert verify.seq_lens_sum == 22 and torch.equal(verify.seq_lens_cpu, seq_lens)
    assert torch.equal(verify.retrieve_index, torch.arange(60).view(3, 20))


@pytest.mark.parametrize(
    "given, accepted",
    [({}, "jetflow_cpu"), ({"attention_backend": "triton"}, "triton"), ({"attention_backend": "torch_native"}, None),
     ({"decode_attention_backend": "torch_native"}, None)],
)  # fmt: skip
def test_attention_backend_must_apply_the_tree_mask(assets, given, accepted):
    from sglang.srt import runtime_context

    if accepted is None:
        (field, backend), = given.items()
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ValueError, match=f"JETFLOW: {flag} {backend} cannot verify draft trees"):
            _context(assets, 64, **given)
        return
    with runtime_context.use_context(_context(assets, 64, **given)):
        assert runtime_context.attention_backends() == (accepted, accepted)
