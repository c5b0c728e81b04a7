"""The JetFlow head: checkpoint format, causal vs bidirectional block, incremental context."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head import JetFlowConfig, JetFlowHead, default_tap_layers
from jetflow_sglang.reference.proposer import HeadProposer


def small_head(causal: bool = True, seed: int = 0, **overrides) -> JetFlowHead:
    config = JetFlowConfig(
        target_hidden_size=32,
        target_vocab_size=50,
        target_num_layers=8,
        target_layer_ids=[1, 4, 5],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        num_layers=2,
        block_size=6,
        causal=causal,
        **overrides,
    )
    generator = torch.Generator().manual_seed(seed)
    head = JetFlowHead(config).init_weights(seed)
    embedding = torch.randn(50, 32, generator=generator)
    return head.bind_target(embedding, torch.randn(50, 32, generator=generator)).eval()


def test_default_taps_follow_the_paper_layout():
    assert default_tap_layers(30) == [1, 7, 15, 22, 27]
    assert default_tap_layers(36) == [1, 9, 18, 27, 33]


FUSED = dict(tap_norm=True, anchor_fusion=True)


@pytest.mark.parametrize("fused", [False, True])
def test_save_load_roundtrip_without_target_weights(tmp_path, fused):
    head = small_head(**(FUSED if fused else {}))
    head.save(tmp_path / "head")
    saved = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert set(saved) == {name for name, _ in head.named_parameters()}  # the head's own weights only
    assert "mask_embedding" in saved and sum(t.numel() for t in saved.values()) < 60_000
    assert ("anchor_fuse.weight" in saved and "tap_norm" in saved and "depth_embedding" in saved) is fused
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["JetFlowDraftModel"] and config["model_type"] == "llama"
    assert config["jetflow"]["block_size"] == 6 and config["jetflow"]["causal"] is True
    assert config["jetflow"]["mask_token_id"] == 50  # one past the target vocabulary
    loaded = JetFlowHead.load(tmp_path / "head").bind_target(head._target_embedding, head._target_lm_head).eval()
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    features = torch.randn(1, 5, 3 * 32)
    context = head.context_kv(features, torch.arange(5)[None])
    last = head.project_features(features[:, -1]) if fused else None
    expected = head.draft(torch.tensor([3]), torch.tensor([5]), context, anchor_context=last)
    got = loaded.draft(torch.tensor([3]), torch.tensor([5]), loaded.context_kv(features, torch.arange(5)[None]), anchor_context=last)
    assert torch.equal(expected, got)


def test_config_loads_with_transformers_autoconfig(tmp_path):
    from transformers import AutoConfig

    small_head().save(tmp_path / "head")
    config = AutoConfig.from_pretrained(tmp_path / "head")
    assert config.architectures == ["JetFlowDraftModel"]
    assert config.hidden_size == 32 and config.num_hidden_layers == 2


def test_causal_block_slots_ignore_later_slots_bidirectional_do_not():
    for causal in (True, False):
        head = small_head(causal=causal)
        context = head.context_kv(torch.randn(1, 4, 96), torch.arange(4)[None])
        mask = torch.cat([torch.ones(6, 4, dtype=torch.bool), head.block_mask(6, torch.device("cpu"))], -1)[None, None]
        positions = torch.arange(4, 10)[None]
        block = torch.tensor([[7, 50, 50, 50, 50, 50]])
        changed = block.clone()
        changed[0, 4] = 9  # a later slot holds a real token instead of MASK
        a = head.forward_block(block, positions, context, mask)
        b = head.forward_block(changed, positions, context, mask)
        early_same = torch.allclose(a[:, :4], b[:, :4])
        assert early_same is causal


@pytest.mark.parametrize("fused", [False, True])
def test_incremental_context_equals_full_recompute(fused):
    head = small_head(**(FUSED if fused else {}))
    features = torch.randn(1, 9, 96)
    whole = HeadProposer(head)
    whole.reset(features)
    pieces = HeadProposer(head, capacity=2)  # forces the buffers to grow
    pieces.reset(features[:, :3])
    pieces.extend(features[:, 3:4])
    pieces.extend(features[:, 4:9])
    a = whole.propose(torch.tensor([5]), 9)
    b = pieces.propose(torch.tensor([5]), 9)
    assert a.shape == (1, 5, 50)
    torch.testing.assert_close(a, b)
    if fused:  # the fused head reads the last committed token's features: they must matter
        other = HeadProposer(head)
        other.reset(torch.cat([features[:, :8], features[:, :1]], 1))
        assert not torch.allclose(other.propose(torch.tensor([5]), 9), a)


def test_mask_token_uses_the_heads_own_embedding():
    head = small_head()
    embedded = head.embed_block(torch.tensor([[3, 50]]), torch.tensor([[7, 8]]))
    torch.testing.assert_close(embedded[0, 0], head._target_embedding[3])
    torch.testing.assert_close(embedded[0, 1], head.mask_embedding.detach())


def test_fused_anchor_slot_and_mask_slots_by_hand():
    """Anchor fusion: slot 0 = fuse([emb(x_a); anchor_context]); a MASK slot at depth d adds
    that vector and depth_embedding[d] to the MASK embedding; a real token stays its embedding."""
    head = small_head(tap_norm=True, anchor_fusion=True)
    context = torch.randn(1, 32)
    embedded = head.embed_block(torch.tensor([[3, 50, 9, 50]]), torch.tensor([[7, 8, 9, 10]]), context)
    anchor = head.anchor_fuse(torch.cat([head._target_embedding[3][None], context], -1))[0]
    torch.testing.assert_close(embedded[0, 0], anchor)
    torch.testing.assert_close(embedded[0, 1], head.mask_embedding + anchor + head.depth_embedding[1])
    torch.testing.assert_close(embedded[0, 2], head._target_embedding[9])
    torch.testing.assert_close(embedded[0, 3], head.mask_embedding + anchor + head.depth_embedding[3])
    with pytest.raises(JetFlowError, match="anchor_context"):
        head.embed_block(torch.tensor([[3, 50]]), torch.tensor([[7, 8]]))


def test_tap_norm_normalizes_each_tapped_layer_on_its_own():
    """Per-tap RMS normalization by hand; a tap scaled up 1000x (a residual stream's massive
    activations) changes nothing, where without the norm it takes the projection over."""
    head = small_head(tap_norm=True, anchor_fusion=True)
    features = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    x = features.view(2, 3, 32)
    expected_taps = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.config.rms_norm_eps)
    expected = head.hidden_norm(head.fc((expected_taps * head.tap_norm).flatten(-2)))
    torch.testing.assert_close(head.project_features(features), expected)
    scaled = features.clone()
    scaled[:, 32:64] *= 1000.0
    torch.testing.assert_close(head.project_features(scaled), head.project_features(features), rtol=1e-4, atol=1e-4)
    plain = small_head()
    assert not torch.allclose(plain.project_features(scaled), plain.project_features(features), atol=1e-2)


def test_block_size_below_two_is_refused():
    with pytest.raises(JetFlowError, match="block size"):
        JetFlowConfig(32, 50, 8, [1], 4, 2, 8, 48, block_size=1)


def test_load_refuses_pickle_and_mismatched_weights(tmp_path):
    head_dir = tmp_path / "head"
    small_head().save(head_dir)
    (head_dir / "model.safetensors").rename(head_dir / "pytorch_model.bin")
    with pytest.raises(JetFlowError, match="safetensors"):
        JetFlowHead.load(head_dir)
    small_head().save(head_dir)
    config = json.loads((head_dir / "config.json").read_text())
    config["jetflow"]["num_layers"] = 3
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(JetFlowError, match="do not match"):
        JetFlowHead.load(head_dir)


@pytest.mark.parametrize("fused", [False, True])
def test_refresh_rows_equal_blocks_with_the_path_revealed(fused):
    """Refresh row i is what the head gives, in training's reveal form, for the block
    [anchor, path tokens to node i, MASK]: the tree-causal mask shows each node only its path."""
    from jetflow_sglang.tree import build_tree

    head = small_head(causal=True, seed=3, **(FUSED if fused else {}))
    features = torch.randn(1, 7, 3 * 32, generator=torch.Generator().manual_seed(4))
    context = head.context_kv(features, torch.arange(7)[None])
    last = head.project_features(features[:, -1]) if fused else None
    anchor, position = torch.tensor([11]), 7
    draft_logprobs = head.draft(anchor, torch.tensor([position]), context, anchor_context=last).float().log_softmax(-1)
    tree = build_tree(anchor, draft_logprobs, budget=12, width=3)
    refreshed = head.refresh(tree.tokens, tree.depths + position, tree.ancestors, context, anchor_context=last)
    assert refreshed.shape == (1, 12, 50)
    # The root's refresh row is the one-pass depth-1 draft (same inputs under a causal mask).
    torch.testing.assert_close(refreshed[0, 0], head.draft(anchor, torch.tensor([position]), context, anchor_context=last)[0, 0])
    parents = tree.parents[0].tolist()
    for i in range(12):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        block = torch.tensor([[int(tree.tokens[0, j]) for j in reversed(path)] + [head.config.mask_token_id]])
        length = block.shape[1]
        mask = torch.cat([torch.ones(1, length, 7, dtype=torch.bool), head.block_mask(length, block.device)[None]], -1)
        hidden = head.forward_block(block, position + torch.arange(length)[None], context, mask[:, None], last)
        torch.testing.assert_close(refreshed[0, i], head.logits(hidden[:, -1])[0], rtol=1e-4, atol=1e-5)


SLIDING = dict(sliding_layers=[1], sliding_window=4)  # a published head's mix: full layer 0, sliding layer 1


def paged_proposer(head: JetFlowHead, lens: list[int], rows: list[int], num_slots: int, gen: torch.Generator):
    """SGLang's proposer over every vocabulary token (width = the vocabulary), each request's
    random target features written at scattered KV slots of its req_to_token row; returns the
    proposer and the features."""
    from jetflow_sglang.sglang_plugin.proposer import PagedHeadProposer

    req_to_token = torch.zeros(max(rows) + 1, max(lens) + 23, dtype=torch.int32)
    slots = torch.randperm(num_slots, generator=gen)
    proposer = PagedHeadProposer(head, req_to_token, num_slots, "cpu", width=head.config.target_vocab_size)
    features, start = [], 0
    for row, n in zip(rows, lens):
        req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
        features.append(torch.randn(n, 3 * 32, generator=gen))
        proposer.write_context(features[-1], slots[start : start + n], torch.arange(n))
        start += n
    return proposer, features


def as_logprobs(candidates, vocab: int) -> torch.Tensor:
    """Top-k lists (`tree.top_candidates`) back as log-probs over the vocabulary, -inf where unlisted."""
    logprobs, tokens = candidates
    return torch.full((*logprobs.shape[:-1], vocab), float("-inf")).scatter(-1, tokens, logprobs)


@pytest.mark.parametrize("causal,extra", [(True, {}), (False, {}), (True, FUSED), (False, SLIDING)],
                         ids=["causal", "bidirectional", "fused", "sliding"])  # fmt: skip
def test_paged_draft_equals_dense_draft_and_graph_padding_changes_nothing(causal, extra):
    """SGLang's proposer: context K/V at scattered KV slots read through req_to_token (the paged
    kernel's torch reference here), batch padded as for CUDA-graph replay, equals `draft` on each
    request's own dense context."""
    from jetflow_sglang.sglang_plugin.proposer import DraftRequest

    fused = "anchor_fusion" in extra
    head = small_head(causal=causal, seed=3, **extra)
    gen = torch.Generator().manual_seed(4)
    lens, rows = [10, 57, 1], [3, 0, 4]
    proposer, features = paged_proposer(head, lens, rows, 200, gen)
    anchors = torch.tensor([7, 11, 2])
    request = DraftRequest(anchors, torch.tensor(lens), torch.tensor(rows), prompts=[[]] * 3, rids=["a", "b", "c"])
    with torch.no_grad():
        dense = torch.cat([
            head.draft(anchors[i : i + 1], torch.tensor([n]), head.context_kv(features[i][None], torch.arange(n)[None]),
                       anchor_context=head.project_features(features[i][-1:]) if fused else None)
            for i, n in enumerate(lens)
        ])  # fmt: skip
        paged = proposer.propose(request)
        proposer.use_graphs([1, 2, 4, 8], "padded")
        assert proposer.runner.bucket(3) == 4 and proposer.runner.bucket(9) is None
        padded = proposer.propose(request)
    assert paged[0].shape == paged[1].shape == (3, head.config.block_size - 1, 50)
    assert bool((paged[0][..., 1:] <= paged[0][..., :-1]).all())  # each depth's list sorted, best first
    paged, padded = as_logprobs(paged, 50), as_logprobs(padded, 50)
    dense = dense.float().log_softmax(-1)
    assert torch.allclose(paged, dense, atol=1e-5), (paged - dense).abs().max()
    assert torch.allclose(padded, paged, atol=1e-6)
    assert proposer.runner.seq_lens[3] == 0  # the padding row has no context


@pytest.mark.parametrize("pruned", [False, True])
def test_draft_candidates_are_the_full_vocabulary_top_k(pruned):
    """The top-k lists both engines build trees from (`draft_candidates`: a log-softmax and top-k
    over the draft vocabulary only) are the target-vocabulary log-probs' own top-k: the same
    tokens, in order, with the same log-probs; a pruned head lists only draft-vocabulary tokens."""
    head = small_head(seed=5, **({"draft_vocab_size": 20} if pruned else {}))
    if pruned:
        head.set_draft_vocab(torch.randperm(50, generator=torch.Generator().manual_seed(1))[:20])
    hidden = torch.randn(3, 5, head.config.hidden_size, generator=torch.Generator().manual_seed(2))
    logprobs, tokens = head.draft_candidates(hidden, width=7)
    full = head.logits(hidden).float().log_softmax(-1)
    want = full.topk(7, dim=-1)
    assert tokens.shape == logprobs.shape == (3, 5, 7) and tokens.dtype == torch.int64
    assert torch.equal(tokens, want.indices)
    torch.testing.assert_close(logprobs, want.values, rtol=0, atol=1e-6)
    if pruned:
        assert set(tokens.flatten().tolist()) <= set(head.draft_vocab.tolist())
        assert head.draft_candidates(hidden, width=64)[1].shape[-1] == 20  # never more than the draft vocabulary


def test_cpu_packed_linears_give_the_same_draft_and_state():
    """`pack_for_cpu` (bf16 on CPU: oneDNN-layout weights) changes no saved weight and, up to bf16
    rounding (bit-identical where oneDNN runs the same kernel both ways, as on AMX), no output; an
    fp32 head is left as it is."""
    from torch import nn

    from jetflow_sglang.cpu_linear import PackedLinear, can_pack, pack_linears

    if not can_pack(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("this torch has no oneDNN linear ops")  # every CPU wheel of torch has them
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(48, 40, bias=False).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (16, 48), (3, 16, 48), (2, 5, 48)]:
        x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(packed(x), linear(x))  # bf16 tolerances: a wrong layout is far off
    head = small_head(seed=4, draft_vocab_size=20, **FUSED)
    head.set_draft_vocab(torch.arange(30, 50))
    assert pack_linears(small_head(seed=4)) == 0  # fp32: nothing to pack
    head = head.to(torch.bfloat16)
    plain = small_head(seed=4, draft_vocab_size=20, **FUSED)
    plain.set_draft_vocab(torch.arange(30, 50))
    plain = plain.to(torch.bfloat16)
    head.bind_target(plain._target_embedding.to(torch.bfloat16), plain._target_lm_head.to(torch.bfloat16))
    plain.bind_target(plain._target_embedding.to(torch.bfloat16), plain._target_lm_head.to(torch.bfloat16))
    state = {k: v.clone() for k, v in head.state_dict().items()}
    head.pack_for_cpu()
    assert sum(isinstance(m, PackedLinear) for m in head.modules()) == 2 * 7 + 2  # layers, fc, anchor_fuse
    assert head._packed_lm_head is not None
    assert all(layer._packed_qkv is not None and layer._packed_kv is not None for layer in head.layers)  # one call for q, k, v
    assert head.state_dict().keys() == state.keys() and all(torch.equal(head.state_dict()[k], v) for k, v in state.items())
    features = torch.randn(1, 9, 3 * 32, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        for h in (head, plain):
            h.eval()
        context = [plain.context_kv(features, torch.arange(9)[None]), head.context_kv(features, torch.arange(9)[None])]
        for (k0, v0), (k1, v1) in zip(*context):
            torch.testing.assert_close(k1, k0)
            torch.testing.assert_close(v1, v0)
        last = plain.project_features(features[:, -1])
        want = plain.draft_hidden(torch.tensor([3]), torch.tensor([9]), context[0], anchor_context=last)
        got = head.draft_hidden(torch.tensor([3]), torch.tensor([9]), context[0], anchor_context=last)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(head.draft_vocab_logits(want), plain.draft_vocab_logits(want))
