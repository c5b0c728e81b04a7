"""`jetflow bench` and `make demo`: prompts through two real SGLang servers, via the OpenAI client.

Two servers run side by side on 127.0.0.1: the target alone, and the target with
``--speculative-algorithm JETFLOW``. Requests go one at a time and alternate between
the servers (prompt 1 plain, prompt 1 JETFLOW, prompt 2 plain, ...), so both see the
same machine state; only one server is ever busy. Chat prompts go to
``/v1/chat/completions``, code prompts to ``/v1/completions``. Per request: the
answer, tokens/s, and tau = 1 + accepted drafts / verify rounds (SGLang's
``spec_tokens_details``). The JETFLOW server runs with ``JETFLOW_PROFILE=1`` and
the last profile line of its log gives the share of a decode round per phase.

Both servers run in bf16 where its matmuls are native (``--dtype auto``). There a tree verify
and a one-token decode step can round a near-tie differently, so an answer may differ from the
no-spec server's: for each such prompt, both servers answer again with log-probs, and the
report gives the first differing position and the no-spec server's top-1 minus top-2 log-prob
there (a near-tie below ``NEAR_TIE_GAP``). In fp32 the answers are identical.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from jetflow_sglang import server as sglang_server
from jetflow_sglang.training.data import Prompt, humaneval_prompts, load_prompts, sharegpt_prompts
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV

DEMO_SHAREGPT, DEMO_HUMANEVAL, DEMO_MAX_CHARS = 3, 3, 400
PROFILE_MARK = "JETFLOW profile "
# top-1 minus top-2 log-prob (= logit gap) below which bf16 rounding may flip the argmax: bf16
# logits of magnitude 16-32 lie 0.125 apart, and measured differing answers part at gaps of 0 or 0.125
NEAR_TIE_GAP = 0.25


@dataclass(frozen=True)
class BenchConfig:
    target: str = "default"
    head: str = "default"
    prompts: str = "humaneval"  # demo | humaneval | sharegpt-heldout | FILE
    limit: Optional[int] = 8
    budget: int = 64
    max_new_tokens: int = 256
    ignore_eos: bool = False
    lookup: bool = True  # the JETFLOW server merges prompt-lookup continuations into its trees
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 where native)
    show_text: bool = False
    out: Optional[str] = None  # JSON report path


def demo_prompts() -> list[Prompt]:
    """A few short held-out ShareGPT questions and the first HumanEval tasks."""
    chat = [p for p in sharegpt_prompts("heldout") if len(p.text) <= DEMO_MAX_CHARS][:DEMO_SHAREGPT]
    return chat + humaneval_prompts()[:DEMO_HUMANEVAL]


def bench_prompts(spec: str, limit: Optional[int]) -> list[Prompt]:
    prompts = demo_prompts() if spec == "demo" else load_prompts(spec)
    return prompts[:limit] if limit else prompts


def _request(client, model: str, prompt: Prompt, config: BenchConfig) -> dict:
    extra = {"ignore_eos": config.ignore_eos, "return_spec_tokens_details": True}
    t0 = time.perf_counter()
    if prompt.kind == "chat":
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt.text}],
            temperature=0, max_tokens=config.max_new_tokens, extra_body=extra,
        )  # fmt: skip
        text = response.choices[0].message.content or ""
    else:
        response = client.completions.create(
            model=model, prompt=prompt.text, temperature=0, max_tokens=config.max_new_tokens, extra_body=extra
        )
        text = response.choices[0].text
    seconds = time.perf_counter() - t0
    tokens = response.usage.completion_tokens
    details = ((response.model_extra or {}).get("sglext") or {}).get("spec_tokens_details") or {}
    verify = details.get("spec_verify_ct") or 0
    return {
        "text": text,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 3),
        "tau": round(1 + details.get("spec_num_correct_drafts", 0) / verify, 3) if verify else None,
    }


def _token_logprobs(client, model: str, prompt: Prompt, config: BenchConfig, top: int) -> list[tuple[str, list[float]]]:
    """The answer again, as (token, its position's top-`top` log-probs, best first) per new token
    (top 0: the tokens alone, which is all a JETFLOW server returns)."""
    common = dict(model=model, temperature=0, max_tokens=config.max_new_tokens, extra_body={"ignore_eos": config.ignore_eos})
    if prompt.kind == "chat":
        response = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt.text}], logprobs=True, **({"top_logprobs": top} if top else {}), **common
        )
        content = response.choices[0].logprobs.content or []
        return [(c.token, sorted((t.logprob for t in c.top_logprobs or ()), reverse=True)) for c in content]
    response = client.completions.create(prompt=prompt.text, logprobs=top, **common)
    logprobs = response.choices[0].logprobs
    tops = logprobs.top_logprobs or [None] * len(logprobs.tokens)
    return [(token, sorted((alts or {}).values(), reverse=True)) for token, alts in zip(logprobs.tokens, tops)]


def first_divergence(plain: list[tuple[str, list[float]]], spec: list[tuple[str, list[float]]]) -> dict:
    """Where two answers (`_token_logprobs`) first differ, and the no-spec server's margin there:
    top-1 minus top-2 log-prob; a near-tie when below `NEAR_TIE_GAP`. Position None: the
    answers agree (or one is a prefix of the other: an earlier stop)."""
    for position, ((token, top), (other, _)) in enumerate(zip(plain, spec)):
        if token != other:
            gap = top[0] - top[1] if len(top) > 1 else None
            return {"position": position, "gap": None if gap is None else round(gap, 4),
                    "near_tie": gap is not None and gap < NEAR_TIE_GAP}  # fmt: skip
    return {"position": None, "gap": None, "near_tie": False}


def last_profile(log: Path) -> Optional[dict]:
    lines = [line for line in log.read_text(errors="replace").splitlines() if PROFILE_MARK in line]
    return json.loads(lines[-1].split(PROFILE_MARK, 1)[1]) if lines else None


def run_bench(config: BenchConfig, echo=print) -> dict:
    """Start both servers, run every prompt on each (interleaved), stop them; returns the report."""
    from openai import OpenAI

    from jetflow_sglang.assets import head_dir_for, resolve_target
    from jetflow_sglang.target import serving_dtype
    from jetflow_sglang.tree import MAX_BUDGET

    if not 1 <= config.budget <= MAX_BUDGET:
        raise JetFlowError(f"budget must be between 1 and {MAX_BUDGET}, got {config.budget}")
    prompts = bench_prompts(config.prompts, config.limit)
    if not prompts:
        raise JetFlowError(f"no prompts in {config.prompts!r}")
    target = resolve_target(config.target)
    head_dir = str(head_dir_for(config.head, target))
    dtype = serving_dtype(config.dtype)
    work = Path(tempfile.mkdtemp(prefix="jetflow-bench-"))
    logs = {"ar": work / "ar.log", "jetflow": work / "jetflow.log"}
    echo(f"starting two SGLang servers on 127.0.0.1, {dtype} (logs in {work}) ...")
    servers = {}
    try:
        try:
            servers["ar"] = sglang_server.start(str(target), logs["ar"], dtype=dtype)
            servers["jetflow"] = sglang_server.start(
                str(target), logs["jetflow"], *sglang_server.jetflow_args(head_dir, config.budget),
                dtype=dtype, env={"JETFLOW_PROFILE": "1", LOOKUP_ENV: "1" if config.lookup else "0"},
            )  # fmt: skip
        except RuntimeError as exc:
            raise JetFlowError(f"{str(exc).splitlines()[0]} (server logs in {work})") from None
        clients = {name: OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=3600) for name, s in servers.items()}
        model = clients["ar"].models.list().data[0].id
        warmup = Prompt(id="warmup", text="Hi", kind="chat")
        for client in clients.values():
            _request(client, model, warmup, BenchConfig(max_new_tokens=8))
        rows = []
        for number, prompt in enumerate(prompts, 1):
            ar = _request(clients["ar"], model, prompt, config)
            spec = _request(clients["jetflow"], model, prompt, config)
            row = {
                "id": prompt.id,
                "kind": prompt.kind,
                "tokens": spec["tokens"],
                "ar_tokens_per_s": ar["tokens_per_s"],
                "jetflow_tokens_per_s": spec["tokens_per_s"],
                "speedup": round(spec["tokens_per_s"] / ar["tokens_per_s"], 3),
                "tau": spec["tau"],
                "identical": spec["text"] == ar["text"],
            }
            rows.append(row)
            if config.show_text:
                echo(f"\n=== [{number}/{len(prompts)}] {prompt.kind} {prompt.id}: {prompt.text.strip().splitlines()[0][:100]}")
                echo(spec["text"].rstrip())
            echo(
                f"--- [{number}/{len(prompts)}] {spec['tokens']} tokens | no spec {ar['tokens_per_s']:.1f} tok/s | "
                f"JETFLOW {spec['tokens_per_s']:.1f} tok/s | tau {spec['tau']} | identical {row['identical']}"
            )
        for prompt, row in zip(prompts, rows):  # after the timed runs: log-probs cost time
            if not row["identical"]:
                row["divergence"] = first_divergence(_token_logprobs(clients["ar"], model, prompt, config, 2),
                                                     _token_logprobs(clients["jetflow"], model, prompt, config, 0))  # fmt: skip
                echo(f"--- {prompt.id} differs: {row['divergence']}")
    finally:
        for server in servers.values():
            server.stop()
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
        "differing_at_near_tie": sum(r.get("divergence", {}).get("near_tie", False) for r in rows),
    }
    report = {"config": {**asdict(config), "dtype": dtype}, "head_dir": head_dir, "summary": summary, "requests": rows,
              "profile": last_profile(logs["jetflow"])}  # fmt: skip
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(json.dumps(report, indent=2))
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
        lines.append(f"{len(differing)} of {len(rows)} answers differ from the no-spec server's ({report['config']['dtype']}); "
                     f"first difference at a near-tie (top-1 minus top-2 log-prob < {NEAR_TIE_GAP}): "
                     f"{s['differing_at_near_tie']}; gaps: {[r.get('divergence', {}).get('gap') for r in differing]}")
    profile = report.get("profile")
    if profile:
        shares = ", ".join(f"{k} {100 * v:.0f}% ({profile['ms_per_round'][k]:.1f} ms)" for k, v in profile["share"].items())
        lines.append(f"decode round profile over {profile['rounds']} rounds (N={profile['budget']}): {shares}")
    return "\n".join(lines)
