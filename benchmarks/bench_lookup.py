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
from pathlib import Path

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.harness import Column, Fleet, Variant
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV

VARIANTS = ("ar", "head", "head+lookup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_args(parser, head="default", prompts="humaneval", limit=8, budget=16, max_new_tokens=128, dtype="float32",
                     out=None)  # fmt: skip
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)

    prompts = harness.bench_prompts(args.prompts, args.limit)
    target, head_dir = harness.resolve("default", args.head)
    work = harness.work_dir("lookup-bench")
    static = {BUDGET_ENV: "static"}  # the drafters compared at one tree size
    rows = []
    with Fleet(target, work, args.dtype) as fleet:
        fleet.start(Variant("ar"), work / "ar.log")
        fleet.start(Variant.jetflow("head", head_dir, args.budget, env={LOOKUP_ENV: "0", **static}), work / "head.log")
        fleet.start(Variant.jetflow("head+lookup", head_dir, args.budget, env={LOOKUP_ENV: "1", **static}), work / "lookup.log")
        fleet.warm_up(prompts[0])
        for prompt in prompts:  # each prompt to each server in turn
            results = {name: fleet.request(name, prompt, max_new_tokens=args.max_new_tokens) for name in VARIANTS}
            row = {"id": prompt.id, "kind": prompt.kind, "tokens": results["ar"]["tokens"]}
            for name in VARIANTS:
                row[f"{name}_tokens_per_s"] = results[name]["tokens_per_s"]
                if name != "ar":
                    row[f"{name}_tau"] = results[name]["tau"]
                    row[f"{name}_speedup"] = round(results[name]["tokens_per_s"] / results["ar"]["tokens_per_s"], 3)
                    row[f"{name}_identical"] = results[name]["text"] == results["ar"]["text"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    summary = {"prompts": len(rows), "new_tokens": sum(r["tokens"] for r in rows)}
    for name in VARIANTS[1:]:
        summary[f"{name}_median_speedup"] = statistics.median(r[f"{name}_speedup"] for r in rows)
        summary[f"{name}_median_tau"] = harness.median(r[f"{name}_tau"] for r in rows)
        summary[f"{name}_all_identical"] = all(r[f"{name}_identical"] for r in rows)
    columns = [Column("drafter", "name", width=12, left=True), Column("median tau", "tau", ".2f"),
               Column("median speedup", "speedup", ".3f", width=15), Column("identical", "identical")]  # fmt: skip
    lines = [{"name": n, "tau": summary[f"{n}_median_tau"], "speedup": summary[f"{n}_median_speedup"],
              "identical": str(summary[f"{n}_all_identical"])} for n in VARIANTS[1:]]  # fmt: skip
    print("\n" + harness.format_table(columns, lines, f"{summary['prompts']} {args.prompts} prompts, budget {args.budget}, {args.dtype}"))
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "head": Path(head_dir).name, "summary": summary, "requests": rows})


if __name__ == "__main__":
    main()
