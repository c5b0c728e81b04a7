"""Hinted drafting: the lookup hint (per anchor, batched for training and per request for the
engines), its reading of the past only, its slot alignment, the hinted head's zero start, and
lossless generation with a hinted head whose hint path is live."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.lookup import hint_kind, lookup_draft, lookup_hint, lookup_hints_batched, lookup_match_length
from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
from jetflow_sglang.reference.proposer import HeadProposer
from jetflow_sglang.training.blocks import head_forward_sequences
from jetflow_sglang.training.train import load_init_head, start_from
from jetflow_sglang.training.validate import ValidationSet

from test_train_units import tiny_config, tiny_head


def all_anchors(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = ids.shape
    return torch.arange(b).repeat_interleave(t), torch.arange(t).repeat(b)


@pytest.mark.parametrize("max_ngram", [1, 2, 3, 4])
def test_batched_hints_equal_the_per_request_hint_at_every_prefix(max_ngram):
    rng = random.Random(max_ngram)
    for _ in range(60):
        b, t, vocab, depth = rng.randint(1, 3), rng.randint(1, 40), rng.randint(2, 6), rng.randint(1, 15)
        ids = torch.tensor([[rng.randrange(vocab) for _ in range(t)] for _ in range(b)])
        rows, anchors = all_anchors(ids)
        tokens, kinds = lookup_hints_batched(ids, rows, anchors, depth, max_ngram)
        for i, (row, a) in enumerate(zip(rows.tolist(), anchors.tolist())):
            context = ids[row, : a + 1].tolist()
            expected = lookup_hint(context, depth, max_ngram)
            assert (tokens[i].tolist(), kinds[i].tolist()) == expected, (context, depth)
            chain = lookup_draft(context, depth, max_ngram)
            assert chain == (expected[0] if chain else []) and (chain or set(expected[1]) == {0})


def test_hint_kinds_name_the_match_length_and_the_wrap():
    # ... 5 6 7 | 9 | 5 6 7: the suffix 5 6 7 last occurred ending at index 2, period 4
    context = [5, 6, 7, 9, 5, 6, 7]
    assert lookup_match_length(context, 3) == (2, 3)
    tokens, kinds = lookup_hint(context, 6, 3)
    assert tokens == [9, 5, 6, 7, 9, 5]
    assert kinds == [hint_kind(3, False)] * 4 + [hint_kind(3, True)] * 2
    assert lookup_hint([1, 2, 3], 4, 3) == ([0] * 4, [0] * 4)  # 3 never occurred before: no hint
    _, kinds = lookup_hint([4, 8, 4], 3, 3)  # only the 1-gram 4 matches, period 2
    assert kinds == [hint_kind(1, False), hint_kind(1, False), hint_kind(1, True)]


def test_hints_read_only_the_past():
    rng = random.Random(7)
    ids = torch.tensor([[rng.randrange(4) for _ in range(60)] for _ in range(2)])
    rows, anchors = all_anchors(ids)
    tokens, kinds = lookup_hints_batched(ids, rows, anchors, 15)
    for a in range(0, 60, 7):
        changed = ids.clone()
        changed[:, a + 1 :] = torch.randint(0, 4, changed[:, a + 1 :].shape)
        again = lookup_hints_batched(changed, rows, anchors, 15)
        at = anchors == a
        assert torch.equal(again[0][at], tokens[at]) and torch.equal(again[1][at], kinds[at])


def plain_copy(head: JetFlowHead) -> JetFlowHead:
    """The same head without a hint path or a copy gate (its weights less hint_proj, the kinds and the gate)."""
    plain = JetFlowHead(dataclasses.replace(head.config, lookup_hint=False, lookup_copy=False)).to(head.fc.weight.dtype)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith(("hint_", "copy_gate."))})
    if head._target_embedding is not None:
        plain.bind_target(head._target_embedding, head._target_lm_head)
    return plain


def hinted_copy(head: JetFlowHead, seed: int = 0, live: bool = True) -> JetFlowHead:
    """The same plain head with a hint path: zero (live=False) or random."""
    hinted = JetFlowHead(dataclasses.replace(head.config, lookup_hint=True)).to(head.fc.weight.dtype)
    missing, unexpected = hinted.load_state_dict(head.state_dict(), strict=False)
    assert sorted(missing) == ["hint_kind_embedding", "hint_proj.weight"] and not unexpected
    hinted.zero_hints()
    if live:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            hinted.hint_proj.weight.copy_(torch.randn(hinted.hint_proj.weight.shape, generator=gen) * 0.05)
            hinted.hint_kind_embedding.copy_(torch.randn(hinted.hint_kind_embedding.shape, generator=gen) * 0.05)
    return hinted.bind_target(head._target_embedding, head._target_lm_head)


def periodic_batch(period: int = 5, length: int = 40, vocab: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, vocab, (period,), generator=gen)
    ids = pattern.repeat(length // period + 1)[:length][None]
    features = torch.randn(1, length, 64, generator=gen)
    return ids, features


def test_a_hinted_head_starts_as_its_plain_head_and_its_hints_move_the_draft():
    plain = tiny_head(anchor_fusion=True, tap_norm=True)
    ids, features = periodic_batch()
    rows, anchors = torch.zeros(20, dtype=torch.long), torch.arange(12, 32)
    args = (features, ids, rows, anchors, torch.tensor([ids.shape[1]]), torch.zeros(20, dtype=torch.long))
    with torch.no_grad():
        base, _ = head_forward_sequences(plain, *args)
        zero, _ = head_forward_sequences(hinted_copy(plain, live=False), *args)
        live = hinted_copy(plain, live=True)
        moved, _ = head_forward_sequences(live, *args)
        dropped, _ = head_forward_sequences(live, *args, 0, torch.zeros(20, dtype=torch.bool))
    assert torch.equal(base, zero)
    assert not torch.allclose(base, moved)
    assert torch.allclose(base, dropped)  # hint dropout: the plain MASK path


def test_slot_d_reads_the_hint_for_the_token_at_anchor_plus_d():
    """With the hint path an identity map (and the draft logits the embedding's own rows), every
    slot drafts its hint; on a periodic sequence the hints are the labels, so a one-slot shift
    (the hint for a+d+1 at slot d) would score near zero."""
    plain = tiny_head(anchor_fusion=True, tap_norm=True)
    embedding = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    plain.bind_target(embedding, embedding)
    head = hinted_copy(plain, live=False)
    with torch.no_grad():
        head.hint_proj.weight.copy_(torch.eye(32) * 1e3)
    ids, features = periodic_batch(period=7, length=60)
    val = ValidationSet([(ids[0], features[0])], [torch.arange(15, 40)], torch.zeros(0), torch.zeros(0))
    depth = head.config.block_size - 1
    labels, chains = [], []
    for a in range(15, 40):
        truth = ids[0, a + 1 : a + 1 + depth].tolist()
        labels.append(truth + [-1] * (depth - len(truth)))
        chains.append(lookup_draft(ids[0, : a + 1].tolist(), depth))
    val.labels, val.lookup_tokens = torch.tensor(labels), torch.tensor(chains)
    scores = val.score(head)
    assert min(scores["top1"]) > 0.95 and scores["lookup_top1"] == [1.0] * depth
    assert scores["hint_use"]["copy"] == [1.0] * depth
    assert scores["blanked_chain_tau"] < 2.0 < scores["chain_tau"]


def test_init_head_lets_a_hinted_run_start_from_a_plain_head(prepared):
    from jetflow_sglang.assets import load_head

    target_dir = Path(prepared["target"])
    shipped = load_head("default", target_dir).config
    start = load_init_head("default", target_dir, dataclasses.replace(shipped, lookup_hint=True))
    assert start.config.lookup_hint is False
    with pytest.raises(JetFlowError, match="num_hidden_layers"):
        load_init_head("default", target_dir, dataclasses.replace(shipped, lookup_hint=True, num_layers=3))
    with pytest.raises(JetFlowError, match="anchor fusion"):
        tiny_config(lookup_hint=True)


def test_a_run_started_from_a_hinted_head_keeps_its_hint_path_and_from_a_plain_one_starts_at_zero():
    plain = tiny_head(anchor_fusion=True, tap_norm=True)
    trained = hinted_copy(plain, live=True)
    for start, expect_zero in ((trained, False), (plain, True)):
        head = JetFlowHead(trained.config).init_weights(5)
        with torch.no_grad():
            head.hint_proj.weight.fill_(1.0)  # whatever a fresh run held before the copy
        start_from(head, start)
        assert torch.equal(head.fc.weight, plain.fc.weight)
        if expect_zero:
            assert not head.hint_proj.weight.any() and not head.hint_kind_embedding.any()
        else:
            assert torch.equal(head.hint_proj.weight, trained.hint_proj.weight)
            assert torch.equal(head.hint_kind_embedding, trained.hint_kind_embedding)


def test_reference_engine_with_a_live_hinted_head_is_lossless_and_passes_the_hints(prepared, target):
    from jetflow_sglang.assets import load_head

    shipped = load_head("default", Path(prepared["target"])).float().bind_target(target.embedding, target.lm_head)
    head = hinted_copy(plain_copy(shipped), live=True)
    proposer = HeadProposer(head)
    seen = []
    propose_topk = proposer.propose_topk

    def spy(anchor, position, width, hints=None):
        seen.append(hints)
        return propose_topk(anchor, position, width, hints)

    proposer.propose_topk = spy
    engine = ReferenceEngine(target, proposer, budget=16, lookup=True)
    ids = target.encode_prompt("def add(a, b):\n    return a + b\n\ndef add3(a, b, c):", chat=False)
    expected = generate_ar(target, ids, 40).tokens
    assert engine.generate(ids, 40).tokens == expected
    assert seen and all(h is not None and h[0].shape == (1, head.config.block_size - 1) for h in seen)
    assert any(int(h[1].max()) > 0 for h in seen)  # the code repeats itself: hints were found
    # The hints are the lookup's own over prompt + committed tokens, anchor last.
    context = ids + expected[:1]
    tokens, kinds = lookup_hint(context, head.config.block_size - 1, head.config.lookup_hint_ngram)
    assert seen[0][0].tolist() == [tokens] and seen[0][1].tolist() == [kinds]
