"""`--speculative-algorithm JETFLOW`: registration, server-args validation, request checks.

Registered from the general plugin entry point (group ``sglang.srt.plugins``,
:func:`jetflow_sglang.sglang_plugin.hooks.register`) with SGLang's own extension
point ``SpeculativeAlgorithm.register``. The validator runs in the launcher while
SGLang resolves its server args, so a head that does not fit the target, a missing
or non-safetensors head, or a budget out of range stops the server before any
model loads, with one message naming the problem.

Flags are SGLang's own: ``--speculative-draft-model-path`` (the head directory),
``--speculative-num-draft-tokens`` (tree budget N, root included, 1..512),
``--speculative-eagle-topk`` (tree width, default 7). The tree budget is adaptive by default
(JETFLOW's load-aware tree size per round, the budget being its cap: ``jetflow_sglang.budget``);
``JETFLOW_BUDGET=static`` in the launcher's environment verifies the whole budget every round.
SGLang's ``--speculative-adaptive`` is accepted and asks for the default. The head's config.json
carries the block size and the target tap layers. Unless ``--max-running-requests`` is
given, it becomes ``VERIFY_TOKENS_PER_BATCH // budget`` (128 at budget 16, 8 at 256), so the
verify graphs and buffers stay the same size whatever the budget; except for the adaptive budget
on the CPU platform (no verify graphs), which keeps SGLang's own batch cap and bounds each
round's tree instead (batch x size <= ``VERIFY_TOKENS_PER_BATCH``): at 64 clients a cap of 32
running requests held it to 0.66x the target alone. The attention backend must
apply the tree mask in TARGET_VERIFY (``TREE_MASK_BACKENDS``); FlashInfer is the GPU default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from jetflow_sglang.budget import VERIFY_TOKENS_PER_BATCH

from . import ALGORITHM

DEFAULT_BUDGET = 64
DEFAULT_WIDTH = 7
# Attention backends whose TARGET_VERIFY applies spec_info.custom_mask to any tree (others, e.g.
# trtllm_mha or torch_native, would verify a causal chain and lose losslessness).
TREE_MASK_BACKENDS = ("flashinfer", "triton", "jetflow_cpu")
DEFAULT_GPU_BACKEND = "flashinfer"


class JetFlowSpecAlgo(CustomSpecAlgo):
    """Adds what SGLang 0.5.23's scheduler calls on every start but CustomSpecAlgo lacks."""

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def has_draft_kv(self) -> bool:
        return False  # the tree lives in the verify mask; no per-branch draft KV

    def get_platform_worker_cls(self) -> Optional[type]:
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True, needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)


def _fail(message: str) -> None:
    raise ValueError(f"JETFLOW: {message}") from None  # one line: no "during handling of" chain


def validate_server_args(server_args) -> None:
    """Check the head against the target and the budget; fill the tree shape settings.

    ``server_args`` is SGLang's recorder: reads see resolved values, writes become
    declared settings that workers read through ``runtime_context.get_spec()``."""
    from transformers import AutoConfig

    from jetflow_sglang.errors import JetFlowError
    from jetflow_sglang.head import JetFlowConfig, JetFlowHead
    from jetflow_sglang.tree import budget_error

    head_path = server_args.speculative_draft_model_path
    if not head_path:
        _fail("--speculative-draft-model-path (the JetFlow head directory) is required")
    budget = server_args.speculative_num_draft_tokens
    if budget is None:
        budget = DEFAULT_BUDGET
        server_args.speculative_num_draft_tokens = budget
    if (error := budget_error(int(budget))) is not None:
        _fail(f"--speculative-num-draft-tokens: {error}")
    width = server_args.speculative_eagle_topk
    if width is None:
        width = DEFAULT_WIDTH
        server_args.speculative_eagle_topk = width
    if int(width) < 1:
        _fail(f"--speculative-eagle-topk (tree width) must be at least 1, got {width}")
    target = AutoConfig.from_pretrained(server_args.model_path, trust_remote_code=server_args.trust_remote_code)
    try:
        config_path = Path(head_path) / "config.json"
        if config_path.is_file():  # shapes first: a misfit head also fails to load its weights
            JetFlowConfig.from_json_dict(json.loads(config_path.read_text())).check_fits_target(target)
        config = JetFlowHead.load(head_path).config
        config.check_fits_target(target)
    except json.JSONDecodeError as exc:
        _fail(f"head config.json is not valid JSON: {exc}")
    except JetFlowError as exc:
        _fail(str(exc))
    text = getattr(target, "text_config", None) or target
    tp, heads = int(getattr(server_args, "tp_size", 1) or 1), int(getattr(text, "num_attention_heads", 0) or 0)
    if tp > 1 and heads and heads % tp:
        fits = [n for n in range(2, heads + 1) if heads % n == 0]
        _fail(f"--tp {tp} does not divide the target's {heads} attention heads (tensor parallelism splits them); "
              f"use --tp {' or '.join(map(str, fits))}")  # fmt: skip
    last = text.num_hidden_layers - 1
    if last in config.target_layer_ids:
        # SGLang captures a layer's output as the next layer's input: the last layer has none.
        _fail(f"head taps the target's last layer ({last}); SGLang can capture layers 0..{last - 1} only")
    depths = config.block_size - 1
    if (error := budget_error(int(budget), depths, int(width))) is not None:
        _fail(f"--speculative-num-draft-tokens: {error}")
    if server_args.speculative_num_steps is None:
        server_args.speculative_num_steps = depths
    _check_deterministic_inference(server_args)  # before the backends, whose refusal would not say why
    _check_attention_backends(server_args)
    policy = _resolve_budget_policy(server_args)
    if server_args.max_running_requests is None and not (policy == "adaptive" and _on_cpu_platform(server_args)):
        server_args.max_running_requests = max(1, VERIFY_TOKENS_PER_BATCH // int(budget))
    if getattr(server_args, "pp_size", 1) > 1:
        _fail("pipeline parallelism is not supported")
    if getattr(server_args, "enable_dp_attention", False):
        _fail("DP attention is not supported")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        _fail("prefill/decode disaggregation is not supported")


def _resolve_budget_policy(server_args) -> str:
    """The tree budget policy the scheduler processes will read from ``JETFLOW_BUDGET`` (the
    launcher's environment passes on): adaptive unless it says static (or sweep, for
    ``benchmarks/verify_cost.py``). ``--speculative-adaptive`` (SGLang's flag; its own adaptive
    runtime serves EAGLE chains only and stays off) asks for the default, so it contradicts
    ``JETFLOW_BUDGET=static``. A ``JETFLOW_COST_TABLE`` must be readable and, where it says so,
    recorded in this server's dtype on this kind of machine (the worker checks the rest)."""
    from jetflow_sglang.budget import BUDGET_ENV, COST_TABLE_ENV, CostTable, host_fingerprint, policy_name

    try:
        policy = policy_name()
    except ValueError as exc:
        _fail(str(exc))
    if getattr(server_args, "speculative_adaptive", False):
        if policy != "adaptive":
            _fail(f"--speculative-adaptive contradicts {BUDGET_ENV}={policy}; the budget is adaptive by default, drop one of them")
        server_args.speculative_adaptive = False  # SGLang's EAGLE adaptive runtime stays off
    table = os.environ.get(COST_TABLE_ENV)
    if table:
        device = str(getattr(server_args, "device", "") or "")
        # The GPU's name is the worker's to read (no CUDA context in the launcher); auto dtype too.
        host = host_fingerprint("cpu") if _on_cpu_platform(server_args) else (
            host_fingerprint("cuda", name=False) if device.startswith("cuda") else None)  # fmt: skip
        try:
            CostTable.load(table, server_args.dtype, host)
        except ValueError as exc:
            _fail(str(exc))
    return policy


def _on_cpu_platform(server_args) -> bool:
    return str(getattr(server_args, "device", "") or "").startswith("cpu")  # "cpu" under the jetflow_cpu platform


def _check_deterministic_inference(server_args) -> None:
    """Refuse ``--enable-deterministic-inference`` on the CPU platform: its promise, the same
    greedy output as the target alone, does not hold for a tree verify in bf16 there (the
    adaptive tree sizes, and the batch, change the verify's shapes and so its rounding; a static
    budget would still vary the batch). With the platform's own attention backend SGLang refuses
    the flag first (it allows deterministic inference on GPU backends only); this is the reason
    where another backend was named."""
    if getattr(server_args, "enable_deterministic_inference", False) and _on_cpu_platform(server_args):
        _fail("--enable-deterministic-inference is not supported on the CPU platform: the adaptive tree size and "
              "the batch change the verify's shapes and with them bf16 rounding, so greedy output could differ from "
              "the target alone's; drop the flag (in float32 greedy output equals the target alone's)")  # fmt: skip


def _check_attention_backends(server_args) -> None:
    if server_args.attention_backend is None:  # the CPU platform has set its own by now
        server_args.attention_backend = DEFAULT_GPU_BACKEND
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(server_args, field, None)
        if backend is not None and backend not in TREE_MASK_BACKENDS:
            flag = "--" + field.replace("_", "-")
            _fail(
                f"{flag} {backend} cannot verify draft trees (no custom attention mask in TARGET_VERIFY); "
                f"use one of {', '.join(TREE_MASK_BACKENDS)}"
            )


def _factory(server_args):
    from .worker import JetFlowWorker

    return JetFlowWorker


def register() -> None:
    """Idempotent: register JETFLOW with SGLang's speculative algorithm registry."""
    from sglang.srt.speculative.spec_registry import get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if get_spec(ALGORITHM) is not None:
        return
    SpeculativeAlgorithm.register(
        ALGORITHM,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=JetFlowSpecAlgo,
    )(_factory)
