"""`--speculative-algorithm JETFLOW` end to end on a real SGLang server (fp32, this CPU).

* A no-spec server gives the reference greedy token ids for 16 prompts (chat prompts
  that stop at EOS, raw completions that run to the token limit), and each prompt's
  continuation run past EOS for the oracle.
* JETFLOW servers at budgets 16, 64 and 256 (each started once; 16 and 256 static, asked for with
  `JETFLOW_BUDGET=static`; 64 as the cap of the adaptive tree budget, the default, whose verify
  width changes round by round) must return the same token ids at
  concurrency 1 and 8. Half of the prompts are drafted by the shipped
  head with the prompt-lookup free branch (short accepted paths), the other half by
  the test oracle (`JETFLOW_TEST_ORACLE`), which puts the true continuation at random
  ranks of each depth's top-k (the adaptive server's oracle drafts every prompt, at rank 0
  with set acceptance, so that its trees pay and the policy verifies them): long accepted paths, KV compaction over long paths, EOS
  and max_new_tokens inside an accepted path, in batches mixed with head-drafted
  requests of different prefix lengths.
* Per-request tau is readable from meta_info; a repeated prompt hits the radix cache.
* The prompt-lookup free branch is on in these servers; a JETFLOW_LOOKUP=0 server drafts with
  the head alone, both lossless, lookup committing more per round on repetitive text.
* Penalties (frequency, presence, repetition, min_new_tokens) equal a no-spec server's with the
  same options; oracle-drafted penalized prompts commit long paths through per-node counts.
* Grammars (regex, JSON schema, EBNF) and a frontend program with regex, JSON-schema and
  `choices` gens equal the no-spec server's, in batches mixed with penalized, sampled and
  plain requests; sampling with top-k, top-p and min-p follows SGLang's own law.
* Bad heads, budgets, cost tables (unreadable, or recorded in another dtype or on another machine),
  budget policies, and deterministic inference on this CPU: the launcher exits non-zero with a
  message naming the problem.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from jetflow_sglang import server as sglang_server  # noqa: E402
from jetflow_sglang.harness import last_profile  # noqa: E402

RANDOM_PROMPTS = [
    ("Say hello in one word.", True),
    ("What is 2+2? Answer with a number only.", True),
    ("List three fruits.", True),
    ("def add(a, b):", False),
    ("The capital of France is", False),
    ("Reply with OK.", True),
    ("for i in range(10):", False),
    ("Name a color.", True),
]
ORACLE_PROMPTS = [
    ("Explain recursion in one sentence.", True),
    ("Write a haiku about rain.", True),
    ("Is the sky blue? Yes or no.", True),
    ("Once upon a time, in a small village,", False),
    ("def fibonacci(n):", False),
    ("Give me a short tip for learning Python.", True),
    ("import numpy as np\n", False),
    ("What is the boiling point of water?", True),
]
BUDGETS = [16, 64, 256]
# Per-node request processing (logit bias, log-probs, radix hits, frontend programs, sampling,
# refusals) is the same code at every tree size: these run on the servers at 16 and 64; the
# 256-node one keeps the greedy, penalty and grammar checks (its rounds cost seconds here). The
# tests on one server run in file order: the adaptive server's policy learns from the earlier ones.
SMALL_TREES = pytest.mark.parametrize("jetflow_server", [16, 64], indirect=True, ids=lambda b: f"budget{b}")
ADAPTIVE_CAP = 64
STATIC = {"JETFLOW_BUDGET": "static"}  # the whole budget every round (the default is adaptive)
REPETITIVE = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday, Wednesday, Thursday,"
ORACLE_EXTRA = 24  # oracle continuations run this far past each request's token limit
# The adaptive server's oracle drafts every prompt, with set acceptance (P(accepted length >= d) =
# p**d) instead of cycling through every length at random ranks: its trees pay, so the policy
# verifies them (head-drafted requests beside them, which rarely pay in fp32 on a CPU, would set
# its batch-level value; the static servers serve those).
ORACLE_ACCEPT = "0.9"
MIN_ORACLE_TOKENS = 8  # oracle answers at least this long are asserted to draft long paths
# ... and it prices and clocks its rounds by this table (`JETFLOW_TEST_COSTS`), not by the machine's
# clock: what it drafts then follows from what it accepts alone, the same on a fast and a slow CPU
# (on the clock, a slower CI machine verified root-only rounds at 8 in flight). The shape is a
# 2-core CPU's in fp32: a plain step by batch size, a verify by tokens, the draft pass by batch size.
MODELLED_COSTS = {
    "plain_ms": {"1": 20, "8": 28, "64": 80},
    "verify_ms": {"2": 21, "8": 23, "16": 25, "64": 32, "128": 45, "256": 70, "512": 130, "2048": 500},
    "draft_ms": {"1": 5, "8": 9, "64": 40},
}


def _max_new_tokens(index: int, oracle: bool) -> int:
    # Varied limits, so the limit lands at different depths of accepted paths.
    return 24 + (7 * index) % 29 if oracle else 8 + (5 * index) % 9


@pytest.fixture(scope="module")
def cases(target_dir) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)

    def encode(text: str, chat: bool) -> list[int]:
        if chat:
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False))
        return tok(text).input_ids

    out = []
    for oracle, prompts in ((False, RANDOM_PROMPTS), (True, ORACLE_PROMPTS)):
        for i, (text, chat) in enumerate(prompts):
            out.append({"ids": encode(text, chat), "oracle": oracle, "max_new_tokens": _max_new_tokens(i, oracle)})
    return out


def _option_cases(target_dir: str, prompts: list, max_new_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    out = []
    for text, chat, options, oracle in prompts:
        ids = (list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False))
               if chat else tok(text).input_ids)  # fmt: skip
        out.append({"ids": ids, "oracle": oracle, "max_new_tokens": max_new_tokens, "options": options})
    return out


@pytest.fixture(scope="module")
def penalized_cases(target_dir) -> list[dict]:
    return _option_cases(target_dir, PENALIZED_PROMPTS, 28)


@pytest.fixture(scope="module")
def grammar_cases(target_dir) -> list[dict]:
    return _option_cases(target_dir, GRAMMAR_PROMPTS, 48)


def _generate(url: str, ids: list[int], max_new_tokens: int, ignore_eos: bool = False, **extra) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos,
              **extra.pop("sampling_params_extra", {})}
    return sglang_server.post(url + "/generate", {"input_ids": ids, "sampling_params": params, **extra})


SAMPLING_CASE = 9  # "Write a haiku about rain.", oracle-drafted: sampled tokens that match the oracle commit deep paths
# top-k and top-p together, and min-p: the worker cuts these as SGLang's sampler does (sampling_filters.py)
SAMPLING = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "max_new_tokens": 4}
SAMPLES = 192
LOGPROB_CASES = [0, 3, 8, 12]  # two head-drafted, two oracle-drafted (multi-token commits)


def _sglang_cut(logits):
    """SGLang's own sampler cut under SAMPLING (temperature 1, top-k, top-p, min-p), renormalized."""
    import torch
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    rows = logits.shape[0]
    _, probs_sort, probs_idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        logits.softmax(-1), torch.full((rows,), SAMPLING["top_k"]), torch.full((rows,), SAMPLING["top_p"]),
        torch.full((rows,), SAMPLING["min_p"]), need_min_p_sampling=True, sampling_seed=None,
        positions=torch.zeros(rows, dtype=torch.long), return_filtered_probs=True,
    )  # fmt: skip
    return probs_idx, probs_sort / probs_sort.sum(-1, keepdim=True)


def _exact_joint(target_dir: str, ids: list[int]) -> dict[tuple[int, ...], float]:
    """P(first 4 tokens) under SAMPLING: HF transformers' fp32 logits cut by SGLang's own sampler."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.hf import exact_joint

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return exact_joint(model, ids, SAMPLING["max_new_tokens"], _sglang_cut)


def _samples(url: str, ids: list[int], greedy: list[dict] = ()) -> tuple[list[dict], list[dict]]:
    """SAMPLES sampled requests, interleaved in the same batches with greedy ones."""
    bodies = [{"input_ids": ids, "sampling_params": SAMPLING}] * SAMPLES
    for k, case in enumerate(greedy):
        params = {"temperature": 0, "max_new_tokens": case["max_new_tokens"]}
        bodies.insert(k * SAMPLES // max(len(greedy), 1), {"input_ids": case["ids"], "sampling_params": params, "greedy": True})
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda b: sglang_server.post(url + "/generate", {k: v for k, v in b.items() if k != "greedy"}), bodies))
    sampled = [o for b, o in zip(bodies, outputs) if "greedy" not in b]
    return sampled, [o for b, o in zip(bodies, outputs) if "greedy" in b]


PENALIZED_PROMPTS = [  # text, chat, penalties, oracle-drafted
    ("Write a short poem about the sea.", True, {"frequency_penalty": 0.6, "presence_penalty": 0.4}, True),
    ("Count from one to twenty in words:", False, {"repetition_penalty": 1.3}, True),
    ("Type the number 7.", True, {"min_new_tokens": 12}, True),  # EOS after 7 tokens without the option
    (REPETITIVE, False, {"frequency_penalty": 0.5}, False),  # head + lookup, whose repeats the penalty rejects
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GRAMMAR_PROMPTS = [  # text, chat, grammar, oracle-drafted (its continuation: the constrained answer)
    ("Is water wet? Answer, then give a reason.", True, {"regex": r"(Yes|No), because [a-z ,]{10,60}\."}, True),
    ("Describe a made-up person.", True, {"json_schema": json.dumps(PERSON_SCHEMA)}, True),
    ("List three colors.", True, {"ebnf": 'root ::= color ", " color ", and " color "."\ncolor ::= "red" | "green" | "blue" | "yellow" | "black" | "white"'}, True),
    ("Name a fruit.", True, {"regex": "[A-Z][a-z]+( and [A-Z][a-z]+)?"}, False),  # head-drafted
]
BIAS_CASES = [3, 6, 11, 12]  # raw completions that run to their limit: two head-drafted, two oracle-drafted


def _logit_bias(greedy_ids: list[int]) -> dict:
    """Bans the greedy answer's third token and favours its sixth: the biased answer differs."""
    return {"sampling_params_extra": {"logit_bias": {str(greedy_ids[2]): -100.0, str(greedy_ids[5]): 4.0}}}


def _with_logprobs(url: str, cases: list[dict]) -> list[dict]:
    outputs = [_generate(url, cases[i]["ids"], cases[i]["max_new_tokens"], return_logprob=True) for i in LOGPROB_CASES]
    return [{"ids": o["output_ids"], "logprobs": [t[0] for t in o["meta_info"]["output_token_logprobs"]]} for o in outputs]


def _run_all(url: str, cases: list[dict], concurrency: int, **extra) -> list[dict]:
    def run(case: dict) -> dict:
        params = {"sampling_params_extra": case["options"]} if "options" in case else {}
        return _generate(url, case["ids"], case["max_new_tokens"], **params, **extra)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(run, cases))


def _frontend(url: str) -> list[dict]:
    """An SGLang frontend program mixing free text, a regex gen, a JSON-schema gen and choices."""
    import sglang as sgl

    @sgl.function
    def profile(s, topic):
        s += sgl.user(f"Tell me about {topic} in one sentence.")
        s += sgl.assistant(sgl.gen("sentence", max_tokens=24, temperature=0))
        s += sgl.user("Rate it from 1 to 10, then say why.")
        s += sgl.assistant(sgl.gen("rating", regex=r"[1-9]|10", temperature=0) + ". " + sgl.gen("why", max_tokens=12, temperature=0))
        s += sgl.user("Give a made-up person as JSON.")
        s += sgl.assistant(sgl.gen("person", json_schema=json.dumps(PERSON_SCHEMA), max_tokens=48, temperature=0))
        s += sgl.user("Pick a color.")
        s += sgl.assistant(sgl.gen("color", choices=["red", "green", "blue"], temperature=0))

    states = profile.run_batch([{"topic": "the moon"}, {"topic": "Python"}], backend=sgl.RuntimeEndpoint(url), num_threads=2)
    return [{k: st[k] for k in ("sentence", "rating", "why", "person", "color")} for st in states]


@pytest.fixture(scope="module")
def reference(target_dir, cases, penalized_cases, grammar_cases, tmp_path_factory) -> dict:
    """No-spec greedy outputs, and the oracle file (continuations past EOS and the limit).
    Without overlap scheduling: SGLang's overlap scheduler feeds its penalizers one round late
    (tree_penalties.py); the exact penalties are the non-overlap server's, and nothing else
    here depends on overlap."""
    work = tmp_path_factory.mktemp("jetflow_ref")
    server = sglang_server.start(target_dir, work / "nospec.log", "--disable-overlap-schedule")
    all_cases = cases + penalized_cases + grammar_cases
    try:
        outputs = _run_all(server.url, cases, 8)
        penalized = _run_all(server.url, penalized_cases, 4)
        unpenalized = _run_all(server.url, [{k: v for k, v in c.items() if k != "options"} for c in penalized_cases], 4)
        constrained = _run_all(server.url, grammar_cases, 4)
        long = _run_all(server.url, [dict(c, max_new_tokens=c["max_new_tokens"] + ORACLE_EXTRA) for c in all_cases], 8,
                        ignore_eos=True)  # fmt: skip
        logprobs = _with_logprobs(server.url, cases)
        biased = [_generate(server.url, cases[i]["ids"], cases[i]["max_new_tokens"], return_logprob=True,
                            **_logit_bias(outputs[i]["output_ids"])) for i in BIAS_CASES]  # fmt: skip
        frontend = _frontend(server.url)
    finally:
        server.stop()
    oracle_file, oracle_all = work / "oracle.json", work / "oracle_all.json"
    oracle_file.write_text(json.dumps([[c["ids"], o["output_ids"]] for c, o in zip(all_cases, long) if c["oracle"]]))
    oracle_all.write_text(json.dumps([[c["ids"], o["output_ids"]] for c, o in zip(all_cases, long)]))
    return {"output_ids": [o["output_ids"] for o in outputs], "oracle_file": str(oracle_file), "logprobs": logprobs,
            "oracle_all": str(oracle_all),
            "sampling_joint": _exact_joint(target_dir, cases[SAMPLING_CASE]["ids"]), "biased": biased,
            "penalized": [o["output_ids"] for o in penalized], "unpenalized": [o["output_ids"] for o in unpenalized],
            "constrained": constrained, "frontend": frontend}


@pytest.fixture(scope="module", params=BUDGETS, ids=[f"budget{b}" for b in BUDGETS])
def jetflow_server(request, target_dir, head_dir, reference, tmp_path_factory):
    """Budgets 16 and 256 static (`JETFLOW_BUDGET=static`); 64 as the cap of the adaptive budget, a
    plain launch's default, which verifies a tree size of its choice round by round: every test
    below runs on both kinds."""
    budget = request.param
    adaptive = budget == ADAPTIVE_CAP
    work = tmp_path_factory.mktemp(f"jetflow_{budget}")
    log, costs = work / "server.log", work / "costs.json"
    costs.write_text(json.dumps(MODELLED_COSTS))
    server = sglang_server.start(
        target_dir, log,
        "--speculative-algorithm", "JETFLOW",
        "--speculative-draft-model-path", head_dir,
        "--speculative-num-draft-tokens", str(budget),
        env={"JETFLOW_TEST_ORACLE": reference["oracle_all" if adaptive else "oracle_file"], "JETFLOW_PROFILE": "1",
             **({"JETFLOW_TEST_ORACLE_ACCEPT": ORACLE_ACCEPT, "JETFLOW_TEST_COSTS": str(costs)} if adaptive else STATIC)},
    )  # fmt: skip
    server.budget, server.adaptive, server.log = budget, adaptive, log
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_token_ids_equal_no_spec_server(jetflow_server, cases, reference, concurrency):
    outputs = _run_all(jetflow_server.url, cases, concurrency)
    mismatches = [
        (i, got["output_ids"], want)
        for i, (got, want) in enumerate(zip(outputs, reference["output_ids"]))
        if got["output_ids"] != want
    ]
    assert not mismatches, f"budget {jetflow_server.budget}, concurrency {concurrency}: {mismatches[:3]}"
    cut_inside = {"stop": 0, "length": 0}  # finish reason -> oracle prompts cut inside a commit
    for case, out in zip(cases, outputs):
        meta = out["meta_info"]
        tau = 1 + meta["spec_num_correct_drafts"] / meta["spec_verify_ct"]
        if case["oracle"]:
            # The oracle's true tokens sit in the tree most rounds: long accepted paths. An answer of
            # a few tokens ("No.") is one or two rounds, whose accepted lengths are one draw each.
            if len(out["output_ids"]) >= MIN_ORACLE_TOKENS:
                assert tau > 2.0, (case, meta)
            # SGLang counts a round's whole accepted path before EOS or max_new_tokens cuts it.
            if meta["spec_verify_ct"] + meta["spec_num_correct_drafts"] > len(out["output_ids"]):
                cut_inside[meta["finish_reason"]["type"]] += 1
    assert cut_inside["stop"] >= 1 and cut_inside["length"] >= 1 and sum(cut_inside.values()) >= 4, (
        f"EOS / max_new_tokens cuts inside a multi-token commit: {cut_inside}"
    )
    oracle_taus = [
        1 + o["meta_info"]["spec_num_correct_drafts"] / o["meta_info"]["spec_verify_ct"]
        for c, o in zip(cases, outputs)
        if c["oracle"]
    ]
    print(f"budget {jetflow_server.budget} concurrency {concurrency}: oracle tau {sum(oracle_taus) / len(oracle_taus):.2f}",
          sorted(round(t, 2) for t in oracle_taus))  # fmt: skip
    assert sorted(oracle_taus)[len(oracle_taus) // 2] > 2.0, oracle_taus  # most oracle prompts draft long paths
    budget_report = last_profile(jetflow_server.log)["tree_sizes"]
    print(f"tree sizes chosen (rounds): {budget_report['chosen']}, head skipped in {budget_report['skipped_drafts']} "
          f"rounds, lookup chains in {budget_report['skipped_chains']}")  # fmt: skip
    sizes = {int(n) for n in budget_report["chosen"]}
    if jetflow_server.adaptive:
        # Trees of several sizes verified, losslessly, the largest ones for the oracle's paths.
        assert len(sizes) >= 2 and max(sizes) >= 16 and max(sizes) <= ADAPTIVE_CAP, budget_report
    else:
        assert sizes == {jetflow_server.budget}, budget_report


@pytest.mark.slow
def test_triton_kernels_in_the_worker_are_lossless(target_dir, head_dir, cases, reference, tmp_path):
    """TRITON_INTERPRET=1: the server's worker drafts with the paged head-attention kernel, builds
    trees and masks and walks acceptance with the Triton kernels, as on a GPU (about 2 s a round
    here), its draft batch padded as for CUDA-graph replay; it must still equal the no-spec ids."""
    picked = [3, 13]  # raw completions to their limit: one head-drafted, one oracle-drafted (long accepted paths)
    log = tmp_path / "server.log"
    server = sglang_server.start(
        target_dir, log, *sglang_server.jetflow_args(head_dir, 64),
        env={"JETFLOW_TEST_ORACLE": reference["oracle_file"], "TRITON_INTERPRET": "1", "JETFLOW_TEST_DRAFT_PADDING": "1", **STATIC},
    )  # fmt: skip
    try:
        outputs = _run_all(server.url, [cases[i] for i in picked], 2)
    finally:
        server.stop()
    text = log.read_text()
    assert "jetflow kernels: triton (interpreter)" in text and "draft pass padded to batch sizes" in text
    for i, out in zip(picked, outputs):
        assert out["output_ids"] == reference["output_ids"][i], i
    oracle_meta = outputs[-1]["meta_info"]
    assert 1 + oracle_meta["spec_num_correct_drafts"] / oracle_meta["spec_verify_ct"] > 2.0



@pytest.mark.slow
def test_published_dflash_layout_head_serves_unchanged(target_dir, cases, reference, tmp_path):
    """A head directory in the published DFlash / JetSpec layout (q/k norms, MASK as a target
    embedding row, `dflash_config`, a sliding-window layer; random weights) passed as
    --speculative-draft-model-path as it is: the no-spec ids, and each request's rounds and
    accepted drafts equal the HF reference engine's with the same head."""
    import torch

    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.reference.proposer import HeadProposer
    from jetflow_sglang.reference.engine import ReferenceEngine
    from test_published import smollm2_published_head

    head_dir = str(smollm2_published_head(target_dir, tmp_path / "published", sliding=True))
    picked = [0, 3]  # a chat prompt that stops at EOS, a raw completion that runs to the limit
    server = sglang_server.start(target_dir, tmp_path / "server.log", *sglang_server.jetflow_args(head_dir, 64), env=STATIC)
    try:
        outputs = _run_all(server.url, [cases[i] for i in picked], 2)
    finally:
        server.stop()
    target, head = load_target_and_head(target_dir, head_dir, torch.float32)
    assert head.config.qk_norm and head.config.mask_from_target and head.config.sliding_layers == [1]
    engine = ReferenceEngine(target, HeadProposer(head), budget=64, lookup=True)
    for i, out in zip(picked, outputs):
        assert out["output_ids"] == reference["output_ids"][i], i
        local = engine.generate(cases[i]["ids"], cases[i]["max_new_tokens"])
        meta = out["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (local.rounds, sum(local.accept_lengths)), i


@pytest.mark.slow
def test_lookup_branch_raises_tau_and_switches_off(target_dir, head_dir, cases, reference, tmp_path):
    """The free branch (each request's prompt-lookup continuation merged into its tree) is on by
    default (the servers above run with it); with JETFLOW_LOOKUP=0 the head drafts alone, with
    JETFLOW_LOOKUP=only the lookup chains are verified alone (no head pass). All return the
    no-spec ids; on text that repeats its context, lookup commits more per round.
    Cross-engine: each request's verify rounds and accepted drafts equal the HF reference
    engine's for the same head, budget and lookup setting (fp32), over 16-token prefill chunks
    and again on radix-cache hits, so the server's drafting (paged head context written by
    chunked prefill or reused from the cache, tree, free branch) is the reference's, not
    merely lossless."""
    import torch
    from transformers import AutoTokenizer

    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.reference.proposer import HeadProposer
    from jetflow_sglang.reference.engine import ReferenceEngine

    repetitive = {"ids": AutoTokenizer.from_pretrained(target_dir)(REPETITIVE).input_ids, "max_new_tokens": 40}
    picked = [0, 3]  # head-drafted cases (chat, raw)
    requests = [cases[i] for i in picked] + [repetitive]
    target, head = load_target_and_head(target_dir, head_dir, torch.float32)
    results = {}
    for lookup in ("1", "0", "only"):
        server = sglang_server.start(
            target_dir, tmp_path / f"lookup{lookup}.log", *sglang_server.jetflow_args(head_dir, 16),
            "--chunked-prefill-size", "16", env={"JETFLOW_LOOKUP": lookup, **STATIC},
        )  # fmt: skip
        try:
            outputs = _run_all(server.url, requests, len(requests))
            again = _run_all(server.url, requests, len(requests))  # radix-cache hits: head context K/V reused
        finally:
            server.stop()
        for i, out in zip(picked, outputs):
            assert out["output_ids"] == reference["output_ids"][i], (lookup, i)
        assert all(out["meta_info"]["cached_tokens"] > 0 for out in again)
        engine = ReferenceEngine(target, HeadProposer(head), budget=16, lookup=lookup != "0", head=lookup != "only")
        for case, out, hit in zip(requests, outputs, again):
            local = engine.generate(case["ids"], case["max_new_tokens"])
            for served in (out, hit):
                meta = served["meta_info"]
                assert local.tokens == served["output_ids"], (lookup, case)
                assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (local.rounds, sum(local.accept_lengths)), (
                    lookup, case, local.accept_lengths)  # fmt: skip
        meta = outputs[-1]["meta_info"]
        results[lookup] = (outputs[-1]["output_ids"], 1 + meta["spec_num_correct_drafts"] / meta["spec_verify_ct"])
    assert results["1"][0] == results["0"][0] == results["only"][0] and len(results["1"][0]) == 40
    print(f"repetitive prompt, budget 16: tau with lookup {results['1'][1]:.2f}, head alone {results['0'][1]:.2f}, "
          f"lookup alone {results['only'][1]:.2f}")  # fmt: skip
    assert results["1"][1] > results["0"][1] + 0.5 and results["1"][1] > 3.0 and results["only"][1] > 3.0, results


@pytest.mark.slow
@SMALL_TREES
def test_repeated_prompt_hits_radix_cache(jetflow_server, cases, reference):
    case, want = cases[-1], reference["output_ids"][-1]
    first = _generate(jetflow_server.url, case["ids"], case["max_new_tokens"])
    again = _generate(jetflow_server.url, case["ids"], case["max_new_tokens"])
    assert again["meta_info"]["cached_tokens"] > 0
    assert first["output_ids"] == want and again["output_ids"] == want


@pytest.mark.slow
@SMALL_TREES
def test_output_logprobs_equal_no_spec(jetflow_server, cases, reference):
    """Logprobs of committed tokens come from the verify row of the node that predicted each one."""
    for i, got, want in zip(LOGPROB_CASES, _with_logprobs(jetflow_server.url, cases), reference["logprobs"]):
        assert got["ids"] == want["ids"], i
        assert len(got["logprobs"]) == len(want["logprobs"]) == len(want["ids"])
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < 1e-3, (i, got, want)


@pytest.mark.slow
@SMALL_TREES
def test_logit_bias_equals_no_spec(jetflow_server, cases, reference):
    """logit_bias is added to every tree node's verify logits: greedy ids and output logprobs
    equal the no-spec server's with the same bias, and the bias changed the answer."""
    for i, want in zip(BIAS_CASES, reference["biased"]):
        got = _generate(jetflow_server.url, cases[i]["ids"], cases[i]["max_new_tokens"], return_logprob=True,
                        **_logit_bias(reference["output_ids"][i]))  # fmt: skip
        assert want["output_ids"] != reference["output_ids"][i], i
        assert got["output_ids"] == want["output_ids"], i
        got_lp = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
        want_lp = [t[0] for t in want["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-3, (i, got_lp, want_lp)


def _assert_oracle_paths_long(cases: list[dict], outputs: list[dict]) -> None:
    """The oracle-drafted requests among `cases` committed more than 2 tokens a round together.
    Pooled, not per request: on the adaptive server a request's rounds follow the batches it
    shared and the oracle's set acceptance, and one short request may verify few long paths."""
    metas = [o["meta_info"] for c, o in zip(cases, outputs) if c["oracle"]]
    assert metas
    tau = 1 + sum(m["spec_num_correct_drafts"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)
    assert tau > 2.0, (tau, [(c.get("options"), o["meta_info"]) for c, o in zip(cases, outputs) if c["oracle"]])


@pytest.mark.slow
def test_penalties_equal_no_spec(jetflow_server, cases, penalized_cases, reference):
    """Frequency, presence and repetition penalties and min_new_tokens, greedy: each tree node is
    penalized for its own path, so the ids equal the no-spec server's with the same options, in
    a batch mixed with plain requests. The oracle drafts three of the prompts (its continuations
    are the penalized answers): long accepted paths whose nodes carry different counts."""
    plain = [0, 3]
    outputs = _run_all(jetflow_server.url, penalized_cases + [cases[i] for i in plain], 6)
    for case, got, want, free in zip(penalized_cases, outputs, reference["penalized"], reference["unpenalized"]):
        assert want != free, case["options"]  # the options changed the answer
        assert got["output_ids"] == want, (jetflow_server.budget, case["options"])
    _assert_oracle_paths_long(penalized_cases, outputs)
    for i, got in zip(plain, outputs[len(penalized_cases) :]):
        assert got["output_ids"] == reference["output_ids"][i], i


@pytest.mark.slow
def test_grammars_equal_no_spec_in_a_mixed_batch(jetflow_server, cases, penalized_cases, grammar_cases, reference):
    """A regex, a JSON schema, an EBNF grammar: each tree node's logits carry the grammar's mask
    for its own path, so the ids equal the no-spec server's. The oracle drafts three of them (its
    continuations are the constrained answers): accepted paths run through grammar-forced tokens
    and the grammar's end. They share batches with penalized, sampled and plain requests."""
    import jsonschema

    plain = [0, 3]
    # At 256 nodes a 14-request batch costs ~2.5 min here; the penalized and sampled requests
    # have their own tests at 256, so that budget mixes grammars with plain requests only.
    full_mix = jetflow_server.budget < 256
    sampled = [{"input_ids": cases[SAMPLING_CASE]["ids"], "sampling_params": SAMPLING}] * (4 if full_mix else 0)
    penalized_cases = penalized_cases if full_mix else []
    mixed = grammar_cases + penalized_cases + [cases[i] for i in plain]
    with ThreadPoolExecutor(len(mixed) + len(sampled)) as pool:
        draws = [pool.submit(sglang_server.post, jetflow_server.url + "/generate", body) for body in sampled]
        outputs = _run_all(jetflow_server.url, mixed, len(mixed))
        draws = [d.result() for d in draws]
    for case, got, want in zip(grammar_cases, outputs, reference["constrained"]):
        assert got["output_ids"] == want["output_ids"], (jetflow_server.budget, case["options"], got["text"], want["text"])
    _assert_oracle_paths_long(grammar_cases, outputs)
    answer = json.loads(outputs[1]["text"])
    jsonschema.validate(answer, PERSON_SCHEMA)
    assert re.fullmatch(r"(Yes|No), because [a-z ,]{10,60}\.", outputs[0]["text"]), outputs[0]["text"]
    penalized_want = reference["penalized"] if full_mix else []
    for got, want in zip(outputs[len(grammar_cases) :], penalized_want + [reference["output_ids"][i] for i in plain], strict=True):
        assert got["output_ids"] == want
    assert all(tuple(d["output_ids"]) in reference["sampling_joint"] for d in draws)


@pytest.mark.slow
@SMALL_TREES
def test_frontend_program_with_grammars_and_choices_equals_no_spec(jetflow_server, reference):
    """`sgl.gen(regex=...)`, `sgl.gen(json_schema=...)` and `sgl.gen(choices=...)` in an
    `sgl.function` program, run as a batch: the same answers as the no-spec server."""
    import jsonschema

    got = _frontend(jetflow_server.url)
    assert got == reference["frontend"], (jetflow_server.budget, got, reference["frontend"])
    for answer in got:
        assert re.fullmatch(r"[1-9]|10", answer["rating"]) and answer["color"] in ("red", "green", "blue"), answer
        jsonschema.validate(json.loads(answer["person"]), PERSON_SCHEMA)


@pytest.mark.slow
@SMALL_TREES  # same tree code at 256, where 192 draws verify 8 x 256 nodes a round (~13 min here)
def test_sampling_follows_the_target_distribution_over_several_tokens(jetflow_server, cases, reference):
    """Temperature 1, top-k 3 with top-p 0.9 and min-p 0.1, four new tokens: the joint distribution
    of the JETFLOW server's continuations equals the one computed from the target's logits with
    SGLang's own sampler cut (chi-square goodness of fit), so tokens committed deep inside a tree
    are sampled right, not only the root. The oracle
    drafts this prompt, so sampled tokens that match its drafts commit multi-token paths. Greedy
    requests batched with the sampled ones still return the no-spec ids."""
    from collections import Counter

    from helpers.stats import joint_fit

    joint = reference["sampling_joint"]
    greedy_picks = [0, 3, 10]
    sampled, greedy = _samples(jetflow_server.url, cases[SAMPLING_CASE]["ids"], [cases[i] for i in greedy_picks])
    for i, out in zip(greedy_picks, greedy):
        assert out["output_ids"] == reference["output_ids"][i], i
    got = Counter(tuple(o["output_ids"]) for o in sampled)
    outside = [o for o in got if o not in joint]
    assert not outside, f"continuations outside the filtered support: {outside}"
    p_value, observed, expected = joint_fit(got, joint, SAMPLES)
    accepted = sum(o["meta_info"]["spec_num_correct_drafts"] for o in sampled)
    print(f"budget {jetflow_server.budget}: observed {observed} expected {[round(e, 1) for e in expected]} p={p_value:.3g}, "
          f"drafts accepted under sampling {accepted} over {SAMPLES} requests")
    assert p_value > 1e-3, (observed, expected, p_value)
    assert accepted >= SAMPLES // 4, accepted  # multi-token commits happened while sampling


@pytest.mark.slow
@SMALL_TREES
def test_requests_jetflow_would_serve_differently_are_refused(jetflow_server, cases, reference):
    """min_p with a seed (SGLang's seeded sampler asserts against it) and logprobs the worker does
    not produce get a 400 naming the option; the server keeps serving."""
    import urllib.error

    ids = cases[0]["ids"]
    refused = [
        ({"temperature": 0.7, "sampling_seed": 3, "min_p": 0.1}, {}, "min_p with sampling_seed"),
        ({"temperature": 0.7}, {"return_logprob": True}, "logprobs of sampled tokens"),
        ({}, {"return_logprob": True, "top_logprobs_num": 3}, "top_logprobs_num"),
    ]
    for params, extra, needle in refused:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4, **params}, **extra}
        with pytest.raises(urllib.error.HTTPError) as info:
            sglang_server.post(jetflow_server.url + "/generate", body)
        assert needle in info.value.read().decode(), needle
    assert _generate(jetflow_server.url, ids, cases[0]["max_new_tokens"])["output_ids"] == reference["output_ids"][0]


# ------------------------------------------------------------ refusing to start
def _bad_heads(head_dir: str, root: Path) -> dict[str, tuple[str, str]]:
    """name -> (head dir, text the error must contain)."""
    from jetflow_sglang.head import JetFlowConfig

    heads = {"missing": (str(root / "no-such-head"), "not found")}
    bin_head = root / "bin-head"
    shutil.copytree(head_dir, bin_head)
    (bin_head / "model.safetensors").rename(bin_head / "pytorch_model.bin")
    heads["non_safetensors"] = (str(bin_head), "only safetensors")
    config = json.loads((Path(head_dir) / "config.json").read_text())
    for name, field, value, needle in (
        ("vocab", "target_vocab_size", 32000, "vocab size"),
        ("hidden", "target_hidden_size", 512, "hidden size"),
        ("taps", "target_layer_ids", [1, 7, 15, 22, 40], "layers"),
    ):
        bad = root / f"{name}-head"
        shutil.copytree(head_dir, bad)
        patched = dict(config, jetflow=dict(config["jetflow"], **{field: value}))
        JetFlowConfig.from_json_dict(patched)  # still a well-formed config
        (bad / "config.json").write_text(json.dumps(patched))
        heads[name] = (str(bad), needle)
    return heads


@pytest.mark.slow
def test_bad_head_or_budget_refuses_to_start(target_dir, head_dir, tmp_path):
    broken_table = tmp_path / "cost.json"
    broken_table.write_text('{"verify_ms": {"4": -1}}')
    bf16_table = tmp_path / "cost_bf16.json"  # these servers run float32
    bf16_table.write_text('{"verify_ms": {"1": 10, "64": 40}, "dtype": "bfloat16"}')
    runs = [
        (name, path, "64", needle, [], None) for name, (path, needle) in _bad_heads(head_dir, tmp_path).items()
    ] + [
        ("budget0", head_dir, "0", "between 1 and 512", [], None),
        ("budget513", head_dir, "513", "between 1 and 512", [], None),
        ("backend", head_dir, "64", "cannot verify draft trees", ["--attention-backend", "torch_native"], None),
        ("pp2", head_dir, "64", "pipeline parallelism is not supported", ["--pp-size", "2"], None),
        ("tp2", head_dir, "64", "--tp 2 does not divide the target's 9 attention heads", ["--tp-size", "2"], None),
        ("cost_table", head_dir, "64", "times > 0", ["--speculative-adaptive"], {"JETFLOW_COST_TABLE": str(broken_table)}),
        ("cost_table_dtype", head_dir, "64", "measured in bfloat16, but this server runs float32", [],
         {"JETFLOW_COST_TABLE": str(bf16_table)}),
        ("static_and_adaptive", head_dir, "64", "contradicts JETFLOW_BUDGET=static", ["--speculative-adaptive"],
         {"JETFLOW_BUDGET": "static"}),
        ("deterministic", head_dir, "64", "--enable-deterministic-inference is not supported on the CPU platform",
         ["--enable-deterministic-inference", "--attention-backend", "triton"], None),
        ("fits", head_dir, "64", "", [], None),  # the control: a good head and budget resolve
    ]  # fmt: skip
    # Every case through the launcher's own argument resolution, in one process (a launch each
    # cost ~17 s of imports here); two of them also as real launches that must exit non-zero.
    cases = [
        {"name": name, "argv": sglang_server.server_cmd(target_dir, 30000, *sglang_server.jetflow_args(path, int(budget)), *extra)[3:],
         "env": env}
        for name, path, budget, _, extra, env in runs
    ]  # fmt: skip
    resolver = Path(__file__).parent / "helpers" / "launcher_args.py"
    proc = subprocess.run([sys.executable, str(resolver), json.dumps(cases)], capture_output=True, text=True, timeout=300,
                          env=sglang_server.launcher_env())  # fmt: skip
    results = {r["name"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines() if line.startswith("{")))}
    assert len(results) == len(runs), proc.stderr[-2000:]
    for name, _, _, needle, _, _ in runs:
        if name == "fits":
            assert not results[name]["refused"], results[name]["message"]
        else:
            assert results[name]["refused"] and "JETFLOW" in results[name]["message"] and needle in results[name]["message"], results[name]
    for name in ("missing", "budget0"):
        path, budget, needle = next((path, budget, needle) for n, path, budget, needle, _, _ in runs if n == name)
        code, output = sglang_server.run_to_exit(target_dir, tmp_path / f"{name}.log", *sglang_server.jetflow_args(path, int(budget)))
        assert code not in (0, -1), f"{name}: server did not refuse (exit {code})"
        assert "JETFLOW" in output and needle in output, f"{name}: {output[-1500:]}"
