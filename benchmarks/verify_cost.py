"""Measure the SGLang server's JETFLOW round costs: verify seconds by verify tokens (batch x tree
size) and the draft pass, as the cost table the adaptive tree budget starts from.

    .venv/bin/python benchmarks/verify_cost.py --cap 256 --concurrency 1,2,4,8,16 \
        --out benchmarks/results/verify_cost_cpu.json
    JETFLOW_COST_TABLE=benchmarks/results/verify_cost_cpu.json jetflow serve --dtype float32

One JETFLOW server (127.0.0.1, --max-total-tokens 16384) runs with JETFLOW_BUDGET=sweep: its
rounds take every size on the ladder 1, 2, 4, ... up to --cap in turn, timing each verify (and,
on a GPU, synchronizing first). Requests of --max-new-tokens (EOS ignored) go in at each
concurrency, so batches of 1..16 requests verify 1..16 x cap tokens. The table is read from the
server's profile log; the output JSON is what `JETFLOW_COST_TABLE` loads (`verify_ms` of trees by
verify tokens, `plain_ms` of root-only rounds by batch size, `draft_ms`), with the settings and
where it was measured beside it: `dtype`, `machine`, `cuda`, `device_name` (the GPU's or the CPU's
model) and, on a CPU, `cpus`, as the server's worker reported them. A server refuses a table whose
dtype or machine differs from its own. Prints the table.
"""

from __future__ import annotations

import argparse
import platform

import torch

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV, CostTable
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import PROFILE, Column, Fleet, Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_args(parser, head="default")
    parser.add_argument("--cap", type=int, default=256, help="largest tree size measured (the adaptive cap)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="requests in flight, in turn")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per request (EOS ignored)")
    harness.add_args(parser, dtype="auto")
    parser.add_argument("--out", default=None, help="write the cost table (JSON) here")
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)
    if not 1 <= args.cap <= 512:
        parser.error(f"--cap must be between 1 and 512, got {args.cap}")

    target, head_dir = harness.resolve("default", args.head)
    prompts = harness.bench_prompts("humaneval", max(args.concurrency))
    sweep = Variant.jetflow("sweep", head_dir, args.cap, "--max-running-requests", str(max(args.concurrency)),
                            env={BUDGET_ENV: "sweep", **PROFILE})  # fmt: skip
    with Fleet(target, harness.work_dir("verify-cost"), args.dtype, max_total_tokens=16384) as fleet:
        fleet.start(sweep)
        for concurrency in args.concurrency:
            fleet.batch("sweep", prompts[:concurrency], concurrency, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            print(f"concurrency {concurrency}: done", flush=True)
    profile = fleet.profile("sweep")
    if profile is None:
        raise SystemExit(f"verify_cost: no profile line in {fleet.logs['sweep']}")
    table = CostTable.from_json(profile["tree_sizes"]["cost"])
    curves = (("verify", table.verify, "verify tokens"), ("plain step", table.plain, "batch size"), ("draft pass", table.draft, "batch size"))
    for name, curve, unit in curves:
        columns = [Column(unit, "size", width=14), Column(name + " ms", "ms", ".2f", 14), Column("read as (monotone)", "read", ".2f", 19)]
        rows = [{"size": size, "ms": seconds * 1e3, "read": curve.seconds(size) * 1e3} for size, seconds in sorted(curve.seconds_at.items())]
        print("\n" + harness.format_table(columns, rows))
    # Where the costs were measured, as the server's worker saw it (older servers: this process's view).
    origin = profile["tree_sizes"].get("origin") or {"dtype": args.dtype, "machine": platform.machine(), "cuda": torch.cuda.is_available()}
    report = {**table.to_json(), **origin, "config": vars(args), "rounds": profile["rounds"]}
    if args.out:
        harness.write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
