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
from pathlib import Path

from jetflow_sglang import harness
from jetflow_sglang.assets import resolve_target
from jetflow_sglang.budget import BUDGET_ENV
from jetflow_sglang.harness import Column, Fleet, Variant
from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.published import is_published_config

HEAD_ALONE = {"JETFLOW_LOOKUP": "0", BUDGET_ENV: "static"}  # no prompt-lookup branch, as DFLASH drafts


def variants(head: str, block_size: int, budgets: list[int]) -> list[Variant]:
    dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", head,
              "--speculative-num-draft-tokens", str(block_size)]  # fmt: skip
    return [
        Variant("target", env=HEAD_ALONE),
        Variant("dflash", tuple(dflash), HEAD_ALONE),
        Variant.jetflow("jetflow-chain", head, block_size, "--speculative-eagle-topk", "1", env=HEAD_ALONE),
        *(Variant.jetflow(f"jetflow-{b}", head, b, env=HEAD_ALONE) for b in budgets),
    ]


def run_variant(fleet: Fleet, variant: Variant, prompts: list, max_new_tokens: int) -> dict:
    """One variant's server up alone: every prompt once, or the reason the platform refused it."""
    try:
        fleet.start(variant)
    except RuntimeError as exc:
        return {"refused": harness.refusal(exc)}
    try:
        fleet.warm_up(prompts[0])
        return {"requests": [fleet.request(variant.name, prompt, max_new_tokens=max_new_tokens) for prompt in prompts]}
    finally:
        fleet.stop(variant.name)


def summarize(results: list[dict], baseline: list[dict]) -> dict:
    """A variant's medians over rounds of its per-round medians against the target's same round."""
    if "refused" in results[0]:
        return {"refused": results[0]["refused"]}
    per_round = []
    for result, base in zip(results, baseline):
        pairs = list(zip(result["requests"], base["requests"]))
        per_round.append({
            "tokens_per_s": harness.median(r["tokens_per_s"] for r, _ in pairs),
            "speedup": harness.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs),
            "tau": harness.median(r["tau"] for r, _ in pairs),
            "identical": sum(r["text"] == b["text"] for r, b in pairs) / len(pairs),
        })  # fmt: skip
    return harness.medians(per_round, per_round[0], digits=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_args(parser, target="default")
    parser.add_argument("--head", required=True, help="a head directory in the published DFlash layout")
    harness.add_args(parser, prompts="humaneval", limit=8)
    parser.add_argument("--budgets", default="16,64,256", help="JETFLOW tree budgets, comma-separated")
    harness.add_args(parser, max_new_tokens=128, dtype="bfloat16")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the cycle over all variants; medians are reported")
    harness.add_args(parser, out=None)
    args = parser.parse_args()
    args.dtype = harness.serving_dtype(args.dtype)

    head = JetFlowHead.load(args.head)  # a clear error for a head that is not loadable
    if not is_published_config(json.loads((Path(args.head) / "config.json").read_text())):
        parser.error("--head must be in the published DFlash layout (jetflow export writes it)")
    target = str(resolve_target(args.target))
    prompts = harness.bench_prompts(args.prompts, args.limit)
    by_name = {v.name: v for v in variants(args.head, head.config.block_size, [int(b) for b in args.budgets.split(",")])}
    with Fleet(target, harness.work_dir("race"), args.dtype) as fleet:

        def measure(name: str, _cell: object) -> dict:
            result = run_variant(fleet, by_name[name], prompts, args.max_new_tokens)
            print(json.dumps({"variant": name, **({"refused": result["refused"]} if "refused" in result else {})}), flush=True)
            return result

        runs = harness.interleave(args.rounds, ["all"], list(by_name), measure)[0]
    summary = {name: summarize(results, runs["target"]) for name, results in runs.items()}
    columns = [Column("variant", "name", width=15, left=True), Column("tokens/s", "tokens_per_s", ".2f", 9),
               Column("speedup", "speedup", ".3f", 8), Column("tau", "tau", ".2f", 6), Column("identical", "identical", ".0%")]  # fmt: skip
    title = f"{len(prompts)} {args.prompts} prompts, {args.dtype}, {args.rounds} round(s)"
    print("\n" + harness.format_table(columns, [{"name": n, **row} for n, row in summary.items() if "refused" not in row], title))
    for name, row in summary.items():
        if "refused" in row:
            print(f"{name:<15} refused: {row['refused']}")
    if args.out:
        harness.write_json(args.out, {"config": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
