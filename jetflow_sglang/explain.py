"""Why a JETFLOW answer differs from the target alone's: re-checks on the target-alone server.

In bf16 a tree verify and a one-token decode step round differently, so a greedy JETFLOW answer
can part from the target-alone server's. `jetflow bench` labels every such difference by cause,
found by asking the target-alone server again (native ``/generate``, greedy, top log-probs) at the
first differing new token, the *position*, with the *shared prefix* (the tokens both answers
agree on) before it. Each re-check changes the target's numerics without changing its input:

* ``uncached``: the same request after ``/flush_cache``, decoded up to the position;
* ``cached``: the same request again; its prompt now sits in the radix cache, so it is not
  prefilled as it was the first time;
* ``prefix``: prompt + shared prefix sent as one new prompt (the prefix prefilled, not decoded);
* ``prefix-uncached``: the same, after ``/flush_cache``: every token prefilled at once.

A re-check whose own answer leaves the shared prefix before the position says nothing about the
position (its ``parted_at``). The others give the target's own token there and its best
``TOP_LOGPROBS`` tokens with their log-probs. Causes, all that apply:

* ``near-tie``: in a re-check, JETFLOW's token is among the target's best and trails the target's
  top-1 by less than ``NEAR_TIE_GAP`` in log-prob. The *gap* reported is the smallest such lag
  over the re-checks: the target's top-1 minus top-2 log-prob where JETFLOW's token is second (as
  it is at every difference measured), and robust to the order in which a server lists exact ties;
* ``target-reproduces``: in a re-check the target alone answers JETFLOW's token at the position
  itself: numerics the target reproduces by itself (the re-checks that did are named).

No cause: the difference is unexplained, which `jetflow bench` reports loudly and fails on. In
float32 the answers must be identical token for token (`EXACT_CHECK`): there a difference fails
whatever its labels.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional, Sequence

from jetflow_sglang import server as sglang_server

# how far (log-prob = logit gap) JETFLOW's token may trail the target's top-1 for bf16 rounding to
# flip the argmax: bf16 logits of magnitude 16-32 lie 0.125 apart, and measured differing answers
# part at gaps of 0 or 0.125 (tests/data/explain_bf16.json)
NEAR_TIE_GAP = 0.25
TOP_LOGPROBS = 5  # the target's best tokens read at the position, per re-check
NEAR_TIE, REPRODUCED = "near-tie", "target-reproduces"
CHECKS = {
    "uncached": "the same request again, cache flushed",
    "cached": "the same request again, its prompt cached",
    "prefix": "prompt + shared prefix as a new prompt",
    "prefix-uncached": "prompt + shared prefix as a new prompt, cache flushed",
}
EXACT_CHECK = (
    "exact check: `jetflow bench --dtype float32` - there JETFLOW's greedy output equals the target "
    "alone's token for token, and any difference is an error"
)


@dataclass(frozen=True)
class Probe:
    """One re-check of the target alone: the token it answered at the position (`token`; None
    when its answer ended first) and its best tokens there, best first, as (token id, log-prob,
    text). When its own answer left the shared prefix first, at new token `parted_at`, `token` is
    what it answered there and `top` is empty."""

    check: str
    token: Optional[int]
    top: list[tuple[int, float, str]]
    parted_at: Optional[int] = None


@dataclass(frozen=True)
class Verdict:
    """What the probes say about JETFLOW's token at the position: `causes` (`NEAR_TIE`,
    `REPRODUCED`; empty: unexplained); `gap`, the smallest log-prob by which JETFLOW's token
    trails the target's top-1 over the probes that list it (under `gap_check`; None where none
    does); and the probes whose own token there is JETFLOW's (`reproduced_by`)."""

    causes: list[str]
    gap: Optional[float]
    gap_check: Optional[str]
    reproduced_by: list[str]


def first_difference(target: Sequence[int], jetflow: Sequence[int]) -> Optional[int]:
    """The first new-token position where two answers differ: where their ids do, or the shorter
    one's length when it is a strict prefix of the other (it stopped first); None when equal."""
    for position, (a, b) in enumerate(zip(target, jetflow)):
        if a != b:
            return position
    return None if len(target) == len(jetflow) else min(len(target), len(jetflow))


def token_at(ids: Sequence[int], position: int, stop: Optional[int]) -> Optional[int]:
    """An answer's token at `position`: its id, or past its end the stop token it ended on
    (SGLang's ``matched_stop`` when an id; None: it ended otherwise, e.g. at the length cap)."""
    return ids[position] if position < len(ids) else stop


def probe_from_output(check: str, output: dict, expected: Sequence[int]) -> Probe:
    """A `Probe` from a native ``/generate`` answer asked with ``top_logprobs_num``, whose first
    new tokens must be `expected` (the part of the shared prefix the re-check decodes itself; the
    position is the next one)."""
    ids = list(output.get("output_ids") or [])
    tops = output.get("meta_info", {}).get("output_top_logprobs") or []
    parted = first_difference(ids[: len(expected)], expected)
    if parted is not None:
        return Probe(check, ids[parted] if parted < len(ids) else None, [], parted)
    token = ids[len(expected)] if len(ids) > len(expected) else None
    if len(tops) <= len(expected) or not tops[len(expected)]:
        return Probe(check, token, [])
    top = [(int(t[1]), float(t[0]), t[2] if len(t) > 2 and t[2] is not None else "") for t in tops[len(expected)]]
    return Probe(check, token, sorted(top, key=lambda t: -t[1]))


def label(jetflow_token: Optional[int], probes: Sequence[Probe], near_tie_gap: float = NEAR_TIE_GAP) -> Verdict:
    """The causes the probes support for JETFLOW's token at the position (module docstring).
    Probes that parted from the shared prefix before the position are passed over."""
    reproduced_by, gaps = [], []
    for probe in probes:
        if jetflow_token is None or probe.parted_at is not None:
            continue
        if probe.token == jetflow_token:
            reproduced_by.append(probe.check)
        listed = [logprob for token, logprob, _ in probe.top if token == jetflow_token]
        if listed:
            gaps.append((round(probe.top[0][1] - listed[0], 4), probe.check))
    gap, gap_check = min(gaps) if gaps else (None, None)
    causes = ([NEAR_TIE] if gap is not None and gap < near_tie_gap else []) + ([REPRODUCED] if reproduced_by else [])
    return Verdict(causes, gap, gap_check, reproduced_by)


def _generate(url: str, input_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos},
        "return_logprob": True,
        "top_logprobs_num": TOP_LOGPROBS,
        "return_text_in_logprobs": True,
    }
    return sglang_server.post(url + "/generate", body)


def _flush_cache(url: str) -> bool:
    """Empty the radix cache of an idle server; False when it refused (requests running)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=60) as resp:
            return resp.status == 200
    except urllib.error.URLError:
        return False


def recheck(url: str, prompt_ids: list[int], prefix: list[int], ignore_eos: bool = False) -> list[Probe]:
    """Ask the idle target-alone server at `url` for its best tokens after `prompt_ids` + `prefix`
    in the four ways of `CHECKS`: cache flushed, the request (``uncached``); the same again
    (``cached``); the prompt + prefix (``prefix``); cache flushed, the prompt + prefix
    (``prefix-uncached``). Self-contained: the cache state each check needs is made here. Where
    the server refuses to flush (requests running), the checks that need it are left out."""
    probes = []
    if _flush_cache(url):
        probes.append(probe_from_output("uncached", _generate(url, prompt_ids, len(prefix) + 1, ignore_eos), prefix))
    probes.append(probe_from_output("cached", _generate(url, prompt_ids, len(prefix) + 1, ignore_eos), prefix))
    probes.append(probe_from_output("prefix", _generate(url, prompt_ids + prefix, 1, ignore_eos), []))
    if _flush_cache(url):
        probes.append(probe_from_output("prefix-uncached", _generate(url, prompt_ids + prefix, 1, ignore_eos), []))
    return probes


def describe(prompt_id: str, difference: dict, near_tie_gap: float = NEAR_TIE_GAP) -> str:
    """One line on a labelled difference (`jetflow bench`'s row ``difference``): ``---`` when it
    is explained, ``!!!`` and NO CAUSE FOUND (or the float32 exact check FAILED) when not."""
    d = difference
    head = (f"{prompt_id} differs at new token {d['position']}: target alone {d['target_text']!r}, "
            f"JETFLOW {d['jetflow_text']!r}")  # fmt: skip
    lag = (f"JETFLOW's token trails the target's top-1 by {d['gap']:.3f} in log-prob ({CHECKS[d['gap_check']]})"
           if d["gap"] is not None else None)  # fmt: skip
    reasons = []
    if NEAR_TIE in d["causes"]:
        reasons.append(f"near-tie: {lag} < {near_tie_gap}")
    if REPRODUCED in d["causes"]:
        reasons.append(f"the target alone answers {d['jetflow_text']!r} there too: "
                       + "; ".join(CHECKS[c] for c in d["reproduced_by"]))  # fmt: skip
    if d.get("exact"):
        return f"!!! {head}, in float32, the exact check: FAILED" + (f" ({'; '.join(reasons)})" if reasons else "")
    if reasons:
        return f"--- {head} -> " + "; ".join(reasons)
    ran = [CHECKS[p["check"]] for p in d["probes"] if p["parted_at"] is None]
    why = (f"no re-check of the target alone answers JETFLOW's token ({'; '.join(ran) or 'none reached the position'}), "
           + (f"and {lag}, not below {near_tie_gap}" if lag else f"and JETFLOW's token is not among its best {TOP_LOGPROBS}"))  # fmt: skip
    return f"!!! {head} -> NO CAUSE FOUND: {why}"
