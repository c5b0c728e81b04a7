"""`jetflow` console script."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from jetflow_sglang.errors import JetFlowError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse


def cmd_prepare(args: argparse.Namespace) -> None:
    from jetflow_sglang.assets import prepare

    print(json.dumps(prepare(args.target)), flush=True)


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.drafter import HeadDrafter
    from jetflow_sglang.engine import ReferenceEngine, Sampling, generate_ar

    from jetflow_sglang.tree import MAX_BUDGET

    if not 1 <= args.budget <= MAX_BUDGET:
        raise JetFlowError(f"budget must be between 1 and {MAX_BUDGET}, got {args.budget}")
    if args.temperature < 0:
        raise JetFlowError(f"temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise JetFlowError(f"top-p must be in (0, 1], got {args.top_p}")
    torch.manual_seed(args.seed if args.seed is not None else 0)
    target, head = load_target_and_head(args.target, args.head, getattr(torch, DTYPES[args.dtype]))
    engine = ReferenceEngine(target, HeadDrafter(head), budget=args.budget, width=args.width)
    prompt_ids = target.encode_prompt(args.prompt, chat=args.chat)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)

    spec_runs, ar_runs = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        spec_runs.append(engine.generate(prompt_ids, args.max_new_tokens, sampling))
        if args.compare_ar:
            ar_runs.append(generate_ar(target, prompt_ids, args.max_new_tokens, sampling))
    result = spec_runs[0]
    report = {
        "text": target.tokenizer.decode(result.tokens, skip_special_tokens=True),
        "new_tokens": len(result.tokens),
        "rounds": result.rounds,
        "tau": round(result.tau, 4),
        "tokens_per_s": round(statistics.median(r.tokens_per_s for r in spec_runs), 3),
    }
    if args.compare_ar:
        ar_tps = statistics.median(r.tokens_per_s for r in ar_runs)
        report["ar_tokens_per_s"] = round(ar_tps, 3)
        report["speedup"] = round(report["tokens_per_s"] / ar_tps, 4) if ar_tps else None
        # Token identity is the lossless check for greedy decoding; sampled runs differ in their draws.
        report["identical"] = result.tokens == ar_runs[0].tokens if args.temperature == 0 else None
    if args.json:
        print(json.dumps(report), flush=True)
        return
    print(report.pop("text"))
    print("---")
    print("  ".join(f"{k}={v}" for k, v in report.items()), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description="JetFlow speculative decoding for SGLang")
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare", help="prepare the default target and a loadable head; print their paths")
    prepare.add_argument("--target", default="default", help="default or a HF model directory")
    prepare.set_defaults(func=cmd_prepare)

    gen = sub.add_parser("generate", help="speculative generation on the HF reference engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--target", default="default", help="default or a HF model directory")
    gen.add_argument("--head", default="default", help="default, random, or a head directory")
    gen.add_argument("--budget", type=int, default=64, help="tree nodes per round, root included (1..512)")
    gen.add_argument("--width", type=_positive("width"), default=7, help="top-k per draft depth")
    gen.add_argument("--max-new-tokens", type=_positive("max new tokens"), default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--repeats", type=_positive("repeats"), default=1, help="timed runs; tokens/s is the median")
    gen.add_argument("--compare-ar", action="store_true", help="also decode with the target alone and compare")
    gen.add_argument("--json", action="store_true", help="print one JSON line")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except JetFlowError as exc:
        print(f"jetflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
