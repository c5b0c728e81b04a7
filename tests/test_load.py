"""A short load-and-faults run (benchmarks/load_test.py) on a real JETFLOW server: concurrent
clients sending greedy, sampled, penalized and grammar-constrained requests, streamed and not,
some streams dropped and some requests aborted by rid. Every request not aborted succeeds,
SGLang's strict idle pool check never fires, the KV pool is back to empty after a cache flush,
and greedy answers are unchanged after the load. The full run (64 clients x 3 rounds) is the
benchmark's default."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from jetflow_sglang import load  # noqa: E402
from jetflow_sglang import server as sglang_server  # noqa: E402


@pytest.mark.slow
def test_short_load_with_aborts_leaves_no_leak(tmp_path):
    from jetflow_sglang.assets import prepare

    assets = prepare("default")
    target, head = str(assets["target"]), str(assets["head"])
    prompts = load.held_out_prompts(target, 12)
    server = sglang_server.start(target, tmp_path / "server.log", *sglang_server.jetflow_args(head, 16), env=load.STRICT_MEM_CHECK)
    try:
        probes = prompts[:2]
        before = load.probe(server, probes)
        config = load.LoadConfig(clients=12, rounds=2, max_new_tokens=20, drop_stream_every=5, abort_every=7, stream_every=3)
        report = load.run_load(server.url, prompts, config)
        load.idle_checks(server, probes, before, report)
    finally:
        server.stop()
    print(report)
    assert not report.failed, report.failed
    assert report.aborted >= 3 and report.ok + report.aborted == report.requests, report
    assert not report.leak_lines, report.leak_lines
    assert report.idle_token_usage and report.token_usage_after == report.idle_token_usage, report
    assert report.greedy_same_after_load and report.healthy_after
