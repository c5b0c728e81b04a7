"""Costs an adaptive server measured, kept under $JETFLOW_HOME for its next start
(jetflow_sglang/cost_cache.py): the key, the round trip into a new policy, the saves while
serving, and files that cannot be used. No server: the policy is fed rounds as the worker feeds it."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch

from jetflow_sglang.budget import CostTable, host_fingerprint, policy_from_env
from jetflow_sglang.cost_cache import SAVE_EVERY, cache_path, cost_key, open_cost_cache
from jetflow_sglang.head_config import JetFlowConfig
from helpers.trees import confident_tree, serve_rounds

HEAD = JetFlowConfig(target_hidden_size=64, target_vocab_size=100, target_num_layers=4, target_layer_ids=[1, 2],
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128)  # fmt: skip
TARGET_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4}
WIDTH = 4


@pytest.fixture
def home(monkeypatch, tmp_path):
    """An empty $JETFLOW_HOME, the budget settings unset (a plain launch)."""
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("JETFLOW_COST_CACHE", raising=False)  # conftest's per-session folder: not here
    monkeypatch.delenv("JETFLOW_BUDGET", raising=False)
    monkeypatch.delenv("JETFLOW_COST_TABLE", raising=False)
    return tmp_path / "home"


def _target(path, **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**TARGET_CONFIG, **config}))
    return path


def _serve_rounds(policy, rounds: int) -> list[int]:
    """Rounds as the worker runs them (`serve_rounds`) over two requests, each depth's top token
    at 0.9: worth a tree once its costs are known."""
    return serve_rounds(policy, confident_tree(2, 15, 0.9, 16, WIDTH), rounds)


def test_key_changes_with_machine_dtype_target_head_width_and_backend(home, tmp_path):
    here = {"dtype": "float32", **host_fingerprint("cpu")}
    target = _target(tmp_path / "Target")
    base = cost_key(here, target, HEAD, WIDTH, "torch_native")
    path = cache_path(base, target)
    assert path.parent == home / "costs" and path.name.startswith("Target-float32-") and path.suffix == ".json"
    others = [
        cost_key({**here, "dtype": "bfloat16"}, target, HEAD, WIDTH, "torch_native"),
        cost_key({**here, "device_name": "Another CPU"}, target, HEAD, WIDTH, "torch_native"),
        cost_key({**here, "cpus": 4096}, target, HEAD, WIDTH, "torch_native"),
        cost_key(here, _target(tmp_path / "wider", hidden_size=128), HEAD, WIDTH, "torch_native"),
        cost_key(here, target, replace(HEAD, num_layers=3), WIDTH, "torch_native"),
        cost_key(here, target, HEAD, 8, "torch_native"),
        cost_key(here, target, HEAD, WIDTH, "triton"),
    ]
    paths = {cache_path(key, target) for key in others}
    assert len(paths) == len(others) and path not in paths
    # The target's architecture, not its bookkeeping: a re-saved copy keeps the key.
    resaved = _target(tmp_path / "copy" / "Target", _name_or_path="/elsewhere", transformers_version="9.9")
    assert cost_key(here, resaved, HEAD, WIDTH, "torch_native") == base
    assert cache_path(cost_key(here, "org/hub-model", HEAD, WIDTH), "org/hub-model").name.startswith("hub-model-float32-")


def test_saved_costs_start_the_next_server_without_measuring(home, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jetflow_sglang.cost_cache")
    target = _target(tmp_path / "Target")
    policy = policy_from_env(16, "cpu", torch.float32)
    cache = open_cost_cache(policy, target, HEAD, WIDTH)
    assert cache is not None and not cache.path.exists() and "measuring (saved to" in caplog.text
    assert _serve_rounds(policy, 7) == [1, 1, 2, 2, 4, 4, 16]  # nothing known: the ladder measured smallest first
    cache.after_round(policy, SAVE_EVERY - 1)
    assert not cache.path.exists()  # no file I/O between saves
    cache.after_round(policy, SAVE_EVERY)
    saved = json.loads(cache.path.read_text())
    # What JETFLOW_COST_TABLE loads, with where it was measured and how often each size was.
    assert saved["verify_ms"] == pytest.approx({"4": 22.0, "8": 24.0, "32": 36.0})
    assert saved["plain_ms"] == pytest.approx({"2": 21.0}) and saved["draft_ms"] == pytest.approx({"2": 1.0})
    assert saved["samples"] == {"verify": {"4": 2, "8": 2, "32": 1}, "draft": {"2": 7}, "plain": {"2": 2}}
    assert saved["dtype"] == "float32" and saved["device_name"] == host_fingerprint("cpu")["device_name"]
    assert CostTable.load(cache.path, torch.float32, host_fingerprint("cpu")).verify.known(8)
    assert "cost table saved to" in caplog.text

    caplog.clear()
    restarted = policy_from_env(16, "cpu", torch.float32)
    again = open_cost_cache(restarted, target, HEAD, WIDTH)
    assert f"JETFLOW: cost table from {cache.path} (5 sizes)" in caplog.text  # 3 verify, 1 plain, 1 draft
    assert restarted.cost.verify.seconds_at == pytest.approx({4: 0.022, 8: 0.024, 32: 0.036})
    assert restarted.cost.verify.trusted() == [4, 8]  # the size measured once is not trusted yet ...
    assert _serve_rounds(policy_from_env(16, "cpu", torch.float32), 1) == [1]  # a fresh policy measures first
    assert _serve_rounds(restarted, 1) == [16]  # the restarted one prices trees at once
    assert restarted.cost.verify.samples[32] == 2 and 32 in restarted.cost.verify.trusted()  # ... its count goes on
    cache.path.unlink()
    again.after_round(restarted, SAVE_EVERY)
    assert cache.path.exists()  # it measured a round since it loaded: saved
    cache.path.unlink()
    again.after_round(restarted, 2 * SAVE_EVERY)
    assert not cache.path.exists()  # nothing measured since: nothing written


def test_a_cost_table_override_or_a_budget_that_measures_nothing_has_no_cache(home, tmp_path, monkeypatch):
    target = _target(tmp_path / "Target")
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"verify_ms": {"1": 10, "64": 40}}))
    monkeypatch.setenv("JETFLOW_COST_TABLE", str(table))
    assert open_cost_cache(policy_from_env(16, "cpu", torch.float32), target, HEAD, WIDTH) is None
    monkeypatch.delenv("JETFLOW_COST_TABLE")
    for mode in ("static", "sweep"):
        monkeypatch.setenv("JETFLOW_BUDGET", mode)
        assert open_cost_cache(policy_from_env(16, "cpu", torch.float32), target, HEAD, WIDTH) is None
    assert not (home / "costs").exists()


BAD_TIMES = "a readable table of this key, with a negative time"


BAD_SAMPLES = "a readable table of this key, with a count for a size it has not measured"


@pytest.mark.parametrize("content", ["{not json", "[]", '{"verify_ms": {"4": 22}}', BAD_TIMES, BAD_SAMPLES],
                         ids=["not_json", "not_an_object", "no_key", "bad_times", "bad_samples"])  # fmt: skip
def test_a_cache_file_that_cannot_be_used_is_ignored_with_a_warning(home, tmp_path, caplog, content):
    caplog.set_level(logging.INFO, logger="jetflow_sglang.cost_cache")
    target = _target(tmp_path / "Target")
    policy = policy_from_env(16, "cpu", torch.float32)
    key = cost_key(policy.origin, target, HEAD, WIDTH)
    path = cache_path(key, target)
    path.parent.mkdir(parents=True)
    if content == BAD_TIMES:
        content = json.dumps({"verify_ms": {"4": -1}, "key": key})
    if content == BAD_SAMPLES:
        content = json.dumps({"verify_ms": {"4": 22}, "samples": {"verify": {"8": 2}}, "key": key})
    path.write_text(content)
    cache = open_cost_cache(policy, target, HEAD, WIDTH)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"JETFLOW: cost table {path} ignored (") and "\n" not in warnings[0]
    assert policy.cost.verify.seconds_at == {}  # measured anew ...
    _serve_rounds(policy, 7)
    cache.after_round(policy, SAVE_EVERY)
    assert json.loads(path.read_text())["key"] == key  # ... and saved over it


def test_a_table_of_another_key_is_ignored(home, tmp_path, caplog):
    target = _target(tmp_path / "Target")
    policy = policy_from_env(16, "cpu", torch.float32)
    key = cost_key(policy.origin, target, HEAD, WIDTH)
    path = cache_path(key, target)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"verify_ms": {"4": 22, "8": 24}, "key": {**key, "width": 8}}))  # a digest collision
    open_cost_cache(policy, target, HEAD, WIDTH)
    assert policy.cost.verify.seconds_at == {} and "records another machine, target, dtype or head" in caplog.text


def test_a_cache_that_cannot_be_written_warns_once_and_serving_goes_on(home, tmp_path, caplog, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("JETFLOW_HOME", str(blocked))  # costs/ cannot be made under a file
    policy = policy_from_env(16, "cpu", torch.float32)
    cache = open_cost_cache(policy, _target(tmp_path / "Target"), HEAD, WIDTH)
    _serve_rounds(policy, 7)
    cache.after_round(policy, SAVE_EVERY)
    _serve_rounds(policy, 1)
    cache.after_round(policy, 2 * SAVE_EVERY)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("JETFLOW: cannot save the cost table to")
