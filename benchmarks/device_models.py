"""The models under test in the device check: a Qwen3 target (8B shape with random weights, or a
toy one for --dry-run) with a JetFlow head bound to it, and the target's tree verify over a cached
prefix through HF's SDPA with a 4D mask or through the packed custom mask (FlashInfer on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6)
TOY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           intermediate_size=128, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6)


def build_models(dry_run: bool, device: torch.device, dtype: torch.dtype) -> tuple:
    """(config, target, head): a Qwen3 target (8B shape, or toy) and a JetFlow head shaped for it,
    built on `meta`, materialized on `device` with random weights, the head bound to the target."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from jetflow_sglang.head import JetFlowConfig, JetFlowHead

    config = Qwen3Config(**(TOY if dry_run else QWEN3_8B), tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    with torch.device("meta"):
        target = Qwen3ForCausalLM(config).to(dtype)
        head = JetFlowHead(JetFlowConfig.for_target(config)).to(dtype)
    for seed, module in enumerate((target, head)):
        module.to_empty(device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
    # to_empty leaves the non-persistent buffers (RoPE frequencies) uninitialized: rebuild them.
    target.model.rotary_emb = type(target.model.rotary_emb)(config).to(device)
    hc = head.config
    head.inv_freq = 1.0 / hc.rope_theta ** (torch.arange(0, hc.head_dim, 2, device=device).float() / hc.head_dim)
    target.eval().requires_grad_(False).set_attn_implementation("sdpa")
    head.eval().requires_grad_(False)
    head.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return config, target, head


class Verifier:
    """Target forward of tree tokens after a prefix in the KV cache, capturing the head's taps
    (as `jetflow_sglang.reference.target.Target.forward`, with the mask on the device); `reset(prefix)`
    cuts the cache back to the prefix after each verify."""

    PACKED = "jetflow_packed_mask"

    def __init__(self, model: nn.Module, tap_layers: list[int]) -> None:
        from transformers import AttentionInterface, DynamicCache

        self.model, self.taps, self.captured = model, tap_layers, {}
        for i in tap_layers:
            model.model.layers[i].register_forward_hook(
                lambda _m, _i, out, i=i: self.captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        self.cache = DynamicCache(config=model.config)
        self.packed: Tensor | None = None  # the current tree's packed mask (FlashInfer layout)
        AttentionInterface.register(self.PACKED, self._packed_attention)

    def use(self, impl: str) -> None:
        self.model.set_attn_implementation("sdpa" if impl == "hf_sdpa_4d" else self.PACKED)

    def _packed_attention(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, **_):
        """HF attention function over the tree's packed custom mask (the 4D mask is ignored)."""
        if query.is_cuda:
            import flashinfer

            out = flashinfer.single_prefill_with_kv_cache(
                query[0].transpose(0, 1).contiguous(), key[0].contiguous(), value[0].contiguous(),
                packed_custom_mask=self.packed, kv_layout="HND", sm_scale=scaling)
            return out[None], None
        n, kv_len = query.shape[2], key.shape[2]
        bits = (self.packed[:, None].long() >> torch.arange(8, device=query.device)) & 1  # little-endian bytes
        mask = bits.flatten()[: n * kv_len].view(n, kv_len).bool()
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    def forward(self, tokens: Tensor, positions: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        self.captured.clear()
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=self.cache,
                         use_cache=True)
        return out.logits, torch.cat([self.captured[i] for i in self.taps], -1)

    def reset(self, length: int = 0) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def additive_mask(ancestors: Tensor, prefix: int, dtype: torch.dtype) -> Tensor:
    """[1, 1, N, prefix + N] additive mask: the whole prefix, then the tree's ancestor mask."""
    visible = torch.cat([ancestors.new_ones(*ancestors.shape[:2], prefix), ancestors], -1)[:, None]
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=ancestors.device)
    return blocked.masked_fill(visible, 0.0)


def follow_picks(tree) -> Tensor:
    """The target's token at every node: its first child's token, so acceptance walks deep."""
    batch, budget = tree.tokens.shape
    node_index = torch.arange(1, budget, device=tree.tokens.device).expand(batch, -1)
    parents = tree.parents[:, 1:].clamp(min=0)
    first_child = torch.full_like(tree.tokens, budget).scatter_reduce(1, parents, node_index, "amin")
    return torch.where(first_child < budget, tree.tokens.gather(1, first_child.clamp(max=budget - 1)), 0)
