"""JETFLOW under tensor parallelism on this CPU (gloo): the default target's 9 attention heads
split three ways, so its servers run at ``--tp-size 3``, one thread per rank, two ranks sharing a
core.

Every rank holds the head whole, gathers the target's vocabulary shards once, and drafts, builds
and accepts the same tree (`jetflow_sglang.sglang_plugin.tensor_parallel`); with
``JETFLOW_TEST_TP_CHECK=1`` a server whose ranks commit different tokens stops at that round, and
the requests below fail. In fp32 the JETFLOW server at --tp 3 gives the no-spec --tp 3 server's
greedy token ids at static budget 16, with 32-token prefill chunks, 4 requests in flight,
radix-cache hits (every prompt asked twice), a grammar request and sampled requests in the same
batches. At static 16, one request at a time, it drafts
as one rank does: the same verify rounds and accepted drafts per prompt as the reference engine
(whose rounds equal a --tp 1 server's: test_sglang_multiturn, test_sglang_hints). At --dp-size 2
(two schedulers, a core each) every request is served as one rank serves it. --tp-size 2 itself,
a rank per core, runs on a small Qwen3-architecture target whose 4 heads split two ways, at the
adaptive budget on each rank's own clock: ranks that chose their tree sizes apart would abort on
a collective of mismatched size (gloo), so the ranks' shared costs and seconds are proven there.
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("sglang")

from jetflow_sglang import server as sglang_server  # noqa: E402
from jetflow_sglang.budget import BUDGET_ENV  # noqa: E402

TP = ("--tp-size", "3", "--chunked-prefill-size", "32")
PROMPTS = [  # raw completions: code that repeats itself (lookup chains) and prose
    ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):", 32),
    ("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,", 24),
    ("The capital of France is", 16),
    ("for i in range(10):\n    print(i)\nfor j in range(10):", 24),
]
REGEX = r"(Yes|No), because [a-z ,]{10,40}\."
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12}


@functools.cache
def _ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from jetflow_sglang.assets import prepare

    return AutoTokenizer.from_pretrained(prepare("default")["target"])(text).input_ids


def _greedy(text: str, limit: int, **extra) -> dict:
    return {"input_ids": _ids(text), "sampling_params": {"temperature": 0, "max_new_tokens": limit, **extra}}


def _bodies() -> list[dict]:
    """Every prompt twice (the second time from the radix cache), a grammar request, and (marked)
    sampled requests between them."""
    bodies = [_greedy(text, limit) for text, limit in PROMPTS] * 2
    bodies.insert(2, _greedy("Is water wet? Answer: ", 32, regex=REGEX))
    for k in (1, 6):
        bodies.insert(k, {"input_ids": _ids(PROMPTS[2][0]), "sampling_params": SAMPLED, "sampled": True})
    return bodies


def _run(url: str, bodies: list[dict], concurrency: int) -> list[dict]:
    def one(body):
        return sglang_server.post(url + "/generate", {k: v for k, v in body.items() if k != "sampled"})

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


@pytest.fixture(scope="module")
def no_spec(target_dir, tmp_path_factory) -> list[dict]:
    """The no-spec --tp 3 server's answers, 4 in flight."""
    server = sglang_server.start(target_dir, tmp_path_factory.mktemp("tp") / "nospec.log", *TP)
    try:
        return _run(server.url, _bodies(), 4)
    finally:
        server.stop()


def _serve(target_dir: str, head_dir: str, log, budget: int, policy: str, runs: dict) -> dict:
    """A JETFLOW --tp 3 server: each (name: (bodies, concurrency)) run's outputs, and its log."""
    server = sglang_server.start(target_dir, log, *sglang_server.jetflow_args(head_dir, budget), *TP,
                                 env={"JETFLOW_TEST_TP_CHECK": "1", BUDGET_ENV: policy})  # fmt: skip
    try:
        outputs = {name: _run(server.url, bodies, c) for name, (bodies, c) in runs.items()}
    finally:
        server.stop()
    return {**outputs, "log": log.read_text(errors="replace")}


def _check_against_no_spec(outputs: list[dict], no_spec: list[dict], label: str) -> None:
    accepted = 0
    for body, got, want in zip(_bodies(), outputs, no_spec, strict=True):
        if body.get("sampled"):  # a sampled answer: any, as long as the ranks agreed on it
            assert 1 <= got["meta_info"]["completion_tokens"] <= SAMPLED["max_new_tokens"], got["meta_info"]
            continue
        assert got["output_ids"] == want["output_ids"], (label, body["input_ids"][:8], got["text"], want["text"])
        accepted += got["meta_info"]["spec_num_correct_drafts"]
    assert accepted > 0, label  # drafts were accepted, not only root rounds
    grammar = next(o for b, o in zip(_bodies(), outputs) if "regex" in b["sampling_params"])
    assert re.fullmatch(REGEX, grammar["text"]), grammar["text"]


@pytest.fixture(scope="module")
def one_rank(target_dir, head_dir) -> list:
    """The reference engine's answers at budget 16 (lookup branch on, as the servers): ids, verify
    rounds and accepted drafts per prompt."""
    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.reference.engine import ReferenceEngine
    from jetflow_sglang.reference.proposer import HeadProposer

    target, head = load_target_and_head(target_dir, head_dir, torch.float32)
    engine = ReferenceEngine(target, HeadProposer(head), budget=16, lookup=True)
    return [engine.generate(_ids(text), limit) for text, limit in PROMPTS]


def _check_drafts_as_one_rank(outputs: list[dict], one_rank: list, label: str) -> None:
    for (text, _), got, local in zip(PROMPTS, outputs, one_rank, strict=True):
        meta = got["meta_info"]
        assert got["output_ids"] == local.tokens, (label, text)
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (local.rounds, sum(local.accept_lengths)), (label, text)


@pytest.mark.slow
def test_tp3_static16_equals_no_spec_and_drafts_as_one_rank(target_dir, head_dir, no_spec, one_rank, tmp_path):
    one_by_one = [_greedy(text, limit) for text, limit in PROMPTS]
    out = _serve(target_dir, head_dir, tmp_path / "server.log", 16, "static",
                 {"single": (one_by_one, 1), "mixed": (_bodies(), 4)})  # fmt: skip
    assert "ranks committed different tokens" not in out["log"]
    _check_against_no_spec(out["mixed"], no_spec, "static 16")
    _check_drafts_as_one_rank(out["single"], one_rank, "tp 3")


@pytest.mark.slow
def test_dp2_serves_each_request_as_one_rank_with_its_tau(target_dir, head_dir, one_rank, tmp_path):
    """--dp-size 2: two schedulers, each with its own JETFLOW worker on one core; the requests,
    spread over both, come back as one rank drafts them, each with its own verify rounds and
    accepted drafts (its tau) in meta_info."""
    server = sglang_server.start(target_dir, tmp_path / "dp.log", *sglang_server.jetflow_args(head_dir, 16), "--dp-size", "2",
                                 env={BUDGET_ENV: "static"})  # fmt: skip
    try:
        outputs = _run(server.url, [_greedy(text, limit) for text, limit in PROMPTS], 2)
        log = server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert "DP0" in log and "DP1" in log  # two data-parallel schedulers served
    _check_drafts_as_one_rank(outputs, one_rank, "dp 2")


@pytest.mark.slow
def test_tp2_on_a_target_whose_heads_split_two_ways(prepared, tmp_path):
    """--tp-size 2 proper, a rank per core: a Qwen3-architecture target with 4 heads (random
    weights) and a published-layout head, at the adaptive budget (cap 16: the ranks share rank
    0's costs). JETFLOW's greedy ids equal the no-spec --tp 2 server's at 1 and 4 in flight, the
    test oracle drafting the no-spec continuations with set acceptance (a random head rarely lands)."""
    from transformers import AutoConfig, AutoTokenizer

    from helpers.targets import tiny_qwen3_target
    from jetflow_sglang import published
    from jetflow_sglang.head import JetFlowConfig, JetFlowHead

    target = str(tiny_qwen3_target(prepared["target"], tmp_path / "qwen3"))
    config = JetFlowConfig.for_target(AutoConfig.from_pretrained(target), target_layer_ids=[0, 2], qk_norm=True,
                                      mask_from_target=True, mask_token_id=0, rms_norm_eps=1e-6, block_size=8)  # fmt: skip
    head_dir = str(published.export_head(JetFlowHead(config).init_weights(1), tmp_path / "head", "dflash"))
    tok = AutoTokenizer.from_pretrained(target)
    texts = ("def fibonacci(n):", "a b a b a b a b a", "x = 1\ny = 2\nx = 1\ny =", "The capital of France is")
    bodies = [{"input_ids": tok(t).input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}
              for t in texts]  # fmt: skip
    outputs, oracle = {}, tmp_path / "oracle.json"
    for name, extra in (("nospec", ()), ("jetflow", sglang_server.jetflow_args(head_dir, 16))):
        if name == "jetflow":  # the oracle drafts the no-spec continuations (set acceptance 0.9): trees that pay
            oracle.write_text(json.dumps([[b["input_ids"], o["output_ids"]] for b, o in zip(bodies, outputs["nospec"][1])]))
        server = sglang_server.start(target, tmp_path / f"{name}.log", *extra, "--tp-size", "2", max_total_tokens=2048,
                                     env={"JETFLOW_TEST_TP_CHECK": "1", BUDGET_ENV: "adaptive", "JETFLOW_TEST_ORACLE": str(oracle),
                                          "JETFLOW_TEST_ORACLE_ACCEPT": "0.9"})  # fmt: skip
        try:
            outputs[name] = {c: _run(server.url, bodies, c) for c in (1, 4)}
            log = server.log.read_text(errors="replace")
        finally:
            server.stop()
        assert "TP1" in log  # a second rank served
    for concurrency in (1, 4):
        got, want = ([o["output_ids"] for o in outputs[n][concurrency]] for n in ("jetflow", "nospec"))
        assert got == want, concurrency
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outputs["jetflow"][1]) > 0
