"""How often a prompt-lookup chain is right, by depth: the table behind
`jetflow_sglang.lookup.CHAIN_ACCEPT` (the scores lookup nodes get in a draft tree).

    .venv/bin/python benchmarks/lookup_acceptance.py --data ~/.cache/jetflow/data/sharegpt-regen \
        --first 128 --out benchmarks/results/lookup_acceptance.json

For every anchor in the first `--first` tokens of each target-written answer (training data:
never the evaluation prompts), the chain `lookup_draft` proposes after it is compared with the
answer's next tokens. Prints, per depth d, P(the first d chain tokens are all right | a chain
was found) and the conditional chance to continue, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jetflow_sglang.lookup import lookup_draft
from jetflow_sglang.training.data import iter_examples


def measure(data: Path, first: int, depths: int, limit: int | None = None) -> dict:
    anchors = with_chain = 0
    right = [0] * depths  # chains whose first d+1 tokens are right
    scored = [0] * depths  # chains with a true token at depth d+1 to compare with
    for example in list(iter_examples(data))[:limit]:
        prompt, answer = example["prompt_ids"], example["response_ids"]
        for a in range(min(len(answer) - 1, first)):
            anchors += 1
            chain = lookup_draft(prompt + answer[: a + 1], depths)
            if not chain:
                continue
            with_chain += 1
            for d, token in enumerate(chain[: len(answer) - a - 1]):
                scored[d] += 1
                if token != answer[a + 1 + d]:
                    break
                right[d] += 1
    # P(first d right | chain) over chains long enough to be scored at depth d: the product of
    # the conditional chances, each over the chains that reached that depth.
    accept, cumulative = [], 1.0
    for d in range(depths):
        reached = scored[d] if d == 0 else right[d - 1]
        cumulative *= right[d] / reached if reached else 0.0
        accept.append(cumulative)
    return {"data": data.name, "first": first, "examples": limit, "anchors": anchors, "with_chain": with_chain, "accept": accept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a data directory of target-written answers (jetflow regenerate)")
    parser.add_argument("--first", type=int, default=128, help="anchors within the first N tokens of each answer")
    parser.add_argument("--depths", type=int, default=15, help="chain length scored")
    parser.add_argument("--limit", type=int, default=None, help="the first N answers only")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    report = measure(Path(args.data).expanduser(), args.first, args.depths, args.limit)
    print(f"{report['anchors']} anchors, {report['with_chain']} with a lookup chain")
    print("| depth | P(chain right to here) | P(continue) |\n|---|---|---|")
    previous = 1.0
    for d, p in enumerate(report["accept"], 1):
        print(f"| {d} | {p:.3f} | {p / previous if previous else 0:.3f} |")
        previous = p
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
