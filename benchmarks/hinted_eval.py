"""Hinted head against its control and the shipped head: per-depth top-1 and τ per budget.

    .venv/bin/python benchmarks/hinted_eval.py --head v6=default --head control=out/hinted/control \
        --head hinted=out/hinted/hinted --out benchmarks/results/hinted_eval.json

Per prompt set (HumanEval: code; held-out ShareGPT: chat; neither trained on), fp32, greedy:
1. per depth, on every anchor of the target's own continuation (computed once, shared by all
   heads): top-1 of each head, of the prompt lookup, of the hinted heads with hints blanked, and
   the ceiling P(head right or lookup right); chain τ of each;
2. τ at each budget in the reference engine, each timed head with the lookup branch (and the
   --branchless ones without it), plus the lookup alone; `identical` says every run matched plain decoding token for token.
Prints tables and writes JSON (and a PNG of top-1 per depth).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from jetflow_sglang.assets import load_head, resolve_target
from jetflow_sglang.reference.proposer import HeadProposer
from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
from jetflow_sglang.reference.target import Target
from jetflow_sglang.prompts import load_prompts
from jetflow_sglang.training.features import featurize, store_from_parts
from jetflow_sglang.training.validate import ValidationSet


def per_depth(target: Target, heads: dict, prompts: list, max_new_tokens: int) -> tuple[dict, list]:
    examples, continuations = [], []
    for prompt in prompts:
        ids = target.encode_prompt(prompt.text, prompt.kind == "chat")
        continuation = generate_ar(target, ids, max_new_tokens).tokens
        continuations.append((ids, continuation))
        examples.append({"ids": ids + continuation, "prompt_len": len(ids)})
    store = store_from_parts([featurize(target, examples)])
    block = next(iter(heads.values())).config.block_size
    val = ValidationSet.from_store(store, block)
    rows = {name: val.score(head) for name, head in heads.items()}
    return rows, continuations


def taus(target: Target, heads: dict, continuations: list, budgets: list[int], max_new_tokens: int,
         branchless: set[str]) -> list[dict]:  # fmt: skip
    any_head = next(iter(heads.values()))
    variants = [("lookup alone", any_head, True, False)]
    variants += [(f"{name}{'' if lookup else ' (no branch)'}", head, lookup, True)
                 for name, head in heads.items() for lookup in ((True, False) if name in branchless else (True,))]  # fmt: skip
    out = []
    for budget in budgets:
        for label, head, lookup, use_head in variants:
            engine = ReferenceEngine(target, HeadProposer(head), budget=budget, lookup=lookup, head=use_head)
            committed = rounds = 0
            identical = True
            for ids, plain in continuations:
                result = engine.generate(ids, max_new_tokens)
                identical &= result.tokens == plain
                committed += sum(a + 1 for a in result.accept_lengths)
                rounds += result.rounds
            out.append({"budget": budget, "drafter": label, "tau": round(committed / max(1, rounds), 3), "identical": identical})
            print(f"  budget {budget:>3}  {label:<24} tau {out[-1]['tau']:.3f}  identical {identical}", flush=True)
    return out


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sets = list(report["per_depth"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.5), dpi=100, squeeze=False)
    for ax, name in zip(axes[0], sets):
        rows = report["per_depth"][name]
        first = next(iter(rows.values()))
        depths = list(range(1, len(first["top1"]) + 1))
        for head, row in rows.items():
            ax.plot(depths, row["top1"], marker="o", markersize=3, label=head)
        ax.plot(depths, first["lookup_top1"], linestyle="--", color="gray", label="prompt lookup")
        ax.set_title(f"{name}: top-1 per depth")
        ax.set_xlabel("draft depth")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", action="append", required=True, help="NAME=SPEC (default, or a head directory); repeat")
    parser.add_argument("--sets", default="humaneval:20,sharegpt-heldout:10", help="SET:LIMIT pairs, comma-separated")
    parser.add_argument("--per-depth-tokens", type=int, default=64, help="target continuation length for per-depth scores")
    parser.add_argument("--budgets", default="16,32,64", help="comma-separated tree budgets for τ")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per prompt for τ")
    parser.add_argument("--no-tau", action="store_true", help="per-depth scores only")
    parser.add_argument("--tau-heads", default="", help="comma-separated heads timed for τ (default: all)")
    parser.add_argument("--branchless", default="", help="comma-separated heads also timed without the lookup branch")
    parser.add_argument("--out", required=True, help="JSON report path (a PNG is written beside it)")
    args = parser.parse_args(argv)
    try:
        named = dict(item.split("=", 1) for item in args.head)
        sets = [(s.split(":")[0], int(s.split(":")[1])) for s in args.sets.split(",")]
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        print("hinted_eval: error: --head takes NAME=SPEC, --sets SET:LIMIT,..., --budgets integers", file=sys.stderr)
        return 2
    target_dir = resolve_target("default")
    heads = {name: load_head(spec, target_dir).float() for name, spec in named.items()}
    target = Target(target_dir, dtype=torch.float32, tap_layers=next(iter(heads.values())).config.target_layer_ids)
    for head in heads.values():
        head.eval().requires_grad_(False).bind_target(target.embedding, target.lm_head)
    report = {"heads": named, "per_depth": {}, "tau": {}}
    for name, limit in sets:
        prompts = load_prompts(name)[:limit]
        rows, continuations = per_depth(target, heads, prompts, args.per_depth_tokens)
        report["per_depth"][name] = rows
        print(f"{name} ({limit} prompts): top-1 at depths 1,2,3,4,8,15 and chain τ", flush=True)
        first = next(iter(rows.values()))
        pick = lambda xs: " ".join(f"{xs[d - 1]:.2f}" for d in (1, 2, 3, 4, 8, 15))  # noqa: E731
        print(f"  {'lookup':<22} {pick(first['lookup_top1'])}  τ {first['lookup_chain_tau']:.2f}")
        for head, row in rows.items():
            print(f"  {head:<22} {pick(row['top1'])}  τ {row['chain_tau']:.2f}   ceiling {pick(row['either_top1'])}")
            if "blanked_top1" in row:
                print(f"  {head + ' (blanked)':<22} {pick(row['blanked_top1'])}  τ {row['blanked_chain_tau']:.2f}   "
                      f"copy {pick(row['hint_use']['copy'])}")  # fmt: skip
        if not args.no_tau:
            short = [(ids, plain[: args.max_new_tokens]) for ids, plain in continuations]
            timed = {k: v for k, v in heads.items() if not args.tau_heads or k in args.tau_heads.split(",")}
            report["tau"][name] = taus(target, timed, short, budgets, args.max_new_tokens, set(args.branchless.split(",")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
