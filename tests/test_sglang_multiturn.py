"""Second turns that reuse KV written by verify rounds, on a real SGLang server (fp32, this CPU).

A conversation's second turn is its first turn's prompt and answer plus a new message, so
SGLang's radix cache serves the first answer's KV: slots written by JETFLOW verify rounds and
compacted to each round's accepted path, together with the head's context K/V for the same
slots. Served at static budget 16 without the prompt-lookup free branch and at static budget 64
with it (the default branch at the default cap's widest trees), the
shipped head must draft both turns exactly as the HF reference engine does from scratch: the
same token ids, verify rounds, accepted drafts and rounds per accepted count. A slot written
at the wrong place, or a context the head reads wrongly, changes the second turn's drafts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("sglang")

from jetflow_sglang import server as sglang_server  # noqa: E402
from jetflow_sglang.budget import BUDGET_ENV  # noqa: E402

CONFIGS = [(16, False), (64, True)]  # (budget, lookup branch): each budget, and each branch setting, once
CONVERSATIONS = [  # (first message, chat, first limit, second message, second limit)
    ("Write a short story about a robot who learns to paint.", True, 40, "Now tell it again in two sentences.", 32),
    ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):", False, 24, "\n\n\ndef mul(a, b):", 24),
    ("Monday, Tuesday, Wednesday, Thursday,", False, 32, " and the months: January, February,", 32),
]


def _second_turn(tok, ids: list[int], answer: list[int], message: str, chat: bool) -> list[int]:
    """The first turn's ids and answer as generated (so the radix cache matches them), then the
    new message: a chat turn in the template's own markup, or more raw text."""
    if not chat:
        return ids + answer + tok(message, add_special_tokens=False).input_ids
    end = "" if answer and answer[-1] == tok.eos_token_id else "<|im_end|>"
    markup = f"{end}\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    return ids + answer + tok(markup, add_special_tokens=False).input_ids


def _post_all(url: str, turns: list[tuple[list[int], int]]) -> list[dict]:
    def one(turn):
        ids, limit = turn
        return sglang_server.post(url + "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": limit}})

    with ThreadPoolExecutor(len(turns)) as pool:
        return list(pool.map(one, turns))


def _histogram(accept_lengths: list[int]) -> list[int]:
    counts = [0] * (max(accept_lengths) + 1)
    for accepted in accept_lengths:
        counts[accepted] += 1
    return counts


@pytest.fixture(scope="module")
def models(prepared):
    from jetflow_sglang.assets import load_target_and_head

    return load_target_and_head(str(prepared["target"]), str(prepared["head"]), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("budget, lookup", CONFIGS, ids=[f"budget{b}-lookup{int(l)}" for b, l in CONFIGS])
def test_second_turn_on_verify_written_cache_drafts_as_the_reference_engine(prepared, models, budget, lookup, tmp_path):
    from jetflow_sglang.reference.proposer import HeadProposer
    from jetflow_sglang.reference.engine import ReferenceEngine

    target, head = models
    tok = target.tokenizer
    firsts = [(target.encode_prompt(text, chat), limit) for text, chat, limit, _, _ in CONVERSATIONS]
    server = sglang_server.start(
        str(prepared["target"]), tmp_path / "server.log", *sglang_server.jetflow_args(str(prepared["head"]), budget),
        env={BUDGET_ENV: "static", "JETFLOW_LOOKUP": "1" if lookup else "0"},
    )  # fmt: skip
    try:
        first_out = _post_all(server.url, firsts)
        seconds = [(_second_turn(tok, ids, out["output_ids"], message, chat), limit)
                   for (ids, _), out, (_, chat, _, message, limit) in zip(firsts, first_out, CONVERSATIONS)]  # fmt: skip
        second_out = _post_all(server.url, seconds)
    finally:
        server.stop()
    engine = ReferenceEngine(target, HeadProposer(head), budget=budget, lookup=lookup)
    deep_rounds = 0
    for turn, ((ids, limit), out) in enumerate(zip(firsts + seconds, first_out + second_out)):
        local = engine.generate(ids, limit)
        meta = out["meta_info"]
        what = (f"budget {budget} lookup {lookup} turn {turn // len(firsts) + 1} conversation {turn % len(firsts)}: "
                f"reference accept lengths {local.accept_lengths}")  # fmt: skip
        assert out["output_ids"] == local.tokens, what
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (local.rounds, sum(local.accept_lengths)), what
        assert meta["spec_correct_drafts_histogram"] == _histogram(local.accept_lengths), what
        deep_rounds += sum(a >= 2 for a in local.accept_lengths)
    for (ids, _), out, second in zip(firsts, first_out, second_out):
        # The second turn read the first answer from the cache, not only the first prompt: KV
        # that verify rounds wrote (all but the last committed token, whose KV no forward wrote).
        cached = second["meta_info"]["cached_tokens"]
        assert cached >= len(ids) + len(out["output_ids"]) - 1, (cached, len(ids), len(out["output_ids"]))
    assert deep_rounds >= 3, "too few multi-token commits to exercise KV compaction"
