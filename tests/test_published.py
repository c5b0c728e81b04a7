"""Published DFlash / JetSpec heads: read unchanged, written by `jetflow export`, and drafting
the same logits as SGLang's own DFlash model (sglang/srt/models/dflash.py) on the same inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetflow_sglang import published
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head import JetFlowConfig, JetFlowHead
from helpers.targets import tiny_qwen3_target

HIDDEN, VOCAB, MASK_ID, BLOCK = 64, 96, 7, 8
HELPER = Path(__file__).parent / "helpers" / "sglang_dflash_logits.py"


def published_style_head(causal: bool, seed: int = 0, **overrides) -> JetFlowHead:
    """A head in the published layout's shape (q/k norms, target-row MASK), random weights
    throughout, norms included, so that a misplaced norm changes the logits."""
    config = JetFlowConfig(
        target_hidden_size=HIDDEN, target_vocab_size=VOCAB, target_num_layers=8, target_layer_ids=[1, 4, 6],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_layers=2,
        block_size=BLOCK, causal=causal, rms_norm_eps=1e-6, rope_theta=10000.0, qk_norm=True,
        mask_from_target=True, mask_token_id=MASK_ID, **overrides,
    )  # fmt: skip
    head = JetFlowHead(config).init_weights(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.mul_(8)  # weights large enough that every layer moves the logits
    embedding = torch.randn(VOCAB, HIDDEN, generator=generator)
    return head.bind_target(embedding, torch.randn(VOCAB, HIDDEN, generator=generator)).eval()


def draft_logits(head: JetFlowHead, features: torch.Tensor, anchor: int) -> torch.Tensor:
    context_len = features.shape[0]
    context = head.context_kv(features[None], torch.arange(context_len)[None])
    with torch.no_grad():
        return head.draft(torch.tensor([anchor]), torch.tensor([context_len]), context)[0]


def test_export_then_load_drafts_the_same_logits(tmp_path):
    head = published_style_head(causal=True)
    published.export_head(head, tmp_path / "jetspec", "jetspec")
    config = json.loads((tmp_path / "jetspec" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["causal_head"] is True
    assert config["dflash_config"]["mask_token_id"] == MASK_ID and config["block_size"] == BLOCK
    names = set(load_file(str(tmp_path / "jetspec" / "model.safetensors")))
    assert "layers.0.self_attn.q_norm.weight" in names and "layers.1.mlp.down_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "mask" in n for n in names)  # the target's are used
    loaded = JetFlowHead.load(tmp_path / "jetspec").bind_target(head._target_embedding, head._target_lm_head).eval()
    assert loaded.config.causal and loaded.config.qk_norm and loaded.config.mask_token_id == MASK_ID
    features = torch.randn(11, 3 * HIDDEN)
    torch.testing.assert_close(draft_logits(loaded, features, 3), draft_logits(head, features, 3), rtol=0, atol=0)


def test_published_variants_load(tmp_path):
    """`model.` prefixes, top-level DFlash keys, HF rotary caches and no causality key (bidirectional)."""
    head = published_style_head(causal=False)
    published.export_head(head, tmp_path / "exported", "dflash")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    section = config.pop("dflash_config")
    for key in ("is_causal", "layer_types"):
        config.pop(key)
    config.update(section)  # mask_token_id, target_layer_ids at top level, as some loaders accept
    config.pop("causal")
    state = load_file(str(tmp_path / "exported" / "model.safetensors"))
    state = {f"model.{name}": tensor.to(torch.bfloat16) for name, tensor in state.items()}
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    variant = tmp_path / "variant"
    variant.mkdir()
    save_file(state, str(variant / "model.safetensors"))
    (variant / "config.json").write_text(json.dumps(config))
    loaded = JetFlowHead.load(variant).bind_target(head._target_embedding, head._target_lm_head).eval()
    assert loaded.config.causal is False and loaded.config.target_layer_ids == [1, 4, 6]
    features = torch.randn(9, 3 * HIDDEN)
    with torch.no_grad():  # the weights as the bf16 file holds them
        for param in head.parameters():
            param.copy_(param.to(torch.bfloat16))
    expected = draft_logits(head, features, 5)
    torch.testing.assert_close(draft_logits(loaded, features, 5), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(layer_types=["full_attention", "linear_attention"]), "linear_attention"),
        (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "no sliding_window"),
        (lambda c: c.update(layer_types=["full_attention", "sliding_attention"], sliding_window=64, is_causal=False),
         "bidirectional sliding_attention"),
        (lambda c: c.update(layer_types=["full_attention"]), "1 layer_types for 2 layers"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c["dflash_config"].update(mask_token_id=VOCAB), "not a row"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
    ],
)
def test_unsupported_published_configs_fail_clearly(tmp_path, change, message):
    published.export_head(published_style_head(causal=True), tmp_path / "h", "dflash")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    change(config)
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(JetFlowError, match=message):
        JetFlowHead.load(tmp_path / "h")


def test_target_row_mask_refuses_anchor_fusion():
    with pytest.raises(JetFlowError, match="anchor fusion needs the head's own MASK"):
        JetFlowConfig(target_hidden_size=HIDDEN, target_vocab_size=VOCAB, target_num_layers=8, target_layer_ids=[1],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                      anchor_fusion=True, mask_from_target=True, mask_token_id=MASK_ID)  # fmt: skip


def test_export_refuses_heads_the_layout_cannot_hold(tmp_path):
    from jetflow_sglang.assets import SHIPPED_HEADS, DEFAULT_TARGET_NAME

    shipped = JetFlowHead.load(SHIPPED_HEADS / DEFAULT_TARGET_NAME)
    with pytest.raises(JetFlowError, match="no q/k norms.*target embedding row.*pruned vocabulary"):
        published.export_head(shipped, tmp_path / "out", "dflash")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(JetFlowError, match="unknown export format"):
        published.export_head(published_style_head(causal=True), tmp_path / "out", "medusa")
    assert not (tmp_path / "out").exists()


# Sliding: layer 0 full, layer 1 a window of 5 positions (inside the 8-slot block over 13 context positions).
SLIDING = dict(sliding_layers=[1], sliding_window=5)


@pytest.mark.parametrize("causal, extra", [(False, {}), (True, {}), (False, SLIDING), (True, SLIDING)],
                         ids=["dflash-bidirectional", "jetspec-causal", "dflash-sliding", "jetspec-sliding"])  # fmt: skip
def test_draft_logits_equal_sglang_dflash_model(tmp_path, causal, extra):
    head = published_style_head(causal=causal, seed=3, **extra)
    published.export_head(head, tmp_path / "head", "jetspec" if causal else "dflash")
    loaded_config = JetFlowHead.load(tmp_path / "head").config
    assert (loaded_config.causal, loaded_config.sliding_layers, loaded_config.sliding_window) == (
        causal, extra.get("sliding_layers", []), extra.get("sliding_window", 0))  # fmt: skip
    features = torch.randn(13, 3 * HIDDEN, generator=torch.Generator().manual_seed(5))
    anchor = 11
    block_ids = torch.tensor([anchor] + [MASK_ID] * (BLOCK - 1))
    save_file({"features": features, "block_ids": block_ids, "embedding": head._target_embedding.contiguous(),
               "lm_head": head._target_lm_head.contiguous()}, str(tmp_path / "inputs.safetensors"))  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(HELPER), str(tmp_path / "head"), str(tmp_path / "inputs.safetensors"), str(tmp_path / "out.safetensors")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    sglang_logits = load_file(str(tmp_path / "out.safetensors"))["logits"][1:]  # block positions 1..B-1
    ours = draft_logits(JetFlowHead.load(tmp_path / "head").bind_target(head._target_embedding, head._target_lm_head).eval(), features, anchor)
    assert ours.shape == sglang_logits.shape
    torch.testing.assert_close(ours, sglang_logits, rtol=1e-4, atol=1e-3)
    assert torch.equal(ours.argmax(-1), sglang_logits.argmax(-1))
    # The other mask gives other logits: the comparison sees causality and the window.
    flipped = JetFlowHead.load(tmp_path / "head").bind_target(head._target_embedding, head._target_lm_head).eval()
    flipped.config.causal = not causal
    assert not torch.allclose(draft_logits(flipped, features, anchor), sglang_logits, rtol=1e-2, atol=1e-2)
    if extra:
        unwindowed = JetFlowHead.load(tmp_path / "head").bind_target(head._target_embedding, head._target_lm_head).eval()
        unwindowed.config.sliding_window = 10_000
        assert not torch.allclose(draft_logits(unwindowed, features, anchor), sglang_logits, rtol=1e-2, atol=1e-2)


def smollm2_published_head(target_dir: str, out: Path, sliding: bool = False) -> Path:
    """A random-weight head in the published layout, shaped for the default target (SmolLM2);
    `sliding`: its second layer sees only the last 12 positions."""
    from transformers import AutoConfig

    window = dict(sliding_layers=[1], sliding_window=12) if sliding else {}
    config = JetFlowConfig.for_target(AutoConfig.from_pretrained(target_dir), target_layer_ids=[1, 14, 26], qk_norm=True,
                                      mask_from_target=True, mask_token_id=0, rms_norm_eps=1e-6, **window)  # fmt: skip
    return published.export_head(JetFlowHead(config).init_weights(0), out, "jetspec")


def test_cli_export_and_reference_engine_serve_published_heads(prepared, tmp_path, capsys):
    from jetflow_sglang.assets import DEFAULT_TARGET_NAME, SHIPPED_HEADS
    from jetflow_sglang.cli import main

    head_dir = smollm2_published_head(prepared["target"], tmp_path / "jetspec")
    assert main(["export", str(head_dir), str(tmp_path / "again"), "--format", "dflash"]) == 0
    first, again = load_file(str(head_dir / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    capsys.readouterr()
    assert main(["export", str(SHIPPED_HEADS / DEFAULT_TARGET_NAME), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jetflow: error: this head cannot be written as a dflash head") and "\n" not in err
    assert not (tmp_path / "refused").exists()
    run = subprocess.run(
        [sys.executable, "-m", "jetflow_sglang.cli", "generate", "--head", str(head_dir), "--budget", "64", "--compare-ar",
         "--json", "--max-new-tokens", "24", "--prompt", "def fibonacci(n):"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["identical"] is True and report["new_tokens"] == 24


@pytest.mark.slow
def test_qwen3_target_with_a_published_head_is_lossless(prepared, tmp_path):
    """A Qwen3-architecture target (q/k norms in the target too) and a published-layout head:
    the SGLang server with JETFLOW (budget 16, prompt-lookup branch on) returns the no-spec
    server's ids, and the reference engine gives the same ids in the same rounds with the same
    accepted drafts."""
    from transformers import AutoConfig, AutoTokenizer

    from jetflow_sglang import server as sglang_server
    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.reference.engine import ReferenceEngine
    from jetflow_sglang.reference.proposer import HeadProposer

    target = str(tiny_qwen3_target(prepared["target"], tmp_path / "qwen3"))
    config = JetFlowConfig.for_target(AutoConfig.from_pretrained(target), target_layer_ids=[0, 2], qk_norm=True,
                                      mask_from_target=True, mask_token_id=0, rms_norm_eps=1e-6, block_size=8)  # fmt: skip
    head_dir = str(published.export_head(JetFlowHead(config).init_weights(1), tmp_path / "head", "dflash"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer(text).input_ids for text in ("def fibonacci(n):", "a b a b a b a b a")]
    outputs = {}
    for name, extra in (("nospec", ()), ("jetflow", sglang_server.jetflow_args(head_dir, 16))):
        server = sglang_server.start(target, tmp_path / f"{name}.log", *extra, max_total_tokens=2048,
                                     env={"JETFLOW_BUDGET": "static"})  # static: rounds as the reference engine's
        try:
            outputs[name] = [sglang_server.post(server.url + "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}) for ids in prompts]  # fmt: skip
        finally:
            server.stop()
    # The reference engine (HF target, same head, lookup on as in the server) must match the
    # server token for token and round for round: the same drafts were accepted.
    ref_target, head = load_target_and_head(target, head_dir, torch.float32)
    engine = ReferenceEngine(ref_target, HeadProposer(head), budget=16, lookup=True)
    for ids, want, got in zip(prompts, outputs["nospec"], outputs["jetflow"]):
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == 24
        local = engine.generate(ids, 24, ignore_eos=True)
        assert local.tokens == want["output_ids"]
        meta = got["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (local.rounds, sum(local.accept_lengths))
