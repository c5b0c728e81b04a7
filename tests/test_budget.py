"""The load-aware tree budget (jetflow_sglang/budget.py): cost table, acceptance calibration,
and the size the policy picks under set costs and draft confidence."""

from __future__ import annotations

import json
import math

import pytest
import torch

from jetflow_sglang.budget import AcceptanceCalibration, BudgetPolicy, CostTable, Curve, budget_ladder
from helpers.trees import confident_tree, serve_rounds
from jetflow_sglang.tree import prune_tree, root_only


def test_ladder():
    assert budget_ladder(16) == [1, 2, 4, 8, 16]
    assert budget_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    assert budget_ladder(1) == [1]


def test_cost_table_interpolates_and_round_trips(tmp_path):
    table = CostTable(Curve({1: 0.010, 16: 0.025, 64: 0.085}), Curve({1: 0.002, 8: 0.009}))
    verify = table.verify
    assert verify.seconds(16) == pytest.approx(0.025)
    assert verify.seconds(40) == pytest.approx(0.025 + 0.06 * 24 / 48)
    assert verify.seconds(128) == pytest.approx(0.085 + 0.06 / 48 * 64)  # linear past the last point
    assert verify.known(40) and not verify.known(65)
    assert table.draft.seconds(4) == pytest.approx(0.002 + 0.007 * 3 / 7)
    verify.observe(16, 0.035)
    assert verify.seconds(16) == pytest.approx(0.8 * 0.025 + 0.2 * 0.035)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table.to_json()))
    loaded = CostTable.load(path)
    assert loaded.verify.seconds_at == pytest.approx(verify.seconds_at)
    assert loaded.draft.seconds_at == pytest.approx({1: 0.002, 8: 0.009})


def test_noisy_costs_are_read_non_decreasing():
    """One slow round at a small size (or a lucky one at a big size) must not make a bigger
    verify look cheaper: the fit pools violators, weighted by how often each size ran."""
    table = Curve()
    for m, seconds, times in [(1, 0.090, 2), (2, 0.080, 10), (4, 0.130, 2), (8, 0.147, 10), (16, 0.121, 2), (32, 0.170, 5)]:
        for _ in range(times):
            table.observe(m, seconds)
    read = [table.seconds(m) for m in range(1, 40)]
    assert all(a <= b + 1e-12 for a, b in zip(read, read[1:]))
    assert table.seconds(1) == pytest.approx((0.090 * 2 + 0.080 * 10) / 12)
    assert table.seconds(4) == pytest.approx(0.130)
    assert table.seconds(8) == table.seconds(16) == pytest.approx((0.147 * 10 + 0.121 * 2) / 12)
    assert table.seconds(64) > table.seconds(32)


@pytest.mark.parametrize("text, match", [
    ("{", "cannot read cost table"),
    ('{"draft_ms": 1}', "verify_ms"),
    ('{"verify_ms": {"0": 1.0}}', ">= 1"),
    ('{"verify_ms": {"4": -1.0}}', "> 0"),
    ('{"verify_ms": {"4": 1.0}, "draft_ms": {"one": 1.0}}', "integers"),
    ('{"verify_ms": [1, 2]}', "verify_ms"),
])  # fmt: skip
def test_bad_cost_table_is_one_clear_error(tmp_path, text, match):
    path = tmp_path / "cost.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        CostTable.load(path)


def test_calibration_learns_observed_acceptance():
    """A draft that claims 0.9 but is right 30% of the time is read as 0.3 once observed."""
    calibration = AcceptanceCalibration()
    claimed, depth = torch.full((4000,), math.log(0.9)), torch.full((4000,), 2)
    assert calibration.probabilities(claimed[:1], depth[:1]).item() == pytest.approx(0.9, abs=1e-6)  # nothing seen yet
    gen = torch.Generator().manual_seed(0)
    calibration.observe(claimed, depth, torch.rand(4000, generator=gen) < 0.3)
    assert calibration.probabilities(claimed[:1], depth[:1]).item() == pytest.approx(0.3, abs=0.03)
    # Another depth with the same score starts from the score bin's rate; another bin from its own.
    assert calibration.probabilities(claimed[:1], torch.tensor([5])).item() == pytest.approx(0.3, abs=0.03)
    other_bin = torch.tensor([math.log(0.01)])
    assert calibration.probabilities(other_bin, depth[:1]).item() == pytest.approx(0.01, rel=1e-4)


def test_calibration_tells_depths_apart():
    """A prompt-lookup chain scores depth * log(0.6) but is right far more often deep in the
    chain than a head node of the same score; per-depth cells learn each."""
    calibration = AcceptanceCalibration()
    score = torch.full((2000,), 4 * math.log(0.6))
    calibration.observe(score, torch.full((2000,), 4), torch.arange(2000) % 10 < 7)  # chain, depth 4: 0.7
    calibration.observe(score, torch.full((2000,), 1), torch.arange(2000) % 10 < 1)  # head, depth 1: 0.1
    got = calibration.probabilities(score[:2], torch.tensor([4, 1]))
    assert got.tolist() == pytest.approx([0.7, 0.1], abs=0.01)


def test_static_always_takes_the_cap():
    policy = BudgetPolicy(16, "static")
    tree = confident_tree(2, 8, 0.01, 16)
    assert policy.choose(tree) == (16, None)
    policy.observe(tree, torch.zeros(2, 3, dtype=torch.long), 0.5, 0.1)  # nothing to learn
    assert policy.cost.verify.seconds_at == {}


def test_sizes_are_measured_smallest_first_until_the_cost_line_is_known():
    policy = BudgetPolicy(16, "adaptive")
    tried = serve_rounds(policy, confident_tree(1, 15, 0.9, 16), 7)
    # Twice each until two tree sizes are trusted (the root alone is a plain step, priced apart);
    # then the line through them prices the rest, and a confident draft goes to the cap.
    assert tried == [1, 1, 2, 2, 4, 4, 16]
    assert sorted(policy.cost.verify.seconds_at) == [2, 4, 16] and list(policy.cost.plain.seconds_at) == [1]


def _policy_with_costs(cap: int, seconds_per_token: float, fixed: float) -> BudgetPolicy:
    sizes = [n * b for n in budget_ladder(cap) for b in (1, 4, 16)]
    cost = CostTable(Curve({m: fixed + seconds_per_token * m for m in sizes}), Curve({1: 0.001, 16: 0.004}))
    return BudgetPolicy(cap, "adaptive", cost)


def test_confident_draft_with_flat_cost_takes_the_cap():
    policy = _policy_with_costs(16, seconds_per_token=1e-6, fixed=0.02)  # verify cost ~ flat in size
    assert policy.choose(confident_tree(1, 15, 0.95, 16))[0] == 16


def test_hopeless_draft_verifies_the_root_only():
    policy = _policy_with_costs(16, seconds_per_token=2e-3, fixed=0.02)
    assert policy.choose(confident_tree(1, 15, 0.001, 16))[0] == 1


def test_a_round_never_verifies_more_than_the_verify_token_cap():
    """Even where the costs say the cap pays, batch x size stays within VERIFY_TOKENS_PER_BATCH
    (the CPU platform's adaptive server runs SGLang's own batch cap, not cap / budget)."""
    from jetflow_sglang.budget import VERIFY_TOKENS_PER_BATCH

    policy = _policy_with_costs(64, seconds_per_token=1e-9, fixed=0.02)  # verify cost flat: bigger always pays
    assert policy.choose(confident_tree(1, 15, 0.95, 64))[0] == 64
    assert policy.choose(confident_tree(40, 15, 0.95, 64))[0] == 32  # 40 x 64 > 2048 >= 40 x 32
    assert 40 * 32 <= VERIFY_TOKENS_PER_BATCH < 40 * 64


def test_size_shrinks_as_the_batch_grows():
    """Same draft, verify cost linear in bs * n: a big batch can afford fewer nodes each."""
    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    alone = policy.choose(confident_tree(1, 15, 0.7, 16))[0]
    loaded = policy.choose(confident_tree(16, 15, 0.7, 16))[0]
    assert alone > loaded >= 1


def test_expected_commits_match_simulated_greedy_acceptance():
    """Calibrated on a chain drafter right with p per depth, E(n) equals the simulated mean."""
    p, cap = 0.6, 8
    policy = BudgetPolicy(cap, "adaptive")
    gen = torch.Generator().manual_seed(1)
    tree = confident_tree(1, 7, 0.999, cap, width=1)  # a chain: node d is at depth d
    for _ in range(3000):
        hits = int((torch.rand(7, generator=gen) < p).int().cumprod(0).sum())
        path = torch.tensor([list(range(hits + 1)) + [-1] * (7 - hits)])
        policy.observe(tree, path, 0.01, 0.001)
    expected = policy.expected_commits(tree)
    simulated = [1 + sum(p**d for d in range(1, n)) for n in range(1, cap + 1)]
    assert expected.tolist() == pytest.approx(simulated, rel=0.05)
    assert expected[0].item() == 1.0


def test_drafting_that_does_not_pay_is_skipped_with_a_probe_every_8th_round():
    policy = _policy_with_costs(16, seconds_per_token=2e-3, fixed=0.02)
    tree = prune_tree(confident_tree(4, 15, 0.001, 16), 2)
    nothing_accepted = torch.tensor([[0, -1]] * 4)
    assert not policy.skip_draft(4)  # nothing known yet: draft
    # 4 tokens in draft + verify seconds, where a plain step (verify of 4 tokens) is faster.
    policy.observe(tree, nothing_accepted, verify_seconds=0.03, draft_seconds=0.002)
    plain = policy.cost.verify.seconds(4)
    assert policy.draft_value[4] == pytest.approx(4 / 0.032 * plain / 4)
    assert policy.draft_value[4] < 1
    skips = [policy.skip_draft(4) for _ in range(16)]
    assert skips == [True] * 7 + [False] + [True] * 7 + [False]  # every 8th round drafts (a probe)
    assert policy.skip_draft(2)  # a batch size not measured yet starts from the nearest measured one
    policy.observe(prune_tree(confident_tree(2, 15, 0.9, 16), 4), torch.tensor([[0, 1, 2, 3]] * 2), 0.03, 0.002)
    assert policy.draft_value[2] > 1 and not policy.skip_draft(2)  # ... until it is measured itself
    assert policy.skipped_drafts == 15 and policy.report()["chosen"] == {}  # the size is still chosen per round
    assert not BudgetPolicy(16, "static").skip_draft(4)


def test_a_probe_that_loses_much_comes_rarely():
    """A head round at batch 16 that takes five plain steps' time to commit one token per request
    loses four plain steps: probing it every 200th round keeps the probes' loss at 2% of the time."""
    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    tree = prune_tree(confident_tree(16, 15, 0.001, 16), 2)
    plain = policy.cost.verify.seconds(16)
    policy.observe(tree, torch.tensor([[0, -1]] * 16), verify_seconds=3 * plain, draft_seconds=2 * plain)
    assert policy.head_loss[16] == pytest.approx(4 * plain)
    skips = [policy.skip_draft(16) for _ in range(400)]
    assert [i for i, skip in enumerate(skips) if not skip] == [199, 399]
    assert [policy.skip_draft(8) for _ in range(8)] == [True] * 8  # batch 8 starts from batch 16's interval


def test_the_head_is_skipped_when_rounds_without_it_commit_faster():
    """The head pays against a plain step (value > 1), but rounds without it (prompt-lookup
    chains alone) have been paying more: skip it, probing every 8th round; once head rounds
    measure better again, keep drafting."""
    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    tree = prune_tree(confident_tree(1, 15, 0.5, 16), 4)
    two, four = torch.tensor([[0, 1, -1, -1]]), torch.tensor([[0, 1, 2, 3]])
    for _ in range(10):
        policy.observe(tree, two, verify_seconds=0.024, draft_seconds=0.01)  # head rounds: 2 tokens
        policy.observe(tree, four, verify_seconds=0.024, draft_seconds=None)  # lookup-only rounds: 4 tokens
    assert 1 < policy.draft_value[1] < policy.chain_value[1]
    assert [policy.skip_draft(1) for _ in range(8)] == [True] * 7 + [False]
    # ... only in rounds that found chains: without any, the alternative is a plain step (worth 1),
    # and chain rounds, measured where text repeats, say nothing of such a round.
    assert not any(policy.skip_draft(1, chains_found=False) for _ in range(8))
    assert not policy.skip_chains(1)  # chains pay
    one = torch.tensor([[0, -1, -1, -1]])
    for _ in range(40):  # later text repeats nothing: lookup-only rounds commit one token
        policy.observe(tree, four, verify_seconds=0.024, draft_seconds=0.001)
        policy.observe(tree, one, verify_seconds=0.024, draft_seconds=None)
    assert policy.chain_value[1] < 1 < policy.draft_value[1] and not policy.skip_draft(1)


def test_head_rounds_value_the_chains_they_held_on_the_same_text():
    """A head round whose requests also had lookup chains values them as a round verifying them
    alone would have committed (leading tokens equal to what the target committed, up to the
    size the policy gives the chain tree, then a bonus), at that round's cost without a draft
    pass. A streak of chain-only rounds that ran copies out (measured on other text) no longer
    outweighs head rounds that commit more on the text both see: the head is kept."""
    from jetflow_sglang.accept import Acceptance
    from jetflow_sglang.lookup import CHAIN_SCORES
    from jetflow_sglang.tree import chain_tree as lookup_chain_tree

    policy = _policy_with_costs(16, seconds_per_token=1e-6, fixed=0.02)  # flat: the chain tree takes the cap
    tree = prune_tree(confident_tree(1, 15, 0.5, 16), 4)  # tokens 0, 0, 0 under the root
    four = torch.tensor([[0, 1, 2, 3]])
    for _ in range(10):  # chain-only rounds in a copy stretch: 4 tokens each, no draft pass
        policy.observe(tree, four, verify_seconds=0.024, draft_seconds=None)
    for _ in range(10):  # head rounds: 4 tokens each
        policy.observe(tree, four, verify_seconds=0.024, draft_seconds=0.01)
    assert policy.draft_value[1] < policy.chain_value[1] and policy.skip_draft(1)  # the streak wins
    accepted = Acceptance(path=four, num_accepted=torch.tensor([3]), bonus=torch.tensor([7]))  # commits 0, 0, 0, 7
    anchor = torch.tensor([9])
    before = policy.chain_value[1]
    policy.observe_chains_beside_head(lookup_chain_tree(anchor, [[]], 15, CHAIN_SCORES), tree, accepted)
    assert policy.chain_value[1] == before  # no chain: nothing to value
    held = lookup_chain_tree(anchor, [[0, 5, 5, 5, 5]], 15, CHAIN_SCORES)
    for _ in range(40):  # the same text: the chain holds the first committed token only
        policy.observe(tree, four, verify_seconds=0.024, draft_seconds=0.01)
        policy.observe_chains_beside_head(held, tree, accepted)
    size = policy._best_size(held, policy.node_probabilities(held))
    seconds, plain = policy.cost.round_seconds(1, size), policy.cost.plain_seconds(1)
    assert size >= 2 and policy.chain_value[1] == pytest.approx(2 / seconds * plain, rel=0.05)  # 1 matched + a bonus
    assert policy.chain_value[1] < policy.draft_value[1] and not policy.skip_draft(1)
    assert policy.totals_report()["credited"]["1"] == {"rounds": 40, "ms": pytest.approx(1e3 * seconds, abs=0.01), "tokens": 2.0}
    right = lookup_chain_tree(anchor, [[0, 0, 0, 7, 1]], 15, CHAIN_SCORES)
    size = policy._best_size(right, policy.node_probabilities(right))
    policy.observe_chains_beside_head(right, tree, accepted)
    # every committed token matched: a round of `size` nodes commits them up to its size
    assert 2 <= size and policy.round_totals["credited"][1][2] == 40 * 2 + min(5, size)
    two = lookup_chain_tree(torch.tensor([9, 9]), [[0, 0, 0, 7, 1], []], 15, CHAIN_SCORES)
    size = policy._best_size(two, policy.node_probabilities(two))
    both = Acceptance(path=torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]]), num_accepted=torch.tensor([3, 1]), bonus=torch.tensor([7, 4]))
    policy.observe_chains_beside_head(two, prune_tree(confident_tree(2, 15, 0.5, 16), 4), both)
    assert policy.round_totals["credited"][2][2] == min(5, size) + 1  # a request without a chain commits its bonus alone
    static = BudgetPolicy(16, "static")
    static.observe_chains_beside_head(held, tree, accepted)
    assert not static.chain_value and not static.round_totals["credited"]


def test_lookup_chains_that_do_not_pay_give_way_to_plain_steps():
    """Rounds verifying lookup chains without the head that commit fewer tokens per second than a
    plain step: the next rounds verify the root alone, with no probe (the skipped chains are valued
    from what the target commits instead); a plain step's own round is worth 1 and changes no
    estimate; chains that pay again are kept."""
    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    chains = prune_tree(confident_tree(2, 15, 0.5, 16), 8)
    assert not policy.skip_chains(2)  # nothing known yet: verify them
    policy.observe(chains, torch.tensor([[0, -1], [0, 1]]), verify_seconds=0.036, draft_seconds=None)
    plain = policy.cost.verify.seconds(2)
    assert policy.chain_value[2] == pytest.approx(3 / 0.036 * plain / 2) and policy.chain_value[2] < 1
    assert all(policy.skip_chains(2) for _ in range(16))
    assert policy.skip_chains(1) and policy.skipped_chains == 17  # batch 1 starts from batch 2's estimate
    before = dict(policy.chain_value)
    policy.observe(prune_tree(chains, 1), torch.tensor([[0], [0]]), verify_seconds=0.022, draft_seconds=None)
    assert policy.chain_value == before and 2 not in policy.draft_value
    # A head whose rounds pay less than a plain step is skipped even where chains pay less still.
    policy.observe(chains, torch.tensor([[0, -1], [0, -1]]), verify_seconds=0.036, draft_seconds=0.01)
    assert policy.draft_value[2] < 1 and policy.skip_draft(2)
    for _ in range(40):  # chains that commit 8 tokens per request again
        policy.observe(chains, torch.tensor([list(range(8))] * 2), verify_seconds=0.036, draft_seconds=None)
    assert policy.chain_value[2] > 1 and not policy.skip_chains(2)
    assert not BudgetPolicy(16, "static").skip_chains(2)


def test_skipped_chains_come_back_when_their_first_tokens_match():
    """A root-only round that skipped lookup chains checks each chain's first token against the
    token the target committed: misses keep the chains skipped, hits (text that repeats again)
    bring them back within a few rounds, with no probe; a request without a chain never hits."""
    from jetflow_sglang.lookup import CHAIN_SCORES
    from jetflow_sglang.tree import chain_tree as lookup_chain_tree

    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    chains = lookup_chain_tree(torch.tensor([5, 5]), [[1, 2, 3, 4, 5, 6, 7], []], 15, CHAIN_SCORES)
    policy.observe(prune_tree(chains, 8), torch.tensor([[0, -1], [0, -1]]), verify_seconds=0.036, draft_seconds=None)
    assert policy.chain_value[2] < 1 and policy.skip_chains(2)
    for _ in range(12):  # the chain misses; the filler row (the anchor's token) is no chain
        policy.observe_skipped_chains(chains, torch.tensor([9, 5]))
    assert policy.chain_value[2] < 1 and policy.skip_chains(2)
    values = []
    for _ in range(12):  # the chain's first token is what the target commits
        policy.observe_skipped_chains(chains, torch.tensor([1, 9]))
        values.append(policy.chain_value[2])
    assert values == sorted(values) and values[-1] > 1 and not policy.skip_chains(2)
    assert policy.skipped_chains == 2  # no probe was needed
    policy.observe_skipped_chains(lookup_chain_tree(torch.tensor([5, 5]), [[], []], 15, CHAIN_SCORES), torch.tensor([5, 5]))
    assert policy.chain_value[2] == values[-1]  # no chain at all: nothing to value


def test_drafting_that_pays_keeps_drafting():
    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    tree = prune_tree(confident_tree(1, 15, 0.5, 16), 4)
    three_committed = torch.tensor([[0, 1, 2, -1]])
    for _ in range(20):
        policy.observe(tree, three_committed, verify_seconds=0.024, draft_seconds=0.002)
    assert policy.draft_value[1] > 2 and not policy.skip_draft(1)


def test_policy_from_env(monkeypatch, tmp_path):
    from jetflow_sglang.budget import policy_from_env

    monkeypatch.setenv("JETFLOW_BUDGET", "adaptive")
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({"verify_ms": {"1": 10, "64": 40}, "draft_ms": {"1": 3}}))
    monkeypatch.setenv("JETFLOW_COST_TABLE", str(table))
    policy = policy_from_env(64)
    assert policy.adaptive and policy.cost.verify.seconds(32) == pytest.approx(0.010 + 0.030 * 31 / 63)
    assert policy.cost.verify.known(1) and policy.cost.verify.known(64)  # a loaded size is trusted at once
    policy.cost.verify.observe(64, 0.041)
    assert policy.cost.verify.known(64)  # and stays trusted when measured once more
    assert policy.cost.draft.seconds(4) == pytest.approx(0.003)
    monkeypatch.setenv("JETFLOW_BUDGET", "fast")
    with pytest.raises(ValueError, match="static, adaptive"):
        policy_from_env(64)


# ------------------------------------------------------------------ default policy and cost-table origin
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adaptive_is_the_default_and_measures_its_own_costs(monkeypatch, dtype):
    """Nothing set: the adaptive policy under the cap, with no cost table, in either serving dtype.
    It prices rounds from what it measures (smallest sizes first), and reports where it measured
    them (what `benchmarks/verify_cost.py` records beside the table)."""
    from jetflow_sglang.budget import DEFAULT_POLICY, host_fingerprint, policy_from_env

    monkeypatch.delenv("JETFLOW_BUDGET", raising=False)
    monkeypatch.delenv("JETFLOW_COST_TABLE", raising=False)
    policy = policy_from_env(16, "cpu", dtype)
    assert DEFAULT_POLICY == "adaptive" and policy.mode == "adaptive" and policy.cap == 16
    assert policy.cost.verify.seconds_at == {} and policy.cost.plain.seconds_at == {}
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    assert policy.report()["origin"] == {"dtype": name, **host_fingerprint("cpu")}
    tree = confident_tree(2, 15, 0.9, 16)
    tree.scores = tree.scores.to(dtype)  # scores in the serving dtype are read the same
    tried = serve_rounds(policy, tree, 7)
    assert tried == [1, 1, 2, 2, 4, 4, 16]
    monkeypatch.setenv("JETFLOW_BUDGET", "")  # empty: the default
    assert policy_from_env(16, "cpu", dtype).adaptive


def test_static_budget_on_request(monkeypatch):
    from jetflow_sglang.budget import policy_from_env

    monkeypatch.delenv("JETFLOW_COST_TABLE", raising=False)
    monkeypatch.setenv("JETFLOW_BUDGET", "static")
    policy = policy_from_env(16)
    assert policy.mode == "static" and not policy.measuring
    assert policy.choose(confident_tree(2, 8, 0.01, 16)) == (16, None)


def _write_table(path, **origin) -> str:
    path.write_text(json.dumps({"verify_ms": {"1": 10, "64": 40}, "draft_ms": {"1": 3}, **origin}))
    return str(path)


def test_cost_table_of_another_dtype_is_refused(monkeypatch, tmp_path):
    from jetflow_sglang.budget import policy_from_env

    monkeypatch.delenv("JETFLOW_BUDGET", raising=False)
    monkeypatch.setenv("JETFLOW_COST_TABLE", _write_table(tmp_path / "bf16.json", dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"measured in bfloat16, but this server runs float32: measure one here") as info:
        policy_from_env(64, "cpu", torch.float32)
    assert "\n" not in str(info.value)
    assert policy_from_env(64, "cpu", torch.bfloat16).cost.verify.known(64)
    assert policy_from_env(64, "cpu", None).adaptive  # dtype not known yet (auto): the worker checks it
    # Older tables record the dtype under "config", as benchmarks/verify_cost.py wrote it.
    monkeypatch.setenv("JETFLOW_COST_TABLE", _write_table(tmp_path / "old.json", config={"dtype": "float32"}))
    with pytest.raises(ValueError, match="measured in float32, but this server runs bfloat16"):
        policy_from_env(64, "cpu", torch.bfloat16)


@pytest.mark.parametrize("key, other", [("machine", "riscv64"), ("cuda", True), ("device_name", "Some Other CPU"), ("cpus", 4096)])
def test_cost_table_of_another_machine_is_refused(monkeypatch, tmp_path, key, other):
    from jetflow_sglang.budget import host_fingerprint, policy_from_env

    here = host_fingerprint("cpu")
    monkeypatch.delenv("JETFLOW_BUDGET", raising=False)
    monkeypatch.setenv("JETFLOW_COST_TABLE", _write_table(tmp_path / "here.json", dtype="float32", **here))
    assert policy_from_env(64, "cpu", torch.float32).cost.verify.known(64)  # recorded here: accepted
    monkeypatch.setenv("JETFLOW_COST_TABLE", _write_table(tmp_path / "there.json", dtype="float32", **{**here, key: other}))
    with pytest.raises(ValueError, match=rf"measured on another machine \(.*{other!r} there, .* here\)"):
        policy_from_env(64, "cpu", torch.float32)


def test_cost_table_of_another_tensor_parallel_size_is_refused(monkeypatch, tmp_path):
    """Under --tp the verify is sharded and the draft pass is not: a table measured at --tp 2 prices
    --tp 1 rounds wrongly, and the other way round. A server at --tp 2 states it in its origin
    (the cost cache's key); at --tp 1 the origin stays as before (the caches saved stay valid)."""
    from jetflow_sglang.budget import host_fingerprint, policy_from_env

    here = host_fingerprint("cpu")
    monkeypatch.delenv("JETFLOW_BUDGET", raising=False)
    monkeypatch.setenv("JETFLOW_COST_TABLE", _write_table(tmp_path / "tp2.json", dtype="float32", tp=2, **here))
    assert policy_from_env(64, "cpu", torch.float32, tp=2).origin["tp"] == 2
    with pytest.raises(ValueError, match=r"another machine \(tensor-parallel ranks: 2 there, 1 here\)"):
        policy_from_env(64, "cpu", torch.float32)
    monkeypatch.setenv("JETFLOW_COST_TABLE", _write_table(tmp_path / "plain.json", dtype="float32", **here))
    assert "tp" not in policy_from_env(64, "cpu", torch.float32).origin  # no tp stated: taken at either size
    assert policy_from_env(64, "cpu", torch.float32, tp=2).cost.verify.known(64)


def test_cost_table_without_origin_and_the_shipped_tables_load():
    """A table that says nothing of where it was measured is taken as it is; the shipped tables
    (architecture, CUDA or not, and their dtype under "config") load here in their own dtype."""
    from pathlib import Path

    from jetflow_sglang.budget import host_fingerprint

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    here = host_fingerprint("cpu")
    for name, dtype in (("verify_cost_cpu.json", "float32"), ("verify_cost_cpu_bf16.json", "bfloat16")):
        data = json.loads((results / name).read_text())
        if data.get("machine") != here["machine"]:
            pytest.skip(f"{name} was measured on {data.get('machine')}")
        assert CostTable.load(results / name, dtype, here).verify.seconds_at
        with pytest.raises(ValueError, match="measured in"):
            CostTable.load(results / name, "float16", here)
    assert CostTable.from_json({"verify_ms": {"1": 10}}).verify.seconds_at == {1: 0.010}


def test_dtype_names():
    from jetflow_sglang.budget import dtype_name

    assert [dtype_name(d) for d in (torch.float32, torch.bfloat16, "bf16", "half", "float", "auto", None)] == [
        "float32", "bfloat16", "bfloat16", "float16", "float32", None, None]  # fmt: skip


def test_a_round_must_pay_more_than_a_plain_step_by_the_margin():
    """Drafting that buys only a little more than a plain step (head or chains) is skipped: at a
    large batch, requests that advance unevenly finish apart and cost partly empty rounds and
    extra prefills that no round's own value shows. Above the margin, drafting is kept."""
    from jetflow_sglang.budget import pay_bar

    margin = pay_bar(4) - 1.0
    assert pay_bar(1) == 1.0 and margin > 0 and pay_bar(16) == pay_bar(4)  # a lone request pays no margin
    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    tree = prune_tree(confident_tree(4, 15, 0.5, 16), 2)
    two = torch.tensor([[0, 1]] * 4)
    plain = policy.cost.verify.seconds(4)
    worth = 1.0 + margin / 2  # pays against a plain step, inside the margin
    seconds = 2 * plain / worth
    policy.observe(tree, two, verify_seconds=seconds, draft_seconds=None)
    policy.observe(tree, two, verify_seconds=seconds - 1e-4, draft_seconds=1e-4)
    assert 1 < policy.chain_value[4] < 1 + margin and 1 < policy.draft_value[4] < 1 + margin
    assert policy.skip_chains(4) and policy.skip_draft(4)
    worth = 1.0 + 3 * margin  # chains once skipped come back above the bar by another margin
    for _ in range(40):
        policy.observe(tree, two, verify_seconds=2 * plain / worth, draft_seconds=None)
        policy.observe(tree, two, verify_seconds=2 * plain / worth - 2e-4, draft_seconds=1e-4)
    assert not policy.skip_chains(4) and not policy.skip_draft(4)  # the head, a little faster, over the chains
    totals = policy.report()["rounds_by_batch"]  # what the server's profile line reports
    assert totals["chains"]["4"]["rounds"] == 41 and totals["head"]["4"]["tokens"] == 2.0 and totals["root"] == {}


def test_plain_steps_are_priced_by_batch_size_apart_from_trees():
    """Root-only rounds at batch 16 cost more than a 16-node tree at batch 1 (16 contexts against
    one): they set the plain step's price at 16 and leave the tree's alone."""
    policy = _policy_with_costs(64, seconds_per_token=1e-3, fixed=0.02)
    tree_price = policy.cost.round_seconds(1, 16)
    for _ in range(20):
        policy.observe(root_only(torch.arange(16)), torch.zeros(16, 1, dtype=torch.long), verify_seconds=0.08, draft_seconds=None)
    assert policy.cost.plain_seconds(16) == pytest.approx(0.08, rel=0.01)
    assert policy.cost.round_seconds(1, 16) == tree_price and policy.cost.plain_seconds(1) < 0.08
    assert CostTable.from_json(policy.cost.to_json()).plain_seconds(16) == pytest.approx(0.08, rel=0.01)


def test_chains_once_skipped_at_a_shared_batch_come_back_only_clearly_above_the_bar():
    """At batch 16 a chain value hovering just above the bar (an EMA on a lucky stretch) must not
    switch chains back on: each such stretch sets the batch's requests apart. Chains come back
    above the bar by another margin; a lone request needs no margin at all."""
    from jetflow_sglang.budget import PAY_MARGIN, pay_bar

    policy = _policy_with_costs(16, seconds_per_token=1e-3, fixed=0.02)
    bar = pay_bar(16)
    policy.chain_value[16] = bar + PAY_MARGIN / 2
    assert not policy.skip_chains(16)  # never skipped here yet: the plain bar
    policy.chain_value[16] = bar - 0.01
    assert policy.skip_chains(16)
    policy.chain_value[16] = bar + PAY_MARGIN / 2
    assert policy.skip_chains(16) and policy.skip_chains(15)  # batch 15 starts from batch 16's state
    policy.chain_value[16] = bar + 1.5 * PAY_MARGIN
    assert not policy.skip_chains(16) and not policy.skip_chains(16)
    policy.chain_value[16] = bar + PAY_MARGIN / 2
    assert not policy.skip_chains(16)  # on again: the plain bar
    policy.chain_value[1] = 0.9
    assert policy.skip_chains(1)
    policy.chain_value[1] = 1.01
    assert not policy.skip_chains(1)  # batch 1: no margin, no hysteresis


def test_modelled_costs_choose_alike_on_a_fast_and_a_slow_clock(tmp_path):
    """`JETFLOW_TEST_COSTS`: the adaptive policy prices and clocks rounds by a fixed table, so the
    sizes it picks and the head rounds it skips are the same whatever seconds the rounds measured
    (a CI machine slower than this one); a table missing a curve is refused in one line."""
    from jetflow_sglang.testing.modelled_costs import modelled_policy

    table = {"plain_ms": {"1": 20, "8": 28}, "verify_ms": {"8": 23, "64": 32, "512": 130}, "draft_ms": {"1": 5, "8": 9}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(table))
    runs = []
    for seconds in (0.001, 1.0):  # every measured round 1 ms, or 1 s
        policy = modelled_policy(path, 64)
        chosen, skipped = [], []
        for r in range(60):
            good = r < 20  # the head's drafts land, then stop landing
            tree = confident_tree(8, 15, 0.9 if good else 0.001, 64)
            skipped.append(policy.skip_draft(8))
            size, priority = policy.choose(tree)
            chosen.append(size)
            path_ids = torch.full((8, 4), -1)
            path_ids[:, 0] = 0
            if good and size >= 4:
                path_ids[:, 1:4] = torch.arange(1, 4)  # depth-1..3 nodes of the confident chain
            policy.observe(prune_tree(tree, size, priority), path_ids, seconds, None if skipped[-1] else seconds)
        prices = [policy.cost.round_seconds(b, n) for b in (1, 8) for n in (1, 2, 8, 16, 64)]
        runs.append((chosen, skipped, prices + [policy.cost.draft.seconds(b) for b in (1, 8)]))
    assert runs[0] == runs[1]
    chosen, skipped, prices = runs[0]
    assert max(chosen) > 1 and any(skipped), runs[0]  # it drafted, then gave the head up
    fixed = CostTable.from_json(table)  # nothing measured moved the prices
    assert prices == pytest.approx([fixed.round_seconds(b, n) for b in (1, 8) for n in (1, 2, 8, 16, 64)]
                                   + [fixed.draft.seconds(b) for b in (1, 8)])  # fmt: skip
    path.write_text(json.dumps({"plain_ms": {"1": 20, "8": 28}, "verify_ms": {"8": 23, "64": 32}, "draft_ms": {"1": 5}}))
    with pytest.raises(ValueError, match="draft_ms needs at least two sizes"):
        modelled_policy(path, 64)
