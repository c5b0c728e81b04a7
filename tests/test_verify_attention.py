"""SGLang's Triton attention kernel reads JETFLOW's tree mask as the tree it is.

On a GPU with ``--attention-backend triton``, TARGET_VERIFY runs SGLang's
``extend_attention_fwd`` with ``spec_info.custom_mask`` (our FULL_MASK bytes) and
``mask_indptr = cumsum(Q * (seq_len + Q))``, the prefix read through ``kv_indices``. Here the
kernel runs under the Triton interpreter (a subprocess: see tests/test_kernels.py for why),
fed exactly as the backend feeds it, with masks from ``jetflow_kernels.tree_masks``, and
must equal SDPA over each node's prefix and ancestors; a plain causal run must not (the
check can fail). The same check runs on CUDA where a GPU is present.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

CASES = [  # prefix lengths, budget, width, depths
    ([7], 1, 3, 2),
    ([5, 17, 3], 12, 3, 4),
    ([40, 1, 90, 12], 64, 7, 15),
    ([130, 64], 256, 7, 15),
]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def reference_attention(q, k_buffer, v_buffer, prefix_slots, verify_slots, ancestors, scale):
    """SDPA per request: node i sees the whole prefix, itself and its ancestors."""
    out = torch.empty_like(q)
    budget = ancestors.shape[-1]
    for b, prefix in enumerate(prefix_slots):
        rows = slice(b * budget, (b + 1) * budget)
        slots = torch.cat([prefix, verify_slots[rows]])
        mask = torch.cat([torch.ones(budget, len(prefix), dtype=torch.bool, device=q.device), ancestors[b]], 1)
        keys = k_buffer[slots].transpose(0, 1).float()
        values = v_buffer[slots].transpose(0, 1).float()
        got = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).float(), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[rows] = got.transpose(0, 1).to(q.dtype)
    return out


def check_triton_verify_attention(device: str) -> None:
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from jetflow_kernels import build_tree_from_topk, tree_masks

    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    scale = HEAD_DIM**-0.5
    for prefix_lens, budget, width, depths in CASES:
        batch = len(prefix_lens)
        seq_lens = torch.tensor(prefix_lens)
        logprobs = torch.randn(batch, depths, 50, generator=gen).log_softmax(-1)
        anchors = torch.randint(0, 50, (batch,), generator=gen)
        tree = build_tree_from_topk(anchors.to(device), *[t.to(device) for t in logprobs.topk(width, dim=-1)], budget)
        masks = tree_masks(tree.parents, tree.depths, seq_lens.to(device), packed=False)

        num_slots = sum(prefix_lens) + batch * budget + 16
        slots = torch.randperm(num_slots, generator=gen).to(device)  # scattered, as in a paged KV pool
        prefix_slots = list(torch.split(slots[: sum(prefix_lens)], prefix_lens))
        verify_slots = slots[sum(prefix_lens) : sum(prefix_lens) + batch * budget]
        k_buffer = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
        v_buffer = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
        q = torch.randn(batch * budget, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
        k_new, v_new = k_buffer[verify_slots].clone(), v_buffer[verify_slots].clone()  # written before attention

        # What TritonAttnBackend builds for TARGET_VERIFY.
        qo_indptr = torch.arange(0, (batch + 1) * budget, budget, dtype=torch.int32, device=device)
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = seq_lens.cumsum(0).to(device)
        kv_indices = slots[: sum(prefix_lens)].to(torch.int64)
        mask_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        mask_indptr[1:] = (budget * (seq_lens + budget)).cumsum(0).to(device)

        def run(custom_mask):
            out = torch.empty_like(q)
            extend_attention_fwd(
                q, k_new, v_new, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                custom_mask, True, mask_indptr, budget, 1.0, 1.0, sm_scale=scale,
            )  # fmt: skip
            return out

        want = reference_attention(q, k_buffer, v_buffer, prefix_slots, verify_slots, tree.ancestors, scale)
        got = run(masks.full_mask)
        error = (got.float() - want.float()).abs().max().item()
        assert error < tolerance, (prefix_lens, budget, error)
        if budget > 1 and bool((tree.depths < torch.arange(budget, device=device)).any()):
            causal = (run(None).float() - want.float()).abs().max().item()
            assert causal > 100 * tolerance, (prefix_lens, budget, causal)  # the mask is what made it right
    print("check_triton_verify_attention: ok")


def test_triton_verify_attention_under_interpreter() -> None:
    pytest.importorskip("sglang")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, __file__], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert "check_triton_verify_attention: ok" in result.stdout


@pytest.mark.gpu
def test_triton_verify_attention_on_cuda() -> None:
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    check_triton_verify_attention("cuda")


if __name__ == "__main__":
    check_triton_verify_attention("cpu")
