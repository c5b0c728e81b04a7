"""Static tree budgets (`JETFLOW_BUDGET=static`) against the adaptive one (the default) and the target alone,
in the SGLang server, at several concurrencies, greedy.

    .venv/bin/python benchmarks/bench_budget.py --prompts humaneval --limit 8 --budgets 16,64 \
        --concurrency 1,4 --max-new-tokens 128 --cost-table benchmarks/results/verify_cost_cpu.json \
        --out benchmarks/results/budget_humaneval8.json

One server per variant, all up at once on 127.0.0.1 (--max-total-tokens 8192): the target alone,
JETFLOW at each static budget, JETFLOW adaptive with the largest budget as its cap, and with
--lookup-only JETFLOW verifying prompt-lookup chains alone (no head pass). For each
concurrency c the prompt set goes to each variant in turn (c requests in flight at a time), so
all variants see the same machine state; a run repeats --rounds times and the median is kept.
Prints output tokens/s per variant and concurrency, the ratio to the target alone, median tau,
whether every output equals the target's, and the tree sizes the adaptive policy chose; writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jetflow_sglang import server as sglang_server
from jetflow_sglang.assets import head_dir_for, resolve_target
from jetflow_sglang.cli import int_list
from jetflow_sglang.budget import BUDGET_ENV, COST_TABLE_ENV
from jetflow_sglang.served import BenchConfig, last_profile, _request, bench_prompts
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV
from jetflow_sglang.target import serving_dtype


def _run(client, model: str, prompts: list, config: BenchConfig, concurrency: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: _request(client, model, p, config), prompts))
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    taus = [r["tau"] for r in results if r["tau"] is not None]
    return {"tokens_per_s": tokens / seconds, "tau": statistics.median(taus) if taus else None,
            "texts": [r["text"] for r in results]}  # fmt: skip


def baseline_code(checkout: Path, work: Path) -> Path:
    """A folder whose jetflow_sglang and jetflow_kernels are the checkout's (PYTHONPATH and the
    launcher's directory put it ahead of the installed package)."""
    if not (checkout / "jetflow_sglang").is_dir() or not (checkout / "kernels").is_dir():
        raise SystemExit(f"--baseline: {checkout} is not a checkout of this project")
    code = work / "baseline-code"
    code.mkdir()
    (code / "jetflow_sglang").symlink_to(checkout.resolve() / "jetflow_sglang")
    (code / "jetflow_kernels").symlink_to(checkout.resolve() / "kernels")
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="default", help="default, random, or a head directory")
    parser.add_argument("--prompts", default="humaneval", help="demo, humaneval, sharegpt-heldout, or a JSON/JSONL file")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of the set")
    parser.add_argument("--budgets", type=int_list, default=[16, 64], help="static budgets; the largest is the adaptive cap")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4], help="requests in flight per variant")
    parser.add_argument("--rounds", type=int, default=1, help="repeat each measurement; medians are reported")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dtype of every server (auto: bf16 where its matmuls are native, else float32)")
    parser.add_argument("--cost-table", default=None, help="JETFLOW_COST_TABLE of the adaptive server (benchmarks/verify_cost.py)")
    parser.add_argument("--lookup-only", action="store_true",
                        help="also JETFLOW_LOOKUP=only (prompt-lookup chains alone, no head pass) at the cap")
    parser.add_argument("--also-head", action="append", default=[], metavar="NAME=SPEC",
                        help="another head served adaptive at the cap beside --head's servers (repeatable)")
    parser.add_argument("--no-static", action="store_true", help="no static-budget servers (the largest budget is the cap)")
    parser.add_argument("--baseline", default=None, metavar="CHECKOUT",
                        help="another checkout of this project (e.g. a git worktree of main): every JETFLOW variant also "
                             "runs on its code, interleaved, labelled 'baseline'")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    if any("=" not in item for item in args.also_head):
        parser.error("--also-head takes NAME=SPEC")
    args.dtype = serving_dtype(args.dtype)

    config = BenchConfig(head=args.head, prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                         dtype=args.dtype)  # fmt: skip
    prompts = bench_prompts(config.prompts, config.limit)
    target = resolve_target("default")
    head_dir = str(head_dir_for(config.head, target))
    work = Path(tempfile.mkdtemp(prefix="jetflow-budget-bench-"))
    cap = max(args.budgets)
    variants = {"target": ([], {})}
    for budget in [] if args.no_static else args.budgets:
        variants[f"static {budget}"] = (sglang_server.jetflow_args(head_dir, budget), {BUDGET_ENV: "static", "JETFLOW_PROFILE": "1"})
    variants[f"adaptive (cap {cap})"] = (sglang_server.jetflow_args(head_dir, cap),
                                         {"JETFLOW_PROFILE": "1", **({COST_TABLE_ENV: args.cost_table} if args.cost_table else {})})  # fmt: skip
    for name, spec in (item.split("=", 1) for item in args.also_head):
        variants[f"adaptive (cap {cap}, {name})"] = (sglang_server.jetflow_args(str(head_dir_for(spec, target)), cap),
                                                     {"JETFLOW_PROFILE": "1"})  # fmt: skip
    if args.lookup_only:
        variants["lookup only"] = (sglang_server.jetflow_args(head_dir, cap),
                                   {LOOKUP_ENV: "only", BUDGET_ENV: "static", "JETFLOW_PROFILE": "1"})  # fmt: skip
    cwds: dict[str, str] = {}
    if args.baseline:
        code = baseline_code(Path(args.baseline), work)
        for name, (extra, env) in list(variants.items()):
            if name != "target":
                # its own measured-cost folder: the two codes' adaptive servers share no costs
                variants[f"{name} baseline"] = (extra, {**env, "PYTHONPATH": str(code), "JETFLOW_COST_CACHE": str(work / "baseline-costs")})
                cwds[f"{name} baseline"] = str(code)
    servers, logs = {}, {}
    table = {}
    try:
        for i, (name, (extra, env)) in enumerate(variants.items()):
            logs[name] = work / f"server{i}.log"
            servers[name] = sglang_server.start(str(target), logs[name], *extra, dtype=config.dtype, env=env,
                                                cwd=cwds.get(name, str(work)))  # fmt: skip
        from openai import OpenAI

        clients = {n: OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=3600) for n, s in servers.items()}
        model = clients["target"].models.list().data[0].id
        for client in clients.values():
            _request(client, model, prompts[0], BenchConfig(max_new_tokens=8))  # warm-up
        for concurrency in args.concurrency:
            runs = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name in variants:
                    runs[name].append(_run(clients[name], model, prompts, config, concurrency))
            base = statistics.median(r["tokens_per_s"] for r in runs["target"])
            for name, rs in runs.items():
                speed = statistics.median(r["tokens_per_s"] for r in rs)
                taus = [r["tau"] for r in rs if r["tau"] is not None]
                row = {"variant": name, "concurrency": concurrency, "tokens_per_s": round(speed, 2),
                       "vs_target": round(speed / base, 3), "tau": round(statistics.median(taus), 3) if taus else None,
                       "identical": all(r["texts"] == runs["target"][0]["texts"] for r in rs)}  # fmt: skip
                table[(name, concurrency)] = row
                print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    adaptive_name = f"adaptive (cap {cap})"
    # Each JETFLOW server's last profile: mean milliseconds per decode round by phase (draft, tree,
    # verify, ...), so adaptive and static rounds are compared in cost, not only in size.
    profiles = {name: last_profile(logs[name]) or {} for name in variants if name != "target"}
    profile = profiles[adaptive_name] or None
    chosen = (profile or {}).get("tree_sizes", {}).get("chosen")
    print(f"\n{'variant':<30}" + "".join(f"{'c=' + str(c):>22}" for c in args.concurrency)
          + f"   ({len(prompts)} {args.prompts} prompts, {args.max_new_tokens} new tokens, {args.dtype})")  # fmt: skip
    for name in variants:
        cells = [table[(name, c)] for c in args.concurrency]
        print(f"{name:<30}" + "".join(
            f"{c['tokens_per_s']:>9.1f} tok/s {c['vs_target']:>5.2f}x{'' if c['identical'] else '*':1}" for c in cells))
    print(f"adaptive sizes chosen (rounds): {chosen}   (* = output differs from the target's)")
    phases = {name: p.get("ms_per_round") for name, p in profiles.items()}
    for name, ms in phases.items():
        print(f"{name:<30} ms per round: {ms}")
    if args.out:
        report = {"config": {k: v for k, v in vars(args).items()}, "head": Path(head_dir).name,
                  "rows": list(table.values()), "adaptive_chosen": chosen, "adaptive_profile": profile,
                  "ms_per_round": phases}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
