"""Out-of-tree SGLang platform that runs the server on a plain CPU.

SGLang 0.5.23's own CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs a CPU build
of ``sgl_kernel`` that PyPI does not publish.  This platform instead declares
itself out-of-tree (``PlatformEnum.OOT``) with device type ``"cpu"`` and the
``"native"`` dispatch key, so fused ops (RoPE, RMSNorm, activations) take their
``forward_native`` torch paths and no sgl_kernel CPU op is ever imported.

Registered through the ``sglang.srt.platforms`` entry point ``jetflow_cpu``
(see ``pyproject.toml``); ``activate()`` is that entry point.  It takes over
only where CUDA is unavailable, or where ``SGLANG_PLATFORM=jetflow_cpu``.
"""

from __future__ import annotations

import gc
import logging
import os
import platform as _platform
from typing import Optional

import psutil
import torch

from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

logger = logging.getLogger(__name__)

PLATFORM_NAME = "jetflow_cpu"
ATTENTION_BACKEND_NAME = "jetflow_cpu"
DEFAULT_MAX_TOTAL_TOKENS = 65536


def activate() -> Optional[str]:
    """Entry point of group ``sglang.srt.platforms``.

    Returns the qualified class name when this platform should run, else None.
    """
    selected = os.environ.get("SGLANG_PLATFORM", "")
    if selected:
        return _qualname() if selected == PLATFORM_NAME else None
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        # The user asked for SGLang's own CPU engine (needs sgl_kernel CPU).
        return None
    try:
        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken driver stack
        has_cuda = False
    if has_cuda:
        return None
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return None
    return _qualname()


def on_jetflow_cpu() -> bool:
    """True in a process whose SGLang platform is this one."""
    from sglang.srt.platforms import current_platform

    return isinstance(current_platform, JetflowCpuPlatform)


def _qualname() -> str:
    return f"{JetflowCpuPlatform.__module__}.{JetflowCpuPlatform.__qualname__}"


class JetflowCpuPlatform(SRTPlatform):
    """CPU platform for SGLang without sgl_kernel: torch-native everything."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"

    # No triton, no device graphs, no piecewise compile, no HiCache kernels.
    capabilities = PlatformCapabilities()

    # ---------------------------------------------------------------- config
    def apply_server_args_defaults(self, server_args) -> None:
        # ``server_args`` is a recorder: reads see the resolved view, writes
        # become declared resolutions (``arg_groups/overrides.py``).
        if server_args.attention_backend in (None, "intel_amx"):
            server_args.attention_backend = ATTENTION_BACKEND_NAME
        for field in ("prefill_attention_backend", "decode_attention_backend"):
            if getattr(server_args, field, None) == "intel_amx":
                setattr(server_args, field, ATTENTION_BACKEND_NAME)
        if getattr(server_args, "sampling_backend", None) is None:
            server_args.sampling_backend = "pytorch"
        if not getattr(server_args, "sleep_on_idle", True):
            # Without it the idle scheduler busy-polls one core at 100%
            # (half of a 2-core machine); with it, it blocks in zmq poll.
            server_args.sleep_on_idle = True
        if server_args.max_total_tokens is None:
            # The KV pool is otherwise sized from free RAM (hundreds of
            # thousands of tokens, tens of seconds of zero-filling).
            server_args.max_total_tokens = DEFAULT_MAX_TOTAL_TOKENS

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND_NAME

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return ATTENTION_BACKEND_NAME

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        # Built-in algorithms need Triton / sgl_kernel tree, verify and
        # cache-location kernels; plugin algorithms bring their own torch ones.
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        builtin = {a.name for a in SpeculativeAlgorithm} | {"NEXTN"}
        return str(algorithm).upper() not in builtin

    def supports_speculative_draft_attention_backend(
        self, algorithm: str, backend: str
    ) -> bool:
        return backend in (ATTENTION_BACKEND_NAME, "torch_native")

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_speculative_cache_locs_fn(self):
        # Torch twin of the Triton/sgl_kernel ``assign_extend_cache_locs``.
        from .spec_ops import assign_extend_cache_locs

        return assign_extend_cache_locs

    def init_backend(self) -> None:
        # Runs in each worker when model_runner is imported, before any KV
        # pool exists: speculative KV compaction (``move_kv_cache``) takes the
        # torch path instead of the Triton multi-layer copy kernel.
        os.environ.setdefault("SGLANG_NATIVE_MOVE_KV_CACHE", "1")

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "inductor"

    # ---------------------------------------------------------------- device
    def get_device(self, device_id: int = 0) -> str:
        # Must be a string: serving_hook calls ``.split(":")`` on it.
        return "cpu"

    def set_device(self, device) -> None:
        pass

    def get_device_name(self, device_id: int = 0) -> str:
        return f"cpu ({_platform.machine()})"

    def get_device_uuid(self, device_id: int = 0) -> str:
        return _platform.machine()

    def get_device_capability(self, device_id: int = 0):
        return None

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    def get_current_memory_usage(self, device=None) -> float:
        vm = psutil.virtual_memory()
        return float(vm.total - vm.available)

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return (int(vm.available), int(vm.total))

    def empty_cache(self) -> None:
        gc.collect()

    def synchronize(self) -> None:
        pass

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    # ----------------------------------------------------------- distributed
    def get_torch_distributed_backend_str(self) -> str:
        return "gloo"

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def get_torch_profiler_activity_str(self) -> str:
        return "CPU"

    def get_torch_profiler_activity(self):
        return torch.profiler.ProfilerActivity.CPU
