"""How lookup nodes are scored against head nodes in a merged draft tree, measured in the
reference engine: τ (committed tokens per target forward) of the head alone, the head with the
prompt-lookup chain scored d * log 0.6 (the old fixed guess), and scored by the per-depth table
measured on training data (`jetflow_sglang.lookup.CHAIN_ACCEPT`), greedy, fp32.

    .venv/bin/python benchmarks/bench_chain_scores.py --prompts humaneval --limit 10 --budgets 16,64 \
        --max-new-tokens 64 --out benchmarks/results/chain_scores_humaneval10.json

Every variant must commit exactly the target's greedy tokens (checked per prompt). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from jetflow_sglang.assets import load_target_and_head
from jetflow_sglang.cli import int_list
from jetflow_sglang.reference.proposer import HeadProposer
from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
from jetflow_sglang.lookup import CHAIN_SCORES, geometric_scores
from jetflow_sglang.prompts import load_prompts

VARIANTS = {"head": None, "head+lookup (0.6^d)": geometric_scores(math.log(0.6), 15), "head+lookup (measured)": CHAIN_SCORES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", default="default", help="default, dflash-t, or a head directory")
    parser.add_argument("--prompts", default="humaneval", help="humaneval, sharegpt-heldout, or a JSON/JSONL file")
    parser.add_argument("--limit", type=int, default=10, help="first N prompts of the set")
    parser.add_argument("--budgets", type=int_list, default=[16, 64], help="comma-separated tree budgets")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()

    target, head = load_target_and_head("default", args.head, torch.float32)
    engines = {
        (name, budget): ReferenceEngine(target, HeadProposer(head), budget=budget, lookup=scores is not None,
                                        **({"lookup_scores": scores} if scores else {}))  # fmt: skip
        for name, scores in VARIANTS.items()
        for budget in args.budgets
    }
    totals = {key: [0, 0] for key in engines}  # committed tokens, rounds
    for prompt in load_prompts(args.prompts)[: args.limit]:
        ids = target.encode_prompt(prompt.text, prompt.kind == "chat")
        want = generate_ar(target, ids, args.max_new_tokens).tokens
        for key, engine in engines.items():
            result = engine.generate(ids, args.max_new_tokens)
            if result.tokens != want:
                raise SystemExit(f"{key}: output differs from the target's greedy decoding on {prompt.text[:40]!r}")
            totals[key][0] += sum(a + 1 for a in result.accept_lengths)
            totals[key][1] += result.rounds
    rows = [{"variant": name, "budget": budget, "tau": round(c / r, 3)} for (name, budget), (c, r) in totals.items()]
    print(f"{args.prompts}, first {args.limit} prompts, {args.max_new_tokens} new tokens, head {args.head}, fp32; all identical")
    print("| variant | " + " | ".join(f"τ@{b}" for b in args.budgets) + " |\n|---" + "|---" * len(args.budgets) + "|")
    for name in VARIANTS:
        print(f"| {name} | " + " | ".join(f"{r['tau']:.2f}" for r in rows if r["variant"] == name) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
