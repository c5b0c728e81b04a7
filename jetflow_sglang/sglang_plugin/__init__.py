"""SGLang plugins shipped with jetflow-sglang, in two parts.

* The CPU platform, :mod:`.cpu` (entry point group ``sglang.srt.platforms``, ``jetflow_cpu``):
  SGLang's real server on a CPU with no ``sgl_kernel`` CPU build (platform, the tree-masked
  attention backend, torch versions of the speculative cache-location kernels). It knows nothing
  of JETFLOW, and is active only where CUDA is absent or ``SGLANG_PLATFORM=jetflow_cpu``.
* JETFLOW's speculative worker stack, the modules here: :mod:`.hooks`, the general plugin (entry
  point group ``sglang.srt.plugins``) that registers the CPU attention backend and ``JETFLOW`` and
  wraps SGLang's seams; :mod:`.spec_algo` (registration, launch validation); :mod:`.worker` (the
  spec-v2 worker) and the per-round modules beside it (proposer, draft graphs, verify input,
  lookup branch and hints, node acceptance with penalties, grammars, sampling cut and seeds).
"""

ALGORITHM = "JETFLOW"  # the name users pass to --speculative-algorithm
