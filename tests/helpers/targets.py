"""Small targets built here with random weights (no other model's weights can be downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_qwen3_target(target_dir: str, out: Path) -> Path:
    """A 4-layer Qwen3-architecture target with random weights (no Qwen3 weights can be
    downloaded here) and the default target's tokenizer. initializer_range 0.2 makes its
    greedy choices clear (no near-ties for fp32 rounding to flip)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(target_dir) / name).is_file():
            (out / name).write_bytes((Path(target_dir) / name).read_bytes())
    return out
