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
import shutil
import subprocess
import sys
import time
from pathlib import Path

from jetflow_sglang import harness
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import PROFILE, Column, Fleet, Variant, profiles

OURS = ("jetflow_sglang/", "jetflow_kernels/", "/kernels/")


def py_spy() -> str | None:
    """py-spy beside this interpreter (the venv's bin/), else on PATH."""
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


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


def run_at(target: str, head_dir: str, args: argparse.Namespace, prompts: list, concurrency: int, work: Path) -> dict:
    env = {**PROFILE, **({} if args.adaptive else {BUDGET_ENV: "static"})}
    variant = Variant.jetflow(f"c={concurrency}", head_dir, args.budget, "--max-running-requests", str(max(concurrency, 1)), env=env)
    with Fleet(target, work, args.dtype) as fleet:
        server = fleet.start(variant, work / f"server_c{concurrency}.log")
        log = fleet.logs[variant.name]
        for prompt in prompts[: max(concurrency, 1)]:  # warm-up, past the first profile line
            fleet.request(variant.name, prompt, max_new_tokens=48)
        before = (profiles(log) or [None])[-1]
        spy = None
        if args.sample:
            pid = scheduler_pid(server)
            spy = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--format", "raw",
                                    "--rate", "250", "--nonblocking", "-o", str(work / f"spy_c{concurrency}.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        run = fleet.batch(variant.name, prompts, concurrency, max_new_tokens=args.max_new_tokens)
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
            spy.wait(timeout=60)
        time.sleep(1)
        after = profiles(log)[-1]
    rounds, totals = window(before, after)
    phases = {k: v / max(rounds, 1) for k, v in totals.items()}
    # Wall time per round: the run's seconds over the window's rounds (counted at the profile lines,
    # so up to PROFILE_EVERY - 1 rounds either end are off: small over hundreds of rounds).
    wall = 1000 * run["seconds"] / max(rounds, 1)
    phases["scheduler"] = max(wall - sum(phases.values()), 0.0)
    row = {
        "concurrency": concurrency,
        "rounds": rounds,
        "tokens_per_s": round(run["tokens_per_s"], 2),
        "tau": run["tau"],
        "ms_per_round": {k: round(v, 2) for k, v in phases.items()},
        "share": {k: round(v / max(sum(phases.values()), 1e-9), 4) for k, v in phases.items()},
        "around_verify_ms": round(sum(v for k, v in phases.items() if k in ("lookup", "draft", "tree", "bookkeeping")), 2),
        "tree_sizes": after.get("tree_sizes"),
    }
    if args.sample and (work / f"spy_c{concurrency}.txt").exists():
        row["sampled"] = sampled_lines(work / f"spy_c{concurrency}.txt", args.top)
    return row


def cell_text(phase: str):
    return lambda row: f"{row['ms_per_round'].get(phase, 0):.2f}ms {100 * row['share'].get(phase, 0):>5.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_args(parser, head="default", prompts="humaneval", limit=8)
    parser.add_argument("--budget", type=int, default=16, help="the tree budget (static), or the adaptive cap")
    parser.add_argument("--adaptive", action="store_true", help="the adaptive budget (default: static at --budget)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16], help="requests in flight, one server each")
    harness.add_args(parser, max_new_tokens=128, dtype="auto")
    parser.add_argument("--sample", action="store_true", help="also sample the scheduler with py-spy (per line of our code)")
    parser.add_argument("--top", type=int, default=25, help="sampled frames to list")
    harness.add_args(parser, out=None)
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)
    if args.sample and py_spy() is None:
        parser.error("--sample needs py-spy (pip install py-spy)")

    prompts = harness.bench_prompts(args.prompts, args.limit)
    target, head_dir = harness.resolve("default", args.head)
    work = harness.work_dir("round-profile")
    rows = []
    for concurrency in args.concurrency:
        needed = max(concurrency, len(prompts))
        batch = (prompts * (needed // len(prompts) + 1))[:needed]
        rows.append(run_at(target, head_dir, args, batch, concurrency, work))
    phases = ["lookup", "draft", "tree", "verify", "bookkeeping", "scheduler"]
    columns = [Column("c", "concurrency", width=3), Column("tok/s", "tokens_per_s", ".1f", 8), Column("tau", "tau", ".2f", 5),
               *(Column(p, cell_text(p), width=17) for p in phases),
               Column("around verify", lambda row: f"{row['around_verify_ms']:.2f}ms", width=14)]  # fmt: skip
    title = f"{len(prompts)} {args.prompts}, {'adaptive cap' if args.adaptive else 'static'} {args.budget}, {args.dtype}"
    print("\n" + harness.format_table(columns, rows, title))
    for view in ("round", "ours"):
        for row in rows:
            for item in row.get("sampled", {}).get(view, []):
                print(f"{view:<5} c={row['concurrency']:<3} {100 * item['share']:5.1f}%  {item['frame']}")
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "rows": rows})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
