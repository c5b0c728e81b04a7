"""The ``jetflow_cpu`` SGLang platform: SGLang's real server, scheduler, radix cache and model runner
on a CPU with no ``sgl_kernel`` CPU build. Independent of the JETFLOW worker stack; any
speculative algorithm or none runs on it.

* :mod:`.platform`: the out-of-tree platform (entry point group ``sglang.srt.platforms``);
* :mod:`.attention`: the ``jetflow_cpu`` attention backend, ``torch_native`` plus a tree-masked
  TARGET_VERIFY;
* :mod:`.spec_ops`: torch versions of SGLang's speculative cache-location kernels;
* :mod:`.threads`: small CPU ops on one thread;
* :mod:`.seams`: the attention backend's registration and the two wraps of SGLang's KV-slot code
  the platform needs, registered by the general plugin (:mod:`..hooks`).
"""
