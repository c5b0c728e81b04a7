"""The quality gate of a shipped head: τ on a fixed held-out slice, fp32, greedy, against its record.

A head directory may hold `gate.json`: the τ its head and prompt-lookup branch reached on the
slice below (the first HumanEval prompts: evaluation only, never trained on), and the τ of the
lookup alone on the same prompts. `make test` re-measures it and fails when the head falls
below its record by more than `MARGIN` or no longer beats the lookup alone; the recipe refuses
to ship a head whose gate τ is below the shipped one's. fp32 keeps the measurement exact up to
near-ties between machines.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from jetflow_sglang.errors import JetFlowError

GATE_FILE = "gate.json"
MARGIN = 0.1  # τ a re-measurement may lose to near-ties on another machine's fp32 rounding


@dataclass(frozen=True)
class GateSlice:
    prompts: str = "humaneval"
    first: int = 6
    max_new_tokens: int = 48
    budget: int = 16


def measure(target, head, slice_: GateSlice = GateSlice()) -> dict:
    """τ of head + lookup branch and of the lookup alone on the slice (greedy, as loaded: use fp32);
    `identical`: both matched plain decoding token for token."""
    from jetflow_sglang.prompts import load_prompts
    from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
    from jetflow_sglang.reference.proposer import HeadProposer

    engines = {
        "tau": ReferenceEngine(target, HeadProposer(head), budget=slice_.budget, lookup=True),
        "lookup_tau": ReferenceEngine(target, HeadProposer(head), budget=slice_.budget, lookup=True, head=False),
    }
    committed = {name: 0 for name in engines}
    rounds = {name: 0 for name in engines}
    identical = True
    for prompt in load_prompts(slice_.prompts)[: slice_.first]:
        ids = target.encode_prompt(prompt.text, prompt.kind == "chat")
        plain = generate_ar(target, ids, slice_.max_new_tokens).tokens
        for name, engine in engines.items():
            result = engine.generate(ids, slice_.max_new_tokens)
            identical &= result.tokens == plain
            committed[name] += sum(a + 1 for a in result.accept_lengths)
            rounds[name] += result.rounds
    taus = {name: round(committed[name] / max(1, rounds[name]), 4) for name in engines}
    return {**taus, "identical": identical, "slice": asdict(slice_)}


def read(head_dir: str | Path) -> dict | None:
    path = Path(head_dir) / GATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def record(target_dir: str | Path, head_dir: str | Path) -> dict:
    """Measure a head directory's gate (fp32) and write its gate.json."""
    from jetflow_sglang.assets import load_target_and_head

    target, head = load_target_and_head(str(target_dir), str(head_dir), torch.float32)
    result = measure(target, head)
    if not result["identical"]:
        raise JetFlowError(f"{head_dir}: speculative output differs from plain decoding in fp32; not recording a gate")
    (Path(head_dir) / GATE_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result


def check_not_worse(candidate: dict, shipped: dict | None) -> None:
    """The recipe's rule: a head ships only if its gate τ is at least the shipped head's."""
    if shipped is None:
        return
    if candidate["slice"] != shipped["slice"]:
        raise JetFlowError("the shipped head's gate was measured on another slice: re-record it before comparing")
    if candidate["tau"] < shipped["tau"]:
        raise JetFlowError(f"the new head's gate τ {candidate['tau']} is below the shipped head's {shipped['tau']}: not shipping it")
