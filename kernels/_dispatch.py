"""When a wrapper launches its Triton kernel instead of the torch reference."""

from __future__ import annotations

import torch
from torch import Tensor
from triton import knobs


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors (numpy). Triton reads it when a
    kernel is decorated, so it must be set before the kernel modules are imported."""
    return bool(knobs.runtime.interpret)


def use_triton(tensor: Tensor) -> bool:
    return tensor.is_cuda or interpreting()


def backend_name(device: torch.device | str) -> str:
    """Which implementation the wrappers run for tensors on `device` (logged by the worker)."""
    if interpreting():
        return "triton (interpreter)"
    return "triton" if torch.device(device).type == "cuda" else "torch reference"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
