"""Labelling why a JETFLOW answer differs from the target alone's (`jetflow_sglang.explain`), on
real data: the four bf16 differences of a `jetflow bench --prompts demo --max-new-tokens 96`
run, with the target-alone server's re-checks at each (tests/data/explain_bf16.json, made by
tests/helpers/capture_explain.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from jetflow_sglang.explain import (
    CHECKS,
    NEAR_TIE,
    NEAR_TIE_GAP,
    REPRODUCED,
    TOP_LOGPROBS,
    Probe,
    describe,
    first_difference,
    label,
    probe_from_output,
    token_at,
)

FIXTURE = json.loads((Path(__file__).parent / "data" / "explain_bf16.json").read_text())
CASES = {case["id"]: case for case in FIXTURE["differences"]}


def probes(case: dict) -> list[Probe]:
    return [Probe(p["check"], p["token"], [tuple(t) for t in p["top"]], p["parted_at"]) for p in case["probes"]]


def difference(case: dict, exact: bool = False, **verdict_overrides) -> dict:
    """A bench row's ``difference`` for `describe`, as `bench.explain_difference` builds it."""
    verdict = asdict(label(case["jetflow_token"], probes(case)))
    return {**case, **verdict, **verdict_overrides, "exact": exact}


def test_the_fixture_is_a_real_bf16_demo_capture():
    assert FIXTURE["meta"]["dtype"] == "bfloat16" and len(CASES) == 4
    for case in CASES.values():
        assert [p["check"] for p in case["probes"]] == list(CHECKS)
        assert case["target_token"] != case["jetflow_token"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_first_difference_and_tokens_are_where_the_captured_answers_part(name):
    case = CASES[name]
    target, jetflow, position = case["target_ids"], case["jetflow_ids"], case["position"]
    assert first_difference(target, jetflow) == position
    assert target[:position] == jetflow[:position]
    assert (token_at(target, position, None), token_at(jetflow, position, None)) == (case["target_token"], case["jetflow_token"])
    assert first_difference(target, target) is None
    # one answer a strict prefix of the other (it stopped first): they part at its end, on its stop token
    assert first_difference(target[:position], target) == position
    assert token_at(target[:position], position, 2) == 2 and token_at(target[:position], position, None) is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_prefix_probe_is_parsed_from_the_raw_generate_answer(name):
    raw = CASES[name]["prefix_output"]
    probe = probe_from_output("prefix", raw, [])
    answered = raw["output_ids"][0]
    assert probe.parted_at is None and probe.token == answered
    assert [t[0] for t in probe.top] == [t[1] for t in raw["meta_info"]["output_top_logprobs"][0]]
    assert len(probe.top) == TOP_LOGPROBS and [t[1] for t in probe.top] == sorted((t[1] for t in probe.top), reverse=True)
    assert probe.top[0][1] == max(t[1] for t in probe.top) and all(isinstance(t[2], str) and t[2] for t in probe.top)
    # a re-check that must first decode a token of the shared prefix: it parts there, or ends before the position
    other = answered + 1
    assert probe_from_output("cached", raw, [other]) == Probe("cached", answered, [], 0)
    assert probe_from_output("cached", raw, [answered]) == Probe("cached", None, [])


def test_every_captured_difference_is_labelled_by_cause():
    for name, case in CASES.items():
        verdict = label(case["jetflow_token"], probes(case))
        assert verdict.causes, name
        assert NEAR_TIE in verdict.causes and verdict.gap is not None and verdict.gap < NEAR_TIE_GAP, name
    # two differences part where JETFLOW's token is the target's second, 0.125 (one bf16 step) behind
    assert label(CASES["CmD5m6T_9"]["jetflow_token"], probes(CASES["CmD5m6T_9"])).gap == 0.125
    assert label(CASES["HumanEval/0"]["jetflow_token"], probes(CASES["HumanEval/0"])).gap == 0.125
    # one at a three-way exact tie: the gap does not depend on how the server orders tied tokens
    tie = CASES["HumanEval/2"]
    assert len({t[1] for t in probes(tie)[0].top[:3]}) == 1
    assert label(tie["jetflow_token"], probes(tie)).gap == 0.0
    assert label(probes(tie)[0].top[2][0], probes(tie)).gap == 0.0


def test_the_target_alone_reproduces_jetflows_token_with_every_token_prefilled():
    """At 'combination' vs 'high' the target alone, asked with prompt + shared prefix in one
    uncached prefill, answers JETFLOW's 'high' itself; decoded, it answers 'combination'."""
    case = CASES["VzC6nIz_0"]
    verdict = label(case["jetflow_token"], probes(case))
    assert verdict.causes == [NEAR_TIE, REPRODUCED] and verdict.reproduced_by == ["prefix-uncached"]
    assert verdict.gap == 0.0 and verdict.gap_check == "prefix-uncached"
    # only a tie explains the others: without the near-tie threshold, this is the one left explained
    strict = {name: label(c["jetflow_token"], probes(c), near_tie_gap=0.0).causes for name, c in CASES.items()}
    assert strict == {name: ([REPRODUCED] if name == "VzC6nIz_0" else []) for name in CASES}


def test_probes_that_left_the_shared_prefix_say_nothing():
    """Re-asked, the target alone answered CmD5m6T_9's first token differently from its timed
    run (whose prompt shared its cached system prefix with the earlier ones): those two re-checks
    parted at token 0 and cannot speak for token 26."""
    case = CASES["CmD5m6T_9"]
    parted = [p for p in probes(case) if p.parted_at is not None]
    assert [(p.check, p.parted_at) for p in parted] == [("uncached", 0), ("cached", 0)]
    assert all(p.token != case["target_ids"][0] and not p.top for p in parted)
    assert label(case["jetflow_token"], parted) == label(case["jetflow_token"], [])
    assert label(case["jetflow_token"], []).causes == [] and label(None, probes(case)).causes == []


def test_a_token_the_target_ranks_far_below_its_top_one_is_unexplained_and_loud():
    """A JETFLOW token that no re-check answers and that trails the target's top-1 by more than
    the threshold (here the target's third choice at '.' vs ',', 2.6 behind) is no near-tie."""
    case = CASES["HumanEval/0"]
    third, logprob = probes(case)[0].top[2][:2]
    verdict = label(third, probes(case))
    assert verdict.causes == [] and verdict.reproduced_by == [] and verdict.gap > 2 * NEAR_TIE_GAP
    line = describe(case["id"], {**difference(case), **asdict(verdict), "jetflow_text": " ("})
    assert line.startswith("!!! HumanEval/0 differs at new token 34") and "NO CAUSE FOUND" in line
    assert f"trails the target's top-1 by {verdict.gap:.3f}" in line
    unlisted = label(-1, probes(case))  # not among the target's best 5 anywhere
    assert unlisted.causes == [] and unlisted.gap is None
    assert f"not among its best {TOP_LOGPROBS}" in describe(case["id"], {**difference(case), **asdict(unlisted)})


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_explained_difference_is_one_line_with_its_gap(name):
    case = CASES[name]
    d = difference(case)
    line = describe(name, d)
    assert "\n" not in line and line.startswith(f"--- {name} differs at new token {case['position']}: ")
    assert f"target alone {case['target_text']!r}, JETFLOW {case['jetflow_text']!r}" in line
    assert f"near-tie: JETFLOW's token trails the target's top-1 by {d['gap']:.3f} in log-prob" in line
    assert CHECKS[d["gap_check"]] in line
    assert ("answers" in line) == (REPRODUCED in d["causes"])


def test_in_float32_the_exact_check_fails_on_any_difference_whatever_its_causes():
    case = CASES["VzC6nIz_0"]
    line = describe(case["id"], difference(case, exact=True))
    assert line.startswith("!!! VzC6nIz_0") and "float32, the exact check: FAILED" in line and "near-tie" in line
