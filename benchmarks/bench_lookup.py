"""The free branch in the SGLang server: JETFLOW with the prompt-lookup continuation merged into
each tree (the default) against JETFLOW with the head alone (JETFLOW_LOOKUP=0) and the target
alone, single requests, greedy.

    .venv/bin/python benchmarks/bench_lookup.py --prompts humaneval --limit 8 --budget 16 \
        --max-new-tokens 128 --out benchmarks/results/lookup_humaneval8_n16.json

Three servers run on 127.0.0.1 (--max-total-tokens 8192); each prompt goes to each server in
turn, one request at a time, so all three see the same machine state. Prints a table (tokens/s,
tau, speedup over the target alone, identical output) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from jetflow_sglang import server as sglang_server
from jetflow_sglang.assets import head_dir_for, resolve_target
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.served import BenchConfig, _request, bench_prompts
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV

VARIANTS = ("ar", "head", "head+lookup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="default", help="default, random, or a head directory")
    parser.add_argument("--prompts", default="humaneval", help="demo, humaneval, sharegpt-heldout, or a JSON/JSONL file")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of the set")
    parser.add_argument("--budget", type=int, default=16, help="tree nodes per round (--speculative-num-draft-tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of all three servers")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()

    config = BenchConfig(head=args.head, prompts=args.prompts, limit=args.limit, budget=args.budget,
                         max_new_tokens=args.max_new_tokens, dtype=args.dtype)  # fmt: skip
    prompts = bench_prompts(config.prompts, config.limit)
    target = resolve_target("default")
    head_dir = str(head_dir_for(config.head, target))
    work = Path(tempfile.mkdtemp(prefix="jetflow-lookup-bench-"))
    spec = sglang_server.jetflow_args(head_dir, config.budget)
    servers = {}
    try:
        servers["ar"] = sglang_server.start(str(target), work / "ar.log", dtype=config.dtype)
        static = {BUDGET_ENV: "static"}  # the drafters compared at one tree size
        servers["head"] = sglang_server.start(str(target), work / "head.log", *spec, dtype=config.dtype, env={LOOKUP_ENV: "0", **static})
        servers["head+lookup"] = sglang_server.start(str(target), work / "lookup.log", *spec, dtype=config.dtype,
                                                     env={LOOKUP_ENV: "1", **static})  # fmt: skip
        from openai import OpenAI

        clients = {name: OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=3600) for name, s in servers.items()}
        model = clients["ar"].models.list().data[0].id
        for client in clients.values():
            _request(client, model, prompts[0], BenchConfig(max_new_tokens=8))  # warm-up
        rows = []
        for prompt in prompts:
            results = {name: _request(clients[name], model, prompt, config) for name in VARIANTS}
            row = {"id": prompt.id, "kind": prompt.kind, "tokens": results["ar"]["tokens"]}
            for name in VARIANTS:
                row[f"{name}_tokens_per_s"] = results[name]["tokens_per_s"]
                if name != "ar":
                    row[f"{name}_tau"] = results[name]["tau"]
                    row[f"{name}_speedup"] = round(results[name]["tokens_per_s"] / results["ar"]["tokens_per_s"], 3)
                    row[f"{name}_identical"] = results[name]["text"] == results["ar"]["text"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()

    summary = {"prompts": len(rows), "new_tokens": sum(r["tokens"] for r in rows)}
    for name in VARIANTS[1:]:
        summary[f"{name}_median_speedup"] = statistics.median(r[f"{name}_speedup"] for r in rows)
        summary[f"{name}_median_tau"] = statistics.median(r[f"{name}_tau"] for r in rows if r[f"{name}_tau"] is not None)
        summary[f"{name}_all_identical"] = all(r[f"{name}_identical"] for r in rows)
    report = {"config": vars(args), "head": Path(head_dir).name, "summary": summary, "requests": rows}
    print(f"\n{'drafter':<12} {'median tau':>10} {'median speedup':>15} {'identical':>10}   "
          f"({summary['prompts']} {args.prompts} prompts, budget {args.budget}, {args.dtype})")  # fmt: skip
    for name in VARIANTS[1:]:
        print(f"{name:<12} {summary[f'{name}_median_tau']:>10.2f} {summary[f'{name}_median_speedup']:>14.3f}x "
              f"{str(summary[f'{name}_all_identical']):>10}")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
