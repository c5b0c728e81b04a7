"""What a JETFLOW round that verifies the root alone costs against a plain decode step, by
concurrency: the floor under the adaptive budget (a round with no draft is still a verify).

    .venv/bin/python benchmarks/root_round_cost.py --concurrency 1,4,16 --dtype bfloat16 \
        --out benchmarks/results/root_round_cost_bf16.json

Two servers up at once on 127.0.0.1: the target alone, and JETFLOW at static budget 1 with
`JETFLOW_LOOKUP=only` (no head pass, every tree the root alone: a TARGET_VERIFY forward of one
token per request, its features written to the head's context, the acceptance walk). At each
concurrency c, 2c held-out ShareGPT requests of --output-len tokens (EOS ignored) go to each
server in turn, --rounds times, each round over every concurrency (`jetflow_sglang.harness.interleave`);
the medians of output tokens/s are compared.
Prints a table, writes JSON with the JETFLOW server's per-phase profile.
"""

from __future__ import annotations

import argparse
import json

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import PROFILE, Column, Fleet, Variant
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="requests in flight, in turn")
    parser.add_argument("--output-len", type=int, default=48, help="new tokens per request (EOS ignored)")
    harness.add_args(parser, rounds=3, dtype="auto", out=None)
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)

    target, head_dir = harness.resolve()
    work = harness.work_dir("root-round")
    prompts = {c: harness.bench_prompts("sharegpt-heldout", 2 * c) for c in args.concurrency}
    with Fleet(target, work, args.dtype) as fleet:
        fleet.start(Variant("target"), work / "target.log")
        root_only = {LOOKUP_ENV: "only", BUDGET_ENV: "static", **PROFILE}
        fleet.start(Variant.jetflow("root only", head_dir, 1, env=root_only), work / "jetflow.log")

        def measure(name: str, concurrency: int) -> float:
            run = fleet.batch(name, prompts[concurrency], concurrency, max_new_tokens=args.output_len, ignore_eos=True)
            print(json.dumps({"variant": name, "concurrency": concurrency, "tokens_per_s": round(run["tokens_per_s"], 2)}), flush=True)
            return run["tokens_per_s"]

        rows = []
        for concurrency, speeds in zip(args.concurrency, harness.interleave(args.rounds, args.concurrency, fleet.names, measure)):
            target_speed, root_speed = (harness.median(speeds[n]) for n in ("target", "root only"))
            rows.append({"concurrency": concurrency, "target_tokens_per_s": round(target_speed, 2),
                         "root_only_tokens_per_s": round(root_speed, 2), "ratio": round(root_speed / target_speed, 3)})  # fmt: skip
        profile = fleet.profile("root only")
    columns = [Column("c", "concurrency", width=4), Column("target tok/s", "target_tokens_per_s", ".1f", 13),
               Column("root-only tok/s", "root_only_tokens_per_s", ".1f", 16), Column("ratio", "ratio", ".3f", 7)]  # fmt: skip
    print("\n" + harness.format_table(columns, rows, f"{args.dtype}, {args.output_len} tokens"))
    if profile:
        print(f"root-only round (ms, over all concurrencies): {profile['ms_per_round']}")
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "rows": rows, "profile": profile})


if __name__ == "__main__":
    main()
