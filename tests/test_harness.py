"""The benchmark harness's pure parts, without servers: medians, interleaving order, the table,
JSON, the flags, variants, profiles, and a request's reading of an OpenAI-client response."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from jetflow_sglang import harness
from jetflow_sglang.harness import Column, Variant
from jetflow_sglang.prompts import Prompt


def test_median_leaves_out_none_and_medians_round():
    assert harness.median([3, None, 1, 2]) == 2
    assert harness.median([None, None]) is None
    runs = [{"a": 1.23456, "b": None}, {"a": 2.0, "b": None}, {"a": 10.0}]
    assert harness.medians(runs, ["a", "b"]) == {"a": 2.0, "b": None}
    assert harness.medians(runs[:2], ["a"], digits=None) == {"a": (1.23456 + 2.0) / 2}


def test_interleave_goes_round_then_cell_then_variant():
    calls = []
    runs = harness.interleave(2, [1, 4], ["target", "jetflow"], lambda name, c: calls.append((name, c)) or f"{name}@{c}")
    assert calls == [("target", 1), ("jetflow", 1), ("target", 4), ("jetflow", 4)] * 2
    assert runs == [{"target": ["target@1"] * 2, "jetflow": ["jetflow@1"] * 2},
                    {"target": ["target@4"] * 2, "jetflow": ["jetflow@4"] * 2}]  # fmt: skip


def test_format_table_aligns_formats_and_prints_none_as_dash():
    columns = [Column("variant", "name", width=8, left=True), Column("tok/s", "speed", ".1f", 7),
               Column("x", lambda row: row["speed"] / 10, ".2f", 5), Column("tau", "tau", ".2f", 5)]  # fmt: skip
    text = harness.format_table(columns, [{"name": "target", "speed": 12.345, "tau": None}], title="demo")
    assert text.splitlines() == ["variant    tok/s     x   tau   (demo)", "target      12.3  1.23     -"]


def test_write_json_makes_the_folder_and_leaves_no_partial(tmp_path):
    out = harness.write_json(tmp_path / "a" / "b.json", {"rows": [1, 2]}, indent=1)
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert sorted(p.name for p in out.parent.iterdir()) == ["b.json"]


def test_add_args_shares_flags_with_defaults_and_help():
    parser = harness.add_args(argparse.ArgumentParser(), head="default", limit=8, dtype="auto", out=None)
    args = parser.parse_args(["--limit", "3", "--dtype", "bfloat16"])
    assert (args.head, args.limit, args.dtype, args.out) == ("default", 3, "bfloat16", None)
    assert all(action.help for action in parser._actions)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])


def test_variants_carry_jetflow_flags_and_a_baseline_copy(tmp_path):
    variant = Variant.jetflow("static 16", "/heads/h", 16, "--speculative-eagle-topk", "1", env={"JETFLOW_BUDGET": "static"})
    assert variant.flags[:2] == ("--speculative-algorithm", "JETFLOW")
    assert variant.flags[-4:] == ("--speculative-num-draft-tokens", "16", "--speculative-eagle-topk", "1")
    checkout = tmp_path / "checkout"
    (checkout / "jetflow_sglang").mkdir(parents=True)
    (checkout / "kernels").mkdir()
    code = harness.baseline_code(checkout, tmp_path)
    baseline = variant.on(code, tmp_path / "costs")
    assert baseline.name == "static 16 baseline" and baseline.cwd == str(code) and baseline.flags == variant.flags
    assert baseline.env == {"JETFLOW_BUDGET": "static", "PYTHONPATH": str(code), "JETFLOW_COST_CACHE": str(tmp_path / "costs")}
    with pytest.raises(SystemExit):
        harness.baseline_code(tmp_path / "nowhere", tmp_path)


def test_profiles_read_every_profile_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("starting\n" + "".join(f"[x] {harness.PROFILE_MARK}{json.dumps({'rounds': n})}\n" for n in (20, 40)))
    assert [p["rounds"] for p in harness.profiles(log)] == [20, 40]
    assert harness.last_profile(log) == {"rounds": 40}
    log.write_text("no profile\n")
    assert harness.last_profile(log) is None


def test_refusal_picks_the_line_that_says_why():
    exc = RuntimeError("sglang server exited with 1:\nloading\nValueError: DFLASH is not supported on cpu\nbye")
    assert harness.refusal(exc) == "ValueError: DFLASH is not supported on cpu"
    assert harness.refusal(RuntimeError("timeout\nmore")) == "timeout"


class FakeClient:
    """The two OpenAI-client calls `request` makes, answering with a fixed completion."""

    def __init__(self) -> None:
        self.calls = []
        extra = {"sglext": {"spec_tokens_details": {"spec_verify_ct": 4, "spec_num_correct_drafts": 6}}}
        choice = SimpleNamespace(text="x = 1", model_extra={"token_ids": [5, 6], "prompt_token_ids": [1], "matched_stop": 2})
        chat_choice = SimpleNamespace(message=SimpleNamespace(content="hi"),
                                      model_extra={"response_token_ids": [7], "matched_stop": "</s>"})  # fmt: skip
        usage = SimpleNamespace(completion_tokens=10)
        self.completions = SimpleNamespace(create=self._answer(SimpleNamespace(choices=[choice], usage=usage, model_extra=extra)))
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._answer(
            SimpleNamespace(choices=[chat_choice], usage=usage, model_extra={}))))  # fmt: skip

    def _answer(self, response):
        def create(**kwargs):
            self.calls.append(kwargs)
            return response

        return create


def test_request_reads_text_ids_stop_and_tau():
    client = FakeClient()
    code = harness.request(client, "m", Prompt(id="c", text="def f():", kind="code"), max_new_tokens=12, ignore_eos=True)
    assert (code["text"], code["ids"], code["prompt_ids"], code["stop"], code["tokens"]) == ("x = 1", [5, 6], [1], 2, 10)
    assert code["tau"] == 2.5  # 1 + 6 accepted drafts / 4 verify rounds
    assert client.calls[0]["max_tokens"] == 12 and client.calls[0]["extra_body"]["ignore_eos"] is True
    chat = harness.request(client, "m", Prompt(id="q", text="hello", kind="chat"))
    assert (chat["text"], chat["ids"], chat["stop"], chat["tau"]) == ("hi", [7], None, None)  # a text stop is not an id
    assert client.calls[1]["messages"] == [{"role": "user", "content": "hello"}]


def test_batch_keeps_prompt_order_and_sums_tokens():
    prompts = [Prompt(id=str(i), text="def f():", kind="code") for i in range(3)]
    run = harness.batch(FakeClient(), "m", prompts, 2)
    assert run["tokens"] == 30 and run["texts"] == ["x = 1"] * 3 and run["tau"] == 2.5 and len(run["requests"]) == 3


def test_plot_lines_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = harness.plot_lines(tmp_path / "curves.png", {"drafter: head": {"adaptive": ([1, 4], [10.0, 30.0]),
                                                                          "target alone": ([1, 4], [12.0, 40.0])}},
                              "concurrent requests", "output tokens/s", dashed=["target alone"])  # fmt: skip
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FakeFleet:
    """A `Fleet` whose two servers answer every prompt alike, the JETFLOW one twice as fast."""

    def __init__(self, target, work, dtype, *args, **kwargs) -> None:
        self.names, self.servers, self.started = [], {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.names = []

    def start(self, variant, log=None):
        self.names.append(variant.name)
        self.started.append(variant)

    def warm_up(self, *args, **kwargs):
        pass

    def request(self, name, prompt, **options):
        speed = 20.0 if name == "jetflow" else 10.0
        return {"text": prompt.id, "ids": [1, 2], "prompt_ids": [0], "stop": None, "tokens": 8, "seconds": 8 / speed,
                "tokens_per_s": speed, "tau": 2.0 if name == "jetflow" else None}  # fmt: skip

    def profile(self, name):
        return None


def test_jetflow_bench_report_keeps_its_keys(monkeypatch, tmp_path):
    from jetflow_sglang import bench

    monkeypatch.setattr(bench, "Fleet", FakeFleet)
    monkeypatch.setattr(harness, "resolve", lambda target, head: ("/target", "/head"))
    out = tmp_path / "bench.json"
    config = bench.BenchConfig(prompts="demo", limit=2, dtype="float32", out=str(out))
    report = bench.run_bench(config, echo=lambda line: None)
    assert set(report) == {"config", "head_dir", "summary", "requests", "profile"}
    assert report["summary"]["speedup"] == 2.0 and report["summary"]["all_identical"] and report["summary"]["median_tau"] == 2.0
    assert [set(r) for r in report["requests"]] == [{"id", "kind", "tokens", "ar_tokens_per_s", "jetflow_tokens_per_s", "speedup",
                                                    "tau", "identical"}] * 2  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert "PASSED" in bench.format_table(report)
