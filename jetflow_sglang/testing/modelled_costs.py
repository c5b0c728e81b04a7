"""Test hook (``JETFLOW_TEST_COSTS=FILE``, read by :mod:`.hooks`): the adaptive budget on a clock
of its own. Every round takes the seconds a fixed cost table gives for it, not the seconds it
measured, so the tree sizes the policy picks, the rounds it skips and the probes it runs follow
from the acceptance it sees alone: the same on a fast machine and a slow one. Tests that check
what an adaptive server drafts (long accepted paths at 8 in flight, commits cut by EOS, drafts
accepted under sampling) use it; the measured clock is tested by the cost-cache and benchmark
tests, which run on the real one.
"""

from __future__ import annotations

import os

from torch import Tensor

from jetflow_sglang.budget import BudgetPolicy, CostTable
from jetflow_sglang.tree import DraftTree


class ModelledCostPolicy(BudgetPolicy):
    """An adaptive `BudgetPolicy` that prices and clocks every round by `table` (verify, plain
    step and draft pass, as `CostTable.from_json` reads them); nothing it measures changes it."""

    def __init__(self, cap: int, table: CostTable, device: object = "cpu", origin: dict | None = None) -> None:
        super().__init__(cap, "adaptive", table, device, origin)

    def observe(self, tree: DraftTree, path: Tensor, verify_seconds: float, draft_seconds: float | None) -> None:
        batch = tree.tokens.shape[0]
        verify_seconds = self.cost.round_seconds(batch, tree.budget)
        if draft_seconds is not None:
            draft_seconds = self.cost.draft.seconds(batch)
        super().observe(tree, path, verify_seconds, draft_seconds)


def modelled_policy(path: str | os.PathLike, cap: int, device: object = "cpu", origin: dict | None = None) -> ModelledCostPolicy:
    """The policy for ``JETFLOW_TEST_COSTS``: the table in `path` (a JSON object of `verify_ms` by
    verify tokens, `plain_ms` and `draft_ms` by batch size), every curve required."""
    table = CostTable.load(path)
    for name, curve in (("verify_ms", table.verify), ("plain_ms", table.plain), ("draft_ms", table.draft)):
        if len(curve.seconds_at) < 2:
            raise ValueError(f"modelled cost table {path}: {name} needs at least two sizes")
    return ModelledCostPolicy(cap, table, device, origin)
