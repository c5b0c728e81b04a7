"""What the head's draft pass buys each request, for the adaptive budget's choice to skip it.

A round's value is the tokens per second it committed against a plain step's (`budget.py`):
``sum_i c_i / seconds * plain / batch`` for requests i committing c_i tokens, so the batch's
value is the mean of the per-request values ``c_i * plain / seconds``. The policy keeps an EMA of
the batch's value per batch size; kept alone, that mixes every request that ever ran at that
size. A request that copies its context (code, repeated text) and one that does not are judged
by one number, and at one request in flight a request's rounds are judged by those before it.
`RequestValues` keeps the value each running request's own head-drafted rounds bought, so the
batch's estimate is the mean over the requests in it now, each known one by its own record and a
new one by the batch-size EMA.
"""

from __future__ import annotations

from collections.abc import Sequence

REQUEST_EMA = 0.5  # a request's own recent rounds weigh more than its early ones


class RequestValues:
    def __init__(self, weight: float = REQUEST_EMA) -> None:
        self.weight = weight
        self.values: dict[str, float] = {}

    def observe(self, rids: Sequence[str], committed: Sequence[int], seconds: float, plain: float) -> None:
        """After a head-drafted round of `seconds` that committed `committed[i]` tokens for request
        `rids[i]`, where a plain step at this batch size costs `plain` seconds."""
        for rid, count in zip(rids, committed):
            value = count * plain / seconds
            old = self.values.get(rid)
            self.values[rid] = value if old is None else (1 - self.weight) * old + self.weight * value

    def estimate(self, rids: Sequence[str], default: float) -> float:
        """The value a head-drafted round would have for these requests: the mean of their own
        values, `default` (the batch-size EMA) for those without one yet. Forgets requests that
        are no longer in flight."""
        live = set(rids)
        self.values = {rid: v for rid, v in self.values.items() if rid in live}
        if not rids:
            return default
        return sum(self.values.get(rid, default) for rid in rids) / len(rids)
