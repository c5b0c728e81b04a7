"""Throughput against concurrency with `python -m sglang.bench_serving`: the target alone,
JETFLOW at static budgets, and JETFLOW adaptive, each with the shipped head and with the
synthetic proposer at set acceptance rates.

    .venv/bin/python benchmarks/serving_curves.py --prompts sharegpt-heldout --concurrency 1,2,4,8,16 \
        --budgets 16,64 --drafters head,0.6,0.8 --output-len 64 --cost-table benchmarks/results/verify_cost_cpu.json \
        --out benchmarks/results/serving_curves_sharegpt.json

The prompts (held-out ShareGPT questions through the chat template, or HumanEval tasks as raw
completions) are written to a ShareGPT-format file that bench_serving reads with its own
sampler; every request asks for exactly --output-len tokens (bench_serving's ignore_eos),
greedy. With --vary-output-len each request asks for its own length instead, spread evenly
over [--output-len / 3, 5 --output-len / 3] in a fixed order, the same on every server: with
equal lengths the target alone's requests finish together and the next ones prefill together,
while JETFLOW's commit at different rates and prefill one by one between decode rounds (each a
forward pass the batch waits for), a lockstep that real answers of varied length do not have.
The target-alone server stays up for the whole run; the JETFLOW servers come up one drafter at a
time (the head, then the synthetic proposer at each p: the target's greedy
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
import subprocess
import sys
from pathlib import Path

from jetflow_sglang import harness
from jetflow_sglang import server as sglang_server
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.cli import int_list
from jetflow_sglang.harness import PROFILE, Column, Fleet, Variant, last_profile
from jetflow_sglang.testing.hooks import ORACLE_ACCEPT_ENV
from jetflow_sglang.testing.hooks import ORACLE_ENV


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
    for prompt in harness.bench_prompts(spec, None):
        if prompt.kind == "chat":
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True)
        else:
            text = prompt.text
        if len(tokenizer.encode(text)) <= max_prompt_tokens:
            texts.append(text)
        if len(texts) == limit:
            break
    return texts


def spread_lengths(n: int, mean: int) -> list[int]:
    """n output lengths spread evenly over [mean / 3, 5 mean / 3], in a fixed scrambled order."""
    low, high = max(4, mean // 3), 5 * mean // 3
    return [low + ((i * 37) % n) * (high - low) // max(1, n - 1) for i in range(n)]


def write_sharegpt_file(texts: list[str], path: Path, tokenizer=None, lengths: list[int] | None = None) -> None:
    """bench_serving's ShareGPT format. The answer only sets a length: overridden by
    --sharegpt-output-len, or (`lengths`) an answer of exactly that many tokens."""
    answers = ["ok ok ok ok"] * len(texts) if lengths is None else [" ok" * n for n in lengths]
    if lengths is not None:
        for n, answer in zip(lengths, answers):
            if len(tokenizer.encode(answer, add_special_tokens=False)) != n:
                raise SystemExit(f"serving_curves: an answer of {n} tokens did not encode to {n} tokens")
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": a}]}
            for i, (t, a) in enumerate(zip(texts, answers))]  # fmt: skip
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
                  output_len: int | None, result: Path) -> dict:  # fmt: skip
    """output_len None: each request's length is its answer's in the dataset."""
    port = url.rsplit(":", 1)[1]
    result.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port", port,
         "--tokenizer", tokenizer_path, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
         "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
         "--request-rate", "inf", "--seed", "1", "--disable-tqdm", "--output-file", str(result),
         *(["--sharegpt-output-len", str(output_len)] if output_len else [])],
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
    """Output tokens/s by concurrency, a panel per drafter: each variant and the target alone."""
    panels = {}
    for drafter in sorted({r["drafter"] for r in rows}, key=lambda d: (d != "head", d)):
        lines = {}
        for variant in dict.fromkeys(r["variant"] for r in rows if r["drafter"] == drafter):
            points = [r for r in rows if r["drafter"] == drafter and r["variant"] == variant]
            lines[variant] = ([r["concurrency"] for r in points], [r["output_throughput"] for r in points])
            lines["target alone"] = (concurrency, [r["target_throughput"] for r in points])
        panels[f"drafter: {drafter}"] = dict(sorted(lines.items(), key=lambda item: item[0] == "target alone"))
    harness.plot_lines(path, panels, "concurrent requests", "output tokens/s", dashed=["target alone"])


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
        row = {"drafter": drafter, "variant": variant, "concurrency": c,
               **harness.medians(runs, ("output_throughput", "median_tpot_ms", "accept_length", "target_throughput",
                                        "target_median_tpot_ms", "vs_target"))}  # fmt: skip
        if any("policy" in r for r in runs):
            row["policy"] = {}
            for r in runs:
                for k, v in r.get("policy", {}).items():
                    row["policy"][k] = row["policy"].get(k, 0) + v
        row["rounds"] = [{k: v for k, v in r.items() if k not in ("drafter", "variant", "concurrency")} for r in runs]
        rows.append(row)
    return rows


def save(rows: list[dict], args: argparse.Namespace, head: str) -> None:
    out = harness.write_json(args.out, {"config": vars(args), "head": head, "rows": rows}, indent=1)
    plot([r for r in rows if "concurrency" in r], args.concurrency, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)


def cell_text(row: dict) -> str:
    return f"{row['output_throughput']:.1f} {row['vs_target']:>5.2f}x τ {row['accept_length'] or 0:>4.2f}"


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    cells = [r for r in rows if "concurrency" in r]
    lengths = f"a mean of {args.output_len}" if args.vary_output_len else str(args.output_len)
    print(f"\n{args.prompts}: {lengths} output tokens per request, {args.dtype}, median of {args.rounds} round(s); "
          "output tokens/s, ratio to the target alone, accept length")  # fmt: skip
    lines: dict[tuple, dict] = {}
    for r in cells:
        lines.setdefault((r["drafter"], r["variant"]), {"drafter": r["drafter"], "variant": r["variant"]})[r["concurrency"]] = r
    columns = [Column("drafter", "drafter", width=7, left=True), Column("variant", "variant", width=27, left=True),
               *(Column(f"c={c}", lambda line, c=c: cell_text(line[c]), width=24) for c in args.concurrency)]  # fmt: skip
    print(harness.format_table(columns, lines.values()))
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


def variants(args: argparse.Namespace, head_dir: str) -> list[Variant]:
    """JETFLOW at each static budget (unless --adaptive-only) and adaptive at the cap (the default)."""
    cap = max(args.budgets)
    # SGLang folds accept counts into its running average only at --decode-log-interval
    # rounds: every round here, so the average is current when a run ends.
    every_round = ("--decode-log-interval", "1")
    static = [] if args.adaptive_only else args.budgets
    out = [Variant.jetflow(f"static {b}", head_dir, b, *every_round, env={BUDGET_ENV: "static"}) for b in static]
    return out + [Variant.jetflow(f"adaptive (cap {cap})", head_dir, cap, *every_round, env={**PROFILE, **harness.cost_env(args.cost_table)})]


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
    parser.add_argument("--vary-output-len", action="store_true",
                        help="each request asks for its own length, spread over [--output-len / 3, 5 --output-len / 3] "
                             "(mean --output-len), the same on every server: no lockstep batches")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds over all concurrencies (each cell's target and JETFLOW runs interleaved per round); "
                             "the table reports per-cell medians")
    harness.add_args(parser, dtype="auto")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of each server")
    harness.add_args(parser, cost_table=None)
    parser.add_argument("--adaptive-only", action="store_true",
                        help="run no static-budget servers: the target alone against JETFLOW adaptive (cap: the largest --budgets)")
    parser.add_argument("--out", default=None, help="write the JSON report here (and a PNG beside it)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    args.dtype = harness.serving_dtype(args.dtype)

    from transformers import AutoTokenizer

    target, head_dir = harness.resolve("default", args.head)
    tokenizer = AutoTokenizer.from_pretrained(target)
    nums = {c: max(args.num_prompts, 2 * c) for c in args.concurrency}
    texts = prompt_texts(args.prompts, max(nums.values()), tokenizer, args.max_prompt_tokens)
    if len(texts) < max(nums.values()):
        raise SystemExit(f"serving_curves: only {len(texts)} prompts of {args.prompts} fit --max-prompt-tokens")
    work = harness.work_dir("curves")
    datasets = {}
    for c, n in nums.items():  # the same n requests for every server at concurrency c
        datasets[c] = work / f"prompts{n}.json"
        write_sharegpt_file(texts[:n], datasets[c], tokenizer, spread_lengths(n, args.output_len) if args.vary_output_len else None)
    jetflow = variants(args, head_dir)
    adaptive = jetflow[-1].name
    trackers = {"target": AcceptTracker()}

    def run(fleet: Fleet, name: str, c: int) -> dict:
        fixed = None if args.vary_output_len else args.output_len
        report = bench_serving(fleet.servers[name].url, target, datasets[c], nums[c], c, fixed, work / "result.jsonl")
        tau = trackers[name].add(report["total_output_tokens"], report["completed"], report.get("accept_length"))
        return {"output_throughput": round(report["output_throughput"], 2), "median_tpot_ms": round(report["median_tpot_ms"], 1),
                "accept_length": round(tau, 3) if tau else None}  # fmt: skip

    rows: list[dict] = []
    with Fleet(target, work, args.dtype, args.max_total_tokens) as fleet:
        fleet.start(Variant("target"), work / "target.log")
        oracle = work / "oracle.json"
        if any(d != "head" for d in args.drafters):
            longest = 5 * args.output_len // 3 if args.vary_output_len else args.output_len
            write_oracle_file(fleet.servers["target"].url, texts, tokenizer, longest, oracle)
        for k, drafter in enumerate(args.drafters):
            env = {} if drafter == "head" else {ORACLE_ENV: str(oracle), ORACLE_ACCEPT_ENV: drafter[2:]}
            for i, variant in enumerate(jetflow):
                fleet.start(Variant(variant.name, variant.flags, {**env, **variant.env}), work / f"{drafter}-{i}.log")
                trackers[variant.name] = AcceptTracker()
            for variant in jetflow:  # warm-up: every prompt once (radix cache as in the runs)
                run(fleet, variant.name, max(args.concurrency))
            if k == 0:
                run(fleet, "target", max(args.concurrency))

            def measure(name: str, c: int) -> dict:
                before = _policy_counts(fleet.logs[name]) if name == adaptive else None
                cell = run(fleet, name, c)
                if before is not None:  # this cell's rounds (the log's cumulative counts, 20-round steps)
                    cell["policy"] = _count_difference(_policy_counts(fleet.logs[name]), before)
                print(json.dumps({"drafter": drafter, "variant": name, "concurrency": c, **cell}), flush=True)
                return cell

            names = ["target", *(v.name for v in jetflow)]
            measured: list[dict] = []
            for c, by_name in zip(args.concurrency, harness.interleave(args.rounds, args.concurrency, names, measure)):
                for round_, base in enumerate(by_name["target"]):
                    for variant in jetflow:
                        cell = by_name[variant.name][round_]
                        measured.append({"drafter": drafter, "variant": f"JETFLOW {variant.name}", "concurrency": c, "round": round_,
                                         **cell, "target_throughput": base["output_throughput"],
                                         "target_median_tpot_ms": base["median_tpot_ms"],
                                         "vs_target": round(cell["output_throughput"] / base["output_throughput"], 3)})  # fmt: skip
            rows += median_cells(measured)
            policy = (fleet.profile(adaptive) or {}).get("tree_sizes") or {}
            rows.append({"drafter": drafter, "variant": "adaptive tree sizes chosen (rounds)", "chosen": policy.get("chosen"),
                         "rounds_by_batch": policy.get("rounds_by_batch")})  # fmt: skip
            for variant in jetflow:
                fleet.stop(variant.name)
            if args.out:  # after every drafter: a run cut short keeps what it measured
                save(rows, args, Path(head_dir).name)

    print_table(rows, args)


if __name__ == "__main__":
    main()
