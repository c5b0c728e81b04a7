"""bf16 linears on a CPU with their weights reordered once for oneDNN.

`F.linear` in bf16 on CPU hands oneDNN a plain [out, in] weight, which it reorders into its
blocked (AMX / AVX512-BF16) layout on every call. At the draft pass's sizes (16 to a few hundred
rows) that reorder is a large part of the call: reordered once, a [16 x 576] x [3072 x 576]
linear took 101 us instead of 173 us, and the 16k-row draft lm_head 584 us instead of 880 us,
with bit-identical outputs. torch's own CPU inductor freezing does the same
(`mkldnn._reorder_linear_weight` / `mkldnn._linear_pointwise`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def can_pack(weight: Tensor) -> bool:
    """bf16 weights on a CPU whose torch has oneDNN's linear ops."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: Tensor, rows: int = 16) -> Tensor:
    """`weight` [out, in] in oneDNN's layout for inputs of about `rows` rows (any row count works)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` with the weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An inference-only stand-in for a bf16 `nn.Linear`: the same `weight` parameter (so state
    dicts and dtype checks see no change) and a reordered copy that `forward` uses."""

    def __init__(self, linear: nn.Linear, rows: int = 16) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight, rows)

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears(module: nn.Module, rows: int = 16) -> int:
    """Swap every bf16 CPU `nn.Linear` under `module` for a `PackedLinear`; returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child, rows))
                swapped += 1
    return swapped
