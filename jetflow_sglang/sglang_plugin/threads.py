"""Small CPU ops on one thread.

On a CPU host the scheduler shares its cores with SGLang's other processes (tokenizer,
detokenizer, HTTP). A torch op's OpenMP region then waits for a core that is busy elsewhere,
and for an op of microseconds that wait is the whole cost. Work this small runs faster on the
calling thread alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

# The worker's rounds of at most this many requests run their draft, tree and bookkeeping on one
# thread (the verify keeps every thread).
ONE_THREAD_BATCH = int(os.environ.get("JETFLOW_ONE_THREAD_BATCH", 0))


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with `count` torch intra-op threads, then restore the count it had."""
    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Run the block on one intra-op thread when `enabled`."""
    return torch_threads(1) if enabled else contextlib.nullcontext()
