"""JETFLOW (trees) against SGLang's own DFLASH (a chain) on the same published-layout head weights,
in the same SGLang build: the paper's central comparison measured inside SGLang.

    .venv/bin/python benchmarks/race_dflash.py --target PATH/TO/Qwen3-8B --head PATH/TO/Qwen3-8B-DFlash-b16 \
        --prompts humaneval --limit 40 --max-new-tokens 256 --dtype bfloat16 --out benchmarks/results/race.json

Variants, each one server on 127.0.0.1 in turn (one at a time, so a large target fits one
GPU), every prompt greedy through the OpenAI API: the target alone; DFLASH
(`--speculative-num-draft-tokens` = the head's block size); JETFLOW at width 1 (the same
chain, whose accept lengths should equal DFLASH's); JETFLOW trees at the given budgets. JETFLOW
drafts with the head alone (no prompt-lookup branch), as DFLASH does.
`--rounds N` repeats the whole cycle and reports medians. A variant the platform refuses (this
CPU refuses DFLASH: SGLang's DFLASH worker uses CUDA streams) is reported with the reason.
Prints a table (tokens/s, tau, speedup over the target alone, outputs identical to it) and
writes JSON. The head directory must be in the published layout (`jetflow export`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from jetflow_sglang import server as sglang_server
from jetflow_sglang.assets import resolve_target
from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.published import is_published_config
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.served import BenchConfig, _request, bench_prompts


def variants(head: str, block_size: int, budgets: list[int]) -> dict[str, list[str]]:
    spec = ["--speculative-draft-model-path", head]
    out = {
        "target": [],
        "dflash": ["--speculative-algorithm", "DFLASH", *spec, "--speculative-num-draft-tokens", str(block_size)],
        "jetflow-chain": [*sglang_server.jetflow_args(head, block_size), "--speculative-eagle-topk", "1"],
    }
    out.update({f"jetflow-{b}": sglang_server.jetflow_args(head, b) for b in budgets})
    return out


def run_variant(target: str, args: list[str], log: Path, prompts, config: BenchConfig, dtype: str) -> dict:
    from openai import OpenAI

    try:
        server = sglang_server.start(target, log, *args, dtype=dtype, env={"JETFLOW_LOOKUP": "0", BUDGET_ENV: "static"})
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if "not supported" in line or "Error" in line]
        return {"refused": (lines[-1] if lines else str(exc).splitlines()[0]).strip()}
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        _request(client, model, prompts[0], BenchConfig(max_new_tokens=8))  # warm-up
        return {"requests": [_request(client, model, prompt, config) for prompt in prompts]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="default or a HF model directory")
    parser.add_argument("--head", required=True, help="a head directory in the published DFlash layout")
    parser.add_argument("--prompts", default="humaneval", help="demo, humaneval, sharegpt-heldout, or a JSON/JSONL file")
    parser.add_argument("--limit", type=int, default=8, help="first N prompts of the set")
    parser.add_argument("--budgets", default="16,64,256", help="JETFLOW tree budgets, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="dtype of every server")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the cycle over all variants; medians are reported")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()

    head = JetFlowHead.load(args.head)  # a clear error for a head that is not loadable
    if not is_published_config(json.loads((Path(args.head) / "config.json").read_text())):
        parser.error("--head must be in the published DFlash layout (jetflow export writes it)")
    target = str(resolve_target(args.target))
    prompts = bench_prompts(args.prompts, args.limit)
    config = BenchConfig(max_new_tokens=args.max_new_tokens)
    work = Path(tempfile.mkdtemp(prefix="jetflow-race-"))
    runs: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for name, flags in variants(args.head, head.config.block_size, [int(b) for b in args.budgets.split(",")]).items():
            result = run_variant(target, flags, work / f"{name}-{round_index}.log", prompts, config, args.dtype)
            runs.setdefault(name, []).append(result)
            print(json.dumps({"round": round_index, "variant": name, **({"refused": result["refused"]} if "refused" in result else {})}), flush=True)

    baseline = runs["target"]
    summary = {}
    for name, results in runs.items():
        if "refused" in results[0]:
            summary[name] = {"refused": results[0]["refused"]}
            continue
        per_round = []
        for result, base in zip(results, baseline):
            pairs = list(zip(result["requests"], base["requests"]))
            per_round.append({
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r, _ in pairs),
                "speedup": statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs),
                "tau": statistics.median(r["tau"] for r, _ in pairs) if pairs[0][0]["tau"] is not None else None,
                "identical": sum(r["text"] == b["text"] for r, b in pairs) / len(pairs),
            })  # fmt: skip
        summary[name] = {key: (statistics.median(r[key] for r in per_round) if per_round[0][key] is not None else None)
                         for key in per_round[0]}  # fmt: skip
    print(f"\n{'variant':<15} {'tokens/s':>9} {'speedup':>8} {'tau':>6} {'identical':>10}   "
          f"({len(prompts)} {args.prompts} prompts, {args.dtype}, {args.rounds} round(s))")  # fmt: skip
    for name, row in summary.items():
        if "refused" in row:
            print(f"{name:<15} refused: {row['refused']}")
            continue
        tau = f"{row['tau']:.2f}" if row["tau"] is not None else "-"
        print(f"{name:<15} {row['tokens_per_s']:>9.2f} {row['speedup']:>7.3f}x {tau:>6} {row['identical']:>10.0%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
