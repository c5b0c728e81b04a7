"""JETFLOW at --tp N against --tp 1 on this machine: the same output, the same drafting, and the
speed as measured.

    .venv/bin/python benchmarks/tensor_parallel.py --tp 3 --prompts humaneval,sharegpt-heldout --limit 5 \
        --budgets 16,64 --concurrency 1,4 --max-new-tokens 48 --out benchmarks/results/tensor_parallel_fp32.json

For each budget, four servers up at once on 127.0.0.1 (fp32 unless --dtype): the target alone and
JETFLOW (static budget, so its drafting follows neither rank count's timings; every round's
commits compared across ranks) at --tp 1 and at --tp N. The default target's 9 attention heads
split three ways, hence --tp 3 (on 2 cores, two ranks share one). Each prompt set at each
concurrency goes to every server in turn, --rounds times (`jetflow_sglang.harness.interleave`).
Per cell: whether every greedy answer of JETFLOW --tp N equals the target alone's at --tp N, the
median tau at --tp 1 and --tp N and how many prompts drafted differently, and tokens/s as ratios.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import Column, Fleet, Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks against one (must divide the target's heads)")
    parser.add_argument("--prompts", default="humaneval,sharegpt-heldout", help="prompt sets, comma-separated")
    parser.add_argument("--budgets", type=int_list, default=[16, 64], help="static tree budgets, comma-separated")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4], help="requests in flight, in turn")
    harness.add_args(parser, limit=5, max_new_tokens=48, rounds=1, dtype="float32", out=None)
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)

    target, head_dir = harness.resolve()
    work = harness.work_dir("tensor-parallel")
    sets = {name: harness.bench_prompts(name, args.limit) for name in args.prompts.split(",")}
    static = {BUDGET_ENV: "static", "JETFLOW_TEST_TP_CHECK": "1"}
    tp = str(args.tp)
    cells = [(name, c) for name in sets for c in args.concurrency]
    rows = []
    for budget in args.budgets:
        variants = [Variant("target tp1", ("--tp-size", "1")), Variant(f"target tp{tp}", ("--tp-size", tp)),
                    Variant.jetflow("jetflow tp1", head_dir, budget, "--tp-size", "1", env=static),
                    Variant.jetflow(f"jetflow tp{tp}", head_dir, budget, "--tp-size", tp, env=static)]  # fmt: skip
        (work / f"budget{budget}").mkdir()
        with Fleet(target, work / f"budget{budget}", args.dtype) as fleet:
            fleet.start_all(variants)
            fleet.warm_up()

            def measure(name: str, cell: tuple[str, int]) -> dict:
                result = fleet.batch(name, sets[cell[0]], cell[1], max_new_tokens=args.max_new_tokens)
                print(f"budget {budget} {name} {cell}: {result['tokens_per_s']:.2f} tok/s", flush=True)
                return result

            runs = harness.interleave(args.rounds, cells, fleet.names, measure)
        for (name, concurrency), by_variant in zip(cells, runs):
            speed = {v: harness.median(r["tokens_per_s"] for r in results) for v, results in by_variant.items()}
            last = {v: results[-1]["requests"] for v, results in by_variant.items()}
            one, many = last["jetflow tp1"], last[f"jetflow tp{tp}"]
            rows.append({
                "prompts": name, "concurrency": concurrency, "budget": budget, "tp": args.tp,
                "identical": all(a["ids"] == b["ids"] for a, b in zip(many, last[f"target tp{tp}"])),
                "tau_tp1": harness.median(r["tau"] for r in one), "tau_tpn": harness.median(r["tau"] for r in many),
                "drafted_differently": sum(a["tau"] != b["tau"] for a, b in zip(one, many)),
                "tpn_vs_target_tpn": round(speed[f"jetflow tp{tp}"] / speed[f"target tp{tp}"], 3),
                "tp1_vs_target_tp1": round(speed["jetflow tp1"] / speed["target tp1"], 3),
                "jetflow_tpn_vs_tp1": round(speed[f"jetflow tp{tp}"] / speed["jetflow tp1"], 3),
                "target_tpn_vs_tp1": round(speed[f"target tp{tp}"] / speed["target tp1"], 3),
            })  # fmt: skip
    columns = [Column("prompts", "prompts", width=17, left=True), Column("c", "concurrency", width=3), Column("budget", "budget", width=7),
               Column("identical", "identical", width=10), Column("tau tp1", "tau_tp1", ".2f", 8),
               Column("tau tpN", "tau_tpn", ".2f", 8), Column("differ", "drafted_differently", width=7),
               Column("tpN/target", "tpn_vs_target_tpn", ".3f", 11), Column("tp1/target", "tp1_vs_target_tp1", ".3f", 11),
               Column("jetflow tpN/tp1", "jetflow_tpn_vs_tp1", ".3f", 16), Column("target tpN/tp1", "target_tpn_vs_tp1", ".3f", 15)]  # fmt: skip
    print("\n" + harness.format_table(columns, rows, f"--tp {args.tp} against --tp 1, {args.dtype}, {args.max_new_tokens} new tokens, {args.rounds} round(s)"))
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
