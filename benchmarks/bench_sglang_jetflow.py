"""Single-request greedy tokens/s of the SGLang server with and without JETFLOW, per-request tau,
and (JETFLOW_PROFILE=1) the share of a decode round in draft / tree / verify / bookkeeping.

    .venv/bin/python benchmarks/bench_sglang_jetflow.py --budget 64 --max-new-tokens 128

Starts each server on 127.0.0.1 (fp32, --max-total-tokens 8192), one at a time, and
stops it by process group. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import sglang_server  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


def _run(url: str, ids: list[list[int]], max_new_tokens: int) -> list[dict]:
    out = []
    for prompt in ids:
        t0 = time.perf_counter()
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
        result = sglang_server.post(url + "/generate", body)
        result["seconds"] = time.perf_counter() - t0
        out.append(result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--head", default=None, help="head directory (default: jetflow prepare's head)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from jetflow_sglang.assets import prepare

    assets = prepare("default")
    target, head = assets["target"], args.head or assets["head"]
    tok = AutoTokenizer.from_pretrained(target)
    ids = [
        list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in PROMPTS
    ]
    work = Path(tempfile.mkdtemp(prefix="jetflow-bench-"))
    report: dict = {"budget": args.budget, "max_new_tokens": args.max_new_tokens, "head": head}
    for name, extra, env in (
        ("ar", (), {}),
        (
            "jetflow",
            ("--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path", head,
             "--speculative-num-draft-tokens", str(args.budget)),
            {"JETFLOW_PROFILE": "1"},
        ),
    ):  # fmt: skip
        server = sglang_server.start(target, work / f"{name}.log", *extra, env=env)
        try:
            _run(server.url, ids[:1], 8)  # warm up
            results = _run(server.url, ids, args.max_new_tokens)
        finally:
            server.stop()
        tokens = sum(len(r["output_ids"]) for r in results)
        report[f"{name}_tokens_per_s"] = round(tokens / sum(r["seconds"] for r in results), 2)
        report[f"{name}_output_ids"] = [r["output_ids"] for r in results]
        if name == "jetflow":
            metas = [r["meta_info"] for r in results]
            report["tau"] = [round(1 + m["spec_num_correct_drafts"] / m["spec_verify_ct"], 3) for m in metas]
            profiles = re.findall(r"JETFLOW profile over .*", (work / f"{name}.log").read_text())
            report["profile"] = profiles[-1] if profiles else None
    report["identical"] = report.pop("ar_output_ids") == report.pop("jetflow_output_ids")
    report["speedup"] = round(report["jetflow_tokens_per_s"] / report["ar_tokens_per_s"], 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
