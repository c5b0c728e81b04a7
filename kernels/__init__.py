"""JetFlow kernels (imported as `jetflow_kernels`): Triton kernels, each beside a torch reference.

The torch references live in `jetflow_sglang` (tree, masks, acceptance) or beside the kernel
(the head's paged attention); the kernels must match them and are tested against them under
the Triton interpreter (tests/test_kernels.py). Each wrapper runs its Triton kernel when its inputs are on CUDA or
TRITON_INTERPRET=1 is set (before this package is imported), else the torch reference.
"""

from ._dispatch import backend_name
from .accept import accept_greedy, accept_sampling, accept_sampling_reference
from .head_attention import PagedContext, paged_block_attention, paged_block_attention_reference, paged_context
from .sampling import sample_inverse_cdf, target_picks_from_uniforms
from .tree_build import build_tree_from_topk, build_tree_reference
from .tree_masks import TreeMasks, ancestor_mask, tree_masks

__all__ = [
    "PagedContext",
    "TreeMasks",
    "backend_name",
    "accept_greedy",
    "accept_sampling",
    "accept_sampling_reference",
    "ancestor_mask",
    "build_tree_from_topk",
    "build_tree_reference",
    "paged_block_attention",
    "paged_block_attention_reference",
    "paged_context",
    "sample_inverse_cdf",
    "target_picks_from_uniforms",
    "tree_masks",
]
