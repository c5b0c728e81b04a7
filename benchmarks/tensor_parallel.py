"""JETFLOW at --tp 2 against --tp 1 on this machine: the same output, the same drafting, and the
speed as measured.

    .venv/bin/python benchmarks/tensor_parallel.py --prompts humaneval,sharegpt-heldout --limit 10 \
        --budgets 16,64 --concurrency 1,4 --max-new-tokens 64 --out benchmarks/results/tensor_parallel_fp32.json

Servers, all up at once on 127.0.0.1 (fp32 unless --dtype): the target alone at --tp 1 and --tp 2,
and JETFLOW at each budget (static, so that its drafting does not follow either machine's timings)
at --tp 1 and --tp 2. Each prompt set at each concurrency goes to every server in turn, --rounds
times (`jetflow_sglang.harness.interleave`). Per cell it reports: whether every greedy answer of
JETFLOW --tp 2 equals the target alone's at --tp 2, the median tau at --tp 1 and --tp 2 and how
many prompts drafted differently, and tokens/s as a ratio to the target alone at the same --tp
and at --tp 1. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import Column, Fleet, Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="humaneval,sharegpt-heldout", help="prompt sets, comma-separated")
    parser.add_argument("--limit", type=int, default=10, help="first N prompts of each set")
    parser.add_argument("--budgets", type=int_list, default=[16, 64], help="static tree budgets, comma-separated")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4], help="requests in flight, in turn")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request")
    harness.add_args(parser, rounds=1, dtype="float32", out=None)
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)

    target, head_dir = harness.resolve()
    work = harness.work_dir("tensor-parallel")
    sets = {name: harness.bench_prompts(name, args.limit) for name in args.prompts.split(",")}
    static = {BUDGET_ENV: "static", "JETFLOW_TEST_TP_CHECK": "1"}
    variants = []
    for tp in ("1", "2"):
        variants.append(Variant(f"target tp{tp}", ("--tp-size", tp)))
        variants += [Variant.jetflow(f"jetflow {b} tp{tp}", head_dir, b, "--tp-size", tp, env=static) for b in args.budgets]
    cells = [(name, c) for name in sets for c in args.concurrency]
    with Fleet(target, work, args.dtype) as fleet:
        fleet.start_all(variants)
        fleet.warm_up()

        def measure(name: str, cell: tuple[str, int]) -> dict:
            prompts, concurrency = sets[cell[0]], cell[1]
            return fleet.batch(name, prompts, concurrency, max_new_tokens=args.max_new_tokens)

        runs = harness.interleave(args.rounds, cells, fleet.names, measure)
    rows = []
    for (name, concurrency), by_variant in zip(cells, runs):
        speed = {v: harness.median(r["tokens_per_s"] for r in results) for v, results in by_variant.items()}
        last = {v: results[-1]["requests"] for v, results in by_variant.items()}
        for budget in args.budgets:
            one, two = last[f"jetflow {budget} tp1"], last[f"jetflow {budget} tp2"]
            rows.append({
                "prompts": name, "concurrency": concurrency, "budget": budget,
                "identical_tp2": all(a["ids"] == b["ids"] for a, b in zip(two, last["target tp2"])),
                "tau_tp1": harness.median(r["tau"] for r in one), "tau_tp2": harness.median(r["tau"] for r in two),
                "drafted_differently": sum(a["tau"] != b["tau"] for a, b in zip(one, two)),
                "tp2_vs_target_tp2": round(speed[f"jetflow {budget} tp2"] / speed["target tp2"], 3),
                "tp1_vs_target_tp1": round(speed[f"jetflow {budget} tp1"] / speed["target tp1"], 3),
                "tp2_vs_tp1": round(speed[f"jetflow {budget} tp2"] / speed[f"jetflow {budget} tp1"], 3),
                "target_tp2_vs_tp1": round(speed["target tp2"] / speed["target tp1"], 3),
            })  # fmt: skip
    columns = [Column("prompts", "prompts", width=17, left=True), Column("c", "concurrency", width=3), Column("budget", "budget", width=7),
               Column("identical", "identical_tp2", width=10), Column("tau tp1", "tau_tp1", ".2f", 8),
               Column("tau tp2", "tau_tp2", ".2f", 8), Column("differ", "drafted_differently", width=7),
               Column("tp2/target", "tp2_vs_target_tp2", ".3f", 11), Column("tp1/target", "tp1_vs_target_tp1", ".3f", 11),
               Column("tp2/tp1", "tp2_vs_tp1", ".3f", 8), Column("target tp2/tp1", "target_tp2_vs_tp1", ".3f", 15)]  # fmt: skip
    print("\n" + harness.format_table(columns, rows, f"{args.dtype}, {args.max_new_tokens} new tokens, {args.rounds} round(s)"))
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
