"""The jetflow CPU platform plugin serves the default target through SGLang's own server.

* End to end: ``python -m sglang.launch_server`` with no device or backend flags
  (the ``jetflow_cpu`` platform and attention backend come from entry points)
  returns the same greedy token ids as HF transformers' ``generate`` in fp32, and
  its radix cache reports hits for a repeated prompt.
* Unit: the ``jetflow_cpu`` backend's TARGET_VERIFY path attends each tree node to
  the committed prefix plus its ancestors only, for both SGLang mask layouts
  (FULL_MASK and QLEN_ONLY), and its decode path equals ``torch_native``'s.
"""

from __future__ import annotations

import json
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from helpers.trees import walk_ancestors
from jetflow_sglang import server as sglang_server
from sglang.srt.layers.radix_attention import AttentionType

MAX_NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


# --------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(target_dir, tmp_path_factory):
    running = sglang_server.start(target_dir, tmp_path_factory.mktemp("sglang") / "server.log")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def hf_model(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return tok, model


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_server_uses_jetflow_platform_and_backend(server):
    info = json.loads(urllib.request.urlopen(server.url + "/server_info", timeout=30).read())
    assert info["device"] == "cpu"
    assert info["attention_backend"] == "jetflow_cpu"


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_token_ids_match_hf(server, hf_model, prompt):
    tok, model = hf_model
    ids = tok(prompt).input_ids
    out = sglang_server.post(
        server.url + "/generate",
        {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}},
    )
    expected = _hf_greedy(model, ids, MAX_NEW_TOKENS)
    assert out["output_ids"] == expected


@pytest.mark.slow
def test_repeated_prompt_hits_radix_cache(server, hf_model):
    tok, _ = hf_model
    ids = tok("A radix cache stores the key and value vectors of shared prefixes.").input_ids
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    sglang_server.post(server.url + "/generate", body)
    again = sglang_server.post(server.url + "/generate", body)
    assert again["meta_info"]["cached_tokens"] > 0


@pytest.mark.slow
def test_a_port_taken_before_the_server_binds_it(target_dir, tmp_path, monkeypatch):
    """A port picked by `free_port` that another process holds by the time the server binds is
    replaced by a new one (the launcher would otherwise hang until the startup timeout: it
    happened once in the suite); a port the caller chose that is in use is a clear error."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((sglang_server.HOST, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks, pick_free = iter([busy]), sglang_server.free_port
        monkeypatch.setattr(sglang_server, "free_port", lambda: next(picks, None) or pick_free())
        server = sglang_server.start(target_dir, tmp_path / "moved.log", max_total_tokens=1024, timeout_s=300)
        try:
            assert not server.url.endswith(f":{busy}")
            out = sglang_server.post(server.url + "/generate", {"text": "2+2=", "sampling_params": {"max_new_tokens": 2}})
            assert out["meta_info"]["completion_tokens"] == 2
        finally:
            server.stop()
        assert next(picks, None) is None  # the taken port was tried first
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"port {busy} on 127.0.0.1 is in use"):
            sglang_server.start(target_dir, tmp_path / "chosen.log", port=busy, max_total_tokens=1024, timeout_s=300)
        assert time.monotonic() - started < 10  # refused before the launcher loads the model, not at the timeout


@pytest.mark.slow
def test_chat_completions(server):
    out = sglang_server.post(
        server.url + "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is 2+2?"}],
            "temperature": 0,
            "max_tokens": 16,
        },
    )
    assert out["choices"][0]["message"]["content"].strip()


# --------------------------------------------------------------- unit: verify
H, HKV, D = 4, 2, 8


def _make_backend(num_slots: int = 256, max_ctx: int = 128):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from jetflow_sglang.sglang_plugin.cpu.attention import JetflowCpuAttnBackend

    kv = MHATokenToKVPool(
        size=num_slots, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=D,
        layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    r2t = ReqToTokenPool(size=4, max_context_len=max_ctx, device="cpu", enable_memory_saver=False)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=kv)
    backend = JetflowCpuAttnBackend(runner)
    layer = SimpleNamespace(
        layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, tp_v_head_num=HKV,
        qk_head_dim=D, v_head_dim=D, scaling=D**-0.5, sliding_window_size=-1,
        is_cross_attention=False, k_scale=None, v_scale=None, attn_type=AttentionType.DECODER,
    )  # fmt: skip
    return backend, kv, r2t, layer


def _tree(parents: list[int]) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a tree given parent indices (-1 = root)."""
    return torch.from_numpy(walk_ancestors(parents))


def _reference(q, k_all, v_all, visible):
    """Per query row, plain softmax attention over the visible keys only."""
    rep = H // HKV
    out = torch.empty(q.shape[0], H, D)
    for i in range(q.shape[0]):
        ks = k_all[visible[i]].repeat_interleave(rep, dim=1)  # [m, H, D]
        vs = v_all[visible[i]].repeat_interleave(rep, dim=1)
        att = torch.einsum("hd,mhd->hm", q[i], ks) * D**-0.5
        out[i] = torch.einsum("hm,mhd->hd", att.softmax(-1), vs)
    return out


@pytest.mark.parametrize("requests", [1, 2])
@pytest.mark.parametrize("layout", ["full", "qlen", "none", "none_bidirectional"])
def test_target_verify_tree_mask(layout, requests):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    torch.manual_seed(0)
    backend, kv, r2t, layer = _make_backend()
    if layout == "none_bidirectional":
        layer.attn_type = AttentionType.ENCODER_ONLY
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 0, 4]][:requests]  # 6-node trees
    n = 6
    seq_lens = [5, 9][:requests]
    rows = [1, 2][:requests]
    # Prefix slots (committed KV) and verify slots, scattered through the pool.
    perm = torch.randperm(200)[: sum(seq_lens) + n * len(seq_lens)] + 1
    off = 0
    verify_locs = []
    for row, s in zip(rows, seq_lens):
        r2t.req_to_token[row, : s + n] = perm[off : off + s + n].to(torch.int32)
        verify_locs.append(perm[off + s : off + s + n])
        off += s + n
    prefix_k = torch.randn(kv.get_key_buffer(0).shape)
    prefix_v = torch.randn(kv.get_value_buffer(0).shape)
    kv.get_key_buffer(0).copy_(prefix_k)
    kv.get_value_buffer(0).copy_(prefix_v)

    tree_masks = [
        _tree(p) if layout in ("full", "qlen")
        else torch.ones(n, n).tril().bool() if layout == "none"
        else torch.ones(n, n, dtype=torch.bool)
        for p in trees
    ]  # fmt: skip
    if layout == "full":
        custom = torch.cat(
            [torch.cat([torch.ones(n, s, dtype=torch.bool), m], 1).flatten() for s, m in zip(seq_lens, tree_masks)]
        )
    elif layout == "qlen":
        custom = torch.stack(tree_masks).flatten().to(torch.uint8)
    else:
        custom = None

    out_cache_loc = torch.cat(verify_locs).to(torch.int64)
    q = torch.randn(n * len(rows), H * D)
    k = torch.randn(n * len(rows), HKV, D)
    v = torch.randn(n * len(rows), HKV, D)
    fb = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY,
        spec_info=SimpleNamespace(draft_token_num=n, custom_mask=custom),
        out_cache_loc=out_cache_loc,
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        req_pool_indices=torch.tensor(rows),
        positions=torch.zeros(n * len(rows), dtype=torch.long),
        encoder_lens=None,
    )
    backend.init_forward_metadata(fb)
    o = backend.forward(q, k, v, layer, fb).view(-1, H, D)

    # K/V of the verify tokens landed at out_cache_loc.
    torch.testing.assert_close(kv.get_key_buffer(0)[out_cache_loc], k)
    torch.testing.assert_close(kv.get_value_buffer(0)[out_cache_loc], v)
    for b, (row, s) in enumerate(zip(rows, seq_lens)):
        locs = r2t.req_to_token[row, : s + n].long()
        k_all = kv.get_key_buffer(0)[locs]
        v_all = kv.get_value_buffer(0)[locs]
        visible = torch.cat([torch.ones(n, s, dtype=torch.bool), tree_masks[b]], 1)
        ref = _reference(q[b * n : (b + 1) * n].view(n, H, D), k_all, v_all, visible)
        torch.testing.assert_close(o[b * n : (b + 1) * n], ref, atol=1e-5, rtol=1e-5)
    if layout in ("full", "qlen"):
        # The mask bites: a causal chain gives different outputs for the tree.
        fb.spec_info.custom_mask = None
        backend.init_forward_metadata(fb)
        o_chain = backend.forward(q, k, v, layer, fb).view(-1, H, D)
        assert (o_chain - o).abs().max() > 1e-3


def test_decode_matches_torch_native():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    torch.manual_seed(1)
    backend, kv, r2t, layer = _make_backend()
    seq_lens = [7, 30, 1]
    rows = [1, 2, 3]
    for row, s in zip(rows, seq_lens):
        r2t.req_to_token[row, :s] = (torch.randperm(200)[:s] + 1).to(torch.int32)
    kv.get_key_buffer(0).normal_()
    kv.get_value_buffer(0).normal_()
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        out_cache_loc=torch.stack([r2t.req_to_token[r, s - 1] for r, s in zip(rows, seq_lens)]).long(),
        seq_lens=torch.tensor(seq_lens),
        req_pool_indices=torch.tensor(rows),
        encoder_lens=None,
    )
    q = torch.randn(len(rows), H * D)
    k = torch.randn(len(rows), HKV, D)
    v = torch.randn(len(rows), HKV, D)
    backend.init_forward_metadata(fb)
    ours = backend.forward(q, k, v, layer, fb)
    ref = TorchNativeAttnBackend.forward_decode(backend, q, k, v, layer, fb)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------- unit: spec cache-loc kernels
def test_spec_cache_loc_ops_match_reference_loops():
    from jetflow_sglang.sglang_plugin.cpu.spec_ops import (
        assign_extend_cache_locs,
        assign_req_to_token_pool,
    )

    torch.manual_seed(2)
    rows = torch.tensor([3, 0, 2])
    start = torch.tensor([4, 0, 7])
    end = torch.tensor([9, 3, 7])  # ragged, one empty row
    locs = torch.randint(1, 1000, (int((end - start).sum()),))
    r2t = torch.zeros(5, 32, dtype=torch.int32)
    assign_req_to_token_pool(rows, r2t, start, end, locs, 3)
    ref = torch.zeros_like(r2t)
    off = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        ref[r, s:e] = locs[off : off + e - s].to(torch.int32)
        off += e - s
    assert torch.equal(r2t, ref)

    got = assign_extend_cache_locs(
        req_pool_indices=rows, req_to_token=r2t, start_offset=start, end_offset=end,
        batch_size=3, draft_token_num=5, device="cpu",
    )  # fmt: skip
    assert got.dtype == torch.int64 and got.numel() == 15
    assert torch.equal(got[: locs.numel()], locs)


def test_plugin_routes_spec_allocation_to_torch():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.platforms import current_platform

    from jetflow_sglang.sglang_plugin.cpu.platform import JetflowCpuPlatform

    if not isinstance(current_platform, JetflowCpuPlatform):
        pytest.skip("jetflow_cpu platform not active here (CUDA host?)")
    load_plugins()
    from sglang.kernels.ops.speculative.cache_locs import (
        assign_extend_cache_locs_uniform_func,
    )
    from sglang.srt.mem_cache import allocation

    r2t = torch.zeros(4, 16, dtype=torch.int32)
    allocation.assign_req_to_token_pool_func(
        torch.tensor([1, 3]), r2t, torch.tensor([2, 5]), torch.tensor([4, 8]),
        torch.tensor([10, 11, 12, 13, 14]), 2,
    )  # fmt: skip
    assert r2t[1, 2:4].tolist() == [10, 11] and r2t[3, 5:8].tolist() == [12, 13, 14]
    locs = assign_extend_cache_locs_uniform_func(
        req_pool_indices=torch.tensor([1, 3]), req_to_token=r2t,
        start_offset=torch.tensor([2, 5]), batch_size=2, draft_token_num=2, device="cpu",
    )  # fmt: skip
    assert locs.tolist() == [10, 11, 12, 13]


def test_torch_threads_restores_the_count_also_after_an_error():
    from jetflow_sglang.sglang_plugin.cpu.threads import one_thread, torch_threads

    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
        with torch_threads(before + 1):  # the verify's threads inside a one-thread round
            assert torch.get_num_threads() == before + 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with one_thread():
            raise RuntimeError("a failed round")
    assert torch.get_num_threads() == before
    with one_thread(False):
        assert torch.get_num_threads() == before
