"""Where a JETFLOW decode round goes: per phase (draft, tree, verify, bookkeeping, the scheduler
around the worker) in ms and share, at each concurrency, from a real SGLang server; with
--sample, also per line of our code (py-spy sampling the scheduler process).

    .venv/bin/python benchmarks/round_profile.py --prompts humaneval --limit 8 --budget 16 \
        --concurrency 1,16 --max-new-tokens 128 --sample --out benchmarks/results/round_profile.json

One server per concurrency (its worker logs cumulative phase times with JETFLOW_PROFILE=1), static
budget unless --adaptive. "scheduler" is the wall time per round the worker's phases do not
account for (SGLang's scheduling, sampling-free output processing, the HTTP side): the round as a
client pays it. The sampled view attributes each sample to the innermost frame in
jetflow_sglang / jetflow_kernels, so a line's share is the time spent in it and in what it calls
outside our code (torch ops included).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jetflow_sglang import server as sglang_server
from jetflow_sglang.assets import head_dir_for, resolve_target
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.served import PROFILE_MARK, BenchConfig, _request, bench_prompts
from jetflow_sglang.target import serving_dtype

OURS = ("jetflow_sglang/", "jetflow_kernels/", "/kernels/")


def py_spy() -> str | None:
    """py-spy beside this interpreter (the venv's bin/), else on PATH."""
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


def profiles(log: Path) -> list[dict]:
    """Every cumulative profile line the worker logged, oldest first."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if PROFILE_MARK in line]
    return [json.loads(line.split(PROFILE_MARK, 1)[1]) for line in lines]


def phase_totals(profile: dict) -> dict[str, float]:
    return {k: v * profile["rounds"] for k, v in profile["ms_per_round"].items()}


def window(before: dict | None, after: dict) -> tuple[int, dict[str, float]]:
    """Rounds and per-phase ms between two cumulative profiles (before None: since the start)."""
    start = phase_totals(before) if before else {}
    end = phase_totals(after)
    rounds = after["rounds"] - (before["rounds"] if before else 0)
    return rounds, {k: v - start.get(k, 0.0) for k, v in end.items()}


def scheduler_pid(server) -> int | None:
    """The SGLang scheduler process: the launcher's child that runs the worker."""
    import psutil

    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()).lower() or "sglang::scheduler" in child.name().lower():
            return child.pid
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return max(children, key=lambda c: c.cpu_times().user).pid if children else None


def sampled_lines(raw: Path, top: int) -> dict[str, list[dict]]:
    """py-spy raw (collapsed) stacks -> shares of the samples by line: "round", the innermost line of
    the worker's own round (worker.py: which step of the round), and "ours", the innermost frame of
    our code (which line does the work)."""
    views: dict[str, collections.Counter[str]] = {"round": collections.Counter(), "ours": collections.Counter()}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")
        ours = [f for f in frames if any(p in f for p in OURS)]
        worker = [f for f in frames if "sglang_plugin/worker.py" in f]
        views["ours"][ours[-1] if ours else "(outside our code)"] += int(n)
        views["round"][worker[-1] if worker else "(outside the worker)"] += int(n)
    return {name: [{"frame": f, "share": round(c / max(total, 1), 4)} for f, c in counts.most_common(top)]
            for name, counts in views.items()}


def run_at(target, head_dir: str, args, prompts: list, concurrency: int, work: Path) -> dict:
    log = work / f"server_c{concurrency}.log"
    env = {"JETFLOW_PROFILE": "1", **({} if args.adaptive else {BUDGET_ENV: "static"})}
    extra = [*sglang_server.jetflow_args(head_dir, args.budget), "--max-running-requests", str(max(concurrency, 1))]
    server = sglang_server.start(str(target), log, *extra, dtype=args.dtype, env=env)
    try:
        from openai import OpenAI

        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        config = BenchConfig(max_new_tokens=args.max_new_tokens, dtype=args.dtype)
        for prompt in prompts[: max(concurrency, 1)]:  # warm-up, past the first profile line
            _request(client, model, prompt, BenchConfig(max_new_tokens=48))
        before = (profiles(log) or [None])[-1]
        spy = None
        if args.sample:
            pid = scheduler_pid(server)
            spy = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--format", "raw",
                                    "--rate", "250", "--nonblocking", "-o", str(work / f"spy_c{concurrency}.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: _request(client, model, p, config), prompts))
        seconds = time.perf_counter() - start
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
            spy.wait(timeout=60)
        time.sleep(1)
        after = profiles(log)[-1]
    finally:
        server.stop()
    rounds, totals = window(before, after)
    phases = {k: v / max(rounds, 1) for k, v in totals.items()}
    tokens = sum(r["tokens"] for r in results)
    # Wall time per round: the run's seconds over the window's rounds (counted at the profile lines,
    # so up to PROFILE_EVERY - 1 rounds either end are off: small over hundreds of rounds).
    wall = 1000 * seconds / max(rounds, 1)
    phases["scheduler"] = max(wall - sum(phases.values()), 0.0)
    row = {
        "concurrency": concurrency,
        "rounds": rounds,
        "tokens_per_s": round(tokens / seconds, 2),
        "tau": statistics.median(r["tau"] for r in results if r["tau"] is not None),
        "ms_per_round": {k: round(v, 2) for k, v in phases.items()},
        "share": {k: round(v / max(sum(phases.values()), 1e-9), 4) for k, v in phases.items()},
        "around_verify_ms": round(sum(v for k, v in phases.items() if k in ("lookup", "draft", "tree", "bookkeeping")), 2),
        "tree_sizes": after.get("tree_sizes"),
    }
    if args.sample and (work / f"spy_c{concurrency}.txt").exists():
        row["sampled"] = sampled_lines(work / f"spy_c{concurrency}.txt", args.top)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="default", help="default, random, or a head directory")
    parser.add_argument("--prompts", default="humaneval", help="demo, humaneval, sharegpt-heldout, or a JSON/JSONL file")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of the set")
    parser.add_argument("--budget", type=int, default=16, help="the tree budget (static), or the adaptive cap")
    parser.add_argument("--adaptive", action="store_true", help="the adaptive budget (default: static at --budget)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16], help="requests in flight, one server each")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="server dtype (auto: bf16 where its matmuls are native, else float32)")
    parser.add_argument("--sample", action="store_true", help="also sample the scheduler with py-spy (per line of our code)")
    parser.add_argument("--top", type=int, default=25, help="sampled frames to list")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    args.dtype = serving_dtype(args.dtype)
    if args.sample and py_spy() is None:
        parser.error("--sample needs py-spy (pip install py-spy)")

    prompts = bench_prompts(args.prompts, args.limit)
    target = resolve_target("default")
    head_dir = str(head_dir_for(args.head, target))
    work = Path(tempfile.mkdtemp(prefix="jetflow-round-profile-"))
    rows = []
    for concurrency in args.concurrency:
        needed = max(concurrency, len(prompts))
        batch = (prompts * (needed // len(prompts) + 1))[:needed]
        rows.append(run_at(target, head_dir, args, batch, concurrency, work))
    phases = ["lookup", "draft", "tree", "verify", "bookkeeping", "scheduler"]
    print(f"\n{'c':>3} {'tok/s':>8} {'tau':>5}" + "".join(f"{p:>18}" for p in phases) + f"{'around verify':>15}"
          + f"   ({len(prompts)} {args.prompts}, {'adaptive cap' if args.adaptive else 'static'} {args.budget}, {args.dtype})")  # fmt: skip
    for row in rows:
        ms, share = row["ms_per_round"], row["share"]
        print(f"{row['concurrency']:>3} {row['tokens_per_s']:>8.1f} {row['tau']:>5.2f}"
              + "".join(f"{ms.get(p, 0):>9.2f}ms {100 * share.get(p, 0):>5.1f}%" for p in phases)
              + f"{row['around_verify_ms']:>13.2f}ms")  # fmt: skip
    for view in ("round", "ours"):
        for row in rows:
            for item in row.get("sampled", {}).get(view, []):
                print(f"{view:<5} c={row['concurrency']:<3} {100 * item['share']:5.1f}%  {item['frame']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
