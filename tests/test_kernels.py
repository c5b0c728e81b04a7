"""Triton kernels (jetflow_kernels) against their torch references.

Every kernel runs under the Triton interpreter on CPU in a subprocess (this file run as a
script, with TRITON_INTERPRET=1): Triton reads that variable when a kernel is decorated, so
setting it here would also turn every Triton kernel imported later in this pytest process
(SGLang's) into an interpreted one, and it would leak into the servers other tests start.
The same checks run in-process on CUDA where a GPU is present.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
import triton
from jetflow_kernels._dispatch import interpreting, use_triton
from jetflow_kernels.accept import (
    _accept_kernel,
    accept_greedy,
    accept_sampling,
    accept_sampling_reference,
)
from jetflow_kernels.sampling import sample_inverse_cdf, target_picks_from_uniforms
from jetflow_kernels.head_attention import (
    _paged_block_attention_kernel,
    paged_block_attention,
    paged_block_attention_reference,
    paged_context,
)
from jetflow_kernels.tree_build import (
    _tree_build_kernel,
    build_tree_from_topk,
    build_tree_reference,
)
from jetflow_kernels.tree_masks import _ancestor_kernel, _mask_kernel, tree_masks
from scipy.stats import chisquare

from helpers.stats import P_MIN, joint_fit
from jetflow_sglang.accept import accept_tree, processed_probs, target_picks
from jetflow_sglang.tree import (
    DraftTree,
    ancestor_mask,
    build_tree,
    full_mask,
    packed_mask,
)


# --------------------------------------------------------------------------- inputs


def draft_logprobs(gen: torch.Generator, batch: int, depths: int, vocab: int, mode: str) -> torch.Tensor:
    """[batch, depths, vocab]: continuous (no ties), quantized (many ties), or uniform (all tied)."""
    if mode == "continuous":
        logits = torch.randn(batch, depths, vocab, generator=gen) * 2
    elif mode == "quantized":
        logits = torch.randint(0, 3, (batch, depths, vocab), generator=gen).float()
    else:
        logits = torch.zeros(batch, depths, vocab)
    return torch.log_softmax(logits, -1)


def random_tree(gen: torch.Generator, batch: int, budget: int, vocab: int, width: int, depths: int) -> DraftTree:
    anchors = torch.randint(0, vocab, (batch,), generator=gen)
    return build_tree(anchors, draft_logprobs(gen, batch, depths, vocab, "continuous"), budget, width)


def random_parent_tree(gen: torch.Generator, batch: int, budget: int, chain: bool = False) -> DraftTree:
    """Random recursive trees (parent drawn uniformly from earlier nodes), or a single chain."""
    parents = torch.full((batch, budget), -1, dtype=torch.long)
    depths = torch.zeros(batch, budget, dtype=torch.long)
    for node in range(1, budget):
        parents[:, node] = node - 1 if chain else torch.randint(0, node, (batch,), generator=gen)
        depths[:, node] = depths.gather(1, parents[:, node : node + 1])[:, 0] + 1
    return DraftTree(torch.zeros_like(parents), parents, depths, depths.float(), ancestor_mask(parents, budget - 1))


def picks_along_tree(gen: torch.Generator, tree: DraftTree, vocab: int, follow: float) -> torch.Tensor:
    """Target tokens [b, N]: at each node, with probability `follow`, the token of its first
    (best) child, else a random token."""
    batch, budget = tree.tokens.shape
    node_index = torch.arange(1, budget).expand(batch, -1)
    first_child = torch.full((batch, budget), budget).scatter_reduce(
        1, tree.parents[:, 1:].clamp(min=0), node_index, "amin"
    )
    has_child = first_child < budget
    child_token = tree.tokens.gather(1, first_child.clamp(max=budget - 1))
    follows = (torch.rand(batch, budget, generator=gen) < follow) & has_child
    return torch.where(follows, child_token, torch.randint(0, vocab, (batch, budget), generator=gen))


def to(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def tree_to(tree: DraftTree, device: str) -> DraftTree:
    return DraftTree(*to(device, tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors))


def assert_same_acceptance(got, want) -> None:
    assert torch.equal(got.path.cpu(), want.path.cpu())
    assert torch.equal(got.num_accepted.cpu(), want.num_accepted.cpu())
    assert torch.equal(got.bonus.cpu(), want.bonus.cpu())


# --------------------------------------------------------------------------- kernel checks (interpreter or CUDA)


def check_tree_build(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cases = [  # batch, depths, vocab, width, budget, mode
        (1, 1, 5, 3, 1, "continuous"),
        (2, 1, 5, 3, 4, "continuous"),
        (3, 3, 6, 3, 13, "quantized"),
        (2, 4, 5, 2, 31, "uniform"),  # the whole tree, all scores tied per depth
        (2, 5, 40, 7, 100, "continuous"),
        (2, 6, 20, 4, 300, "quantized"),
        (1, 10, 64, 7, 512, "continuous"),
        (1, 6, 9, 5, 512, "quantized"),
        (64, 3, 12, 3, 8, "continuous"),
        (64, 2, 4, 4, 6, "uniform"),
    ]
    for batch, depths, vocab, width, budget, mode in cases:
        logprobs = draft_logprobs(gen, batch, depths, vocab, mode).to(device)
        anchors = torch.randint(0, vocab, (batch,), generator=gen).to(device)
        assert use_triton(logprobs)
        want = build_tree(anchors, logprobs, budget, width)
        got = build_tree_from_topk(anchors, *logprobs.topk(width, dim=-1), budget)
        for field in ("tokens", "parents", "depths", "scores", "ancestors"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, batch, budget, mode)


def check_tree_masks(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    trees = [
        random_tree(gen, 1, 1, 5, 3, 2),
        random_tree(gen, 3, 7, 10, 3, 3),
        random_tree(gen, 2, 64, 50, 5, 6),
        random_tree(gen, 1, 512, 64, 7, 10),
        random_tree(gen, 64, 9, 10, 3, 3),
        random_parent_tree(gen, 3, 45),
        random_parent_tree(gen, 1, 512),
        random_parent_tree(gen, 2, 70, chain=True),
    ]
    for tree in trees:
        batch = tree.tokens.shape[0]
        for prefix_lens in (torch.zeros(batch, dtype=torch.long), torch.randint(0, 40, (batch,), generator=gen)):
            tree_on = tree_to(tree, device)
            prefix_on = prefix_lens.to(device)
            assert use_triton(tree_on.parents)
            got = tree_masks(tree_on.parents, tree_on.depths, prefix_on)
            want_packed, want_indptr = packed_mask(tree_on, prefix_on)
            assert torch.equal(got.ancestors, tree_on.ancestors)
            assert torch.equal(got.positions, tree_on.positions(prefix_on))
            assert torch.equal(got.full_mask, full_mask(tree_on, prefix_on))
            assert torch.equal(got.packed_mask, want_packed)
            assert torch.equal(got.packed_indptr, want_indptr)
            unpacked = tree_masks(tree_on.parents, tree_on.depths, prefix_on, packed=False)
            assert unpacked.packed_mask is None and unpacked.packed_indptr is None
            assert torch.equal(unpacked.full_mask, got.full_mask) and torch.equal(unpacked.positions, got.positions)


def check_accept_greedy(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    cases = [  # batch, budget, vocab, width, depths, max_depth
        (1, 1, 5, 3, 2, None),
        (4, 5, 10, 3, 3, 3),
        (3, 64, 30, 5, 6, None),
        (2, 512, 64, 7, 10, 10),
        (64, 16, 12, 3, 4, 4),
    ]
    deepest = 0
    for batch, budget, vocab, width, depths, max_depth in cases:
        tree = random_tree(gen, batch, budget, vocab, width, depths)
        for follow in (0.0, 0.9, 1.0):
            picks = picks_along_tree(gen, tree, vocab, follow)
            tree_on, (picks_on,) = tree_to(tree, device), to(device, picks)
            assert use_triton(tree_on.tokens)
            got = accept_greedy(tree_on, picks_on, max_depth)
            want = accept_tree(tree, picks, max_depth)
            assert_same_acceptance(got, want)
            deepest = max(deepest, int(want.num_accepted.max()))
    assert deepest >= 5  # the walks went deep, not just root-only


def sampling_case(gen: torch.Generator, batch: int, budget: int, vocab: int, width: int, depths: int):
    """A tree, logits that favour one child per node (so walks go deep), uniforms, and mixed
    per-request temperature (some greedy), top-k (off, cutting, or above the vocab) and top-p."""
    tree = random_tree(gen, batch, budget, vocab, width, depths)
    logits = torch.randn(batch, budget, vocab, generator=gen)
    favoured = picks_along_tree(gen, tree, vocab, 1.0)
    logits.scatter_add_(2, favoured[..., None], torch.full((batch, budget, 1), 2.5))
    uniforms = torch.rand(batch, budget, generator=gen)
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.3
    temperature[torch.rand(batch, generator=gen) < 0.15] = 0.0
    top_k = torch.randint(0, vocab + 3, (batch,), generator=gen) * (torch.rand(batch, generator=gen) < 0.6)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.6, torch.rand(batch, generator=gen) * 0.95 + 0.01, 1.0)
    return tree, logits, uniforms, temperature, top_k, top_p


def check_accept_sampling(device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    cases = [  # batch, budget, vocab, width, depths
        (1, 1, 7, 3, 2),
        (24, 6, 8, 3, 3),
        (16, 20, 50, 4, 4),
        (64, 4, 16, 3, 2),
        (2, 512, 64, 7, 10),
        (2, 5, 5000, 3, 2),  # more than one vocabulary chunk
    ]
    mismatches = total = 0
    deepest = 0
    for batch, budget, vocab, width, depths in cases:
        tree, logits, uniforms, temperature, top_k, top_p = sampling_case(gen, batch, budget, vocab, width, depths)
        assert use_triton(logits.to(device))
        got = accept_sampling(tree_to(tree, device), *to(device, logits, uniforms, temperature, top_k, top_p))
        want = accept_sampling_reference(tree, logits, uniforms, temperature, top_k, top_p)
        same = (got.path.cpu() == want.path).all(1) & (got.bonus.cpu() == want.bonus)
        mismatches += int((~same).sum())
        total += batch
        deepest = max(deepest, int(want.num_accepted.max()))
    # The interpreter computes in numpy: bit for bit the reference's draws. CUDA's exp and
    # summation order round differently, which moves a draw only when its uniform lies within
    # rounding of a CDF step.
    assert mismatches <= (0 if interpreting() else total // 100), (mismatches, total)
    assert deepest >= 3

    # End to end in distribution: many kernel draws on one small tree against the exact
    # probability of every outcome (accepted tokens, then the bonus).
    tree, logits, _, _, _, _ = sampling_case(gen, 1, 4, 4, 2, 2)
    draws = 600
    wide_tree = DraftTree(
        *(t.expand(draws, *t.shape[1:]) for t in (tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors))
    )
    uniforms = torch.rand(draws, 4, generator=gen)
    got = accept_sampling(tree_to(wide_tree, device), *to(device, logits.expand(draws, -1, -1), uniforms), 0.8)
    observed = Counter(map(tuple, got.committed_tokens(tree_to(wide_tree, device)).cpu().tolist()))
    assert_fits(observed, outcome_probs(tree, processed_probs(logits[0], 0.8)), draws)


# --------------------------------------------------------------------------- distribution helpers


def outcome_probs(tree: DraftTree, probs: torch.Tensor) -> dict[tuple, float]:
    """Exact probability of each committed sequence (padded with -1 to N) for request 0 of
    `tree` when the target draws from probs [N, V] at every node."""
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    budget = len(tokens)
    outcomes: dict[tuple, float] = {}

    def walk(node: int, committed: list[int], mass: float) -> None:
        children = {tokens[c]: c for c in range(budget) if parents[c] == node}
        for token, p in enumerate(probs[node].tolist()):
            if p == 0:
                continue
            if token in children:
                walk(children[token], committed + [token], mass * p)
            else:
                sequence = committed + [token]
                outcomes[tuple(sequence + [-1] * (budget - len(sequence)))] = mass * p

    walk(0, [], 1.0)
    return outcomes


def assert_fits(observed: Counter, expected: dict[tuple, float], draws: int) -> None:
    """Chi-square goodness of fit (`joint_fit`); outcomes expected fewer than 5 times are pooled."""
    assert set(observed) <= set(expected), set(observed) - set(expected)
    p_value, obs, _ = joint_fit(observed, expected, draws)
    assert len(obs) >= 3
    assert p_value > P_MIN


def check_paged_block_attention(device: str) -> None:
    """The head's paged attention against the gather + SDPA reference: ragged and empty contexts,
    scattered slots, GQA, causal and bidirectional blocks, sliding windows, fp32 and (on CUDA) bf16."""
    gen = torch.Generator().manual_seed(6)
    cases = [  # context lengths, block, heads, kv heads, head dim
        ([0], 1, 2, 1, 16),
        ([5, 130, 0, 64], 16, 9, 3, 64),
        ([300], 8, 4, 4, 32),
        ([1, 2, 3, 200, 64, 65, 0, 7], 16, 32, 8, 128),
    ]
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for lens, block, heads, kv_heads, head_dim in cases:
        batch, rows = len(lens), len(lens) + 3
        num_slots = sum(lens) + 10
        req_to_token = torch.zeros(rows, max(lens) + 5, dtype=torch.int32)
        req_pool_indices = torch.randperm(rows, generator=gen)[:batch]
        slots = torch.randperm(num_slots, generator=gen)
        start = 0
        for row, n in zip(req_pool_indices.tolist(), lens):
            req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
            start += n
        for dtype in dtypes:
            def rand(*shape):
                return torch.randn(*shape, generator=gen).to(device, dtype)

            q, block_k, block_v = rand(batch, heads, block, head_dim), rand(batch, kv_heads, block, head_dim), rand(batch, kv_heads, block, head_dim)
            key_cache, value_cache = rand(num_slots, kv_heads, head_dim), rand(num_slots, kv_heads, head_dim)
            args = (key_cache, value_cache, req_to_token.to(device), req_pool_indices.to(device), torch.tensor(lens).to(device))
            # Sliding-window layers: a window inside the block, and one that starts mid-context.
            for causal, window in ((True, 0), (False, 0), (True, 5), (True, 70)):
                assert use_triton(q)
                got = paged_block_attention(q, block_k, block_v, *args, causal, window)
                want = paged_block_attention_reference(q.float(), block_k.float(), block_v.float(), *[a.float() if a.is_floating_point() else a for a in args], causal, window)
                tolerance = 1e-5 if dtype == torch.float32 else 2e-2
                error = (got.float() - want).abs().max().item()
                assert error < tolerance, (lens, block, heads, dtype, causal, window, error)


CHECKS = {
    check.__name__: check
    for check in (check_tree_build, check_tree_masks, check_accept_greedy, check_accept_sampling, check_paged_block_attention)
}


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("check", list(CHECKS))
def test_kernel_under_triton_interpreter(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, __file__, check], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"{check}: ok" in result.stdout


# Every kernel at the largest blocks its wrapper launches: argument types, constexprs, warps.
SM90_BUILDS = {
    "tree_build": (
        _tree_build_kernel,
        "*i64 *fp32 *i64 *i64 *i64 *i64 *fp32 *fp32 *i64 *i32 *i32 *i32 i32 i32 i32 i32",
        {"KEEP_BLOCK": 512, "CAND_BLOCK": 2048},
        8,
    ),
    "ancestors": (_ancestor_kernel, "*i64 *u8 i32", {"TILE": 32}, 4),
    "masks": (_mask_kernel, "*u8 *i64 *i64 *i64 *i64 *i64 *u8 *u8 i32", {"BLOCK": 4096}, 4),
    "accept_greedy": (
        _accept_kernel,
        "*i64 *i64 *i64 *fp32 *fp32 *fp32 *i64 *fp32 *i64 *i64 *i64 i32 i32 i32",
        {"BLOCK_N": 512, "BLOCK_V": 1, "SAMPLING": False},
        4,
    ),
    "paged_block_attention": (
        _paged_block_attention_kernel,
        "*bf16 *bf16 *bf16 *bf16 *bf16 *i32 *i64 *i64 *bf16 i32 i32 i32 i32 fp32",
        {"CAUSAL": True, "WINDOW": 0, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 128, "DOT_PRECISION": "tf32"},
        4,
    ),
    "paged_block_attention_sliding": (
        _paged_block_attention_kernel,
        "*bf16 *bf16 *bf16 *bf16 *bf16 *i32 *i64 *i64 *bf16 i32 i32 i32 i32 fp32",
        {"CAUSAL": True, "WINDOW": 2048, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 128, "DOT_PRECISION": "tf32"},
        4,
    ),
    "accept_sampling": (
        _accept_kernel,
        "*i64 *i64 *i64 *fp32 *fp32 *fp32 *i64 *fp32 *i64 *i64 *i64 i32 i32 i32",
        {"BLOCK_N": 512, "BLOCK_V": 4096, "SAMPLING": True},
        4,
    ),
}


@pytest.mark.parametrize("build", list(SM90_BUILDS))
def test_kernel_compiles_for_sm90(build: str) -> None:
    """Compile to an H100/H200 cubin without a GPU: the interpreter accepts code the compiler
    rejects (e.g. a constexpr reassigned in an unrolled loop)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, arg_types, constexprs, num_warps = SM90_BUILDS[build]
    runtime_args = iter(arg_types.split())
    signature = {name: "constexpr" if name in constexprs else next(runtime_args) for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"]
    if not build.startswith("paged_block_attention"):  # reads only inputs; the others re-read what they wrote
        # The tree build re-reads its scratch after barriers: those loads must not go through the
        # non-coherent read-only cache.
        assert "ld.global.nc" not in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("check", list(CHECKS))
def test_kernel_on_cuda(check: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    CHECKS[check]("cuda")


def test_cpu_wrappers_are_the_references() -> None:
    """Off CUDA and without the interpreter the wrappers run torch: the top-k-list tree build
    maps ranks back to tokens, and the masks come from the shared functions."""
    gen = torch.Generator().manual_seed(5)
    logprobs = draft_logprobs(gen, 3, 4, 30, "continuous")
    anchors = torch.randint(0, 30, (3,), generator=gen)
    got = build_tree_reference(anchors, *logprobs.topk(5, dim=-1), 40)
    want = build_tree(anchors, logprobs, 40, 5)
    for field in ("tokens", "parents", "depths", "scores", "ancestors"):
        assert torch.equal(getattr(got, field), getattr(want, field))
    prefix_lens = torch.tensor([0, 3, 17])
    masks = tree_masks(want.parents, want.depths, prefix_lens)
    assert torch.equal(masks.full_mask, full_mask(want, prefix_lens))
    assert torch.equal(masks.positions, want.positions(prefix_lens))
    assert torch.equal(masks.packed_mask, packed_mask(want, prefix_lens)[0])
    assert torch.equal(masks.ancestors, want.ancestors)
    unpacked = tree_masks(want.parents, want.depths, prefix_lens, packed=False)
    assert unpacked.packed_mask is None and torch.equal(unpacked.full_mask, masks.full_mask)
    reused = tree_masks(want.parents, want.depths, prefix_lens, packed=False, ancestors=want.ancestors)  # the worker's call
    assert reused.ancestors is want.ancestors and torch.equal(reused.full_mask, masks.full_mask)


def test_one_paged_context_serves_every_layer_as_the_reference() -> None:
    """The draft pass gathers each request's context slots once (`paged_context`) for all its
    layers: per layer, causal or not, windowed or not, the same output as the reference alone."""
    gen = torch.Generator().manual_seed(8)
    lens, block, heads, kv_heads, head_dim, layers = [5, 130, 0, 64], 16, 9, 3, 64, 3
    batch, rows = len(lens), len(lens) + 2
    req_to_token = torch.zeros(rows, max(lens) + 4, dtype=torch.int32)
    req_pool_indices = torch.randperm(rows, generator=gen)[:batch]
    slots, start = torch.randperm(sum(lens) + 10, generator=gen), 0
    for row, n in zip(req_pool_indices.tolist(), lens):
        req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
        start += n
    seq_lens = torch.tensor(lens)
    context = paged_context(req_to_token, req_pool_indices, seq_lens, block)
    assert context is not None  # CPU without the interpreter: the reference runs
    caches = torch.randn(layers, 2, sum(lens) + 10, kv_heads, head_dim, generator=gen)
    for layer, (causal, window) in enumerate(((True, 0), (False, 0), (True, 70))):
        q = torch.randn(batch, heads, block, head_dim, generator=gen)
        block_k, block_v = torch.randn(2, batch, kv_heads, block, head_dim, generator=gen)
        args = (caches[layer, 0], caches[layer, 1], req_to_token, req_pool_indices, seq_lens, causal, window)
        got = paged_block_attention(q, block_k, block_v, *args, context)
        assert torch.equal(got, paged_block_attention_reference(q, block_k, block_v, *args))


def test_tree_build_rejects_bad_budgets() -> None:
    lists = torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.long)
    with pytest.raises(ValueError):
        build_tree_from_topk(torch.zeros(1, dtype=torch.long), *lists, 14)  # 1 + 3 + 9 = 13 nodes at most
    with pytest.raises(ValueError):
        build_tree_from_topk(torch.zeros(1, dtype=torch.long), *lists, 0)


def test_inverse_cdf_draws_follow_processed_probs() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    temperature, top_k, top_p = torch.tensor([0.7, 1.3, 1.0]), torch.tensor([0, 4, 3]), torch.tensor([0.8, 1.0, 0.9])
    probs = processed_probs(logits, temperature, top_k, top_p)
    draws = 20000
    picks = sample_inverse_cdf(probs.expand(draws, -1, -1), torch.rand(draws, 3, generator=gen))
    for row in range(3):
        counts = torch.bincount(picks[:, row], minlength=6)
        kept = probs[row] > 0
        assert counts[~kept].sum() == 0
        expected = probs[row][kept].double()
        assert chisquare(counts[kept].tolist(), (expected / expected.sum() * draws).tolist()).pvalue > P_MIN


def test_sampling_reference_matches_target_picks_in_distribution() -> None:
    """The inverse-CDF acceptance reference and `target_picks` + `accept_tree` (multinomial)
    both follow the exact outcome distribution."""
    gen = torch.Generator().manual_seed(7)
    tree, logits, _, _, _, _ = sampling_case(gen, 1, 6, 5, 2, 3)
    draws = 20000
    params = torch.tensor([0.9]), torch.tensor([4]), torch.tensor([0.85])
    expected = outcome_probs(tree, processed_probs(logits[0], *params))
    wide_tree = DraftTree(
        *(t.expand(draws, *t.shape[1:]) for t in (tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors))
    )
    wide_logits = logits.expand(draws, -1, -1)
    uniforms = torch.rand(draws, 6, generator=gen)
    by_inverse_cdf = accept_sampling_reference(wide_tree, wide_logits, uniforms, *(p.expand(draws) for p in params))
    by_multinomial = accept_tree(wide_tree, target_picks(wide_logits, 0.9, 4, 0.85, generator=gen))
    for acceptance in (by_inverse_cdf, by_multinomial):
        assert_fits(Counter(map(tuple, acceptance.committed_tokens(wide_tree).tolist())), expected, draws)
    assert torch.equal(
        target_picks_from_uniforms(
            wide_logits[:2], uniforms[:2], torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2)
        ),
        wide_logits[:2].argmax(-1),
    )


if __name__ == "__main__":
    # python tests/test_kernels.py CHECK, with TRITON_INTERPRET=1 (see the module docstring)
    assert interpreting(), "run with TRITON_INTERPRET=1"
    name = sys.argv[1]
    started = time.perf_counter()
    CHECKS[name]("cpu")
    print(f"{name}: ok in {time.perf_counter() - started:.1f}s")
