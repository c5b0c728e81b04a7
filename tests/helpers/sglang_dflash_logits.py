"""Draft logits of SGLang's own DFlash model (sglang/srt/models/dflash.py) for a published head.

Run as a script in its own process (it sets up SGLang's single-rank gloo groups):
    python sglang_dflash_logits.py HEAD_DIR INPUTS.safetensors OUT.safetensors
INPUTS holds `features` [C, n_taps*H] of context positions 0..C-1, `block_ids` [B] (the anchor
then MASK ids), `embedding` and `lm_head` [V, H] (the target's). OUT gets `logits` [B, V].

Everything is SGLang's code: its config parsing, `load_weights`, fc + hidden_norm
projection, the context K/V as its DFlash worker materializes them (`kv_proj_only`,
`apply_k_norm`, `apply_k_rope`), its layers, norms, RoPE and MLP. Only the paged
RadixAttention kernel is replaced by softmax attention over (context K/V, block K/V) with
the layer's own attention type (ENCODER_ONLY: the whole block; DECODER: causal) and sliding
window (`window_left`), because a paged KV pool needs a whole server around it.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


class ContextThenBlockAttention(torch.nn.Module):
    def __init__(self, radix, context_k: torch.Tensor, context_v: torch.Tensor) -> None:
        super().__init__()
        self.radix, self.context_k, self.context_v = radix, context_k, context_v

    def forward(self, q, k, v, forward_batch=None, **_):
        from sglang.srt.layers.radix_attention import AttentionType

        radix = self.radix
        block = q.shape[0]
        q = q.view(block, radix.tp_q_head_num, radix.head_dim).transpose(0, 1)
        k = torch.cat([self.context_k, k.view(block, radix.tp_k_head_num, radix.head_dim)]).transpose(0, 1)
        v = torch.cat([self.context_v, v.view(block, radix.tp_v_head_num, radix.head_dim)]).transpose(0, 1)
        within = torch.ones(block, block, dtype=torch.bool)
        if radix.attn_type == AttentionType.DECODER:
            within = within.tril()
        context_len = self.context_k.shape[0]
        mask = torch.cat([torch.ones(block, context_len, dtype=torch.bool), within], 1)
        if radix.sliding_window_size >= 0:  # SGLang's window_left: keys at positions q - window_left .. q
            query_positions = context_len + torch.arange(block)
            key_positions = torch.arange(context_len + block)
            mask &= key_positions[None, :] >= query_positions[:, None] - radix.sliding_window_size
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=radix.scaling, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(block, -1)


def main(head_dir: str, inputs_path: str, out_path: str) -> None:
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    inputs = load_file(inputs_path)
    args = ServerArgs(model_path=head_dir, device="cpu", max_total_tokens=1024)
    with runtime_context.use_context(runtime_context.create_context(args, role="scheduler")):
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from sglang.srt.models.dflash import DFlashDraftModel

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
        initialize_model_parallel()
        config = AutoConfig.from_pretrained(head_dir)
        model = DFlashDraftModel(config).float().eval()
        model.load_weights(load_file(str(Path(head_dir) / "model.safetensors")).items())
        with torch.no_grad():
            context = model.project_target_hidden(inputs["features"].float())
            positions = torch.arange(context.shape[0])
            for layer in model.layers:
                attn = layer.self_attn
                k, v = attn.kv_proj_only(context)
                k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
                attn.attn = ContextThenBlockAttention(
                    attn.attn, k.view(-1, attn.num_kv_heads, attn.head_dim), v.view(-1, attn.num_kv_heads, attn.head_dim)
                )
            block_ids = inputs["block_ids"].long()
            block_positions = context.shape[0] + torch.arange(len(block_ids))
            embeds = F.embedding(block_ids, inputs["embedding"].float())
            hidden = model(block_ids, block_positions, None, input_embeds=embeds).hidden_states
            save_file({"logits": (hidden @ inputs["lm_head"].float().T).contiguous()}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
