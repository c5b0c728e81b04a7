"""The SGLang seams the CPU platform needs beyond its platform interface, registered by the general
plugin (:func:`jetflow_sglang.sglang_plugin.hooks.register`, entry point group
``sglang.srt.plugins``), which runs in every SGLang process:

* registers the ``jetflow_cpu`` attention backend and CLI choice (:mod:`.attention`);
* wraps ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func``
  (a Triton kernel with an ``sgl_kernel`` CPU twin, used by speculative decode
  allocation) so that, only while the ``jetflow_cpu`` platform is active, it
  runs the torch version in :mod:`.spec_ops`.  Elsewhere it calls the original;
* wraps ``MHATokenToKVPool._init_kv_copy_and_warmup`` (SGLang builds the KV pool
  with the Triton slot-copy kernel and warms it up whenever a speculative
  algorithm is set) so that on ``jetflow_cpu`` it is skipped: the platform sets
  ``SGLANG_NATIVE_MOVE_KV_CACHE``, so KV compaction takes the torch move and the
  Triton copy is never used;
* gives each rank of ``--tp`` / ``--dp`` its share of the cores (:mod:`.ranks`).
"""

from __future__ import annotations

from . import attention, ranks

ASSIGN_REQ_TO_TOKEN = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
KV_COPY_WARMUP = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"


def _assign_req_to_token_pool_around(original, *args, **kwargs):
    from .platform import on_jetflow_cpu

    if on_jetflow_cpu():
        from .spec_ops import assign_req_to_token_pool

        return assign_req_to_token_pool(*args, **kwargs)
    return original(*args, **kwargs)


def _kv_copy_warmup_around(original, pool, *args, **kwargs):
    from .platform import on_jetflow_cpu

    if on_jetflow_cpu() and getattr(pool, "use_native_move_kv_cache", False):
        pool._kv_copy_config = None
        return None
    return original(pool, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    attention.register()
    ranks.register()
    HookRegistry.register(ASSIGN_REQ_TO_TOKEN, _assign_req_to_token_pool_around, HookType.AROUND)
    HookRegistry.register(KV_COPY_WARMUP, _kv_copy_warmup_around, HookType.AROUND)
