"""`jetflow bench` and `make demo`: prompts through two real SGLang servers, via the OpenAI client
(a configuration of `jetflow_sglang.harness`).

Two servers run side by side on 127.0.0.1: the target alone, and the target with
``--speculative-algorithm JETFLOW`` (its tree budget adaptive under the cap ``--budget``, the
default; static with ``--no-adaptive``). Requests go one at a time and alternate between
the servers (prompt 1 plain, prompt 1 JETFLOW, prompt 2 plain, ...), so both see the
same machine state; only one server is ever busy. Chat prompts go to
``/v1/chat/completions``, code prompts to ``/v1/completions``. Per request: the
answer, tokens/s, and tau = 1 + accepted drafts / verify rounds (SGLang's
``spec_tokens_details``). The JETFLOW server runs with ``JETFLOW_PROFILE=1`` and
the last profile line of its log gives the share of a decode round per phase.

Both servers run in bf16 where its matmuls are native (``--dtype auto``). There a tree verify
and a one-token decode step can round a near-tie differently, so an answer may differ from the
target-alone server's. Every answer's token ids come back with it; after the timed runs each
difference is re-checked on the target-alone server and labelled by cause (`jetflow_sglang.explain`):
a near-tie (the gap printed), or numerics the target reproduces alone (e.g. with its prompt cached).
A difference with no cause is reported loudly, and `jetflow bench` exits 1. In float32, the exact
check, the answers must be identical token for token.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.explain import EXACT_CHECK, NEAR_TIE, NEAR_TIE_GAP, REPRODUCED
from jetflow_sglang.harness import PROFILE, Fleet, Variant, bench_prompts, work_dir, write_json
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV


@dataclass(frozen=True)
class BenchConfig:
    target: str = "default"
    head: str = "default"
    prompts: str = "humaneval"  # demo | humaneval | sharegpt-heldout | FILE
    limit: Optional[int] = 8
    budget: int = 64  # the cap of the adaptive tree budget, or every round's size (adaptive False)
    adaptive: bool = True  # False: JETFLOW_BUDGET=static
    max_new_tokens: int = 256
    ignore_eos: bool = False
    lookup: bool = True  # the JETFLOW server merges prompt-lookup continuations into its trees
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 where native)
    show_text: bool = False
    out: Optional[str] = None  # JSON report path


def explain_difference(url: str, ar: dict, spec: dict, tokenizer, exact: bool, ignore_eos: bool) -> dict:
    """A row's ``difference``: where the two answers (`harness.request`) first part, each one's token
    there, the target-alone server's re-checks at that position (`explain.recheck`) and their
    verdict (`explain.label`); ``explained`` is False when no cause was found, and always in
    float32 (`exact`), where any difference is an error."""
    from jetflow_sglang import explain

    position = explain.first_difference(ar["ids"], spec["ids"])
    if position is None:  # the same ids and a different text (not expected): nothing to re-check
        target_token = jetflow_token = None
        probes, verdict = [], explain.Verdict([], None, None, [])
    else:
        target_token = explain.token_at(ar["ids"], position, ar["stop"])
        jetflow_token = explain.token_at(spec["ids"], position, spec["stop"])
        probes = explain.recheck(url, ar["prompt_ids"], ar["ids"][:position], ignore_eos)
        verdict = explain.label(jetflow_token, probes)
    text = lambda token: "<end>" if token is None else tokenizer.decode([token])  # noqa: E731
    return {
        "position": position,
        "target_token": target_token,
        "jetflow_token": jetflow_token,
        "target_text": text(target_token),
        "jetflow_text": text(jetflow_token),
        "probes": [asdict(p) for p in probes],
        **asdict(verdict),
        "exact": exact,
        "explained": bool(verdict.causes) and not exact,
        "prompt_ids": ar["prompt_ids"],
        "target_ids": ar["ids"],
        "jetflow_ids": spec["ids"],
    }


def run_bench(config: BenchConfig, echo: Callable[[str], None] = print) -> dict:
    """Start both servers, run every prompt on each (interleaved), stop them; returns the report."""
    from jetflow_sglang.harness import resolve
    from jetflow_sglang.reference.target import serving_dtype
    from jetflow_sglang.tree import budget_error

    if (error := budget_error(config.budget)) is not None:
        raise JetFlowError(error)
    prompts = bench_prompts(config.prompts, config.limit)
    if not prompts:
        raise JetFlowError(f"no prompts in {config.prompts!r}")
    target, head_dir = resolve(config.target, config.head)
    dtype = serving_dtype(config.dtype)
    work = work_dir("bench")
    policy = f"adaptive tree budget, cap {config.budget}" if config.adaptive else f"static tree budget {config.budget}"
    echo(f"starting two SGLang servers on 127.0.0.1, {dtype}; JETFLOW's {policy} (logs in {work}) ...")
    env = {**PROFILE, LOOKUP_ENV: "1" if config.lookup else "0", BUDGET_ENV: "adaptive" if config.adaptive else "static"}
    options = {"max_new_tokens": config.max_new_tokens, "ignore_eos": config.ignore_eos}
    rows, timed = [], []
    with Fleet(target, work, dtype) as fleet:
        try:
            fleet.start(Variant("ar"), work / "ar.log")
            fleet.start(Variant.jetflow("jetflow", head_dir, config.budget, env=env), work / "jetflow.log")
        except RuntimeError as exc:
            raise JetFlowError(f"{str(exc).splitlines()[0]} (server logs in {work})") from None
        fleet.warm_up()
        for number, prompt in enumerate(prompts, 1):
            ar, spec = (fleet.request(name, prompt, **options) for name in ("ar", "jetflow"))
            row = {
                "id": prompt.id,
                "kind": prompt.kind,
                "tokens": spec["tokens"],
                "ar_tokens_per_s": ar["tokens_per_s"],
                "jetflow_tokens_per_s": spec["tokens_per_s"],
                "speedup": round(spec["tokens_per_s"] / ar["tokens_per_s"], 3),
                "tau": spec["tau"],
                "identical": spec["ids"] == ar["ids"] and spec["text"] == ar["text"],
            }
            rows.append(row)
            timed.append((ar, spec))
            if config.show_text:
                echo(f"\n=== [{number}/{len(prompts)}] {prompt.kind} {prompt.id}: {prompt.text.strip().splitlines()[0][:100]}")
                echo(spec["text"].rstrip())
            echo(
                f"--- [{number}/{len(prompts)}] {spec['tokens']} tokens | no spec {ar['tokens_per_s']:.1f} tok/s | "
                f"JETFLOW {spec['tokens_per_s']:.1f} tok/s | tau {spec['tau']} | identical {row['identical']}"
            )
        differing = [(prompt, row, answers) for prompt, row, answers in zip(prompts, rows, timed) if not row["identical"]]
        if differing:  # after the timed runs: re-checks cost time and flush the target-alone server's cache
            from transformers import AutoTokenizer

            from jetflow_sglang.explain import describe

            tokenizer = AutoTokenizer.from_pretrained(target)
            for prompt, row, (ar, spec) in differing:
                row["difference"] = explain_difference(fleet.servers["ar"].url, ar, spec, tokenizer, dtype == "float32",
                                                       config.ignore_eos)  # fmt: skip
                echo(describe(prompt.id, row["difference"]))
        profile = fleet.profile("jetflow")
    ar_time = sum(r["tokens"] / r["ar_tokens_per_s"] for r in rows)
    spec_time = sum(r["tokens"] / r["jetflow_tokens_per_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    summary = {
        "prompts": len(rows),
        "new_tokens": tokens,
        "ar_tokens_per_s": round(tokens / ar_time, 3),
        "jetflow_tokens_per_s": round(tokens / spec_time, 3),
        "speedup": round(ar_time / spec_time, 3),
        "median_tau": statistics.median(taus) if (taus := [r["tau"] for r in rows if r["tau"] is not None]) else None,
        "all_identical": all(r["identical"] for r in rows),
        "identical_share": round(sum(r["identical"] for r in rows) / len(rows), 3),
        "differing": sum(not r["identical"] for r in rows),
        "differing_by_cause": {cause: sum(cause in r["difference"]["causes"] for r in rows if "difference" in r)
                               for cause in (NEAR_TIE, REPRODUCED)},  # fmt: skip
        "unexplained": sum(not r["difference"]["explained"] for r in rows if "difference" in r),
    }
    report = {"config": {**asdict(config), "dtype": dtype}, "head_dir": head_dir, "summary": summary, "requests": rows,
              "profile": profile}  # fmt: skip
    if config.out:
        write_json(config.out, report)
    return report


def format_table(report: dict) -> str:
    rows = report["requests"]
    lines = [f"{'id':<22} {'kind':<5} {'tokens':>6} {'no-spec tok/s':>13} {'JETFLOW tok/s':>13} {'speedup':>8} {'tau':>6} {'same':>5}"]
    for r in rows:
        lines.append(
            f"{r['id'][:22]:<22} {r['kind']:<5} {r['tokens']:>6} {r['ar_tokens_per_s']:>13.2f} "
            f"{r['jetflow_tokens_per_s']:>13.2f} {r['speedup']:>8.3f} {r['tau'] or 0:>6.2f} {str(r['identical']):>5}"
        )
    s = report["summary"]
    lines.append(
        f"{'all':<22} {'':<5} {s['new_tokens']:>6} {s['ar_tokens_per_s']:>13.2f} {s['jetflow_tokens_per_s']:>13.2f} "
        f"{s['speedup']:>8.3f} {s['median_tau'] or 0:>6.2f} {str(s['all_identical']):>5}"
    )
    differing = [r for r in rows if not r["identical"]]
    if differing:
        gaps = [r["difference"]["gap"] for r in differing]
        by_cause = s["differing_by_cause"]
        lines.append(f"{len(differing)} of {len(rows)} answers differ from the no-spec server's ({report['config']['dtype']}); "
                     f"at a near-tie (JETFLOW's token within {NEAR_TIE_GAP} of the target's top-1 log-prob): {by_cause[NEAR_TIE]}, "
                     f"gaps {gaps}; "
                     f"the target alone reproduces JETFLOW's token: {by_cause[REPRODUCED]}; unexplained: {s['unexplained']}")  # fmt: skip
    profile = report.get("profile")
    if profile:
        shares = ", ".join(f"{k} {100 * v:.0f}% ({profile['ms_per_round'][k]:.1f} ms)" for k, v in profile["share"].items())
        lines.append(f"decode round profile over {profile['rounds']} rounds (N={profile['budget']}): {shares}")
    if report["config"]["dtype"] == "float32":  # this run is the exact check
        verdict = "PASSED" if not differing else f"FAILED: {len(differing)} of {len(rows)} answers differ"
        lines.append(f"exact check (float32): JETFLOW's greedy output equals the target alone's token for token: {verdict}")
    else:
        lines.append(EXACT_CHECK)
    return "\n".join(lines)
