"""Seeded sampling on the tree (sglang_plugin/seeded_sampling.py): with the same seed, walking a
tree whose nodes are drawn at their own positions commits exactly the tokens that plain seeded
decoding draws one at a time with SGLang's own sampler functions, whatever else the tree holds.

SGLang's deterministic inference (where the server reads `sampling_seed`) needs a GPU attention
backend, so this is checked at the function level on a toy language model: next-token logits
are a fixed random table indexed by the previous token. SGLang's seed hash (`murmur_hash32`) is a
Triton kernel with a CPU op in sgl_kernel's CPU build, which this machine's wheel lacks: on CPU
the tests use `torch_murmur_hash32` below, the same hash in torch (checked against SGLang's
kernel where a GPU is present)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch  # noqa: E402

from jetflow_sglang.accept import accept_tree  # noqa: E402
from jetflow_sglang.sglang_plugin.seeded_sampling import seeded_picks  # noqa: E402
from jetflow_sglang.tree import build_tree  # noqa: E402

VOCAB, DEPTHS, BUDGET = 30, 6, 40
TABLE = 2.0 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))  # logits after token t: TABLE[t]


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    mask = 0xFFFFFFFF
    k = (k * 0xCC9E2D51) & mask
    k = ((k << 15) | (k >> 17)) & mask
    k = (k * 0x1B873593) & mask
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & mask
    return (h * 5 + 0xE6546B64) & mask


def torch_murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's `murmur_hash32_kernel` (sglang/kernels/ops/sampling/murmur_hash.py) in int64 torch:
    seed low and high words, position, column, length 16, fmix32. [n, m] values in [0, 2**32)."""
    mask = 0xFFFFFFFF
    seed = seed.to(torch.int64)
    h = torch.zeros((seed.shape[0], col_indices.shape[0]), dtype=torch.int64)
    h = _mix(h, (seed & mask)[:, None])
    h = _mix(h, ((seed >> 32) & mask)[:, None])
    h = _mix(h, (positions.to(torch.int64) & mask)[:, None])
    h = _mix(h, (col_indices.to(torch.int64) & mask)[None, :])
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    return (h ^ (h >> 16)).to(torch.uint32)


@pytest.fixture(autouse=True)
def seed_hash_on_cpu(monkeypatch):
    if not torch.cuda.is_available():
        import sglang.srt.layers.sampler as sampler

        monkeypatch.setattr(sampler, "murmur_hash32", torch_murmur_hash32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang's seed hash kernel needs a GPU here")
def test_torch_hash_equals_sglang_kernel():
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32

    seed = torch.tensor([0, 42, -7, 2**40 + 3], dtype=torch.int64)
    positions = torch.tensor([0, 17, 5, 1 << 20], dtype=torch.int64)
    cols = torch.arange(3000)
    got = murmur_hash32(seed.cuda(), positions.cuda(), cols.cuda()).cpu()
    assert torch.equal(got.to(torch.int64), torch_murmur_hash32(seed, positions, cols).to(torch.int64))


def info(batch: int, seed: int, temperature: float, top_k: int, top_p: float) -> SimpleNamespace:
    filtered = top_k != 1 << 30 or top_p < 1.0
    return SimpleNamespace(
        temperatures=torch.full((batch, 1), temperature), top_ks=torch.full((batch,), top_k),
        top_ps=torch.full((batch,), top_p), min_ps=torch.zeros(batch), sampling_seed=torch.full((batch,), seed),
        need_top_p_sampling=top_p < 1.0, need_top_k_sampling=filtered and top_k != 1 << 30, need_min_p_sampling=False,
    )  # fmt: skip


def plain_seeded_decode(anchor: int, position: int, steps: int, sampling: SimpleNamespace) -> list[int]:
    """The target alone: one SGLang sampler call per token, at the input token's position."""
    tokens, last = [], anchor
    for step in range(steps):
        probs = (TABLE[last] / sampling.temperatures[0]).softmax(-1)[None]
        seed, pos = sampling.sampling_seed[:1], torch.tensor([position + step])
        if sampling.need_top_k_sampling or sampling.need_top_p_sampling:
            pick = top_k_top_p_min_p_sampling_from_probs_torch(
                probs, sampling.top_ks[:1], sampling.top_ps[:1], sampling.min_ps[:1], False, seed, pos)  # fmt: skip
        else:
            pick = sampling_from_probs_torch(probs, sampling_seed=seed, positions=pos)
        last = int(pick[0])
        tokens.append(last)
    return tokens


def tree_holding(anchor: int, path: list[int], seed: int):
    """A best-first tree over random drafts with `path` forced to the top of every depth."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(1, DEPTHS, VOCAB, generator=gen)
    for depth, token in enumerate(path[:DEPTHS]):
        logprobs[0, depth, token] = 10.0
    return build_tree(torch.tensor([anchor]), logprobs.log_softmax(-1), BUDGET)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 1 << 30, 1.0), (0.8, 5, 1.0), (1.2, 8, 0.85)])
def test_tree_walk_commits_what_plain_seeded_decoding_draws(temperature, top_k, top_p):
    anchor, seq_len = 4, 17
    outputs = set()
    for seed in range(6):
        sampling = info(1, seed, temperature, top_k, top_p)
        want = plain_seeded_decode(anchor, seq_len, DEPTHS + 1, sampling)
        tree = tree_holding(anchor, want, seed)
        logits = TABLE[tree.tokens]  # [1, N, V]: each node's next-token logits
        picks = seeded_picks(logits, tree, torch.tensor([seq_len]), sampling)
        acceptance = accept_tree(tree, picks, max_depth=DEPTHS)
        committed = acceptance.committed_tokens(tree)[0, : int(acceptance.num_accepted[0]) + 1].tolist()
        assert int(acceptance.num_accepted[0]) == DEPTHS, seed  # the drawn path was in the tree
        assert committed == want, (seed, committed, want)
        outputs.add(tuple(want))
    assert len(outputs) > 1  # the seed matters


def test_a_tree_without_the_drawn_path_commits_its_prefix_then_the_draw():
    anchor, seq_len, seed = 9, 30, 3
    sampling = info(1, seed, 1.0, 1 << 30, 1.0)
    want = plain_seeded_decode(anchor, seq_len, DEPTHS + 1, sampling)
    wrong = [(want[0] + 1) % VOCAB] * DEPTHS  # the tree misses the first drawn token
    tree = tree_holding(anchor, wrong, seed)
    tree.tokens[tree.tokens == want[0]] = (want[0] + 2) % VOCAB  # nowhere at all
    picks = seeded_picks(TABLE[tree.tokens], tree, torch.tensor([seq_len]), sampling)
    acceptance = accept_tree(tree, picks, max_depth=DEPTHS)
    assert int(acceptance.num_accepted[0]) == 0 and int(acceptance.bonus[0]) == want[0]
