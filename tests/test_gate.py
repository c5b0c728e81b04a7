"""The shipped head's quality gate: fp32 τ on a fixed held-out slice against its recorded value,
and head + lookup branch ahead of the lookup alone; and the recipe's rule against shipping worse."""

from __future__ import annotations

import pytest

from jetflow_sglang.assets import SHIPPED_HEADS, DEFAULT_TARGET_NAME, load_target_and_head
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.training import gate


def test_the_shipped_head_reaches_its_recorded_tau_and_beats_the_lookup_alone(prepared):
    head_dir = SHIPPED_HEADS / DEFAULT_TARGET_NAME
    recorded = gate.read(head_dir)
    assert recorded is not None, f"{head_dir} has no {gate.GATE_FILE}: record it with gate.record"
    target, head = load_target_and_head(prepared["target"], str(head_dir))  # fp32
    result = gate.measure(target, head, gate.GateSlice(**recorded["slice"]))
    assert result["identical"]
    assert result["tau"] >= recorded["tau"] - gate.MARGIN, (result, recorded)
    assert result["tau"] > result["lookup_tau"], result


def test_a_head_below_the_shipped_gate_is_not_shipped():
    slice_ = {"prompts": "humaneval", "first": 6, "max_new_tokens": 48, "budget": 16}
    shipped = {"tau": 3.0, "lookup_tau": 2.0, "slice": slice_}
    gate.check_not_worse({"tau": 3.0, "slice": slice_}, shipped)
    gate.check_not_worse({"tau": 2.5, "slice": slice_}, None)  # nothing shipped yet
    with pytest.raises(JetFlowError, match="below the shipped"):
        gate.check_not_worse({"tau": 2.99, "slice": slice_}, shipped)
    with pytest.raises(JetFlowError, match="another slice"):
        gate.check_not_worse({"tau": 4.0, "slice": {**slice_, "first": 5}}, shipped)
