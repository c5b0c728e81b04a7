"""Batched generation for `jetflow regenerate` in a page of plain PyTorch (gpt-fast style).

The target's own HF modules (norms, projections, rotary, MLP) run over a preallocated KV
cache: no per-step cache concatenation, no grouped-query K/V copies (the query heads of a
KV head attend as one group), one attention call per layer for the whole batch, and rows
that finished are dropped from the batch as it goes. It is `regenerate`'s backend where
SGLang's Engine does not start: 2.2x HF `generate`, 0.76x SGLang on a 2-core AMX CPU
(`benchmarks/regen_speed.py`), whose paged cache reads only each row's own tokens where
this one reads the batch's widest row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's is the same

from jetflow_sglang.errors import JetFlowError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")  # decoder layers of exactly the shape `_forward` runs
COMPACT_SHARE = 0.25  # drop finished rows once this share of the live batch has finished
PREFILL_ROWS = 8  # prompts per prefill forward (bounds the [rows, heads, T, T] attention scores)


class BatchDecoder:
    """Greedy (or seeded sampled) answers of a HF Llama-family causal LM to a batch of prompts."""

    def __init__(self, model) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise JetFlowError(f"the batched torch decoder runs {', '.join(SUPPORTED_MODEL_TYPES)} models, not {config.model_type}")
        self.model = model.eval()
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.groups = config.num_attention_heads // self.kv_heads
        eos = model.generation_config.eos_token_id
        self.eos = torch.tensor(sorted(set(eos if isinstance(eos, list) else [eos]) - {None}), dtype=torch.long)

    def _forward(self, tokens: Tensor, positions: Tensor, cache: Tensor, start: int, keep: Tensor) -> Tensor:
        """tokens, positions [b, T]; their K/V go to cache[:, :, :, :, start:start+T] (cache holds b rows); keep [b, 1, T, start+T]
        (True = attend). Returns last-position logits [b, V]."""
        decoder = self.model.model
        b, T = tokens.shape
        hidden = decoder.embed_tokens(tokens)
        cos, sin = decoder.rotary_emb(hidden, positions)
        end = start + T
        mask = keep.repeat(1, 1, self.groups, 1)  # [b, 1, groups * T, end]: query rows grouped per KV head
        for index, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(b, T, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, T, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, T, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache[index, 0, :, :, start:end] = k
            cache[index, 1, :, :, start:end] = v
            q = q.reshape(b, self.kv_heads, self.groups * T, self.head_dim)
            out = F.scaled_dot_product_attention(q, cache[index, 0, :, :, :end], cache[index, 1, :, :, :end], attn_mask=mask)
            out = out.view(b, -1, T, self.head_dim).transpose(1, 2).reshape(b, T, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(decoder.norm(hidden[:, -1]))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
        """Answers to `prompts`, each cut after its first EOS (kept) or at max_new_tokens."""
        model = self.model
        dtype, rows, width = model.dtype, len(prompts), max(len(p) for p in prompts)
        layers = len(model.model.layers)
        cache = torch.zeros(layers, 2, rows, self.kv_heads, width + max_new_tokens, self.head_dim, dtype=dtype)
        pad = torch.tensor([width - len(p) for p in prompts])  # left padding: every row writes the same cache slot
        tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        columns = torch.arange(width)
        positions = (columns - pad[:, None]).clamp(min=0)
        causal = columns[None, :] <= columns[:, None]
        itself = torch.eye(width, dtype=torch.bool)  # a padding row attends to itself only (no all-masked row)
        last_logits = []
        for first in range(0, rows, PREFILL_ROWS):
            part = slice(first, first + PREFILL_ROWS)
            keep = ((causal[None] & (columns >= pad[part, None])[:, None, :]) | itself)[:, None]  # [b, 1, T, T]
            last_logits.append(self._forward(tokens[part], positions[part], cache[:, :, part], 0, keep))
        logits = torch.cat(last_logits)
        generator = torch.Generator().manual_seed(seed)
        answers: list[list[int]] = [[] for _ in prompts]
        live = torch.arange(rows)  # prompt index of each cache row
        done = torch.zeros(rows, dtype=torch.bool)  # finished rows still in the batch
        length = width
        for step in range(max_new_tokens):
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1)
                chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                chosen = logits.argmax(-1)
            for row, token, finished in zip(live.tolist(), chosen.tolist(), done.tolist()):
                if not finished:
                    answers[row].append(token)
            done |= torch.isin(chosen, self.eos)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if done.sum() >= max(1.0, COMPACT_SHARE * len(live)):
                rest = (~done).nonzero().squeeze(1)
                live, chosen, pad, done = live[rest], chosen[rest], pad[rest], done[rest]
                cache = cache.index_select(2, rest)
            keep = (torch.arange(length + 1)[None, :] >= pad[:, None])[:, None, None, :]  # [b, 1, 1, length + 1]
            logits = self._forward(chosen[:, None], (length - pad)[:, None], cache, length, keep)
            length += 1
        return answers
