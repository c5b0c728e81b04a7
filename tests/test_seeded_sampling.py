"""Seeded sampling on the tree (sglang_plugin/seeded_sampling.py): with the same seed, walking a
tree whose nodes are drawn at their own positions commits exactly the tokens that plain seeded
decoding draws one at a time with SGLang's own sampler functions, whatever else the tree holds.

SGLang's deterministic inference (where the server reads `sampling_seed`) needs a GPU attention
backend, so this is checked at the function level on a toy language model: next-token logits
are a fixed random table indexed by the previous token. SGLang's seed hash (`murmur_hash32`) is a
Triton kernel with a CPU op in sgl_kernel's CPU build, which this machine's wheel lacks: on CPU
the tests use `torch_murmur_hash32` below, the same hash in torch, checked on the CPU against
pinned values from SGLang's own Python reference of that hash, and against SGLang's kernel where
a GPU is present (benchmarks/device_check.sh runs that test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch  # noqa: E402

from helpers.trees import random_tree  # noqa: E402
from jetflow_sglang.accept import accept_tree  # noqa: E402
from jetflow_sglang.sglang_plugin.seeded_sampling import seeded_picks  # noqa: E402

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


# Known hash values, computed with SGLang's CPU reference of the same hash (the watermark
# detector's `_murmur3_words` over the words seed low, seed high, position, column; it finalizes
# with 4 * 4 = 16 bytes as the kernel does): (seed, position) -> {column: hash}.
PINNED = {
    (0, 0): {0: 2167721464, 1: 10027521, 31: 1273648775, 32: 454682930, 4095: 3153783674, 151935: 1065631903},
    (42, 17): {0: 3382997381, 1: 3497547135, 31: 1334323548, 32: 2716504633, 4095: 400600367, 151935: 275470352},
    (-7, 5): {0: 3693819169, 1: 128128446, 31: 269436373, 32: 1699801648, 4095: 2181508210, 151935: 1745157860},
    (2**40 + 3, 1 << 20): {0: 2630516582, 1: 1452468848, 31: 1629503929, 32: 3969551611, 4095: 432086748,
                           151935: 3503996084},
    (2**63 - 1, 2**31 - 1): {0: 1367382394, 1: 1259439722, 31: 4003580640, 32: 1876952178, 4095: 1764403172,
                             151935: 3190621704},
    (-(2**63), 123456): {0: 1866208009, 1: 612537173, 31: 2662101541, 32: 3179093718, 4095: 1432270229,
                         151935: 1405816778},
}  # fmt: skip


def test_torch_hash_gives_the_pinned_values():
    """The CPU stand-in for SGLang's kernel, on seeds of both signs and past 32 bits, positions up
    to 2**31 - 1 and columns past 2**17: a wrong constant, rotation, word order or sign
    handling changes these."""
    columns = list(next(iter(PINNED.values())))
    seeds, positions = zip(*PINNED)
    got = torch_murmur_hash32(torch.tensor(seeds), torch.tensor(positions), torch.tensor(columns))
    assert got.dtype == torch.uint32 and got.shape == (len(PINNED), len(columns))
    want = [[row[c] for c in columns] for row in PINNED.values()]
    assert got.to(torch.int64).tolist() == want


def test_torch_hash_equals_sglang_cpu_reference():
    """The pins are SGLang's own reference values, and the stand-in agrees with that reference
    over many more inputs (the reference is plain Python, so this stays on the CPU)."""
    from sglang.srt.sampling.watermarking.detector import _murmur3_words

    mask = 0xFFFFFFFF

    def reference(seed: int, position: int, column: int) -> int:
        return _murmur3_words([seed & mask, (seed >> 32) & mask, position & mask, column & mask])

    assert all(reference(s, p, c) == v for (s, p), row in PINNED.items() for c, v in row.items())
    gen = torch.Generator().manual_seed(1)
    seeds = torch.randint(-(2**63), 2**63 - 1, (12,), generator=gen)
    positions = torch.randint(0, 2**31 - 1, (12,), generator=gen)
    columns = torch.randint(0, 262144, (40,), generator=gen)
    got = torch_murmur_hash32(seeds, positions, columns).to(torch.int64).tolist()
    for i, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist())):
        assert got[i] == [reference(seed, position, c) for c in columns.tolist()], i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang's seed hash kernel needs a GPU here")
def test_torch_hash_equals_sglang_kernel_on_cuda():
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32

    seed = torch.tensor([0, 42, -7, 2**40 + 3], dtype=torch.int64)
    positions = torch.tensor([0, 17, 5, 1 << 20], dtype=torch.int64)
    cols = torch.arange(3000)
    got = murmur_hash32(seed.cuda(), positions.cuda(), cols.cuda()).cpu()
    assert torch.equal(got.to(torch.int64), torch_murmur_hash32(seed, positions, cols).to(torch.int64))
    pinned_seeds, pinned_positions = (torch.tensor(v, dtype=torch.int64) for v in zip(*PINNED))
    pinned_columns = torch.tensor(list(next(iter(PINNED.values()))))
    kernel = murmur_hash32(pinned_seeds.cuda(), pinned_positions.cuda(), pinned_columns.cuda()).cpu()
    assert kernel.to(torch.int64).tolist() == [list(row.values()) for row in PINNED.values()]


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
    return random_tree([anchor], DEPTHS, VOCAB, BUDGET, torch.Generator().manual_seed(seed), path)


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
