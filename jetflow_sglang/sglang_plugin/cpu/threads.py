"""Small CPU ops on one thread.

On a CPU host the scheduler shares its cores with SGLang's other processes (tokenizer,
detokenizer, HTTP). A torch op's OpenMP region then waits for a core that is busy elsewhere,
and for an op of microseconds that wait is the whole cost. Work this small runs faster on the
calling thread alone. (Not the draft pass: at one request a static-16 server drafted in 9.2 ms
per round on one thread against 6.6 ms on two.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
