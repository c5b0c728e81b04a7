"""The JetFlow draft head: a few decoder layers over [anchor, MASK x (B-1)] that attend to
context K/V projected from fused target features. One pass gives draft logits for every depth.

The target's embedding and lm_head are shared and frozen: the head borrows them
(`bind_target`) and never saves them. The MASK embedding is the head's own
parameter; `mask_token_id` is a virtual id one past the target vocabulary, so the
target's vocabulary never grows. Heads in the published DFlash layout (`published.py`)
use a target embedding row as MASK instead and Qwen3-style q/k norms; the same class
runs them.

A head may draft over a pruned vocabulary (FR-Spec style): `draft_vocab` holds the
target ids of the K most frequent tokens of its training data (saved with the
weights), and the draft lm_head is those K rows of the target's. Draft logits are
still returned over the target vocabulary (-inf outside the draft vocabulary), so
trees and every engine stay unchanged; the target verifies over its full vocabulary,
so output stays lossless.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from jetflow_sglang import published
from jetflow_sglang.copy_gate import CopyGate
from jetflow_sglang.cpu_linear import can_pack, pack_linears, pack_weight, packed_linear
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head_config import ARCHITECTURE, JetFlowConfig, default_tap_layers
from jetflow_sglang.lookup import hint_kind_count
from jetflow_sglang.tree import Candidates, top_candidates

__all__ = ["ARCHITECTURE", "WEIGHTS_FILE", "JetFlowConfig", "JetFlowHead", "default_tap_layers", "draft_id_map"]

WEIGHTS_FILE = "model.safetensors"


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


Rope = tuple[Tensor, Tensor]  # RoPE cos and sin at a pass's positions, [b, 1, T, d] float32 each


def rope_tables(positions: Tensor, inv_freq: Tensor) -> Rope:
    """cos and sin of Llama RoPE at positions [b, T]: computed once per pass, shared by its layers."""
    angles = positions[:, None, :, None].float() * inv_freq  # [b, 1, T, d/2]
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, rope: Rope) -> Tensor:
    """RoPE (Llama half-rotation). x: [b, heads, T, d]; rope: `rope_tables` at its positions."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


Hints = tuple[Tensor, Tensor]  # lookup hint tokens and kinds (`lookup.lookup_hint`), [b, slots] each


def draft_id_map(draft_vocab: Tensor | None, vocab_size: int) -> Tensor:
    """target id -> draft row (-1 outside the draft vocabulary) [V]."""
    if draft_vocab is None:
        return torch.arange(vocab_size)
    table = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab.device)
    table[draft_vocab] = torch.arange(len(draft_vocab), device=draft_vocab.device)
    return table


LayerAttention = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, block_k, block_v) -> [b, heads, Q, d]
Attention = Callable[[int, Tensor, Tensor, Tensor], Tensor]  # the same, given the layer index first


def dense_attention(context: list[tuple[Tensor, Tensor]], attn_mask: Tensor | list[Tensor]) -> Attention:
    """Attention over dense context K/V (per layer [b, kv_heads, C, d]) then the block, under a
    bool mask [b or 1, 1, Q, C + Q] over (context, block) keys, or one such mask per layer."""

    def attend(layer: int, q: Tensor, block_k: Tensor, block_v: Tensor) -> Tensor:
        context_k, context_v = context[layer]
        k = torch.cat([context_k, block_k], 2)
        v = torch.cat([context_v, block_v], 2)
        mask = attn_mask[layer] if isinstance(attn_mask, list) else attn_mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def window_mask(visible: Tensor, query_positions: Tensor, key_positions: Tensor, window: int) -> Tensor:
    """visible [b, Q, K] restricted to keys fewer than `window` positions before their query."""
    return visible & (key_positions[:, None, :] > query_positions[:, :, None] - window)


class HeadLayer(nn.Module):
    """Llama decoder layer whose attention also reads the context K/V of the target features."""

    def __init__(self, config: JetFlowConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self._packed_qkv: Tensor | None = None  # `pack_for_cpu`
        self._packed_kv: Tensor | None = None

    def pack_for_cpu(self) -> None:
        """bf16 on a CPU: q, k and v as one oneDNN-layout linear (and k, v as another), so a draft
        pass makes one call where it made three (45 instead of 114 us for 16 rows). The same dot
        products; for some row counts oneDNN blocks the wider matrix differently, so bf16 outputs
        can differ from the three apart in the last bit (fp32 heads are not packed)."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if all(can_pack(w) for w in weights):
            self._packed_qkv = pack_weight(torch.cat(weights))
            self._packed_kv = pack_weight(torch.cat(weights[1:]))

    def project_qkv(self, x: Tensor, with_q: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
        """q (None unless with_q), k and v of x [b, T, H], each [b, T, heads * d]."""
        sizes = [self.kv_heads * self.head_dim] * 2
        packed = self._packed_qkv if with_q else self._packed_kv
        if packed is not None and x.dtype == torch.bfloat16:
            parts = packed_linear(x, packed).split([self.heads * self.head_dim, *sizes] if with_q else sizes, -1)
            return (parts[0] if with_q else None), parts[-2], parts[-1]
        return (self.q_proj(x) if with_q else None), self.k_proj(x), self.v_proj(x)

    def key_value(self, x: Tensor, rope: Rope, projected: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Rotated keys and values [b, kv_heads, T, d] of x [b, T, H] (or of its k, v projections)."""
        b, t, _ = x.shape
        k, v = projected if projected is not None else self.project_qkv(x, with_q=False)[1:]
        k = k.view(b, t, self.kv_heads, self.head_dim)
        k = (k if self.k_norm is None else self.k_norm(k)).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, rope), v

    def forward(self, hidden: Tensor, rope: Rope, attend: "LayerAttention") -> Tensor:
        """hidden: [b, Q, H] block states (`rope_tables` at their positions); attend(q, block_k,
        block_v) gives the attention of q [b, heads, Q, d] over the context and the block keys
        [b, kv_heads, Q, d]."""
        b, q_len, _ = hidden.shape
        x = self.input_layernorm(hidden)
        q, k, v = self.project_qkv(x)
        q = q.view(b, q_len, self.heads, self.head_dim)
        q = rotate((q if self.q_norm is None else self.q_norm(q)).transpose(1, 2), rope)
        block_k, block_v = self.key_value(x, rope, (k, v))
        attn = attend(q, block_k, block_v)
        hidden = hidden + self.o_proj(attn.transpose(1, 2).reshape(b, q_len, -1))
        x = self.post_attention_layernorm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class JetFlowHead(nn.Module):
    def __init__(self, config: JetFlowConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, hidden, bias=False)
        # Residual streams carry a few massive dimensions (here one dimension holds ~99% of the
        # energy of the middle and late taps); normalized per tap, as the target's own next layer
        # reads them, every tap and every position gets a say in the context K/V.
        self.tap_norm = nn.Parameter(torch.ones(len(config.target_layer_ids), config.target_hidden_size)) if config.tap_norm else None
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        # EAGLE-style: the anchor slot starts from fuse([embedding of x_a; projected features of
        # a-1]) and every MASK slot from that plus its depth's embedding: each slot holds the
        # last context position and the anchor from the start, which attention would otherwise
        # have to learn to find.
        self.anchor_fuse = nn.Linear(2 * hidden, hidden, bias=False) if config.anchor_fusion else None
        self.depth_embedding = nn.Parameter(torch.zeros(config.block_size, hidden)) if config.anchor_fusion else None
        # Hinted heads (`config.lookup_hint`): a MASK slot adds hint_proj(E[hint token]) plus its
        # kind's embedding (`lookup.hint_kind`); both start at zero, so a hinted head initialized
        # from a plain one drafts exactly as it did.
        self.hint_proj = nn.Linear(hidden, hidden, bias=False) if config.lookup_hint else None
        self.hint_kind_embedding = nn.Parameter(torch.zeros(hint_kind_count(config.lookup_hint_ngram), hidden)) if config.lookup_hint else None
        self.layers = nn.ModuleList(HeadLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.mask_embedding = None if config.mask_from_target else nn.Parameter(torch.zeros(hidden))
        # Copying heads (`config.lookup_copy`): the draft distribution of each depth is mixed with
        # its lookup hint by a learned gate (`copy_gate.CopyGate`). Registered last, so the other
        # parameters draw the same initial values as in a head without it.
        self.copy_gate = CopyGate(hidden, config.block_size - 1, hint_kind_count(config.lookup_hint_ngram)) if config.lookup_copy else None
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))
        else:
            self.draft_vocab = None
        self._target_embedding: Tensor | None = None
        self._target_lm_head: Tensor | None = None
        self._draft_lm_head: Tensor | None = None
        self._packed_lm_head: Tensor | None = None  # `pack_for_cpu`
        self._to_draft: Tensor | None = None  # target id -> draft row, for the copy gate

    def init_weights(self, seed: int = 0) -> "JetFlowHead":
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or name == "tap_norm":
                    param.fill_(1.0)
                else:
                    std = 0.02 / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
        self.zero_hints()
        return self

    @torch.no_grad()
    def zero_hints(self) -> "JetFlowHead":
        """Zero the hint path (a hinted head then drafts as the same head without hints) and
        reset the copy gate (g = 1/2)."""
        if self.hint_proj is not None:
            self.hint_proj.weight.zero_()
            self.hint_kind_embedding.zero_()
        if self.copy_gate is not None:
            self.copy_gate.reset()
        return self

    def bind_target(self, embedding: Tensor, lm_head: Tensor) -> "JetFlowHead":
        """Share the frozen target embedding [V, H] and lm_head [V, H] (never part of state_dict)."""
        # Plain (detached) tensors: assigning an nn.Parameter would register it as the head's own.
        self._target_embedding, self._target_lm_head = embedding.detach(), lm_head.detach()
        self._draft_lm_head = self._packed_lm_head = self._to_draft = None
        if self.draft_vocab is not None:
            self._draft_lm_head = self._target_lm_head.index_select(0, self.draft_vocab.to(lm_head.device))
            if self.copy_gate is not None:
                self._to_draft = draft_id_map(self.draft_vocab.to(lm_head.device), self.config.target_vocab_size)
        return self

    def pack_for_cpu(self) -> "JetFlowHead":
        """Inference in bf16 on a CPU: every linear and the draft lm_head keep their weights in
        oneDNN's layout (`cpu_linear`): the same outputs, faster at the draft pass's sizes. Call
        after `bind_target` and any `set_draft_vocab`; a no-op elsewhere."""
        for layer in self.layers:
            layer.pack_for_cpu()
        pack_linears(self)
        lm_head = self._target_lm_head if self._draft_lm_head is None else self._draft_lm_head
        if lm_head is not None and can_pack(lm_head) and self.fc.weight.dtype == lm_head.dtype:
            self._packed_lm_head = pack_weight(lm_head)
        return self

    def set_draft_vocab(self, target_ids: Tensor) -> "JetFlowHead":
        """Draft over these target ids only (e.g. the most frequent tokens of the training data)."""
        if target_ids.dim() != 1 or len(target_ids) != self.config.draft_vocab_size:
            raise JetFlowError(f"draft vocabulary needs {self.config.draft_vocab_size} ids, got shape {tuple(target_ids.shape)}")
        if len(target_ids.unique()) != len(target_ids) or int(target_ids.min()) < 0 or int(target_ids.max()) >= self.config.target_vocab_size:
            raise JetFlowError("draft vocabulary ids must be distinct target ids")
        self.draft_vocab.copy_(target_ids.to(self.draft_vocab.device))
        if self._target_lm_head is not None:
            self.bind_target(self._target_embedding, self._target_lm_head)
        return self

    # -- the pieces every engine uses -------------------------------------------------
    def embed_block(self, block_tokens: Tensor, positions: Tensor, anchor_context: Tensor | None = None, hints: Hints | None = None) -> Tensor:
        """Embeddings of block tokens [b, Q] at positions [b, Q] (slot 0: the anchor);
        `mask_token_id` maps to the head's MASK embedding. With anchor fusion, slot 0 is
        fuse([its embedding; anchor_context]), anchor_context [b, H] being the projected
        features of the position before the anchor (`project_features`), and each MASK slot
        adds that vector and the embedding of its depth (position - anchor position).
        hints (hinted heads): lookup tokens and kinds [b, Q] aligned with the block slots;
        a MASK slot of kind > 0 adds hint_proj(E[token]) + the kind's embedding. Branch-free
        (no host sync), so the draft pass stays graph-capturable."""
        dtype = self.fc.weight.dtype
        if self.mask_embedding is None:  # MASK is a target row (no anchor fusion: see JetFlowConfig)
            return F.embedding(block_tokens, self._target_embedding).to(dtype)
        is_mask = block_tokens == self.config.mask_token_id
        embedded = F.embedding(block_tokens.masked_fill(is_mask, 0), self._target_embedding)
        embedded = torch.where(is_mask[..., None], self.mask_embedding.to(embedded.dtype), embedded).to(dtype)
        if self.anchor_fuse is None:
            return embedded
        if anchor_context is None:
            raise JetFlowError("this head fuses the anchor with the features before it: pass anchor_context")
        anchor = self.anchor_fuse(torch.cat([embedded[:, 0], anchor_context.to(dtype)], -1))  # [b, H]
        depths = (positions - positions[:, :1]).clamp(0, self.config.block_size - 1)
        masks = embedded + anchor[:, None] + F.embedding(depths, self.depth_embedding.to(dtype))
        if hints is not None and self.hint_proj is not None:
            hint_tokens, kinds = hints
            hinted = (kinds > 0)[..., None].to(dtype)
            hint = self.hint_proj(F.embedding(hint_tokens.clamp(min=0), self._target_embedding).to(dtype))
            masks = masks + (hint + F.embedding(kinds.clamp(min=0), self.hint_kind_embedding.to(dtype))) * hinted
        embedded = torch.where(is_mask[..., None], masks, embedded)
        return torch.cat([anchor[:, None], embedded[:, 1:]], 1)

    def project_features(self, features: Tensor) -> Tensor:
        """Fused target features [..., n_taps * H_t] -> head space [..., H]."""
        dtype = self.fc.weight.dtype
        if self.tap_norm is not None:
            taps = features.unflatten(-1, self.tap_norm.shape).float()
            taps = taps * torch.rsqrt(taps.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
            features = (taps.to(dtype) * self.tap_norm.to(dtype)).flatten(-2)
        return self.hidden_norm(self.fc(features.to(dtype)))

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context K/V of target features [b, T, n_taps*H_t] at positions [b, T]."""
        return self.projected_kv(self.project_features(features), positions)

    def projected_kv(self, projected: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """`context_kv` from already projected features [b, T, H]."""
        rope = rope_tables(positions, self.inv_freq)
        return [layer.key_value(projected, rope) for layer in self.layers]

    def block_mask(self, block_size: int, device: torch.device, causal: bool | None = None) -> Tensor:
        """Within-block visibility: causal (JetFlow) or bidirectional (DFlash baseline). [B, B] bool.
        `causal`: a layer's own (`config.layer_causal`); None: the head's."""
        if self.config.causal if causal is None else causal:
            return torch.ones(block_size, block_size, dtype=torch.bool, device=device).tril()
        return torch.ones(block_size, block_size, dtype=torch.bool, device=device)

    def forward_block(
        self,
        block_tokens: Tensor,
        positions: Tensor,
        context: list[tuple[Tensor, Tensor]],
        attn_mask: Tensor,
        anchor_context: Tensor | None = None,
        hints: Hints | None = None,
    ) -> Tensor:
        """Final-normed hidden states of the block tokens [b, Q, H]."""
        return self.run_block(block_tokens, positions, dense_attention(context, attn_mask), anchor_context, hints)

    def run_block(self, block_tokens: Tensor, positions: Tensor, attention: Attention, anchor_context: Tensor | None = None,
                  hints: Hints | None = None) -> Tensor:  # fmt: skip
        """`forward_block` with the attention over context and block supplied (e.g. paged, in SGLang)."""
        hidden = self.embed_block(block_tokens, positions, anchor_context, hints)
        rope = rope_tables(positions, self.inv_freq)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, functools.partial(attention, index))
        return self.norm(hidden)

    def draft_vocab_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary [..., K] (the whole target vocabulary when not pruned)."""
        if self._packed_lm_head is not None and hidden.dtype == torch.bfloat16:
            return packed_linear(hidden, self._packed_lm_head)
        lm_head = self._target_lm_head if self._draft_lm_head is None else self._draft_lm_head
        # contiguous: on CPU a linear over a strided 3-d slice (the block minus its anchor, b > 1)
        # measured 3x slower in fp32 and 50-100x slower in bf16 than over a copy
        return F.linear(hidden.contiguous(), lm_head.to(hidden.dtype))

    def logits(self, hidden: Tensor, hints: Hints | None = None) -> Tensor:
        """Logits over the target vocabulary [..., V]; -inf outside a pruned draft vocabulary. A
        copying head given per-depth hints [..., D] returns the log-probs of its copy mixture."""
        logits = self.draft_vocab_logits(hidden)
        if self.draft_vocab is not None:
            full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.draft_vocab, logits)
        if self.copy_gate is None or hints is None:
            return logits
        return self.copy_gate.mix(hidden, logits.float().log_softmax(-1), hints)

    def draft_candidates(self, hidden: Tensor, width: int, hints: Hints | None = None) -> Candidates:
        """The top-`width` draft tokens of draft hidden states [..., D, H] (`draft_hidden`): log-probs and
        target token ids [..., D, k], by a log-softmax and top-k over the draft vocabulary only
        (`tree.top_candidates`): no target-vocabulary logits are built. A copying head given
        per-depth hints [..., D] lists the top tokens of its copy mixture (`CopyGate.candidates`)."""
        logits = self.draft_vocab_logits(hidden)
        if self.copy_gate is None or hints is None:
            return top_candidates(logits, width, self.draft_vocab)
        return self.copy_gate.candidates(hidden, logits.float().log_softmax(-1), hints, width, self.draft_vocab, self._to_draft)

    def draft(self, anchors: Tensor, anchor_positions: Tensor, context: list[tuple[Tensor, Tensor]], context_valid: Tensor | None = None,
              anchor_context: Tensor | None = None, hints: Hints | None = None) -> Tensor:  # fmt: skip
        """Draft logits for depths 1..B-1 [b, B-1, V] (`draft_hidden`, then `logits`)."""
        return self.logits(self.draft_hidden(anchors, anchor_positions, context, context_valid, anchor_context, hints), hints)

    def draft_hidden(self, anchors: Tensor, anchor_positions: Tensor, context: list[tuple[Tensor, Tensor]],
                     context_valid: Tensor | None = None, anchor_context: Tensor | None = None,
                     hints: Hints | None = None) -> Tensor:  # fmt: skip
        """Final-normed hidden states of depths 1..B-1 [b, B-1, H] from one pass over [anchor, MASK...].

        anchors, anchor_positions: [b]; context: per-layer K/V [b, kv_heads, C, d];
        context_valid: [b, C] bool for ragged contexts (None: all valid); anchor_context: [b, H]
        projected features of the position before the anchor (heads with anchor fusion); hints:
        lookup tokens and kinds per depth [b, B-1] (hinted heads; None: no hints)."""
        block = self.config.block_size
        b, device = anchors.shape[0], anchors.device
        block_tokens, positions = self.draft_block(anchors, anchor_positions)
        context_len = context[0][0].shape[2]
        if context_valid is None:
            context_valid = torch.ones(b, context_len, dtype=torch.bool, device=device)

        def visible(causal: bool) -> Tensor:
            within = self.block_mask(block, device, causal).expand(b, -1, -1)
            return torch.cat([context_valid[:, None, :].expand(-1, block, -1), within], -1)

        mask = self.layer_masks(visible, positions, context_len)
        hidden = self.forward_block(block_tokens, positions, context, mask, anchor_context, self.block_hints(hints))
        return hidden[:, 1:]

    @staticmethod
    def block_hints(hints: Hints | None) -> Hints | None:
        """Per-depth hints [b, B-1] as per-slot hints [b, B] (the anchor slot: kind 0)."""
        if hints is None:
            return None
        return tuple(F.pad(h, (1, 0)) for h in hints)  # type: ignore[return-value]

    def layer_masks(self, visible: Callable[[bool], Tensor], query_positions: Tensor, context_len: int) -> Tensor | list[Tensor]:
        """The attention mask of a pass over context positions 0..C-1 then its queries [b, Q] at
        `query_positions`: visible(causal) [b, Q, C + Q] as [b, 1, Q, C + Q], or, for heads with
        sliding-window layers, one mask per layer (its causality, its window)."""
        config = self.config
        if not config.sliding_layers:
            return visible(config.causal)[:, None]
        context_positions = torch.arange(context_len, device=query_positions.device).expand(query_positions.shape[0], -1)
        key_positions = torch.cat([context_positions, query_positions], 1)
        masks = []
        for layer in range(config.num_layers):
            mask, window = visible(config.layer_causal(layer)), config.layer_window(layer)
            masks.append((window_mask(mask, query_positions, key_positions, window) if window else mask)[:, None])
        return masks

    def draft_block(self, anchors: Tensor, anchor_positions: Tensor) -> tuple[Tensor, Tensor]:
        """The draft block [anchor, MASK, ...] [b, B] and its positions [b, B]."""
        block = self.config.block_size
        block_tokens = torch.full((anchors.shape[0], block), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        block_tokens[:, 0] = anchors
        return block_tokens, anchor_positions[:, None] + torch.arange(block, device=anchors.device)

    def draft_hidden_with(self, anchors: Tensor, anchor_positions: Tensor, attention: Attention,
                          anchor_context: Tensor | None = None, hints: Hints | None = None) -> Tensor:  # fmt: skip
        """`draft_hidden` with the attention over each request's context and the block supplied:
        [b, B-1, H]. The attention must apply each layer's causality within the block and its
        window (`config.layer_causal`, `config.layer_window`; context position j at slot j)."""
        block_tokens, positions = self.draft_block(anchors, anchor_positions)
        return self.run_block(block_tokens, positions, attention, anchor_context, self.block_hints(hints))[:, 1:]

    def refresh(
        self,
        tree_tokens: Tensor,
        tree_positions: Tensor,
        ancestors: Tensor,
        context: list[tuple[Tensor, Tensor]],
        context_valid: Tensor | None = None,
        anchor_context: Tensor | None = None,
    ) -> Tensor:
        """Path-conditioned draft logits [b, N, V]: row i is q(next token | context, path to node i).

        One pass over the N tree nodes as real tokens plus one MASK child per node: node i
        sees its ancestors (the tree-causal mask), its MASK child sees that path and itself,
        which is a block with a revealed prefix, as `reveal` training shows the head.
        tree_tokens, tree_positions: [b, N]; ancestors: [b, N, N] bool (node, ancestor-or-self)."""
        b, n = tree_tokens.shape
        device = tree_tokens.device
        masks = torch.full_like(tree_tokens, self.config.mask_token_id)
        tokens = torch.cat([tree_tokens, masks], 1)
        positions = torch.cat([tree_positions, tree_positions + 1], 1)
        eye = torch.eye(n, dtype=torch.bool, device=device).expand(b, -1, -1)
        block_mask = torch.cat(
            [torch.cat([ancestors, torch.zeros_like(ancestors)], 2), torch.cat([ancestors, eye], 2)], 1
        )  # [b, 2N, 2N]
        context_len = context[0][0].shape[2]
        if context_valid is None:
            context_valid = torch.ones(b, context_len, dtype=torch.bool, device=device)
        visible = torch.cat([context_valid[:, None, :].expand(-1, 2 * n, -1), block_mask], -1)
        mask = self.layer_masks(lambda _causal: visible, positions, context_len)  # the tree mask is causal already
        hidden = self.forward_block(tokens, positions, context, mask, anchor_context)  # node 0 is the anchor
        return self.logits(hidden[:, n:])

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(self.config.to_json_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype | None = None) -> "JetFlowHead":
        directory = Path(directory)
        if not directory.is_dir():
            raise JetFlowError(f"head directory not found: {directory}")
        config_path, weights_path = directory / "config.json", directory / WEIGHTS_FILE
        if not config_path.is_file():
            raise JetFlowError(f"head directory has no config.json: {directory}")
        if not weights_path.is_file():
            others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
            hint = f" (found {', '.join(others)}; only safetensors weights are loaded)" if others else ""
            raise JetFlowError(f"head directory has no {WEIGHTS_FILE}{hint}: {directory}")
        try:
            data = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise JetFlowError(f"head config.json is not valid JSON: {exc}") from None
        head = cls(JetFlowConfig.from_json_dict(data))
        try:
            state = load_file(str(weights_path))
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise JetFlowError(f"cannot read head weights {weights_path}: {exc}") from None
        if "jetflow" not in data:
            state = published.own_state_dict(state)
        try:
            head.load_state_dict(state)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[1:2] or [str(exc)]
            raise JetFlowError(f"head weights do not match its config.json: {first[0].strip()}") from None
        if head.draft_vocab is not None:
            ids = head.draft_vocab
            if len(ids.unique()) != len(ids) or int(ids.min()) < 0 or int(ids.max()) >= head.config.target_vocab_size:
                raise JetFlowError(f"head draft vocabulary holds ids outside the target vocabulary or repeats: {weights_path}")
        return head.to(dtype) if dtype is not None else head
