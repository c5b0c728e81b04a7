"""CPU cores per rank under ``--tp`` / ``--dp`` on the ``jetflow_cpu`` platform.

SGLang's CPU bootstrap (``sglang.srt.distributed.bootstrap``) gives each rank one NUMA node, and
refuses more ranks than nodes, unless ``SGLANG_CPU_OMP_THREADS_BIND`` lists each rank's cores
(``"0-15|16-31"``); it then pins OpenMP threads through ``sgl_kernel``'s CPU ops, which PyPI does
not publish, so on this platform nothing is pinned and every rank runs as many threads as the
machine has cores. Two seams, active only on ``jetflow_cpu`` with more than one rank:

* ``_bind_threads_if_cpu``: where the bind variable is unset, the cores this process may use are
  split in equal shares, in order, among the ranks (rank i gets the i-th share), so two ranks on
  a 2-core machine get a core each instead of a refusal (three get one thread each, two of them
  on the same core);
* ``_init_cpu_threads_env``: the rank pins itself to its cores and runs that many torch threads.

One rank (the default) keeps SGLang's own path and torch's thread count.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

BIND_THREADS = "sglang.srt.distributed.bootstrap._bind_threads_if_cpu"
INIT_THREADS = "sglang.srt.distributed.bootstrap._init_cpu_threads_env"
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def split_cores(cores: list[int], ranks: int) -> list[list[int]]:
    """`cores` in order, cut into `ranks` contiguous shares of one size (cores left over stay
    unused: ranks running different thread counts could round the head's replicated draft pass
    differently, and every rank must draft the same tree). With more ranks than cores, rank i
    runs one thread on core i mod cores (ranks share cores: slow, but a target whose heads only
    split three ways still serves on two cores)."""
    if ranks > len(cores):
        logger.warning("JETFLOW CPU: %d ranks on %d cores: ranks share cores, one thread each", ranks, len(cores))
        return [[cores[rank % len(cores)]] for rank in range(ranks)]
    size = len(cores) // ranks
    return [cores[rank * size : (rank + 1) * size] for rank in range(ranks)]


def parse_cores(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11]."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    if not cores:
        raise ValueError(f"no CPU cores in {text!r}")
    return cores


def _world() -> tuple[int, int]:
    """(ranks on this machine, this rank's index among them), as SGLang's bootstrap counts them."""
    from sglang.srt.distributed import bootstrap

    parallel = bootstrap.get_parallel()
    return parallel.dp_size * parallel.tp_size * parallel.pp_size, bootstrap.get_device().gpu_id


def _bind_around(original, *args, **kwargs):
    from .platform import on_jetflow_cpu

    device = kwargs.get("device", args[0] if args else None)
    if device != "cpu" or not on_jetflow_cpu() or os.environ.get(BIND_ENV):
        return original(*args, **kwargs)
    ranks, index = _world()
    if ranks == 1:
        return original(*args, **kwargs)
    share = split_cores(sorted(os.sched_getaffinity(0)), ranks)[index]
    return ",".join(map(str, share))


def _init_threads_around(original, *args, **kwargs):
    from .platform import on_jetflow_cpu

    cores = kwargs.get("local_omp_cpuid", args[0] if args else None)
    if not on_jetflow_cpu() or _world()[0] == 1 or not cores:
        return original(*args, **kwargs)
    pinned = parse_cores(str(cores))
    os.sched_setaffinity(0, pinned)
    torch.set_num_threads(len(pinned))
    logger.info("JETFLOW CPU: rank %d pinned to cores %s, %d torch threads", _world()[1], pinned, len(pinned))
    return None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(BIND_THREADS, _bind_around, HookType.AROUND)
    HookRegistry.register(INIT_THREADS, _init_threads_around, HookType.AROUND)
