"""An adaptive JETFLOW server (the default launch, fp32, this CPU) keeps the costs it measured under
$JETFLOW_HOME (jetflow_sglang/cost_cache.py), and the next server of the same target, dtype and
head starts from them."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang")

from jetflow_sglang import server as sglang_server  # noqa: E402
from jetflow_sglang.cost_cache import COSTS_DIR  # noqa: E402

PROMPTS = ["def add(a, b):", "The capital of France is", "for i in range(10):", "Once upon a time, in a small village,"]
MAX_REQUESTS = 16  # of 96 tokens each, one at a time: far more than the rounds between two saves


@pytest.mark.slow
def test_a_restarted_server_starts_from_the_costs_the_last_one_measured(tmp_path):
    from transformers import AutoTokenizer

    from jetflow_sglang.assets import prepare

    assets = prepare("default")
    target, head = str(assets["target"]), str(assets["head"])
    tokenizer = AutoTokenizer.from_pretrained(target)
    home = tmp_path / "home"  # an empty $JETFLOW_HOME; target and head are named by path
    env = {"JETFLOW_HOME": str(home), "JETFLOW_BUDGET": "", "JETFLOW_COST_TABLE": "", "JETFLOW_COST_CACHE": ""}
    args = sglang_server.jetflow_args(head, 64)
    server = sglang_server.start(target, tmp_path / "first.log", *args, env=env)
    try:
        for i in range(MAX_REQUESTS):
            ids = tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids
            sglang_server.post(server.url + "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": 96, "ignore_eos": True}})  # fmt: skip
            saved = list((home / COSTS_DIR).glob("*.json"))
            if saved:
                break
    finally:
        server.stop()
    first = (tmp_path / "first.log").read_text(errors="replace")
    assert len(saved) == 1 and saved[0].name.startswith(f"{Path(target).name}-float32-"), first[-3000:]
    assert "measuring (saved to" in first and f"cost table saved to {saved[0]}" in first

    server = sglang_server.start(target, tmp_path / "second.log", *args, env=env)
    server.stop()
    second = (tmp_path / "second.log").read_text(errors="replace")
    assert f"JETFLOW: cost table from {saved[0]} (" in second, second[-3000:]
