"""What a JETFLOW round that verifies the root alone costs against a plain decode step, by
concurrency: the floor under the adaptive budget (a round with no draft is still a verify).

    .venv/bin/python benchmarks/root_round_cost.py --concurrency 1,4,16 --dtype bfloat16 \
        --out benchmarks/results/root_round_cost_bf16.json

Two servers up at once on 127.0.0.1: the target alone, and JETFLOW at static budget 1 with
`JETFLOW_LOOKUP=only` (no head pass, every tree the root alone: a TARGET_VERIFY forward of one
token per request, its features written to the head's context, the acceptance walk). At each
concurrency c, 2c held-out ShareGPT requests of --output-len tokens (EOS ignored) go to each
server in turn, --rounds times, interleaved; the medians of output tokens/s are compared.
Prints a table, writes JSON with the JETFLOW server's per-phase profile.
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
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.served import BenchConfig, _request, bench_prompts, last_profile
from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV
from jetflow_sglang.target import serving_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="requests in flight, in turn")
    parser.add_argument("--output-len", type=int, default=48, help="new tokens per request (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats per concurrency; medians reported")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dtype of both servers (auto: bf16 where its matmuls are native, else float32)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    args.dtype = serving_dtype(args.dtype)

    target = resolve_target("default")
    head_dir = str(head_dir_for("default", target))
    work = Path(tempfile.mkdtemp(prefix="jetflow-root-round-"))
    config = BenchConfig(max_new_tokens=args.output_len, ignore_eos=True)
    servers = {}
    rows = []
    try:
        servers["target"] = sglang_server.start(str(target), work / "target.log", dtype=args.dtype)
        servers["root only"] = sglang_server.start(
            str(target), work / "jetflow.log", *sglang_server.jetflow_args(head_dir, 1), dtype=args.dtype,
            env={LOOKUP_ENV: "only", BUDGET_ENV: "static", "JETFLOW_PROFILE": "1"},
        )  # fmt: skip
        from openai import OpenAI

        clients = {n: OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=3600) for n, s in servers.items()}
        model = clients["target"].models.list().data[0].id
        for concurrency in args.concurrency:
            prompts = bench_prompts("sharegpt-heldout", 2 * concurrency)
            speeds = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, client in clients.items():
                    start = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        results = list(pool.map(lambda p: _request(client, model, p, config), prompts))
                    speeds[name].append(sum(r["tokens"] for r in results) / (time.perf_counter() - start))
            target_speed, root_speed = (statistics.median(speeds[n]) for n in ("target", "root only"))
            row = {"concurrency": concurrency, "target_tokens_per_s": round(target_speed, 2),
                   "root_only_tokens_per_s": round(root_speed, 2), "ratio": round(root_speed / target_speed, 3)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    profile = last_profile(work / "jetflow.log")
    print(f"\n{'c':>4} {'target tok/s':>13} {'root-only tok/s':>16} {'ratio':>7}   ({args.dtype}, {args.output_len} tokens)")
    for row in rows:
        print(f"{row['concurrency']:>4} {row['target_tokens_per_s']:>13.1f} {row['root_only_tokens_per_s']:>16.1f} {row['ratio']:>7.3f}")
    if profile:
        print(f"root-only round (ms, over all concurrencies): {profile['ms_per_round']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows, "profile": profile}, indent=2))


if __name__ == "__main__":
    main()
