"""The `jetflow` console script: prepare, generate, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetflow_sglang.cli import build_parser, main

JETFLOW = [sys.executable, "-m", "jetflow_sglang.cli"]


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*JETFLOW, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def test_prepare_is_idempotent_and_reports_loadable_paths(prepared):
    out = run_cli("prepare")
    assert out.returncode == 0, out.stderr
    again = json.loads(out.stdout.strip().splitlines()[-1])
    assert again == prepared
    target, head = Path(again["target"]), Path(again["head"])
    assert (target / "config.json").is_file() and list(target.glob("*.safetensors"))
    assert (target / "tokenizer.json").is_file() and (target / "chat_template.jinja").is_file()
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()


def test_generate_random_head_json_is_identical_to_plain_decoding(prepared):
    out = run_cli(
        "generate", "--head", "random", "--budget", "64", "--compare-ar", "--json",
        "--max-new-tokens", "24", "--prompt", "def fibonacci(n):",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["identical"] is True
    # One token from prefill, then each verify round commits its accepted drafts and a bonus
    # token; the last round was needed, and cut to the 24 asked for.
    accepted, rounds = report["accept_lengths"], report["rounds"]
    assert rounds == len(accepted) and all(0 <= a <= 15 for a in accepted), accepted  # block 16: 15 drafts
    assert report["new_tokens"] == 24 == len(report["tokens"])
    assert 1 + sum(a + 1 for a in accepted[:-1]) < 24 <= 1 + sum(a + 1 for a in accepted), accepted
    assert report["tau"] == round(1 + sum(accepted) / rounds, 4)  # committed tokens per verify
    assert report["tau"] < 2.0  # an untrained head accepts almost nothing
    for key in ("text", "tokens_per_s", "ar_tokens_per_s", "speedup"):
        assert key in report


def test_generate_samples_reproducibly_within_top_k(prepared, target):
    """`jetflow generate --temperature 1 --top-k 2 --seed S`: the same seed gives the same tokens,
    different seeds give different ones, and every token is one of the target's top two there."""
    import torch

    args = ("generate", "--json", "--chat", "--prompt", "Write a haiku about rain.", "--max-new-tokens", "10",
            "--budget", "16", "--temperature", "1", "--top-k", "2")  # fmt: skip
    runs = {}
    for seed in ("1", "1", "2", "3", "4"):
        out = run_cli(*args, "--seed", seed)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        runs.setdefault(seed, []).append(report["tokens"])
    assert runs["1"][0] == runs["1"][1]
    assert len({tuple(r[0]) for r in runs.values()}) >= 2, runs
    prompt = target.encode_prompt("Write a haiku about rain.", chat=True)
    for tokens in (r[0] for r in runs.values()):
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2, dim=-1).indices.tolist()
        assert all(token in pair for token, pair in zip(tokens, top2)), (tokens, top2)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("budget", ["0", "513"])
def test_budget_out_of_range_is_one_line_error(prepared, capsys, budget):
    assert main(["generate", "--budget", budget, "--prompt", "x", "--head", prepared["head"]]) == 2
    assert "budget" in _error_line(capsys)


def _head_copy(prepared, tmp_path, **jetflow_fields) -> Path:
    head = tmp_path / "head"
    shutil.copytree(prepared["head"], head)
    config = json.loads((head / "config.json").read_text())
    config["jetflow"].update(jetflow_fields)
    (head / "config.json").write_text(json.dumps(config))
    return head


def test_head_with_block_size_below_two_is_refused(prepared, tmp_path, capsys):
    head = _head_copy(prepared, tmp_path, block_size=1)
    assert main(["generate", "--prompt", "x", "--head", str(head)]) == 2
    assert "block size" in _error_line(capsys)


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"target_hidden_size": 640}, "hidden size"),
        ({"target_vocab_size": 1000}, "vocab size"),
        ({"target_layer_ids": [1, 40]}, "layers"),
    ],
)
def test_head_built_for_another_target_is_refused(prepared, tmp_path, capsys, overrides, words):
    from transformers import AutoConfig

    from jetflow_sglang.head import JetFlowConfig, JetFlowHead

    target_config = AutoConfig.from_pretrained(prepared["target"])
    config = JetFlowConfig.for_target(target_config, num_layers=1, intermediate_size=64, **overrides)
    JetFlowHead(config).save(tmp_path / "other")
    assert main(["generate", "--prompt", "x", "--head", str(tmp_path / "other")]) == 2
    assert words in _error_line(capsys)


def test_missing_and_pickled_heads_are_refused(prepared, tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--head", str(tmp_path / "nowhere")]) == 2
    assert "not found" in _error_line(capsys)
    head = _head_copy(prepared, tmp_path)
    (head / "model.safetensors").rename(head / "pytorch_model.bin")
    assert main(["generate", "--prompt", "x", "--head", str(head)]) == 2
    assert "safetensors" in _error_line(capsys)


def test_target_without_safetensors_is_refused(prepared, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(Path(prepared["target"]) / "config.json", target)
    (target / "pytorch_model.bin").write_bytes(b"not loaded")
    assert main(["generate", "--prompt", "x", "--target", str(target), "--head", "random"]) == 2
    assert "safetensors" in _error_line(capsys)


def test_prompt_longer_than_context_is_refused(prepared, capsys):
    assert main(["generate", "--prompt", "word " * 9000, "--head", prepared["head"]]) == 2
    assert "context" in _error_line(capsys)


def test_console_script_exits_nonzero_with_one_line(prepared):
    out = run_cli("generate", "--budget", "0", "--prompt", "x")
    assert out.returncode != 0
    assert out.stderr.strip().startswith("jetflow: error:") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_serve_refuses_bad_budget_head_and_busy_port_before_launching(prepared, tmp_path, capsys):
    import socket

    assert main(["serve", "--budget", "0"]) == 2
    assert "between 1 and 512" in _error_line(capsys)
    assert main(["serve", "--head", str(tmp_path / "nowhere")]) == 2
    assert "not found" in _error_line(capsys)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        assert "already in use" in _error_line(capsys)


def test_unknown_flags_are_refused_except_by_serve(prepared, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "x", "--chunked-prefill-size", "64"])
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_eval_refuses_refresh_for_the_bidirectional_baseline(prepared, capsys):
    assert main(["eval", "--head", "dflash-t", "--refresh", "--limit", "1", "--budgets", "4"]) == 2
    assert "needs a causal head" in _error_line(capsys)


def test_eval_per_depth_scores_the_head_beside_prompt_lookup(prepared, tmp_path, capsys):
    """On a prompt whose greedy continuation repeats itself, prompt lookup hits; the table
    prints both drafters per depth, and --json carries the same numbers."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,", "kind": "code"}) + "\n")
    args = ["eval", "--head", "random", "--prompts", str(prompts), "--limit", "1", "--max-new-tokens", "12", "--per-depth"]
    assert main([*args, "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["per_depth"] and len(row["top1"]) == len(row["lookup_top1"]) == 15
    assert row["blocks"] >= 11 and row["lookup_top1"][0] > 0.5 and row["lookup_chain_tau"] > 2
    assert 1.0 <= row["chain_tau"] <= 16 and all(0 <= x <= 1 for x in row["top1"])
    assert main(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["depth", "1", "2"] and table[1].startswith("    head") and table[2].startswith("  lookup")


def test_auto_dtype_is_bf16_exactly_where_its_matmuls_are_native():
    from jetflow_sglang.reference.target import fast_dtype, serving_dtype

    native = "bfloat16" if fast_dtype() == torch.bfloat16 else "float32"
    assert serving_dtype("auto") == native
    assert (serving_dtype("fp32"), serving_dtype("bf16"), serving_dtype("float32")) == ("float32", "bfloat16", "float32")
    assert build_parser().parse_args(["serve"]).dtype == "auto" == build_parser().parse_args(["bench"]).dtype


def test_serve_and_bench_budget_is_adaptive_unless_asked_static():
    """The tree budget is adaptive by default (--budget is its cap); --no-adaptive asks for a
    static budget (--adaptive, the default, is still accepted)."""
    from jetflow_sglang.cli import _config_from_args
    from jetflow_sglang.bench import BenchConfig

    parser = build_parser()
    for command in ("serve", "bench"):
        assert parser.parse_args([command]).adaptive is True
        assert parser.parse_args([command, "--adaptive"]).adaptive is True
        assert parser.parse_args([command, "--no-adaptive"]).adaptive is False
    assert BenchConfig().adaptive and _config_from_args(BenchConfig, parser.parse_args(["bench"])).adaptive
    assert not _config_from_args(BenchConfig, parser.parse_args(["bench", "--no-adaptive", "--budget", "16"])).adaptive


@pytest.mark.slow
def test_bench_labels_every_bf16_difference_by_cause(prepared, tmp_path):
    """`jetflow bench --dtype bfloat16` on two demo prompts: every answer that differs from the
    target alone's is re-checked on the target-alone server and carries a cause, each in one
    printed line; nothing is unexplained, so the exit code is 0; and the output names float32 as
    the exact check."""
    from jetflow_sglang.explain import EXACT_CHECK, TOP_LOGPROBS, first_difference

    out = tmp_path / "bench.json"
    run = run_cli("bench", "--dtype", "bfloat16", "--prompts", "demo", "--limit", "2", "--max-new-tokens", "24",
                  "--out", str(out), timeout=1800)  # fmt: skip
    assert out.is_file(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == "bfloat16" and report["summary"]["prompts"] == 2
    for row in report["requests"]:
        if row["identical"]:
            assert "difference" not in row
            continue
        d = row["difference"]
        assert d["causes"] and d["explained"], d
        assert d["position"] == first_difference(d["target_ids"], d["jetflow_ids"]) is not None
        assert any(len(p["top"]) == TOP_LOGPROBS for p in d["probes"]), d["probes"]
        assert f"--- {row['id']} differs at new token {d['position']}: " in run.stdout
    assert report["summary"]["differing"] == sum(not r["identical"] for r in report["requests"])
    assert report["summary"]["unexplained"] == 0 and "!!!" not in run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert EXACT_CHECK in run.stdout
