"""Sampling as clients send it, on a real SGLang server (fp32, this CPU).

A JETFLOW server at a static budget of 16 (every round verifies a tree; the adaptive default's
sampling is checked in test_sglang_jetflow.py) and a no-spec server (without overlap scheduling,
whose penalizers run one round late: tree_penalties.py). The test oracle drafts every prompt
here, with the target's greedy continuation at random ranks of each depth's top-k, so sampled
tokens that follow the drafts commit multi-token paths.

* The sampler's plain path (temperature without SGLang's joint cut: top-p alone, top-k alone),
  two settings mixed in one batch with greedy requests: the joint law of the first tokens equals
  the one computed from HF transformers' fp32 logits with SGLang's own filter (chi-square), and
  the greedy requests keep the no-spec ids. A temperature applied twice, or not at all, fails.
* A sampled grammar request and a sampled penalized request: the same law as the no-spec
  server's own samples (two-sample chi-square).
* One greedy request with penalties, a regex and a logit bias at once: the token ids and their
  log-probs equal the composition by hand in SGLang's order from HF transformers' logits.
* A custom logit processor on a server that enables them is refused, not silently skipped.
"""

from __future__ import annotations

import json
import urllib.error
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("sglang")

from jetflow_sglang import server as sglang_server  # noqa: E402
from jetflow_sglang.budget import BUDGET_ENV  # noqa: E402

SAMPLES = 192  # per setting
BUDGET = 16
LAW_PROMPT = ("The capital of France is", False)  # a likely first path (trees commit), yet several cells
LAWS = {  # the plain path of node_acceptance: no top-k and top-p together, no min-p
    "T0.7 top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "T1.3 top-k 5": {"temperature": 1.3, "top_k": 5},
}
LAW_TOKENS = 3
COLORS = "(red|green|blue|yellow|black|white)"
OPTION_CASES = {  # name -> (prompt, chat, options, tokens): sampled on both servers
    "regex": ("List three colors.", True, {"regex": f"{COLORS}, {COLORS}, and {COLORS}\\.", "temperature": 1.0}, 5),
    # One penalty: SGLang's scheduler without overlap applies several in the order of a Python set of
    # classes, which differs between processes (the test below fixes the composition by hand).
    "penalized": ("List some fruits: apple, banana,", False, {"temperature": 0.6, "repetition_penalty": 1.4}, 4),
}  # fmt: skip
ALL_AT_ONCE = ("Name the days of the week, separated by commas.", True, 16)  # greedy, with every option below
ALLOWED = "A-Za-z ,."  # its regex's character class
MIN_CHARS = 100  # the regex asks for this many characters first: no EOS within the answer checked
GREEDY_IN_BATCH = [("Say hello in one word.", True, 8), ("def add(a, b):", False, 12)]
# p-value floors. The servers' draws are not seeded (SGLang seeds only under deterministic
# inference), so every run is a fresh draw and a floor is a false-alarm rate per check. Against
# the exact law: 1e-3 (a temperature not applied at T1.3 top-k 5 puts the expected p near 1e-4
# at 192 draws; doubled, below 1e-27). Two samples, JETFLOW's against the no-spec server's:
# 1e-4. The regex case drew p = 0.00098 once in CI; 1000 draws a side gave p = 0.42.
LAW_P_MIN, TWO_SAMPLE_P_MIN = 1e-3, 1e-4


def _encode(tok, text: str, chat: bool) -> list[int]:
    if chat:
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False))
    return tok(text).input_ids


def _generate(url: str, ids: list[int], params: dict, **extra) -> dict:
    return sglang_server.post(url + "/generate", {"input_ids": ids, "sampling_params": params, **extra})


def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda body: sglang_server.post(url + "/generate", body), bodies))


def _all_at_once_options(tok) -> dict:
    """Repetition, frequency and presence penalties, a regex, and a logit bias on the comma the
    answer repeats (the bias and the repetition penalty do not commute)."""
    return {"repetition_penalty": 1.3, "frequency_penalty": 0.2, "presence_penalty": 0.1,
            "regex": f"[{ALLOWED}]{{{MIN_CHARS},400}}", "logit_bias": {str(tok.convert_tokens_to_ids(",")): 3.0}}  # fmt: skip


def _by_hand(model, tok, ids: list[int], options: dict, tokens: int, bias_first: bool = False) -> tuple[list[int], list[float]]:
    """Greedy ids and log-probs with `_all_at_once_options` composed in SGLang's order at every step,
    from HF transformers' fp32 logits: the additive penalties (frequency, presence) and then the
    scaling one (repetition), each over the tokens generated so far; the regex's mask (tokens
    made only of its characters; no EOS before MIN_CHARS characters); then the logit bias.
    `bias_first`: the bias before the penalties instead, a wrong order."""
    vocab = model.config.vocab_size
    texts = [tok.decode([i]) for i in range(vocab)]
    allowed = torch.tensor([bool(t) and all(c.isascii() and (c.isalpha() or c in " ,.") for c in t) for t in texts])
    bias = torch.zeros(vocab)
    for token, value in options["logit_bias"].items():
        bias[int(token)] += value
    out, logprobs = [], []
    for _ in range(tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
        if bias_first:
            logits = logits + bias
        logits = logits - options["frequency_penalty"] * counts - options["presence_penalty"] * (counts > 0)
        penalty = options["repetition_penalty"]
        logits = torch.where(counts > 0, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        logits = logits.masked_fill(~allowed, float("-inf"))
        if not bias_first:
            logits = logits + bias
        row = logits.log_softmax(-1)
        out.append(int(row.argmax()))
        logprobs.append(float(row[out[-1]]))
    assert len(tok.decode(out)) < MIN_CHARS, "the answer checked reached the regex's minimum: EOS would be allowed"
    return out, logprobs


@pytest.fixture(scope="module")
def hf_model(prepared):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(prepared["target"]), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def setup(prepared, hf_model, tmp_path_factory) -> dict:
    """The no-spec server's answers and samples, the oracle file, then the JETFLOW server."""
    from transformers import AutoTokenizer

    target_dir, head_dir = str(prepared["target"]), str(prepared["head"])
    tok = AutoTokenizer.from_pretrained(target_dir)
    work = tmp_path_factory.mktemp("sampling")
    law_ids = _encode(tok, *LAW_PROMPT)
    options = {name: (_encode(tok, text, chat), opts, tokens) for name, (text, chat, opts, tokens) in OPTION_CASES.items()}
    all_ids = _encode(tok, *ALL_AT_ONCE[:2])
    greedy = [(_encode(tok, text, chat), n) for text, chat, n in GREEDY_IN_BATCH]
    plain = sglang_server.start(target_dir, work / "nospec.log", "--disable-overlap-schedule")
    try:
        oracle = [(law_ids, {"temperature": 0}), *((ids, {k: v for k, v in opts.items() if k != "temperature"}) for ids, opts, _ in options.values())]
        long = [_generate(plain.url, ids, {**opts, "temperature": 0, "max_new_tokens": 40, "ignore_eos": True}) for ids, opts in oracle]
        greedy_want = [_generate(plain.url, ids, {"temperature": 0, "max_new_tokens": n})["output_ids"] for ids, n in greedy]
        oracle += [(ids, {}) for ids, _ in greedy]
        long += [_generate(plain.url, ids, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}) for ids, _ in greedy]
        plain_samples = {
            name: [o["output_ids"] for o in _post_all(plain.url, [{"input_ids": ids, "sampling_params": {**opts, "max_new_tokens": tokens}}] * SAMPLES)]
            for name, (ids, opts, tokens) in options.items()
        }  # fmt: skip
    finally:
        plain.stop()
    all_options = _all_at_once_options(tok)
    all_at_once = _by_hand(hf_model, tok, all_ids, all_options, ALL_AT_ONCE[2])
    oracle_file = work / "oracle.json"
    pairs = [[ids, o["output_ids"]] for (ids, _), o in zip(oracle, long)] + [[all_ids, all_at_once[0]]]
    oracle_file.write_text(json.dumps(pairs))
    server = sglang_server.start(
        target_dir, work / "jetflow.log", *sglang_server.jetflow_args(head_dir, BUDGET), "--enable-custom-logit-processor",
        env={"JETFLOW_TEST_ORACLE": str(oracle_file), BUDGET_ENV: "static"},
    )  # fmt: skip
    try:
        yield {"url": server.url, "tok": tok, "law_ids": law_ids, "options": options, "greedy": greedy,
               "greedy_want": greedy_want, "plain_samples": plain_samples, "all_ids": all_ids, "all_options": all_options,
               "all_at_once": all_at_once}  # fmt: skip
    finally:
        server.stop()


# ------------------------------------------------------------------ laws
def _filtered(logits: torch.Tensor, params: dict) -> torch.Tensor:
    """[rows, V] logits -> the probabilities SGLang's sampler draws from: divide by the
    temperature, softmax, then its own top-k / top-p / min-p filter, renormalized."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    rows = logits.shape[0]
    probs = (logits / params["temperature"]).softmax(-1)
    min_p = params.get("min_p", 0.0)
    _, kept, index, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs, torch.full((rows,), params.get("top_k", TOP_K_ALL)), torch.full((rows,), params.get("top_p", 1.0)),
        torch.full((rows,), min_p), need_min_p_sampling=min_p > 0, sampling_seed=None,
        positions=torch.zeros(rows, dtype=torch.long), return_filtered_probs=True,
    )  # fmt: skip
    return torch.zeros_like(probs).scatter_(-1, index, kept / kept.sum(-1, keepdim=True))


class Law:
    """The target's law over the first `tokens` new tokens under `params` (HF transformers, fp32),
    a sequence ending early where it draws EOS."""

    def __init__(self, model, ids: list[int], params: dict, tokens: int, eos: int) -> None:
        self.model, self.ids, self.params, self.tokens, self.eos = model, ids, params, tokens, eos

    @torch.no_grad()
    def _rows(self, seqs: list[tuple[int, ...]], start: int) -> torch.Tensor:
        """Filtered next-token probabilities after each prefix of equal-length `seqs`, from `start` on."""
        logits = self.model(torch.tensor([self.ids + list(s) for s in seqs])).logits.float()
        return _filtered(logits[:, len(self.ids) - 1 + start :].flatten(0, 1), self.params).view(len(seqs), -1, logits.shape[-1])

    def common(self, min_prob: float) -> dict[tuple[int, ...], float]:
        """Every sequence of probability >= min_prob (each of its prefixes is at least as likely)."""
        level, done = {(): 1.0}, {}
        for _ in range(self.tokens):
            prefixes = list(level)
            rows = self._rows(prefixes, len(prefixes[0]))[:, -1]
            grown = {}
            for prefix, row in zip(prefixes, rows):
                joint = row * level[prefix]
                for token in (joint >= min_prob).nonzero().flatten().tolist():
                    (done if token == self.eos else grown)[prefix + (token,)] = float(joint[token])
            level = grown
            if not level:
                break
        return {**done, **level}

    def probability(self, seq: tuple[int, ...]) -> float:
        rows = self._rows([seq[:-1]], 0)[0] if len(seq) > 1 else self._rows([()], 0)[0]
        return float(torch.stack([rows[k, token] for k, token in enumerate(seq)]).prod())


def _fits_law(law: Law, samples: list[list[int]]) -> tuple[float, list, list]:
    """Chi-square of the samples against the law: one cell per sequence expected >= 5 times, one
    for the rest. Asserts every sample lies inside the law's support."""
    from scipy.stats import chisquare

    n = len(samples)
    counts = Counter(tuple(s) for s in samples)
    common = law.common(5 / n)
    outside = [s for s in counts if s not in common and law.probability(s) == 0.0]
    assert not outside, f"continuations outside the filtered support: {outside}"
    cells = sorted(common, key=common.get, reverse=True)
    observed = [counts[c] for c in cells] + [n - sum(counts[c] for c in cells)]
    expected = [common[c] * n for c in cells] + [n * max(0.0, 1 - sum(common.values()))]
    if expected[-1] < 1e-6:
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]  # rounding of the rest cell
    return float(chisquare(observed, expected).pvalue), observed, [round(e, 1) for e in expected]


def _same_law(a: list[list[int]], b: list[list[int]]) -> tuple[float, list]:
    """Two-sample chi-square: one cell per sequence seen >= 10 times in both samples together,
    one for the rest."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(map(tuple, a)), Counter(map(tuple, b))
    cells = sorted((s for s in ca | cb if ca[s] + cb[s] >= 10), key=lambda s: -(ca[s] + cb[s]))
    table = [[c[s] for s in cells] + [len(x) - sum(c[s] for s in cells)] for c, x in ((ca, a), (cb, b))]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 3, f"too few cells to compare: {table}"
    return float(chi2_contingency(table).pvalue), table


def _accepted(outputs: list[dict]) -> int:
    return sum(o["meta_info"]["spec_num_correct_drafts"] for o in outputs)


# ------------------------------------------------------------------ tests
@pytest.mark.slow
def test_plain_path_settings_mixed_in_one_batch_follow_the_target_law(setup, hf_model):
    """Temperature 0.7 with top-p 0.9 and temperature 1.3 with top-k 5, interleaved in the same
    batches with greedy requests: each setting's first tokens follow its own law, and the greedy
    requests return the no-spec ids."""
    bodies = [{"input_ids": setup["law_ids"], "sampling_params": {**params, "max_new_tokens": LAW_TOKENS}, "law": name}
              for _ in range(SAMPLES) for name, params in LAWS.items()]  # fmt: skip
    for k, (ids, n) in enumerate(setup["greedy"]):
        bodies.insert((2 * k + 1) * len(bodies) // 4, {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    outputs = _post_all(setup["url"], [{k: v for k, v in b.items() if k != "law"} for b in bodies])
    greedy = [o for b, o in zip(bodies, outputs) if "law" not in b]
    assert [o["output_ids"] for o in greedy] == setup["greedy_want"]
    eos = hf_model.generation_config.eos_token_id
    for name, params in LAWS.items():
        sampled = [o for b, o in zip(bodies, outputs) if b.get("law") == name]
        law = Law(hf_model, setup["law_ids"], params, LAW_TOKENS, eos[0] if isinstance(eos, list) else eos)
        p_value, observed, expected = _fits_law(law, [o["output_ids"] for o in sampled])
        accepted = _accepted(sampled)
        print(f"{name}: observed {observed} expected {expected} p={p_value:.3g}, drafts accepted {accepted} over {SAMPLES}")
        assert p_value > LAW_P_MIN, (name, observed, expected, p_value)
        assert accepted >= SAMPLES // 4, (name, accepted)  # sampled tokens committed inside trees


@pytest.mark.slow
def test_sampled_grammar_and_penalized_requests_follow_the_no_spec_server(setup):
    """A sampled regex request and a sampled penalized request (frequency, presence, repetition):
    the JETFLOW server's samples and the no-spec server's come from the same law."""
    for name, (ids, opts, tokens) in setup["options"].items():
        got = _post_all(setup["url"], [{"input_ids": ids, "sampling_params": {**opts, "max_new_tokens": tokens}}] * SAMPLES)
        p_value, table = _same_law([o["output_ids"] for o in got], setup["plain_samples"][name])
        accepted = _accepted(got)
        print(f"{name}: JETFLOW / no-spec counts {table} p={p_value:.3g}, drafts accepted {accepted} over {SAMPLES}")
        assert p_value > TWO_SAMPLE_P_MIN, (name, table, p_value)
        assert accepted >= SAMPLES // 4, (name, accepted)


@pytest.mark.slow
def test_penalties_grammar_and_bias_at_once_follow_sglangs_order(setup, hf_model):
    """One greedy request carrying repetition, frequency and presence penalties, a regex and a
    logit bias on a repeated token: its ids and output log-probs equal the composition by hand in
    SGLang's order (penalties, grammar mask, bias) at every node, and trees committed several
    tokens a round for it. The wrong order (the bias before the repetition penalty) gives other
    log-probs for this request, so the check can tell them apart. (Not against a no-spec server:
    without overlap, SGLang applies additive and scaling penalties in an order that differs
    between processes.)"""
    want_ids, want_lp = setup["all_at_once"]
    got = _generate(setup["url"], setup["all_ids"], {"temperature": 0, "max_new_tokens": ALL_AT_ONCE[2], **setup["all_options"]},
                    return_logprob=True)  # fmt: skip
    assert got["output_ids"] == want_ids, (setup["tok"].decode(got["output_ids"]), setup["tok"].decode(want_ids))
    got_lp = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
    assert len(got_lp) == len(want_lp)
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-3, (got_lp, want_lp)
    wrong_ids, wrong_lp = _by_hand(hf_model, setup["tok"], setup["all_ids"], setup["all_options"], ALL_AT_ONCE[2], bias_first=True)
    assert wrong_ids != want_ids or max(abs(a - b) for a, b in zip(wrong_lp, want_lp)) > 10 * 1e-3
    meta = got["meta_info"]
    assert meta["spec_num_correct_drafts"] >= meta["spec_verify_ct"], meta  # over 2 tokens a round on average


@pytest.mark.slow
def test_custom_logit_processor_is_refused_where_the_server_enables_them(setup):
    """The tree walk does not run custom logit processors: a request with one gets a 400 that says
    so, even on a server started with --enable-custom-logit-processor; the server keeps serving."""
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    ids, n = setup["greedy"][0]
    body = {"input_ids": ids, "custom_logit_processor": DisallowedTokensLogitsProcessor.to_str(),
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "custom_params": {"token_ids": [setup["greedy_want"][0][0]]}}}  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        sglang_server.post(setup["url"] + "/generate", body)
    assert "custom logit processors" in info.value.read().decode()
    assert _generate(setup["url"], ids, {"temperature": 0, "max_new_tokens": n})["output_ids"] == setup["greedy_want"][0]
