"""Load and faults on a JETFLOW server: many concurrent clients, mixed requests, aborts.

    python benchmarks/load_test.py [--clients 64] [--rounds 3] [--budget 16] [--no-adaptive] [--dtype bfloat16] [--out out/load.json]

The load and the checks after it are `jetflow_sglang.load` (its docstring says what is sent and
checked); `tests/test_load.py` runs a short version. Prints a table, PASS or FAIL, and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from jetflow_sglang import harness, load
from jetflow_sglang.budget import BUDGET_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=3, help="requests per client")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="upper bound of each request's token limit")
    parser.add_argument("--budget", type=int, default=16, help="JETFLOW tree budget (adaptive: the cap)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="adaptive tree budget under the --budget cap, the server's default (default: on); "
                             "--no-adaptive: static (JETFLOW_BUDGET=static)")
    harness.add_args(parser, cost_table=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the server's dtype")
    parser.add_argument("--head", default="default", help="head name or directory")
    parser.add_argument("--max-total-tokens", type=int, default=32768, help="SGLang KV pool size in tokens")
    parser.add_argument("--out", default="", help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.rounds < 1:
        parser.error("--clients and --rounds must be at least 1")
    if args.cost_table and not Path(args.cost_table).is_file():
        parser.error(f"--cost-table {args.cost_table}: no such file")
    target, head = harness.resolve("default", args.head)
    prompts = load.held_out_prompts(target, 48)
    env = {**load.STRICT_MEM_CHECK, BUDGET_ENV: "adaptive" if args.adaptive else "static", **harness.cost_env(args.cost_table)}
    with harness.Fleet(target, harness.work_dir("load"), args.dtype, args.max_total_tokens) as fleet:
        server = fleet.start(harness.Variant.jetflow("jetflow", head, args.budget, env=env))
        probes = prompts[:3]
        before = load.probe(server, probes)
        config = load.LoadConfig(clients=args.clients, rounds=args.rounds, max_new_tokens=args.max_new_tokens)
        report = load.run_load(server.url, prompts, config)
        load.idle_checks(server, probes, before, report)
    policy = f"adaptive, cap {args.budget}" if args.adaptive else f"budget {args.budget}"
    print(f"| {args.clients} clients x {args.rounds} rounds, {policy}, {args.dtype} | |\n|---|---|")
    for name, value in load.report_rows(report):
        print(f"| {name} | {value} |")
    print("PASS" if report.passed else "FAIL")
    if args.out:
        harness.write_json(args.out, {"config": vars(args), **asdict(report), "passed": report.passed}, indent=1)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
