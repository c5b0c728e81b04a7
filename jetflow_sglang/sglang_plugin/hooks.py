"""General SGLang plugin (entry point group ``sglang.srt.plugins``) of jetflow-sglang.

Runs in every SGLang process (``sglang.srt.plugins.load_plugins``):

* registers the ``jetflow_cpu`` attention backend and CLI choice;
* wraps ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func``
  (a Triton kernel with an ``sgl_kernel`` CPU twin, used by speculative decode
  allocation) so that, only while the ``jetflow_cpu`` platform is active, it
  runs the torch version in :mod:`.spec_ops`.  Elsewhere it calls the original.
"""

from __future__ import annotations

from . import attention

ASSIGN_REQ_TO_TOKEN = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"


def _on_jetflow_cpu() -> bool:
    from sglang.srt.platforms import current_platform

    from .platform import JetflowCpuPlatform

    return isinstance(current_platform, JetflowCpuPlatform)


def _assign_req_to_token_pool_around(original, *args, **kwargs):
    if _on_jetflow_cpu():
        from .spec_ops import assign_req_to_token_pool

        return assign_req_to_token_pool(*args, **kwargs)
    return original(*args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    attention.register()
    HookRegistry.register(ASSIGN_REQ_TO_TOKEN, _assign_req_to_token_pool_around, HookType.AROUND)
