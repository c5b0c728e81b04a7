"""Static tree budgets (`JETFLOW_BUDGET=static`) against the adaptive one (the default) and the target alone,
in the SGLang server, at several concurrencies, greedy.

    .venv/bin/python benchmarks/bench_budget.py --prompts humaneval --limit 8 --budgets 16,64 \
        --concurrency 1,4 --max-new-tokens 128 --cost-table benchmarks/results/verify_cost_cpu.json \
        --out benchmarks/results/budget_humaneval8.json

One server per variant, all up at once on 127.0.0.1 (--max-total-tokens 8192): the target alone,
JETFLOW at each static budget, JETFLOW adaptive with the largest budget as its cap, and with
--lookup-only JETFLOW verifying prompt-lookup chains alone (no head pass). Each of --rounds
rounds goes over the concurrencies in turn; at each concurrency c the prompt set goes to each
variant in turn (c requests in flight at a time), so all variants see the same machine state;
each cell reports its median over the rounds (`jetflow_sglang.harness.interleave`).
Prints output tokens/s per variant and concurrency, the ratio to the target alone, median tau,
whether every output equals the target's, and the tree sizes the adaptive policy chose; writes
JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import PROFILE, Column, Fleet, Variant
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV


def variants(args: argparse.Namespace, head_dir: str, work: Path) -> list[Variant]:
    cap = max(args.budgets)
    static = {BUDGET_ENV: "static", **PROFILE}
    out = [Variant("target")]
    out += [Variant.jetflow(f"static {b}", head_dir, b, env=static) for b in ([] if args.no_static else args.budgets)]
    out.append(Variant.jetflow(f"adaptive (cap {cap})", head_dir, cap, env={**PROFILE, **harness.cost_env(args.cost_table)}))
    for name, spec in (item.split("=", 1) for item in args.also_head):
        out.append(Variant.jetflow(f"adaptive (cap {cap}, {name})", harness.resolve("default", spec)[1], cap, env=PROFILE))
    if args.lookup_only:
        out.append(Variant.jetflow("lookup only", head_dir, cap, env={**static, LOOKUP_ENV: "only"}))
    if args.baseline:
        code = harness.baseline_code(Path(args.baseline), work)
        out += [v.on(code, work / "baseline-costs") for v in out if v.name != "target"]
    return out


def cell_text(row: dict) -> str:
    return f"{row['tokens_per_s']:.1f} tok/s {row['vs_target']:>5.2f}x{'' if row['identical'] else '*':1}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_args(parser, head="default", prompts="humaneval", limit=8)
    parser.add_argument("--budgets", type=int_list, default=[16, 64], help="static budgets; the largest is the adaptive cap")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4], help="requests in flight per variant")
    harness.add_args(parser, rounds=1, max_new_tokens=128, dtype="auto", cost_table=None)
    parser.add_argument("--lookup-only", action="store_true",
                        help="also JETFLOW_LOOKUP=only (prompt-lookup chains alone, no head pass) at the cap")
    parser.add_argument("--also-head", action="append", default=[], metavar="NAME=SPEC",
                        help="another head served adaptive at the cap beside --head's servers (repeatable)")
    parser.add_argument("--no-static", action="store_true", help="no static-budget servers (the largest budget is the cap)")
    parser.add_argument("--baseline", default=None, metavar="CHECKOUT",
                        help="another checkout of this project (e.g. a git worktree of main): every JETFLOW variant also "
                             "runs on its code, interleaved, labelled 'baseline'")
    harness.add_args(parser, out=None)
    args = parser.parse_args()
    if any("=" not in item for item in args.also_head):
        parser.error("--also-head takes NAME=SPEC")
    args.dtype = harness.serving_dtype(args.dtype)

    prompts = harness.bench_prompts(args.prompts, args.limit)
    target, head_dir = harness.resolve("default", args.head)
    work = harness.work_dir("budget-bench")
    adaptive = f"adaptive (cap {max(args.budgets)})"
    with Fleet(target, work, args.dtype, cwd=str(work)) as fleet:
        fleet.start_all(variants(args, head_dir, work))
        fleet.warm_up(prompts[0])

        def measure(name: str, concurrency: int) -> dict:
            run = fleet.batch(name, prompts, concurrency, max_new_tokens=args.max_new_tokens)
            print(json.dumps({"variant": name, "concurrency": concurrency, "tokens_per_s": round(run["tokens_per_s"], 2)}), flush=True)
            return run

        runs = harness.interleave(args.rounds, args.concurrency, fleet.names, measure)
        rows = []
        for concurrency, by_name in zip(args.concurrency, runs):
            base = harness.median(r["tokens_per_s"] for r in by_name["target"])
            for name, results in by_name.items():
                speed = harness.median(r["tokens_per_s"] for r in results)
                rows.append({"variant": name, "concurrency": concurrency, "tokens_per_s": round(speed, 2),
                             "vs_target": round(speed / base, 3), **harness.medians(results, ["tau"]),
                             "identical": all(r["texts"] == by_name["target"][0]["texts"] for r in results)})  # fmt: skip
        # Each JETFLOW server's last profile: mean milliseconds per decode round by phase (draft, tree,
        # verify, ...), so adaptive and static rounds are compared in cost, not only in size.
        profiles = {name: fleet.profile(name) or {} for name in fleet.names if name != "target"}
    profile = profiles[adaptive] or None
    chosen = (profile or {}).get("tree_sizes", {}).get("chosen")
    table = {}
    for row in rows:
        table.setdefault(row["variant"], {"variant": row["variant"]})[row["concurrency"]] = row
    columns = [Column("variant", "variant", width=30, left=True),
               *(Column(f"c={c}", lambda line, c=c: cell_text(line[c]), width=21) for c in args.concurrency)]
    print("\n" + harness.format_table(columns, table.values(), f"{len(prompts)} {args.prompts} prompts, "
                                      f"{args.max_new_tokens} new tokens, {args.dtype}"))  # fmt: skip
    print(f"adaptive sizes chosen (rounds): {chosen}   (* = output differs from the target's)")
    phases = {name: p.get("ms_per_round") for name, p in profiles.items()}
    for name, ms in phases.items():
        print(f"{name:<30} ms per round: {ms}")
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "head": Path(head_dir).name, "rows": rows, "adaptive_chosen": chosen,
                                      "adaptive_profile": profile, "ms_per_round": phases})  # fmt: skip


if __name__ == "__main__":
    main()
