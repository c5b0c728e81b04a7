"""A hinted (and copying) head in the SGLang worker: lookup hints built from the worker's committed ids
(sglang_plugin/hints.py), carried through the draft pass and its CUDA-graph replay buffers
(proposer.py, draft_graphs.py, here in the "padded" mode), and served end to end: a hinted head
drafts in the server exactly as in the HF reference engine, with the free branch on and off."""

from __future__ import annotations

import dataclasses
from array import array
from types import SimpleNamespace

import pytest
import torch

from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.lookup import lookup_draft, lookup_hint
from jetflow_sglang.sglang_plugin.committed_ids import CommittedIds
from jetflow_sglang.sglang_plugin.hints import RoundLookups
from jetflow_sglang.sglang_plugin.lookup_branch import LookupBranch
from jetflow_sglang.sglang_plugin.proposer import DraftRequest, PagedHeadProposer
from test_head import FUSED, as_logprobs, paged_proposer, small_head
from test_hints import plain_copy

DEPTHS = 6


def request(rid: str, ids: list[int]):
    """What the worker reads of an SGLang Req: its id and origin + output ids."""
    return SimpleNamespace(rid=rid, full_untruncated_fill_ids=array("q", ids))


def test_hints_read_the_committed_ids_and_the_branch_reuses_them():
    """Each request's hint is `lookup_hint` of its committed ids + anchor (the branch's context);
    unknown ids give kind 0; the branch's chains are the hint tokens when both match suffixes of
    the same length, and are matched again otherwise."""
    ids = {"a": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], "b": [10, 11, 12, 13], "c": [7, 8, 9, 7, 8]}
    reqs = [request(rid, row) for rid, row in ids.items()] + [request("d", [1, 2, 1])]
    record = CommittedIds()
    record.on_extend(reqs[:3], torch.tensor([12, 4, 5]))  # "d" was never extended: ids unknown
    seq_lens, anchors = torch.tensor([12, 4, 5, 3]), torch.tensor([3, 14, 9, 2])
    branch = LookupBranch(DEPTHS)

    chains, hints = RoundLookups(branch, DEPTHS, hint_ngram=3)(reqs, seq_lens, anchors, record)
    contexts = [ids["a"] + [3], ids["b"] + [14], ids["c"] + [9]]
    for i, context in enumerate(contexts):
        assert (hints.tokens[i], hints.kinds[i]) == lookup_hint(context, DEPTHS, 3), i
    assert hints.tokens[3] == [0] * DEPTHS and hints.kinds[3] == [0] * DEPTHS
    assert hints.kinds[0][0] > 0 and hints.kinds[1] == [0] * DEPTHS  # anchor 14 never occurred
    assert chains == branch.chains(reqs, seq_lens, anchors, record) == [lookup_draft(c, DEPTHS) for c in contexts] + [[]]
    tokens, kinds = hints.tensors("cpu")
    assert tokens.dtype == kinds.dtype == torch.int64 and tokens.shape == kinds.shape == (4, DEPTHS)
    assert tokens.tolist() == hints.tokens and kinds.tolist() == hints.kinds

    # Hints of up to 2-grams: the branch's chains (3-grams) are matched on their own. With anchor
    # 3, the 3-gram (1, 2, 3) last occurred ending at index 2 (chain 7, 9, ...), the 2-gram (2, 3)
    # at index 6 (hint 8, 1, ...).
    e_ids = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2]
    record.on_extend([request("e", e_ids)], torch.tensor([10]))
    chains, hints = RoundLookups(branch, DEPTHS, hint_ngram=2)([request("e", e_ids)], torch.tensor([10]), torch.tensor([3]), record)
    assert chains == [lookup_draft(e_ids + [3], DEPTHS, 3)] and chains[0][:2] == [7, 9]
    assert (hints.tokens[0], hints.kinds[0]) == lookup_hint(e_ids + [3], DEPTHS, 2) and hints.tokens[0][:2] == [8, 1]

    # A hinted head with the branch off: hints only; a plain head with the branch off reads nothing.
    chains, hints = RoundLookups(None, DEPTHS, hint_ngram=3)(reqs, seq_lens, anchors, record)
    assert chains is None and hints.tokens[0] == lookup_hint(contexts[0], DEPTHS, 3)[0]
    plain = RoundLookups(None, DEPTHS, hint_ngram=0)
    assert not plain.reads_ids and plain(reqs, seq_lens, anchors, record) == (None, None)
    assert RoundLookups(None, DEPTHS, hint_ngram=3).reads_ids and RoundLookups(branch, DEPTHS, 0).reads_ids


def hinted_small_head(seed: int = 3, copying: bool = False) -> JetFlowHead:
    """`test_head.small_head` with anchor fusion and a random (non-zero) hint path, and a random
    copy gate if `copying`."""
    head = small_head(seed=seed, lookup_hint=True, lookup_copy=copying, **FUSED)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        head.hint_proj.weight.copy_(torch.randn(head.hint_proj.weight.shape, generator=gen) * 0.3)
        head.hint_kind_embedding.copy_(torch.randn(head.hint_kind_embedding.shape, generator=gen))
        for param in head.copy_gate.parameters() if copying else ():
            param.copy_(torch.randn(param.shape, generator=gen))
    return head


@pytest.mark.parametrize("copying", [False, True], ids=["hinted", "hinted-and-copying"])
def test_padded_draft_with_hints_equals_eager_and_pads_with_kind_0(copying):
    """PagedHeadProposer with a hinted head (and one that also copies): the paged draft with hints
    equals the dense `draft` with the same hints; padded to a replay bucket it gives the eager
    logits, padding rows (and a batch given no hints) read kind 0."""
    head = hinted_small_head(copying=copying)
    depths = head.config.block_size - 1
    gen = torch.Generator().manual_seed(4)
    lens, rows = [10, 23, 1], [3, 0, 4]
    proposer, features = paged_proposer(head, lens, rows, 100, gen)
    anchors = torch.tensor([7, 11, 2])
    hint_tokens = torch.randint(0, 50, (3, depths), generator=gen)
    hint_kinds = torch.randint(1, 7, (3, depths), generator=gen)
    hint_kinds[2] = 0  # a request without hints
    request = DraftRequest(anchors, torch.tensor(lens), torch.tensor(rows), prompts=[[]] * 3, rids=["a", "b", "c"],
                           hint_tokens=hint_tokens, hint_kinds=hint_kinds)  # fmt: skip
    plain = dataclasses.replace(request, hint_tokens=None, hint_kinds=None)
    with torch.no_grad():
        dense = torch.cat([
            head.draft(anchors[i : i + 1], torch.tensor([n]), head.context_kv(features[i][None], torch.arange(n)[None]),
                       anchor_context=head.project_features(features[i][-1:]), hints=(hint_tokens[i : i + 1], hint_kinds[i : i + 1]))
            for i, n in enumerate(lens)
        ])  # fmt: skip
        eager, eager_plain = proposer.propose(request), proposer.propose(plain)
        proposer.use_graphs([1, 2, 4, 8], "padded")
        assert proposer.runner.hint_tokens.shape == (8, depths)
        full = DraftRequest(torch.tensor([7, 11, 2, 5]), torch.tensor(lens + [4]), torch.tensor(rows + [1]), prompts=[[]] * 4,
                            rids=list("abcd"), hint_tokens=torch.ones(4, depths, dtype=torch.int64),
                            hint_kinds=torch.ones(4, depths, dtype=torch.int64))  # fmt: skip
        proposer.propose(full)  # leaves hints of kind 1 in all four rows of bucket 4
        padded = proposer.propose(request)
        assert proposer.runner.hint_kinds[3].eq(0).all() and proposer.runner.seq_lens[3] == 0  # the padding row
        padded_plain = proposer.propose(plain)
        assert proposer.runner.hint_kinds.eq(0).all()  # no hints given: kind 0 everywhere
    vocab = head.config.target_vocab_size
    dense = dense.float().log_softmax(-1)
    eager, eager_plain, padded, padded_plain = (as_logprobs(c, vocab) for c in (eager, eager_plain, padded, padded_plain))
    torch.testing.assert_close(eager, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_plain, eager_plain, rtol=1e-5, atol=1e-5)
    # The hints move the hinted rows' logits and leave the kind-0 row's as they were.
    assert (eager[:2] - eager_plain[:2]).abs().amax() > 1e-2
    torch.testing.assert_close(eager[2], eager_plain[2], rtol=0, atol=1e-6)
    # A plain head's runner holds no hint buffers.
    assert PagedHeadProposer(small_head(seed=3, **FUSED), proposer.req_to_token, 100, "cpu", 4).runner.hint_tokens is None


REPETITIVE = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday, Wednesday, Thursday,"
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):"
SERVED = [(REPETITIVE, False, 40), (CODE, False, 32), ("List three fruits.", True, 24)]  # (text, chat, max_new_tokens)


def hinted_shipped_head(shipped: str, directory) -> str:
    """The shipped head with a hint path (`lookup_hint`) and a copy gate (`lookup_copy`) of seeded
    random weights, saved to `directory`."""
    plain = plain_copy(JetFlowHead.load(shipped))
    head = JetFlowHead(dataclasses.replace(plain.config, lookup_hint=True, lookup_copy=True))
    missing, unexpected = head.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["copy_gate.bias", "copy_gate.feature_weights", "copy_gate.proj.weight",
                               "hint_kind_embedding", "hint_proj.weight"] and not unexpected  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.hint_proj.weight.copy_(torch.randn(head.hint_proj.weight.shape, generator=gen) * 0.1)
        head.hint_kind_embedding.copy_(torch.randn(head.hint_kind_embedding.shape, generator=gen) * 0.3)
        head.copy_gate.proj.weight.copy_(torch.randn(head.copy_gate.proj.weight.shape, generator=gen) * 0.05)
        head.copy_gate.bias.copy_(torch.randn(head.copy_gate.bias.shape, generator=gen))  # copies some hints, not all
        head.copy_gate.feature_weights.copy_(torch.tensor([0.2, -0.2]))
    head.save(directory)
    return str(directory)


def served_cases(target_dir: str) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    out = []
    for text, chat, max_new_tokens in SERVED:
        messages = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) if chat else tok(text).input_ids
        out.append({"ids": list(ids), "max_new_tokens": max_new_tokens})
    return out


def accept_histogram(accept_lengths: list[int]) -> list[int]:
    """Rounds per accepted-draft count (index), as SGLang's `spec_correct_drafts_histogram`."""
    counts = [0] * (max(accept_lengths) + 1)
    for accepted in accept_lengths:
        counts[accepted] += 1
    return counts


@pytest.mark.slow
def test_hinted_head_drafts_in_the_server_as_in_the_reference_engine(tmp_path):
    """A hinted, copying head (the shipped head plus a random hint path and copy gate) served at a static budget of 16 (fp32,
    16-token prefill chunks, three requests batched, then again on radix-cache hits), with the free branch
    on and off (`JETFLOW_LOOKUP=0`: hints still read): the target's greedy ids, and each request's
    verify rounds, accepted drafts and rounds per accepted count equal the HF reference engine's
    with the same head and lookup setting. The hints matter: the shipped head without them
    accepts differently."""
    pytest.importorskip("sglang")
    from helpers.hf import hf_greedy
    from jetflow_sglang import server as sglang_server
    from jetflow_sglang.assets import load_target_and_head, prepare
    from jetflow_sglang.budget import BUDGET_ENV
    from jetflow_sglang.reference.proposer import HeadProposer
    from jetflow_sglang.reference.engine import ReferenceEngine
    from test_sglang_jetflow import _run_all

    assets = prepare("default")
    target_dir = str(assets["target"])
    head_dir = hinted_shipped_head(str(assets["head"]), tmp_path / "hinted")
    cases = served_cases(target_dir)
    target, head = load_target_and_head(target_dir, head_dir, torch.float32)
    plain_copy(JetFlowHead.load(str(assets["head"]))).save(tmp_path / "plain")  # the shipped head, hints or not, without them
    _, plain_head = load_target_and_head(target_dir, str(tmp_path / "plain"), torch.float32)
    greedy = [hf_greedy(target, case["ids"], case["max_new_tokens"]) for case in cases]
    for lookup in ("1", "0"):
        server = sglang_server.start(
            target_dir, tmp_path / f"lookup{lookup}.log", *sglang_server.jetflow_args(head_dir, 16),
            "--chunked-prefill-size", "16", env={"JETFLOW_LOOKUP": lookup, BUDGET_ENV: "static"},
        )  # fmt: skip
        try:
            outputs = _run_all(server.url, cases, len(cases))
            again = _run_all(server.url, cases, len(cases))  # radix-cache hits: head context reused
        finally:
            server.stop()
        assert all(out["meta_info"]["cached_tokens"] > 0 for out in again)
        engine = ReferenceEngine(target, HeadProposer(head), budget=16, lookup=lookup == "1")
        plain = ReferenceEngine(target, HeadProposer(plain_head), budget=16, lookup=lookup == "1")
        differs = 0
        for case, want, out, hit in zip(cases, greedy, outputs, again):
            local = engine.generate(case["ids"], case["max_new_tokens"])
            assert local.tokens == want, (lookup, case)
            for served in (out, hit):
                meta = served["meta_info"]
                assert served["output_ids"] == want, (lookup, case)
                assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (local.rounds, sum(local.accept_lengths)), (
                    lookup, case, local.accept_lengths)  # fmt: skip
                assert meta["spec_correct_drafts_histogram"] == accept_histogram(local.accept_lengths), (lookup, case)
            differs += plain.generate(case["ids"], case["max_new_tokens"]).accept_lengths != local.accept_lengths
        assert differs >= 1, f"JETFLOW_LOOKUP={lookup}: the hints changed no accepted path"
