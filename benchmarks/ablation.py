"""Loss ablation (fkl vs rkl vs sft) and refresh vs one-pass, at one budget, on the recipe's data.

    .venv/bin/python benchmarks/ablation.py --steps 100 --out benchmarks/results/ablation.json

Each loss trains a causal head for the same steps on the data `make train-default`
regenerated (no revealed prefixes, so only the loss differs), then `jetflow eval` runs
it at the budget on the first HumanEval and held-out ShareGPT prompts. With
`--refresh-head DIR`, that head is also evaluated with the path-conditioned refresh pass,
before the loss runs (same prompts, same budget). Stages run once: rerun to resume.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jetflow_sglang import harness
from jetflow_sglang.training.recipe import EVAL_SETS, RecipeConfig, Stages, _data_dirs, _eval_dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="out/ablation", help="heads, eval results and stage records (rerun to resume)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per loss")
    parser.add_argument("--budget", type=int, default=64, help="tree budget of every eval")
    harness.add_args(parser, limit=10, max_new_tokens=64)
    parser.add_argument("--refresh-head", default=None, help="also compare refresh vs one-pass for this head")
    harness.add_args(parser, out=None)
    args = parser.parse_args(argv)
    recipe = RecipeConfig()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages(work)
    regen, corpus, _ = _data_dirs(recipe)
    data = ",".join(str(d) for d in (regen, corpus) if d is not None)

    def evaluate(name: str, head: str, extra: list[str]) -> dict:
        results = {}
        for prompts in EVAL_SETS:
            out = stages.run(f"eval-{name}-{prompts}", [
                "eval", "--head", head, "--prompts", prompts, "--limit", str(args.limit), "--budgets", str(args.budget),
                "--max-new-tokens", str(args.max_new_tokens), "--dtype", _eval_dtype(recipe), "--json", *extra,
            ])
            results[prompts] = json.loads(out.strip().splitlines()[-1])
        return results

    rows = {}
    if args.refresh_head:
        rows["one-pass"] = evaluate("one-pass", args.refresh_head, [])
        rows["refresh"] = evaluate("refresh", args.refresh_head, ["--refresh"])
    for loss in ("fkl", "rkl", "sft"):
        stages.run(f"train-{loss}", [
            "train", "--data", str(data), "--out", str(work / loss), "--loss", loss, "--steps", str(args.steps),
            "--batch-tokens", str(recipe.batch_tokens), "--anchor-fraction", str(recipe.anchor_fraction),
            "--draft-vocab", str(recipe.draft_vocab), "--lr", str(recipe.lr), "--warmup-steps", str(recipe.warmup_steps),
        ])
        rows[loss] = evaluate(loss, str(work / loss), [])
    header = f"{'run':<10}" + "".join(f"{p + ' tau':>22}{'speedup':>10}" for p in EVAL_SETS)
    print(header)
    for name, results in rows.items():
        print(f"{name:<10}" + "".join(f"{results[p]['tau']:>22.3f}{results[p]['speedup']:>9.2f}x" for p in EVAL_SETS))
    report = {"steps": args.steps, "budget": args.budget, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "rows": rows, "stage_seconds": {k: v["seconds"] for k, v in stages.record["stages"].items()}}
    if args.out:
        harness.write_json(args.out, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
