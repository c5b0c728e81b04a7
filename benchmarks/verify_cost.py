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
import json
import platform
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from jetflow_sglang import server as sglang_server
from jetflow_sglang.assets import head_dir_for, resolve_target
from jetflow_sglang.cli import int_list
from jetflow_sglang.budget import BUDGET_ENV, CostTable
from jetflow_sglang.served import BenchConfig, _request, bench_prompts, last_profile
from jetflow_sglang.target import serving_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="default", help="default, random, or a head directory")
    parser.add_argument("--cap", type=int, default=256, help="largest tree size measured (the adaptive cap)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="requests in flight, in turn")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per request (EOS ignored)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="server dtype (auto: bf16 where its matmuls are native, else float32)")
    parser.add_argument("--out", default=None, help="write the cost table (JSON) here")
    args = parser.parse_args()
    args.dtype = serving_dtype(args.dtype)
    if not 1 <= args.cap <= 512:
        parser.error(f"--cap must be between 1 and 512, got {args.cap}")

    target = resolve_target("default")
    head_dir = str(head_dir_for(args.head, target))
    prompts = bench_prompts("humaneval", max(args.concurrency))
    config = BenchConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    log = Path(tempfile.mkdtemp(prefix="jetflow-verify-cost-")) / "server.log"
    server = sglang_server.start(
        str(target), log, *sglang_server.jetflow_args(head_dir, args.cap), "--max-running-requests", str(max(args.concurrency)),
        dtype=args.dtype, max_total_tokens=16384, env={BUDGET_ENV: "sweep", "JETFLOW_PROFILE": "1"},
    )  # fmt: skip
    try:
        from openai import OpenAI

        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        for concurrency in args.concurrency:
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda p: _request(client, model, p, config), prompts[:concurrency]))
            print(f"concurrency {concurrency}: done", flush=True)
    finally:
        server.stop()
    profile = last_profile(log)
    if profile is None:
        raise SystemExit(f"verify_cost: no profile line in {log}")
    table = CostTable.from_json(profile["tree_sizes"]["cost"])
    curves = (("verify", table.verify, "verify tokens"), ("plain step", table.plain, "batch size"), ("draft pass", table.draft, "batch size"))
    for name, curve, unit in curves:
        print(f"\n{unit:>14} {name + ' ms':>14} {'read as (monotone)':>19}")
        for size, seconds in sorted(curve.seconds_at.items()):
            print(f"{size:>14} {seconds * 1e3:>14.2f} {curve.seconds(size) * 1e3:>19.2f}")
    # Where the costs were measured, as the server's worker saw it (older servers: this process's view).
    origin = profile["tree_sizes"].get("origin") or {"dtype": args.dtype, "machine": platform.machine(), "cuda": torch.cuda.is_available()}
    report = {**table.to_json(), **origin, "config": vars(args), "rounds": profile["rounds"]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(args.out + ".partial")
        partial.write_text(json.dumps(report, indent=1) + "\n")
        partial.rename(args.out)


if __name__ == "__main__":
    main()
