"""The copy gate: its top-k lists are the top of the full mixture, slots without a hint keep the
head's own lists, its loss is the mixture's NLL, a copying head starts from a plain one, a tiny
run learns when to copy, and generation with a live copying head is lossless."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from jetflow_sglang.copy_gate import LOG_Q_FLOOR, CopyGate
from jetflow_sglang.head import JetFlowHead, draft_id_map
from jetflow_sglang.lookup import hint_kind_count, lookup_hint
from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
from jetflow_sglang.reference.proposer import HeadProposer
from jetflow_sglang.training.train import load_init_head, start_from
from jetflow_sglang.tree import top_candidates

from test_hints import periodic_batch, plain_copy
from test_train_units import tiny_head


def random_gate(hidden: int, depths: int, seed: int = 0, scale: float = 1.0) -> CopyGate:
    gate = CopyGate(hidden, depths, hint_kind_count())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in gate.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return gate


def mixture_case(seed: int = 0):
    """A random gate, a pruned draft vocabulary, and hints in and out of it and of the top-k."""
    gen = torch.Generator().manual_seed(seed)
    vocab, rows, depths, hidden_size, batch = 60, 24, 6, 8, 4
    gate = random_gate(hidden_size, depths, seed)
    draft_vocab = torch.randperm(vocab, generator=gen)[:rows].sort().values
    hidden = torch.randn(batch, depths, hidden_size, generator=gen)
    logits = torch.randn(batch, depths, rows, generator=gen) * 2
    tokens = torch.randint(0, vocab, (batch, depths), generator=gen)
    kinds = torch.randint(0, hint_kind_count(), (batch, depths), generator=gen)
    tokens[0, 0], kinds[0, 0] = draft_vocab[logits[0, 0].argmax()], 3  # the head's own top-1
    tokens[1, 1], kinds[1, 1] = draft_vocab[logits[1, 1].argmin()], 2  # in the vocabulary, far down
    outside = torch.tensor([t for t in range(vocab) if t not in draft_vocab.tolist()])
    tokens[2, 2], kinds[2, 2] = outside[0], 1  # a token the head cannot emit ...
    with torch.no_grad():
        gate.bias[2, 1] = 5.0  # ... which its gate copies
    full = torch.full((batch, depths, vocab), float("-inf"))
    full[..., draft_vocab] = logits.log_softmax(-1)
    return gate, draft_vocab, hidden, logits, (tokens, kinds), full


def test_candidates_are_the_top_of_the_full_mixture_and_unhinted_slots_keep_the_heads_lists():
    for seed in range(5):
        gate, draft_vocab, hidden, logits, hints, full = mixture_case(seed)
        mixed = gate.mix(hidden, full, hints)
        assert torch.allclose(mixed.exp().sum(-1), torch.ones(mixed.shape[:-1]), atol=1e-5)  # a distribution
        for width in (1, 4, 10):
            values, ids = gate.candidates(hidden, logits.log_softmax(-1), hints, width, draft_vocab,
                                          draft_id_map(draft_vocab, full.shape[-1]))  # fmt: skip
            want_values, want_ids = mixed.topk(width)
            assert torch.allclose(values, want_values, atol=1e-5) and torch.equal(ids, want_ids), (seed, width)
            plain_values, plain_ids = top_candidates(logits, width, draft_vocab)
            unhinted = hints[1] == 0
            assert unhinted.any() and torch.equal(values[unhinted], plain_values[unhinted])
            assert torch.equal(ids[unhinted], plain_ids[unhinted])
        tokens, kinds = hints
        assert ids.shape[-1] == 10 and tokens[2, 2] in ids[2, 2]  # outside the draft vocabulary, yet listed


def test_the_gate_loss_is_the_mixtures_negative_log_likelihood():
    gate, draft_vocab, hidden, logits, hints, full = mixture_case(1)
    tokens, kinds = hints
    labels = torch.where(torch.rand(tokens.shape, generator=torch.Generator().manual_seed(2)) < 0.5, tokens,
                         draft_vocab[logits.argmax(-1)])  # fmt: skip
    labels[3, 0] = -1
    kinds[0, 1], labels[0, 1] = 1, tokens[2, 2]  # outside the draft vocabulary, and not this slot's hint
    assert tokens[0, 1] != tokens[2, 2]
    nll = gate.nll(hidden, logits.log_softmax(-1), hints, labels, draft_id_map(draft_vocab, full.shape[-1]))
    want = -gate.mix(hidden, full, hints).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    counted = (kinds > 0) & (labels >= 0)
    finite = counted & want.isfinite()
    assert finite.any() and torch.allclose(nll[finite], want[finite], atol=1e-4)
    impossible = counted & ~want.isfinite()  # outside the draft vocabulary and not the hint: the floor
    assert impossible.any() and (nll[impossible].isfinite() & (nll[impossible] >= -LOG_Q_FLOOR)).all()
    assert not nll[~counted].any()
    nll.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate.parameters())


def copying_copy(head: JetFlowHead, seed: int = 0, live: bool = True) -> JetFlowHead:
    """The same head with a copy gate: untrained (live=False, g = 1/2) or random."""
    copying = JetFlowHead(dataclasses.replace(head.config, lookup_copy=True)).to(head.fc.weight.dtype)
    start_from(copying, head)
    if live:
        gate = random_gate(head.config.hidden_size, head.config.block_size - 1, seed, scale=0.5)
        copying.copy_gate.load_state_dict(gate.state_dict())
    return copying.bind_target(head._target_embedding, head._target_lm_head)


def test_a_copying_head_drafts_its_plain_heads_lists_without_hints_and_its_mixture_with_them():
    plain = tiny_head(anchor_fusion=True, tap_norm=True)
    embedding = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    plain.bind_target(embedding, embedding)
    head = copying_copy(plain, live=False)
    assert not any(p.any() for p in head.copy_gate.parameters())  # started from a plain head: g = 1/2
    ids, features = periodic_batch(period=7, length=40)
    hidden = torch.randn(3, plain.config.block_size - 1, 32)
    tokens = torch.randint(0, 50, hidden.shape[:2])
    kinds = torch.ones_like(tokens)
    with torch.no_grad():
        plain_lists = plain.draft_candidates(hidden, 4)
        assert all(torch.equal(a, b) for a, b in zip(plain_lists, head.draft_candidates(hidden, 4)))
        values, top = head.draft_candidates(hidden, 4, (tokens, kinds))
        full = head.logits(hidden, (tokens, kinds))
    assert torch.equal(top[..., 0], tokens)  # g = 1/2 always puts the hint first
    assert torch.allclose(values, full.topk(4).values, atol=1e-5)


def test_init_head_lets_a_copying_run_start_from_a_plain_head(prepared):
    from jetflow_sglang.assets import load_head

    target_dir = Path(prepared["target"])
    shipped = load_head("default", target_dir)
    plain_config = plain_copy(shipped).config
    for hinted in (False, True):
        wanted = dataclasses.replace(plain_config, lookup_copy=True, lookup_hint=hinted)
        start = load_init_head("default", target_dir, wanted)
        head = JetFlowHead(wanted).init_weights(1)
        start_from(head, plain_copy(start))
        assert torch.equal(head.fc.weight, shipped.fc.weight.to(head.fc.weight.dtype))
        assert not any(p.any() for p in head.copy_gate.parameters())


def test_reference_engine_with_a_live_copying_head_is_lossless_and_copies(prepared, target):
    from jetflow_sglang.assets import load_head

    shipped = load_head("default", Path(prepared["target"])).float().bind_target(target.embedding, target.lm_head)
    plain = plain_copy(shipped)
    head = copying_copy(plain, live=True)
    with torch.no_grad():
        head.copy_gate.bias.fill_(4.0)  # copy wherever there is a hint
    proposer = HeadProposer(head)
    seen = []
    propose_topk = proposer.propose_topk

    def spy(anchor, position, width, hints=None):
        lists = propose_topk(anchor, position, width, hints)
        seen.append((hints, lists))
        return lists

    proposer.propose_topk = spy
    ids = target.encode_prompt("def add(a, b):\n    return a + b\n\ndef add3(a, b, c):", chat=False)
    expected = generate_ar(target, ids, 40).tokens
    for lookup in (True, False):
        seen.clear()
        assert ReferenceEngine(target, proposer, budget=16, lookup=lookup).generate(ids, 40).tokens == expected
        hinted = [(h, lists) for h, lists in seen if int(h[1].max()) > 0]
        assert hinted  # the code repeats itself: hints were found and copied to the top
        for (tokens, kinds), (_, top) in hinted:
            assert torch.equal(top[..., 0][kinds > 0], tokens[kinds > 0])
    context = ids + expected[:1]
    assert seen[0][0][0].tolist() == [lookup_hint(context, head.config.block_size - 1, head.config.lookup_hint_ngram)[0]]


def test_the_gate_learns_to_copy_where_the_hints_are_right_and_not_where_they_are_wrong():
    """Overfit a tiny set: on a periodic sequence every hint is right, on a random one the
    hints are mostly wrong; a few hundred steps of the gate's loss alone open the gate on the
    first and close it on the second (the head is held fixed)."""
    from jetflow_sglang.lookup import lookup_hints_batched
    from jetflow_sglang.training.blocks import head_forward_sequences
    from jetflow_sglang.training.objective import copy_gate_loss

    plain = tiny_head(anchor_fusion=True, tap_norm=True)
    embedding = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    plain.bind_target(embedding, embedding)
    head = copying_copy(plain, live=False)
    periodic, features = periodic_batch(period=6, length=48)
    noisy = torch.randint(0, 50, periodic.shape, generator=torch.Generator().manual_seed(4))
    optimizer = torch.optim.Adam(head.copy_gate.parameters(), lr=0.05)
    depth = head.config.block_size - 1
    batches = []
    for ids in (periodic, noisy):
        anchors = torch.arange(12, 32)
        rows = torch.zeros_like(anchors)
        with torch.no_grad():
            hidden, positions = head_forward_sequences(head, features, ids, rows, anchors, torch.tensor([48]), torch.zeros_like(anchors))
        labels = torch.where(positions >= 0, ids[0, positions.clamp(min=0)], -1)
        batches.append((hidden, lookup_hints_batched(ids, rows, anchors, depth), labels))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        optimizer.zero_grad()
        sum(copy_gate_loss(head, *batch, gen) for batch in batches).backward()
        optimizer.step()
    with torch.no_grad():
        for (hidden, hints, labels), copies in zip(batches, (True, False)):
            _, top = head.draft_candidates(hidden, 1, hints)
            right = (hints[0] == labels) & (hints[1] > 0)
            copied = (top[..., 0] == hints[0])[hints[1] > 0].float().mean()
            if copies:
                assert right[hints[1] > 0].all() and copied > 0.95
            else:
                assert right.float().mean() < 0.2 and copied < 0.3
