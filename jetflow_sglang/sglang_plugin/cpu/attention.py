"""CPU attention backend for SGLang: torch_native plus tree-masked TARGET_VERIFY.

SGLang's ``torch_native`` backend handles EXTEND and DECODE but crashes in
``TARGET_VERIFY`` (it reads ``extend_prefix_lens``, which is None there) and
never looks at ``spec_info.custom_mask``.  ``JetflowCpuAttnBackend`` keeps the
parent's extend/decode paths and adds a verify path:

* K/V of the ``n = spec_info.draft_token_num`` verify tokens of every request
  are written at ``forward_batch.out_cache_loc`` (``bs * n`` slots, request
  major; SGLang assigns them as ``req_to_token[req, seq_len:seq_len + n]``);
* for each request, SDPA runs its ``n`` queries over the keys of the committed
  prefix ``req_to_token[req, :seq_len]`` followed by its own ``n`` verify slots,
  with a boolean mask: prefix columns always visible, verify columns taken from
  the tree mask (``None`` means a causal chain, or the whole block for
  bidirectional ``ENCODER_ONLY`` layers such as a DFLASH-style draft).

``forward_batch.seq_lens`` in TARGET_VERIFY is the committed length *without*
the verify tokens.  Two custom-mask layouts are accepted (SGLang's
``TreeMaskMode``):

* ``FULL_MASK``: flat, per request an ``[n, seq_len + n]`` row-major block,
  blocks concatenated over the batch (total ``n * sum(seq_lens) + bs * n * n``);
* ``QLEN_ONLY``: per request an ``[n, n]`` block (total ``bs * n * n``), flat or
  shaped ``[bs, n, n]``.

Any non-zero / True entry means "may attend".  The backend is registered as
``jetflow_cpu`` by :func:`register` (entry point group ``sglang.srt.plugins``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .threads import one_thread

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

BACKEND_NAME = "jetflow_cpu"

# q_len * heads * head_dim * kv_len below which one request's SDPA runs on one
# thread (e.g. decode at 2k context with 9x64 heads is ~1.2M).
SMALL_ATTENTION_WORK = int(os.environ.get("JETFLOW_CPU_SMALL_ATTN_WORK", 1 << 22))

FULL_MASK = "full"
QLEN_ONLY = "qlen"


def split_tree_mask(
    custom_mask: Optional[torch.Tensor],
    seq_lens: list[int],
    n: int,
    causal: bool = True,
) -> list[torch.Tensor]:
    """Per-request ``[n, n]`` boolean masks over the verify tokens.

    ``custom_mask`` is a FULL_MASK or QLEN_ONLY mask (see module doc), or None
    for a causal chain (``causal``) or a fully visible block (``not causal``).
    The layout is told apart by size: the two totals
    differ by ``n * sum(seq_lens)``, which is positive whenever a request has
    any committed prefix (always true in verify).  A FULL_MASK buffer larger
    than needed (a preallocated one) is read from its front.
    """
    bs = len(seq_lens)
    if custom_mask is None or custom_mask.numel() == 0:
        block = torch.ones(n, n, dtype=torch.bool)
        if causal:
            block.tril_()
        return [block] * bs
    flat = custom_mask.reshape(-1)
    if flat.dtype != torch.bool:
        flat = flat != 0
    qlen_total = bs * n * n
    full_total = n * sum(seq_lens) + qlen_total
    if flat.numel() == qlen_total and full_total != qlen_total:
        layout = QLEN_ONLY
    elif flat.numel() >= full_total:
        layout = FULL_MASK
    elif flat.numel() >= qlen_total:
        layout = QLEN_ONLY
    else:
        raise ValueError(
            f"custom_mask has {flat.numel()} entries; expected {full_total} "
            f"(FULL_MASK) or {qlen_total} (QLEN_ONLY) for bs={bs}, n={n}"
        )
    out = []
    if layout == QLEN_ONLY:
        blocks = flat[:qlen_total].view(bs, n, n)
        return [blocks[i] for i in range(bs)]
    off = 0
    for s in seq_lens:
        block = flat[off : off + n * (s + n)].view(n, s + n)
        out.append(block[:, s:])
        off += n * (s + n)
    return out


def _attend(query, k_cache, v_cache, kv_loc, mask, layer) -> torch.Tensor:
    """SDPA of ``query`` [q, H, D] over the cache rows ``kv_loc``; returns [q, H, Dv].

    ``mask`` is None (all visible) or a boolean [q, len(kv_loc)] (True = attend).
    """
    key = k_cache.index_select(0, kv_loc)
    value = v_cache.index_select(0, kv_loc)
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
        value = value.to(query.dtype)
    work = query.shape[0] * query.shape[1] * query.shape[2] * key.shape[0]
    with one_thread(work < SMALL_ATTENTION_WORK):  # see .threads
        out = scaled_dot_product_attention(
            query.movedim(0, 1).unsqueeze(0),  # [1, H, q, D]
            key.movedim(0, 1).unsqueeze(0),  # [1, Hkv, kv, D]
            value.movedim(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
    return out.squeeze(0).movedim(0, 1)


def _attend_batched(query, k_cache, v_cache, kv_loc, mask, layer) -> torch.Tensor:
    """One SDPA for a whole batch: ``query`` [b, q, H, D] over the cache rows ``kv_loc``
    [b, L] (padding columns may hold any valid slot), ``mask`` bool [b, q, L] (True =
    attend; every query row has a True). Returns [b, q, H, Dv].

    Per-request SDPA calls cost ~0.3 ms each in dispatch alone: at batch 32 and 30
    layers that was most of a decode step."""
    bs, length = kv_loc.shape
    flat = kv_loc.reshape(-1)
    key = k_cache.index_select(0, flat).view(bs, length, *k_cache.shape[1:])
    value = v_cache.index_select(0, flat).view(bs, length, *v_cache.shape[1:])
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
        value = value.to(query.dtype)
    out = scaled_dot_product_attention(
        query.transpose(1, 2),  # [b, H, q, D]
        key.transpose(1, 2),  # [b, Hkv, L, D]
        value.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),
        scale=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
    )
    return out.transpose(1, 2)


def _padded_rows(req_to_token, rows: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of each request's first seq_len tokens, [b, max_len] (padding: slot 0), and
    their validity [b, max_len]."""
    width = max(int(seq_lens.max()), 1)
    columns = torch.arange(width, device=seq_lens.device)
    valid = columns[None, :] < seq_lens[:, None]
    slots = req_to_token[rows.long()][:, :width].long()
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


class JetflowCpuAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with a tree-masked TARGET_VERIFY path (see module doc)."""

    def forward_extend(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        **kwargs,
    ):
        if forward_batch.forward_mode.is_target_verify():
            return self._forward_target_verify(
                q, k, v, layer, forward_batch, save_kv_cache
            )
        return super().forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache
        )

    def forward_decode(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        **kwargs,
    ):
        # Same computation as the parent's decode, with ``index_select``
        # gathers and host-side lengths: on a busy 2-core host the parent's
        # advanced-indexing gather (``k_cache[idx]``) opens an OpenMP region
        # per call and costs ~7 ms instead of ~3 us, which dominated decode.
        if layer.is_cross_attention or forward_batch.encoder_lens is not None:
            return super().forward_decode(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache
            )
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        cache_loc = forward_batch.out_cache_loc
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(cache_loc, self.swa_out_cache_loc), k, v
            )
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        window = layer.sliding_window_size
        use_window = window is not None and window > -1
        if q_.shape[0] > 1 and not use_window:
            kv_loc, valid = self._decode_rows(forward_batch, req_to_token)
            o_.copy_(_attend_batched(q_[:, None], k_cache, v_cache, kv_loc, valid[:, None, :], layer)[:, 0])
            return o
        seq_lens = forward_batch.seq_lens.tolist()
        rows = forward_batch.req_pool_indices.tolist()
        for i, (row, s) in enumerate(zip(rows, seq_lens)):
            kv_loc = req_to_token[row, :s]
            mask = None
            if use_window:
                k_pos = torch.arange(s, device=q.device)
                mask = (k_pos >= (s - 1) - window).unsqueeze(0)
            o_[i : i + 1] = _attend(
                q_[i : i + 1], k_cache, v_cache, kv_loc, mask, layer
            )
        return o

    # ------------------------------------------------------------- verify
    def _forward_target_verify(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ):
        if layer.is_cross_attention:
            raise NotImplementedError("cross attention in TARGET_VERIFY")
        spec_info = forward_batch.spec_info
        if spec_info is None:
            raise RuntimeError("TARGET_VERIFY forward without spec_info")
        n = int(spec_info.draft_token_num)

        cache_loc = forward_batch.out_cache_loc
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(cache_loc, self.swa_out_cache_loc), k, v
            )

        if layer.qk_head_dim != layer.v_head_dim:
            o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        else:
            o = torch.empty_like(q)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)

        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token

        # The device ``seq_lens`` is authoritative (DFLASH-style drafts set a
        # host ``seq_lens_cpu`` that already includes the block); on this
        # platform the device is the CPU, so reading it costs nothing.
        seq_lens = [int(x) for x in forward_batch.seq_lens.tolist()]
        bs = len(seq_lens)
        # A verify-shaped forward without a tree mask is a causal chain, except
        # for bidirectional (ENCODER_ONLY) layers, e.g. a DFLASH-style draft
        # block run in TARGET_VERIFY mode, which see the whole block.
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        tree_masks = self._tree_masks(forward_batch, spec_info, seq_lens, n, causal)

        window = layer.sliding_window_size
        use_window = window is not None and window > -1

        if not use_window:  # slots and mask built once per forward, shared by every layer
            kv_loc, mask = self._verify_rows(forward_batch, req_to_token, tree_masks, n)
            if bs == 1:  # one request: `_attend` keeps a small SDPA on one thread
                o_.copy_(_attend(q_, k_cache, v_cache, kv_loc[0], mask[0], layer))
                return o
            out = _attend_batched(q_.view(bs, n, *q_.shape[1:]), k_cache, v_cache, kv_loc, mask, layer)
            o_.copy_(out.reshape(o_.shape))
            return o
        rows = forward_batch.req_pool_indices.tolist()
        for i in range(bs):
            s = seq_lens[i]
            qs = slice(i * n, (i + 1) * n)
            prefix = req_to_token[rows[i], :s]
            kv_loc = torch.cat([prefix.to(cache_loc.dtype), cache_loc[qs]])
            mask = torch.ones(n, s + n, dtype=torch.bool, device=q.device)
            mask[:, s:] = tree_masks[i].to(q.device)
            if use_window:
                draft_pos = forward_batch.positions[qs].to(torch.long)
                k_pos = torch.cat([torch.arange(s, device=q.device), draft_pos])
                mask &= k_pos.unsqueeze(0) >= draft_pos.unsqueeze(1) - window
            o_[qs] = _attend(q_[qs], k_cache, v_cache, kv_loc, mask, layer)
        return o

    def _decode_rows(self, forward_batch, req_to_token):
        """Padded cache slots and validity of a decode batch; one gather per forward, shared by every layer."""
        cache = getattr(self, "_jetflow_decode_rows", None)
        if cache is not None and cache[0] is forward_batch and cache[1] is forward_batch.out_cache_loc:
            return cache[2]
        rows = _padded_rows(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens)
        self._jetflow_decode_rows = (forward_batch, forward_batch.out_cache_loc, rows)
        return rows

    def _verify_rows(self, forward_batch, req_to_token, tree_masks, n):
        """Verify batch: slots [b, max_prefix + n] (padded prefix, then the n verify slots) and
        the mask [b, n, max_prefix + n] (valid prefix columns, then the tree mask)."""
        cache = getattr(self, "_jetflow_verify_rows", None)
        key = (forward_batch, forward_batch.out_cache_loc, tree_masks)
        if cache is not None and all(a is b for a, b in zip(cache[0], key)):
            return cache[1]
        bs = len(tree_masks)
        prefix, valid = _padded_rows(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens)
        verify_slots = forward_batch.out_cache_loc.view(bs, n).long()
        kv_loc = torch.cat([prefix, verify_slots], 1)
        mask = torch.cat([valid[:, None, :].expand(-1, n, -1), torch.stack(tree_masks).to(valid.device)], 2)
        self._jetflow_verify_rows = (key, (kv_loc, mask))
        return kv_loc, mask

    def _tree_masks(self, forward_batch, spec_info, seq_lens, n, causal):
        # One split per forward, shared by every layer.
        cache = getattr(self, "_jetflow_mask_cache", None)
        mask = getattr(spec_info, "custom_mask", None)
        key = (id(forward_batch), id(mask), tuple(seq_lens), n, causal)
        if cache is not None and cache[0] == key:
            return cache[1]
        masks = split_tree_mask(mask, seq_lens, n, causal)
        self._jetflow_mask_cache = (key, masks, forward_batch, mask)
        return masks


def create_backend(runner):
    return JetflowCpuAttnBackend(runner)


def register() -> None:
    """Register ``jetflow_cpu`` in SGLang's attention registry and CLI choices.

    Idempotent.  Called by the ``sglang.srt.plugins`` entry point in every
    SGLang process (launcher, tokenizer manager, scheduler).
    """
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_draft_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([BACKEND_NAME])
