"""What SGLang users do with a JETFLOW server, on a real server (fp32, this CPU).

One JETFLOW server, launched through `jetflow serve` (so the launcher, its defaults and
its pass-through of SGLang flags are exercised) with a small prefill chunk, and one
no-spec server with the same chunk, both on 127.0.0.1. Every test compares the
JETFLOW server with the no-spec one:

* chunked prefill of long ShareGPT prompts: token ids match, and the target features
  the worker captured over the chunks, and after each verify round, equal HF transformers'
  features at the head's tap layers (the head sees what it was trained on);
* streaming (`/generate` and the OpenAI client), stop strings and stop token ids landing
  inside accepted paths (the test oracle drafts those prompts), request abort;
* an SGLang frontend program with `gen`, `fork`, `select`, a regex `gen` and a `gen` with
  `choices`; OpenAI `response_format` with a JSON schema;
* `python -m sglang.bench_serving` on the repaired ShareGPT file: no failures, an
  accept length reported.

The JETFLOW server runs with SGLang's strict KV accounting checks (`STRICT_KV_CHECKS`) throughout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from jetflow_sglang import server as sglang_server  # noqa: E402

CHUNK = 32
BUDGET = 64
ORACLE_PROMPTS = [
    ("Write a haiku about rain.", True),
    ("def fibonacci(n):", False),
    ("Once upon a time, in a small village,", False),
]
ORACLE_TOKENS = 48
LONG_PROMPT_CHARS = (300, 1500)
NUM_LONG_PROMPTS = 4
# SGLang's own KV accounting checks, strict: a leak or a page freed twice found while idle raises,
# the pool is checked after every busy step, and every request's committed KV must lie within its
# allocation. A failed check stops the scheduler, so every test after it fails.
STRICT_KV_CHECKS = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
                    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1"}  # fmt: skip
KV_CHECK_FAILURES = ("memory leak", "Mem Leak", "double free", "use-after-free")


@pytest.fixture(scope="module")
def assets() -> dict:
    from jetflow_sglang.assets import prepare

    return prepare("default")


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["target"])


def _chat_ids(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def oracle_cases(tokenizer) -> list[list[int]]:
    return [_chat_ids(tokenizer, t) if chat else tokenizer(t).input_ids for t, chat in ORACLE_PROMPTS]


@pytest.fixture(scope="module")
def long_cases(tokenizer) -> list[list[int]]:
    from jetflow_sglang.prompts import sharegpt_prompts

    lo, hi = LONG_PROMPT_CHARS
    texts = [p.text for p in sharegpt_prompts("heldout") if lo <= len(p.text) <= hi][:NUM_LONG_PROMPTS]
    return [_chat_ids(tokenizer, t) for t in texts]


def _generate(url: str, ids: list[int], max_new_tokens: int, rid: str | None = None, **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **params}}
    if rid:
        body["rid"] = rid
    return sglang_server.post(url + "/generate", body)


def _start_jetflow_serve(log: Path, env: dict, *args: str) -> tuple[subprocess.Popen, dict]:
    """`jetflow serve ...` in the background; waits for the JSON line with its URL."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jetflow_sglang.cli", "serve", "--port", str(sglang_server.free_port()), *args],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + sglang_server.STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"url"'):
                return proc, json.loads(line)
        if proc.poll() is not None:
            raise RuntimeError(f"jetflow serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(1)
    sglang_server.stop(proc)
    raise RuntimeError(f"jetflow serve printed no URL:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="module")
def servers(assets, oracle_cases, tmp_path_factory):
    work = tmp_path_factory.mktemp("serving")
    chunk = ("--chunked-prefill-size", str(CHUNK))
    plain = sglang_server.start(assets["target"], work / "nospec.log", *chunk)
    serve_proc, info = None, None
    try:
        with ThreadPoolExecutor(4) as pool:
            long = list(pool.map(lambda ids: _generate(plain.url, ids, ORACLE_TOKENS + 24, ignore_eos=True), oracle_cases))
        oracle_file = work / "oracle.json"
        oracle_file.write_text(json.dumps([[ids, out["output_ids"]] for ids, out in zip(oracle_cases, long)]))
        dump_dir = work / "features"
        dump_dir.mkdir()
        env = {"JETFLOW_TEST_ORACLE": str(oracle_file), "JETFLOW_TEST_DUMP_FEATURES": str(dump_dir), **STRICT_KV_CHECKS}
        # fp32 (its default is bf16 where native): ids and captured taps are compared exactly. A static
        # budget (its default is adaptive): the oracle's long paths are verified every round.
        serve_proc, info = _start_jetflow_serve(work / "jetflow.log", env, "--budget", str(BUDGET), "--no-adaptive",
                                                "--dtype", "float32", *chunk)  # fmt: skip
        yield {"plain": plain.url, "jetflow": info["url"], "dump_dir": dump_dir, "serve_proc": serve_proc, "info": info,
               "jetflow_log": work / "jetflow.log"}  # fmt: skip
    finally:
        plain.stop()
        if serve_proc is not None:
            serve_proc.send_signal(signal.SIGTERM)
            try:
                serve_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                sglang_server.stop(serve_proc)
        if info is not None:  # the server's own group, should `jetflow serve` have left it behind
            try:
                os.killpg(info["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def _both(servers: dict, fn):
    return fn(servers["plain"]), fn(servers["jetflow"])


# --------------------------------------------------------------- chunked prefill
@pytest.mark.slow
def test_captured_taps_equal_hf_taps_over_prefill_chunks(servers, assets, long_cases):
    ids = long_cases[0]
    assert len(ids) > 3 * CHUNK
    _generate(servers["jetflow"], ids, 1, rid="taps-check")
    files = sorted(servers["dump_dir"].glob("taps-check-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    assert len(files) >= 3, f"expected several prefill chunks, got {[f.name for f in files]}"
    from safetensors.torch import load_file

    chunks = [load_file(f) for f in files]
    positions = torch.cat([c["positions"] for c in chunks])
    assert positions.tolist() == list(range(len(ids)))
    assert torch.cat([c["input_ids"] for c in chunks]).tolist() == ids
    served = torch.cat([c["features"] for c in chunks])
    error = (served - _hf_taps(assets, ids)).abs().max() / served.abs().max()
    assert error < 1e-4, f"relative max error {error:.2e}"


def _hf_taps(assets: dict, ids: list[int]) -> torch.Tensor:
    from jetflow_sglang.head import JetFlowHead
    from jetflow_sglang.reference.target import Target

    head = JetFlowHead.load(assets["head"])
    target = Target(assets["target"], dtype=torch.float32, tap_layers=head.config.target_layer_ids)
    _, hf_features = target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], target.new_cache())
    return hf_features[0].float()


@pytest.mark.slow
def test_captured_taps_after_verify_equal_hf_taps(servers, assets, oracle_cases):
    """The rows the worker hands the head after each verify round (anchor + accepted drafts,
    gathered from the tree's verify rows) are HF's features at those positions: with the prompt's
    rows they cover every committed token but the last bonus, each position once."""
    from safetensors.torch import load_file

    prompt = oracle_cases[1]
    out = _generate(servers["jetflow"], prompt, 32, rid="taps-decode")
    files = sorted(servers["dump_dir"].glob("taps-decode-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    writes = [load_file(f) for f in files]
    ids = prompt + out["output_ids"]
    rounds = [w for w in writes if len(prompt) <= int(w["positions"][0]) < len(ids) - 1]
    assert len(rounds) == out["meta_info"]["spec_verify_ct"]
    assert max(len(w["positions"]) for w in rounds) > 2  # multi-token commits were written
    # SGLang may run one more verify for a request that finished inside the previous round's
    # path (it does not count it); its rows lie past the output.
    assert len(writes) - 1 - len(rounds) <= 1
    positions = torch.cat([w["positions"] for w in writes]).tolist()
    # The last round may have accepted past max_new_tokens: its rows run on beyond the output.
    assert positions == list(range(len(positions))) and len(positions) >= len(ids) - 1
    assert torch.cat([w["input_ids"] for w in writes]).tolist()[: len(ids) - 1] == ids[:-1]
    served = torch.cat([w["features"] for w in writes])[: len(ids) - 1]
    error = (served - _hf_taps(assets, ids[:-1])).abs().max() / served.abs().max()
    assert error < 1e-4, f"relative max error {error:.2e}"


@pytest.mark.slow
def test_long_prompts_with_small_prefill_chunks_match(servers, long_cases, oracle_cases):
    cases = long_cases + oracle_cases

    def run(url):
        with ThreadPoolExecutor(len(cases)) as pool:
            return [o["output_ids"] for o in pool.map(lambda ids: _generate(url, ids, 24), cases)]

    want, got = _both(servers, run)
    assert got == want


# ------------------------------------------------------------ streaming and stops
def _stream_generate(url: str, ids: list[int], max_new_tokens: int, **params) -> list[dict]:
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **params}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


@pytest.mark.slow
def test_streaming_matches_non_streaming(servers, oracle_cases, tokenizer):
    from openai import OpenAI

    for ids in oracle_cases:
        want = _generate(servers["plain"], ids, ORACLE_TOKENS)
        chunks = _stream_generate(servers["jetflow"], ids, ORACLE_TOKENS)
        assert len(chunks) > 1
        assert chunks[-1]["output_ids"] == want["output_ids"]
        assert chunks[-1]["text"] == want["text"]
        assert chunks[-1]["meta_info"]["spec_num_correct_drafts"] > 0  # long accepted paths were streamed

    client = OpenAI(base_url=servers["jetflow"] + "/v1", api_key="none", max_retries=0, timeout=600)
    plain = OpenAI(base_url=servers["plain"] + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": ORACLE_PROMPTS[0][0]}]
    want = plain.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=ORACLE_TOKENS)
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=ORACLE_TOKENS, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == want.choices[0].message.content


@pytest.mark.slow
def test_stop_strings_and_stop_token_ids_inside_accepted_paths(servers, oracle_cases, tokenizer):
    """The oracle drafts these prompts, so each round commits a long path and the stop lands inside
    one: SGLang counts a round's full accepted path in spec_num_correct_drafts before the stop cuts
    it, so rounds + accepted drafts > tokens returned means the cut fell inside a commit."""
    cut_inside = {"stop": 0, "stop_token_ids": 0}
    for ids in oracle_cases:
        full = _generate(servers["plain"], ids, ORACLE_TOKENS)
        out_ids = full["output_ids"]
        # A stop string and a stop token from the middle of the reference answer.
        middle = len(out_ids) // 2
        stop_text = tokenizer.decode(out_ids[middle : middle + 2]).strip() or tokenizer.decode(out_ids[middle : middle + 4])
        stop_token = out_ids[middle]
        for params in ({"stop": [stop_text]}, {"stop_token_ids": [stop_token]}):
            want, got = _both(servers, lambda url: _generate(url, ids, ORACLE_TOKENS, **params))
            assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"], params
            assert len(got["output_ids"]) < len(out_ids), params
            meta = got["meta_info"]
            assert meta["finish_reason"]["type"] == "stop", meta
            if "stop" in params:
                assert stop_text not in got["text"]
            committed = meta["spec_verify_ct"] + meta["spec_num_correct_drafts"]
            cut_inside[next(iter(params))] += committed > len(got["output_ids"])
    print(f"stops cut inside a multi-token commit: {cut_inside} of {len(oracle_cases)} prompts each")
    assert min(cut_inside.values()) >= 2, cut_inside


@pytest.mark.slow
def test_abort_frees_the_request_and_the_server_keeps_serving(servers, long_cases, oracle_cases):
    url = servers["jetflow"]
    # A client that disconnects mid-stream.
    body = {"input_ids": long_cases[1], "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=600)
    seen = 0
    for raw in resp:
        seen += raw.decode().startswith("data:")
        if seen >= 3:
            break
    resp.close()
    # An explicit abort by request id, while the request decodes.
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(_generate(url, long_cases[2], 4000, ignore_eos=True, rid="abort-me"))
    )
    worker.start()
    time.sleep(3)
    abort = urllib.request.Request(url + "/abort_request", data=json.dumps({"rid": "abort-me"}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(abort, timeout=60) as resp:
        assert resp.status == 200
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < 4000
    # Both requests are gone: their KV slots were freed (SGLang's strict checks ran while idle,
    # and after every busy step), and the server still decodes correctly at batch > 1.
    time.sleep(2)
    log = servers["jetflow_log"].read_text(errors="replace")
    assert not [line for line in log.splitlines() if any(f in line for f in KV_CHECK_FAILURES)]
    want = [_generate(servers["plain"], ids, 24)["output_ids"] for ids in oracle_cases]
    with ThreadPoolExecutor(len(oracle_cases)) as pool:
        got = [o["output_ids"] for o in pool.map(lambda ids: _generate(url, ids, 24), oracle_cases)]
    assert got == want
    assert sglang_server.healthy(url)


# --------------------------------------------------------------- frontend program
@pytest.mark.slow
def test_frontend_program_with_gen_fork_select(servers):
    import sglang as sgl

    @sgl.function
    def facts(s, topic):
        s += f"A fact about {topic}:" + sgl.gen("fact", max_tokens=20, temperature=0)
        branches = s.fork(2)
        for i, branch in enumerate(branches):
            branch += f"\nAnother fact about {topic}, number {i + 2}:" + sgl.gen("more", max_tokens=16, stop="\n", temperature=0)
        s += "\nIs the first fact true? Answer:" + sgl.select("verdict", choices=[" yes", " no", " unsure"])
        s += "\nHow sure are you, in percent?" + sgl.gen("sure", regex=r" [0-9]{1,2}%", temperature=0)
        s += "\nOne more word about it:" + sgl.gen("word", choices=[" big", " small", " old"], temperature=0)
        s["branches"] = [branch["more"] for branch in branches]

    def run(url):
        states = facts.run_batch([{"topic": "the moon"}, {"topic": "Python"}], backend=sgl.RuntimeEndpoint(url), num_threads=2)
        return [(st["fact"], st["branches"], st["verdict"], st["sure"], st["word"]) for st in states]

    want, got = _both(servers, run)
    assert got == want
    assert all(fact.strip() and all(more.strip() for more in branches) for fact, branches, *_ in got), got
    assert all(verdict in (" yes", " no", " unsure") for _, _, verdict, _, _ in got), got
    assert all(re.fullmatch(r" [0-9]{1,2}%", sure) and word in (" big", " small", " old") for *_, sure, word in got), got


@pytest.mark.slow
def test_openai_response_format_json_schema(servers):
    """OpenAI `response_format` with a JSON schema: the JETFLOW server's answer (tree verify under
    the grammar's per-node masks) equals the no-spec server's and validates against the schema."""
    import jsonschema
    from openai import OpenAI

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}  # fmt: skip
    answers = []
    for url in (servers["plain"], servers["jetflow"]):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "Give a city and its population as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        )  # fmt: skip
        answers.append(reply.choices[0].message.content)
    assert answers[1] == answers[0]
    jsonschema.validate(json.loads(answers[1]), schema)


# ------------------------------------------------------------------ bench_serving
@pytest.mark.slow
def test_bench_serving_sharegpt_completes_with_accept_length(servers, assets, tmp_path):
    from jetflow_sglang.prompts import sharegpt_path

    port = servers["jetflow"].rsplit(":", 1)[1]
    result_file = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
         "--host", "127.0.0.1", "--port", port, "--tokenizer", assets["target"],
         "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_path()),
         "--num-prompts", "8", "--sharegpt-output-len", "16", "--seed", "1",
         "--disable-tqdm", "--output-file", str(result_file)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    report = json.loads(result_file.read_text().splitlines()[-1])
    assert report["completed"] == 8, output[-4000:]
    assert "Accept length:" in output, output[-4000:]
    assert report.get("accept_length", 0) > 1.0  # 1.0: no draft was ever accepted


# ------------------------------------------------------------------- jetflow serve
@pytest.mark.slow
def test_jetflow_serve_stops_its_server_on_sigterm(servers):
    """Runs last in this module: `jetflow serve` takes its server down with it."""
    proc, url = servers["serve_proc"], servers["jetflow"]
    assert sglang_server.healthy(url)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    assert not sglang_server.healthy(url)
    assert _live_processes_in_group(servers["info"]["pid"]) == []


def _live_processes_in_group(group: int) -> list[int]:
    """Running (not zombie) processes whose process group is `group` (Linux /proc)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == group and state != "Z":
            live.append(int(stat.parent.name))
    return live
