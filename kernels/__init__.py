"""JetFlow kernels (imported as `jetflow_kernels`): Triton kernels, each beside a torch reference.

The torch references live in `jetflow_sglang` (tree, masks, acceptance); kernels added
here must match them and are tested against them under the Triton interpreter.
"""
