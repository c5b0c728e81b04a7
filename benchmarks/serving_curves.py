"""Throughput against concurrency with `python -m sglang.bench_serving`: the target alone,
JETFLOW at static budgets, and JETFLOW adaptive, each with the shipped head and with the
synthetic proposer at set acceptance rates.

    .venv/bin/python benchmarks/serving_curves.py --prompts sharegpt-heldout --concurrency 1,2,4,8,16 \
        --budgets 16,64 --drafters head,0.6,0.8 --output-len 64 --cost-table benchmarks/results/verify_cost_cpu.json \
        --out benchmarks/results/serving_curves_sharegpt.json

The prompts (held-out ShareGPT questions through the chat template, or HumanEval tasks as raw
completions) are written to a ShareGPT-format file that bench_serving reads with its own
sampler; every request asks for exactly --output-len tokens (bench_serving's ignore_eos),
greedy. The target-alone server stays up for the whole run; the JETFLOW servers come up one
drafter at a time (the head, then the synthetic proposer at each p: the target's greedy
continuation at each depth with probability p, else a wrong token; `JETFLOW_TEST_ORACLE_ACCEPT`).
At each concurrency c the same --num-prompts requests (at least 2c) go to the target and
then to each JETFLOW variant, so a drafter's row and its target row are measured minutes
apart on the same machine. Reports bench_serving's output throughput and median TPOT, the
ratio to the target alone in the same round, and the mean accept length of that run
(bench_serving reports the server's running average; the per-run value is recovered from
successive averages, see `AcceptTracker`). With --rounds R every cell is measured R times,
the rounds going over all concurrencies in turn, and the table holds each cell's medians (one
round of a cell on this 2-core CPU moves by up to ±0.1x). --adaptive-only leaves the static
budgets out. The adaptive server's rounds by kind (root alone, lookup chains, head) and batch
size, from its profile, go to the JSON and the table. Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jetflow_sglang import server as sglang_server
from jetflow_sglang.assets import head_dir_for, resolve_target
from jetflow_sglang.budget import BUDGET_ENV, COST_TABLE_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.served import bench_prompts, last_profile
from jetflow_sglang.sglang_plugin.proposer import ORACLE_ACCEPT_ENV
from jetflow_sglang.sglang_plugin.worker import ORACLE_ENV
from jetflow_sglang.target import serving_dtype


def drafter_list(text: str) -> list[str]:
    """"head,0.6,0.8" -> ["head", "p=0.6", "p=0.8"]."""
    drafters = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item != "head":
            try:
                p = float(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r} is neither 'head' nor an acceptance rate") from None
            if not 0 < p <= 1:
                raise argparse.ArgumentTypeError(f"acceptance rate {p} is not in (0, 1]")
            item = f"p={p:g}"
        drafters.append(item)
    return drafters


def prompt_texts(spec: str, limit: int, tokenizer, max_prompt_tokens: int) -> list[str]:
    """Request texts as the server receives them: chat prompts through the chat template."""
    texts = []
    for prompt in bench_prompts(spec, None):
        if prompt.kind == "chat":
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True)
        else:
            text = prompt.text
        if len(tokenizer.encode(text)) <= max_prompt_tokens:
            texts.append(text)
        if len(texts) == limit:
            break
    return texts


def write_sharegpt_file(texts: list[str], path: Path) -> None:
    """bench_serving's ShareGPT format; the answer only sets a length, overridden by --sharegpt-output-len."""
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok ok ok ok"}]}
            for i, t in enumerate(texts)]  # fmt: skip
    path.write_text(json.dumps(rows))


def write_oracle_file(url: str, texts: list[str], tokenizer, output_len: int, path: Path) -> None:
    """[[prompt ids, the target's greedy continuation]] as the synthetic proposer reads them,
    from the target-alone server itself (ignore_eos, as bench_serving asks)."""
    pairs = []
    for text in texts:
        reply = sglang_server.post(url + "/generate", {
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}})  # fmt: skip
        pairs.append([tokenizer.encode(text), reply["output_ids"]])
    path.write_text(json.dumps(pairs))


def bench_serving(url: str, tokenizer_path: str, dataset: Path, num_prompts: int, concurrency: int,
                  output_len: int, result: Path) -> dict:  # fmt: skip
    port = url.rsplit(":", 1)[1]
    result.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port", port,
         "--tokenizer", tokenizer_path, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
         "--num-prompts", str(num_prompts), "--sharegpt-output-len", str(output_len), "--max-concurrency", str(concurrency),
         "--request-rate", "inf", "--seed", "1", "--disable-tqdm", "--output-file", str(result)],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"bench_serving failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    report = json.loads(result.read_text().splitlines()[-1])
    if report["completed"] != num_prompts:
        raise RuntimeError(f"bench_serving completed {report['completed']} of {num_prompts} requests")
    return report


class AcceptTracker:
    """Per-run mean accept length from SGLang's running average over the server's life.

    SGLang averages accept length over request-rounds: avg = tokens committed by decode rounds
    / request-rounds. Every request's first token comes from prefill, so one run's decode tokens
    are output tokens - requests; summing those over the server's life (every request it served
    went through here) gives request-rounds = decode tokens / avg after each run. Approximate by
    the tokens a request's last round commits past its max_new_tokens (SGLang counts them)."""

    def __init__(self) -> None:
        self.decode_tokens = 0
        self.rounds = 0.0

    def add(self, output_tokens: int, requests: int, running_average: float | None) -> float | None:
        self.decode_tokens += output_tokens - requests
        if not running_average:
            return None
        rounds = self.decode_tokens / running_average
        run_rounds, self.rounds = rounds - self.rounds, rounds
        return (output_tokens - requests) / run_rounds if run_rounds > 0 else None


def plot(rows: list[dict], concurrency: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = sorted({r["drafter"] for r in rows}, key=lambda d: (d != "head", d))
    fig, axes = plt.subplots(1, len(drafters), figsize=(5 * len(drafters), 4), sharey=True, squeeze=False)
    for ax, drafter in zip(axes[0], drafters):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["drafter"] == drafter):
            points = [r for r in rows if r["drafter"] == drafter and r["variant"] == variant]
            ax.plot([r["concurrency"] for r in points], [r["output_throughput"] for r in points], marker="o", label=variant)
            base = [r["target_throughput"] for r in points]
        ax.plot(concurrency, base, marker="s", color="black", linestyle="--", label="target alone")
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_title(f"drafter: {drafter}")
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _policy_counts(log: Path) -> dict:
    """The adaptive server's cumulative round counts: rounds per tree size, head passes skipped,
    lookup chains skipped (from its last profile line)."""
    policy = ((last_profile(log) if log.exists() else None) or {}).get("tree_sizes") or {}
    counts = {f"size {k}": v for k, v in (policy.get("chosen") or {}).items()}
    return {**counts, "skipped_drafts": policy.get("skipped_drafts", 0), "skipped_chains": policy.get("skipped_chains", 0)}


def _count_difference(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def median_cells(measured: list[dict]) -> list[dict]:
    """One row per (drafter, variant, concurrency): the median over rounds of throughput, TPOT,
    accept length and ratio (each round's ratio against that round's target run), with every
    round's row kept under "rounds"; the adaptive policy's round counts are summed."""
    cells: dict[tuple, list[dict]] = {}
    for row in measured:
        cells.setdefault((row["drafter"], row["variant"], row["concurrency"]), []).append(row)
    rows = []
    for (drafter, variant, c), runs in cells.items():
        row = {"drafter": drafter, "variant": variant, "concurrency": c}
        for key in ("output_throughput", "median_tpot_ms", "accept_length", "target_throughput", "target_median_tpot_ms", "vs_target"):
            values = [r[key] for r in runs if r[key] is not None]
            row[key] = round(statistics.median(values), 3) if values else None
        if any("policy" in r for r in runs):
            row["policy"] = {}
            for r in runs:
                for k, v in r.get("policy", {}).items():
                    row["policy"][k] = row["policy"].get(k, 0) + v
        row["rounds"] = [{k: v for k, v in r.items() if k not in ("drafter", "variant", "concurrency")} for r in runs]
        rows.append(row)
    return rows


def save(rows: list[dict], args: argparse.Namespace, head: str) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "head": head, "rows": rows}, indent=1))
    plot([r for r in rows if "concurrency" in r], args.concurrency, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    cells = [r for r in rows if "concurrency" in r]
    print(f"\n{args.prompts}: {args.output_len} output tokens per request, {args.dtype}, median of {args.rounds} round(s); "
          "output tokens/s, ratio to the target alone, accept length")  # fmt: skip
    print(f"{'drafter':<8}{'variant':<28}" + "".join(f"{'c=' + str(c):>25}" for c in args.concurrency))
    for drafter in dict.fromkeys(r["drafter"] for r in cells):
        for variant in dict.fromkeys(r["variant"] for r in cells if r["drafter"] == drafter):
            line = {r["concurrency"]: r for r in cells if r["drafter"] == drafter and r["variant"] == variant}
            print(f"{drafter:<8}{variant:<28}" + "".join(
                f"{line[c]['output_throughput']:>9.1f} {line[c]['vs_target']:>5.2f}x τ {line[c]['accept_length'] or 0:>4.2f}"
                for c in args.concurrency))  # fmt: skip
    for row in cells:
        if "policy" in row:
            print(f"{row['drafter']}: adaptive rounds at c={row['concurrency']}: {row['policy']}")
    for row in rows:
        if "chosen" in row:
            print(f"{row['drafter']}: adaptive tree sizes chosen (rounds) {row['chosen']}")
        for kind, by_batch in (row.get("rounds_by_batch") or {}).items():  # the adaptive server's whole life
            cells = [f"{b}: {r['rounds']}x {r['ms']:.0f} ms {r['tokens']:.2f} tok" + (f" {r['vs_root']:.2f}" if "vs_root" in r else "")
                     for b, r in by_batch.items() if r["rounds"] >= 3]  # fmt: skip
            if cells:
                print(f"  {kind} rounds by batch size (rounds, mean ms, tokens per request, tokens/s vs root-only): " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="default", help="default, or a head directory")
    parser.add_argument("--prompts", default="sharegpt-heldout", help="sharegpt-heldout, humaneval, or a JSON/JSONL file")
    parser.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts (KV pool: --max-total-tokens)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="bench_serving --max-concurrency values")
    parser.add_argument("--num-prompts", type=int, default=8, help="requests per run (at least 2x the concurrency)")
    parser.add_argument("--budgets", type=int_list, default=[16, 64], help="static budgets; the largest is the adaptive cap")
    parser.add_argument("--drafters", type=drafter_list, default=["head", "p=0.6", "p=0.8"],
                        help="comma list, in order: head (the --head) and/or acceptance rates p of the synthetic proposer")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds over all concurrencies (each cell's target and JETFLOW runs interleaved per round); "
                             "the table reports per-cell medians")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dtype of every server (auto: bf16 where its matmuls are native, else float32)")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of each server")
    parser.add_argument("--cost-table", default=None, help="JETFLOW_COST_TABLE of the adaptive servers (benchmarks/verify_cost.py)")
    parser.add_argument("--adaptive-only", action="store_true",
                        help="run no static-budget servers: the target alone against JETFLOW adaptive (cap: the largest --budgets)")
    parser.add_argument("--out", default=None, help="write the JSON report here (and a PNG beside it)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    args.dtype = serving_dtype(args.dtype)

    from transformers import AutoTokenizer

    target_dir = resolve_target("default")
    head_dir = str(head_dir_for(args.head, target_dir))
    target = str(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target)
    nums = {c: max(args.num_prompts, 2 * c) for c in args.concurrency}
    texts = prompt_texts(args.prompts, max(nums.values()), tokenizer, args.max_prompt_tokens)
    if len(texts) < max(nums.values()):
        raise SystemExit(f"serving_curves: only {len(texts)} prompts of {args.prompts} fit --max-prompt-tokens")
    work = Path(tempfile.mkdtemp(prefix="jetflow-curves-"))
    datasets = {}
    for c, n in nums.items():  # the same n requests for every server at concurrency c
        datasets[c] = work / f"prompts{n}.json"
        write_sharegpt_file(texts[:n], datasets[c])
    cap = max(args.budgets)
    # SGLang folds accept counts into its running average only at --decode-log-interval
    # rounds: every round here, so the average is current when a run ends.
    every_round = ["--decode-log-interval", "1"]
    static = [] if args.adaptive_only else args.budgets
    variants = {f"static {b}": ([*sglang_server.jetflow_args(head_dir, b), *every_round], {BUDGET_ENV: "static"}) for b in static}
    adaptive_env = {"JETFLOW_PROFILE": "1", **({COST_TABLE_ENV: args.cost_table} if args.cost_table else {})}
    variants[f"adaptive (cap {cap})"] = ([*sglang_server.jetflow_args(head_dir, cap), *every_round], adaptive_env)  # the default
    start = dict(dtype=args.dtype, max_total_tokens=args.max_total_tokens)

    def run(url: str, tracker: AcceptTracker, c: int) -> dict:
        report = bench_serving(url, target, datasets[c], nums[c], c, args.output_len, work / "result.jsonl")
        tau = tracker.add(report["total_output_tokens"], report["completed"], report.get("accept_length"))
        return {"output_throughput": round(report["output_throughput"], 2), "median_tpot_ms": round(report["median_tpot_ms"], 1),
                "accept_length": round(tau, 3) if tau else None}  # fmt: skip

    rows: list[dict] = []
    target_server = sglang_server.start(target, work / "target.log", **start)
    try:
        oracle = work / "oracle.json"
        if any(d != "head" for d in args.drafters):
            write_oracle_file(target_server.url, texts, tokenizer, args.output_len, oracle)
        target_tracker = AcceptTracker()
        for k, drafter in enumerate(args.drafters):
            env = {} if drafter == "head" else {ORACLE_ENV: str(oracle), ORACLE_ACCEPT_ENV: drafter[2:]}
            servers, trackers = {}, {}
            try:
                for i, (name, (extra, variant_env)) in enumerate(variants.items()):
                    log = work / f"{drafter}-{i}.log"
                    servers[name] = sglang_server.start(target, log, *extra, env={**env, **variant_env}, **start)
                    trackers[name] = AcceptTracker()
                for name, server in servers.items():  # warm-up: every prompt once (radix cache as in the runs)
                    run(server.url, trackers[name], max(args.concurrency))
                if k == 0:
                    run(target_server.url, target_tracker, max(args.concurrency))
                adaptive_log = work / f"{drafter}-{len(variants) - 1}.log"
                measured: list[dict] = []
                for round_ in range(args.rounds):
                    for c in args.concurrency:
                        base = run(target_server.url, target_tracker, c)
                        for name, server in servers.items():
                            adaptive = name.startswith("adaptive")
                            before = _policy_counts(adaptive_log) if adaptive else None
                            cell = run(server.url, trackers[name], c)
                            row = {"drafter": drafter, "variant": f"JETFLOW {name}", "concurrency": c, "round": round_, **cell,
                                   "target_throughput": base["output_throughput"], "target_median_tpot_ms": base["median_tpot_ms"],
                                   "vs_target": round(cell["output_throughput"] / base["output_throughput"], 3)}  # fmt: skip
                            if adaptive:  # this cell's rounds (the log's cumulative counts, 20-round steps)
                                row["policy"] = _count_difference(_policy_counts(adaptive_log), before)
                            measured.append(row)
                            print(json.dumps(row), flush=True)
                rows += median_cells(measured)
                policy = (last_profile(adaptive_log) or {}).get("tree_sizes") or {}
                rows.append({"drafter": drafter, "variant": "adaptive tree sizes chosen (rounds)", "chosen": policy.get("chosen"),
                             "rounds_by_batch": policy.get("rounds_by_batch")})  # fmt: skip
                if args.out:  # after every drafter: a run cut short keeps what it measured
                    save(rows, args, Path(head_dir).name)
            finally:
                for server in servers.values():
                    server.stop()
    finally:
        target_server.stop()

    print_table(rows, args)


if __name__ == "__main__":
    main()
