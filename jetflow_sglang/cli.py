"""`jetflow` console script."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from jetflow_sglang.errors import JetFlowError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
SERVING_DTYPES = sorted(DTYPES) + ["auto"]  # auto: bf16 where native (AMX, AVX512-BF16, CUDA), else fp32


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


def _config_from_args(config_class, args: argparse.Namespace, **overrides):
    """A config dataclass from the parsed flags of the same names (unset flags keep the defaults)."""
    fields = {k: v for k, v in vars(args).items() if k in config_class.__dataclass_fields__ and v is not None}
    return config_class(**{**fields, **overrides})


def cmd_prepare(args: argparse.Namespace) -> None:
    from jetflow_sglang.assets import prepare

    print(json.dumps(prepare(args.target)), flush=True)


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.reference.engine import ReferenceEngine, Sampling, generate_ar
    from jetflow_sglang.reference.proposer import HeadProposer
    from jetflow_sglang.tree import budget_error

    if (error := budget_error(args.budget)) is not None:
        raise JetFlowError(error)
    if args.temperature < 0:
        raise JetFlowError(f"temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise JetFlowError(f"top-p must be in (0, 1], got {args.top_p}")
    torch.manual_seed(args.seed if args.seed is not None else 0)
    target, head = load_target_and_head(args.target, args.head, getattr(torch, DTYPES[args.dtype]))
    engine = ReferenceEngine(target, HeadProposer(head), budget=args.budget, width=args.width, lookup=args.lookup)
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
        "tokens": result.tokens,
        "new_tokens": len(result.tokens),
        "rounds": result.rounds,
        "tau": round(result.tau, 4),
        "accept_lengths": result.accept_lengths,  # accepted drafts per verify round
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
    report.pop("tokens")
    report.pop("accept_lengths")
    print("---")
    print("  ".join(f"{k}={v}" for k, v in report.items()), flush=True)


def cmd_regenerate(args: argparse.Namespace) -> None:
    from jetflow_sglang.training.regenerate import RegenerateConfig, regenerate

    report = regenerate(_config_from_args(RegenerateConfig, args))
    report.pop("config", None)
    print(json.dumps(report), flush=True)


def cmd_train(args: argparse.Namespace) -> None:
    from jetflow_sglang.training.train import TrainConfig, train

    print(json.dumps(train(_config_from_args(TrainConfig, args))), flush=True)


def int_list(text: str, low: int = 1, high: int | None = None, what: str = "values") -> list[int]:
    """argparse type: comma-separated integers in [low, high]."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    bad = [v for v in values if v < low or (high is not None and v > high)]
    if not values or bad:
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {bad or text!r}")
    return values


def _budgets(text: str) -> tuple[int, ...]:
    from jetflow_sglang.tree import MAX_BUDGET

    return tuple(int_list(text, 1, MAX_BUDGET, "budgets"))


def cmd_eval(args: argparse.Namespace) -> None:
    from jetflow_sglang.training.evaluate import EvalConfig, evaluate

    config = _config_from_args(EvalConfig, args, dtype=DTYPES[args.dtype])
    if config.per_depth:
        from jetflow_sglang.training.evaluate import evaluate_per_depth

        row = evaluate_per_depth(config)
        if args.json:
            print(json.dumps(row), flush=True)
            return
        depths = len(row["top1"])
        print(f"{'depth':>8}" + "".join(f"{d:>6}" for d in range(1, depths + 1)) + f"{'chain tau':>11}")
        print(f"{'head':>8}" + "".join(f"{x:>6.2f}" for x in row["top1"]) + f"{row['chain_tau']:>11.3f}")
        print(f"{'lookup':>8}" + "".join(f"{x:>6.2f}" for x in row["lookup_top1"]) + f"{row['lookup_chain_tau']:>11.3f}")
        print(f"{row['blocks']} anchors of the target's greedy continuations of {row['prompts']}", flush=True)
        return
    for row in evaluate(config):
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def cmd_serve(args: argparse.Namespace) -> None:
    from jetflow_sglang import server as sglang_server
    from jetflow_sglang.assets import head_dir_for, resolve_target
    from jetflow_sglang.budget import BUDGET_ENV
    from jetflow_sglang.reference.target import check_model_dir, serving_dtype
    from jetflow_sglang.sglang_plugin.lookup_branch import LOOKUP_ENV
    from jetflow_sglang.tree import budget_error

    if (error := budget_error(args.budget)) is not None:
        raise JetFlowError(error)
    target = check_model_dir(resolve_target(args.target))
    extra = list(args.sglang_args)
    if not args.no_spec:
        extra = sglang_server.jetflow_args(str(head_dir_for(args.head, target)), args.budget) + extra
    if sglang_server.port_in_use(args.port):
        raise JetFlowError(f"port {args.port} on {sglang_server.HOST} is already in use")
    os.environ[LOOKUP_ENV] = "1" if args.lookup else "0"  # read by the JETFLOW worker in the server
    os.environ[BUDGET_ENV] = "adaptive" if args.adaptive else "static"  # ... and by the JETFLOW validator
    code = sglang_server.serve_forever(str(target), extra, args.port, serving_dtype(args.dtype), args.max_total_tokens)
    if code not in (0, -15):
        raise JetFlowError(f"sglang server exited with {code}")


def cmd_bench(args: argparse.Namespace) -> int:
    """Exit 1 when an answer differs from the target alone's with no cause found (in float32, the
    exact check: when any answer differs), after the report: the speed is still shown, but a
    demo that cannot explain its output must not pass as one that can (`make demo` fails)."""
    from jetflow_sglang.bench import BenchConfig, format_table, run_bench

    config = _config_from_args(BenchConfig, args, dtype=args.dtype)
    report = run_bench(config, echo=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True))
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print("\n" + format_table(report), flush=True)
        if config.out:
            print(f"report: {config.out}", flush=True)
    unexplained = report["summary"]["unexplained"]
    if unexplained:
        what = ("differ in float32, the exact check" if report["config"]["dtype"] == "float32"
                else "differ from the target alone's with no cause found")  # fmt: skip
        print(f"jetflow: error: {unexplained} of {report['summary']['prompts']} answers {what} (the lines marked !!!)",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> None:
    from jetflow_sglang.head import JetFlowHead
    from jetflow_sglang.published import export_head

    out = export_head(JetFlowHead.load(args.head), args.out, args.format)
    print(f"wrote {args.format} head: {out}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description="JetFlow speculative decoding for SGLang")
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare", help="prepare the default target and a loadable head; print their paths")
    prepare.add_argument("--target", default="default", help="default or a HF model directory")
    prepare.set_defaults(func=cmd_prepare)

    gen = sub.add_parser("generate", help="speculative generation on the HF reference engine")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--target", default="default", help="default or a HF model directory")
    gen.add_argument("--head", default="default", help="default, random, or a head directory")
    gen.add_argument("--budget", type=int, default=64, help="tree nodes per round, root included (1..512)")
    gen.add_argument("--width", type=_positive("width"), default=7, help="top-k per draft depth")
    gen.add_argument("--max-new-tokens", type=_positive("max new tokens"), default=128, help="new tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and head dtype")
    gen.add_argument("--repeats", type=_positive("repeats"), default=1, help="timed runs; tokens/s is the median")
    gen.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                     help="merge the prompt-lookup continuation into each draft tree, same budget (default: on)")
    gen.add_argument("--compare-ar", action="store_true", help="also decode with the target alone and compare")
    gen.add_argument("--json", action="store_true", help="print one JSON line")
    gen.set_defaults(func=cmd_generate)

    regen = sub.add_parser("regenerate", help="write training data: prompts answered by the target itself")
    regen.add_argument("--target", default="default", help="default or a HF model directory")
    regen.add_argument("--prompts", default="sharegpt",
                       help="sharegpt, sharegpt-validation, sharegpt-heldout, humaneval, python-stdlib "
                            "(code completions: documented stdlib functions), or a JSON/JSONL file")
    regen.add_argument("--limit", type=_positive("limit"), default=None, help="answer at most this many prompts")
    regen.add_argument("--skip", type=int, default=0, help="pass over the first N prompts of the set")
    regen.add_argument("--max-new-tokens", type=_positive("max new tokens"), default=256, help="answer length cap")
    regen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    regen.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    regen.add_argument("--batch-size", type=_positive("batch size"), default=32, help="prompts per engine call")
    regen.add_argument("--backend", choices=["auto", "sglang", "torch", "hf", "corpus"], default="auto",
                       help="who answers: SGLang's Engine, a batched plain-PyTorch decoder over the target's HF modules, "
                            "HF generate, or the corpus itself (teacher-forced in training); auto: SGLang, else torch where SGLang does not start")
    regen.add_argument("--dtype", choices=SERVING_DTYPES, default="auto",
                       help="the answering target's dtype; auto (default): bf16 where its matmuls are native, else float32")
    regen.add_argument("--tp", type=_positive("tp"), default=1,
                       help="tensor-parallel ranks for SGLang's Engine (a target larger than one GPU; sglang backend only)")
    regen.add_argument("--out", required=True, help="data directory (shards + meta.json); reruns resume")
    regen.set_defaults(func=cmd_regenerate)

    tr = sub.add_parser("train", help="train a JetFlow head on regenerated data")
    tr.add_argument("--target", default="default", help="default or a HF model directory")
    tr.add_argument("--data", required=True, help="data directory, or several joined by commas")
    tr.add_argument("--val-data", default=None, help="data directory for held-out per-depth metrics at checkpoints")
    tr.add_argument("--out", required=True, help="head directory (checkpoints and resume state)")
    tr.add_argument("--loss", choices=["fkl", "rkl", "sft"], default="fkl", help="forward KL, reverse KL or hard labels")
    tr.add_argument("--mask", choices=["causal", "bidirectional"], default="causal",
                    help="within-block mask: causal (JetFlow) or bidirectional (DFlash-T baseline)")
    tr.add_argument("--block-size", type=int, default=16, help="block length: anchor + draft depths")
    tr.add_argument("--layers", type=_positive("layers"), default=2, help="head decoder layers")
    tr.add_argument("--steps", type=_positive("steps"), default=1000, help="optimizer steps")
    tr.add_argument("--batch-tokens", type=_positive("batch tokens"), default=4096, help="target tokens per step")
    tr.add_argument("--anchor-fraction", type=float, default=None,
                    help="share of each sequence's response positions drafted from per step (default 1: all)")
    tr.add_argument("--draft-vocab", type=int, default=None,
                    help="draft over the N most frequent target tokens of the data (default 16384; 0 = all)")
    tr.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, cosine)")
    tr.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps")
    tr.add_argument("--reveal", type=float, default=None, help="share of blocks that reveal a prefix of true tokens")
    tr.add_argument("--tap-norm", action=argparse.BooleanOptionalAction, default=None,
                    help="RMS-normalize each tapped layer's features before the head's fc (default: on)")
    tr.add_argument("--anchor-fusion", action=argparse.BooleanOptionalAction, default=None,
                    help="fuse the anchor's embedding with the projected features before it, EAGLE-style (default: on)")
    tr.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=None,
                    help="per-head q/k RMSNorm, Qwen3-style, as published DFlash heads (default: off)")
    tr.add_argument("--mask-token-id", type=int, default=None,
                    help="use this target embedding row as MASK instead of a learned vector (the published layout; "
                         "with --qk-norm --no-tap-norm --no-anchor-fusion --draft-vocab 0 the head exports to DFlash)")
    tr.add_argument("--depth-sampling", action=argparse.BooleanOptionalAction, default=None,
                    help="with --depth-decay, sample depths instead of weighting them: causal heads run blocks "
                         "truncated at depth L with P(L >= d) = weight, bidirectional ones draw each slot's loss "
                         "(same expected gradient, less compute; default: on)")
    tr.add_argument("--depth-decay", type=float, default=None,
                    help="loss weight exp(-(d-1)/DECAY) at draft depth d (0: uniform over depths)")
    tr.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=None,
                    help="start the head's layers as copies of the target's last layers (default: off)")
    tr.add_argument("--init-head", default=None,
                    help="start from this head directory's weights with a new schedule and optimizer "
                         "(continue a finished run; its architecture must match, except that a hinted or "
                         "copying run may start from a plain head)")
    tr.add_argument("--lookup-hint", action=argparse.BooleanOptionalAction, default=None,
                    help="train a hinted head: each MASK slot also reads the prompt-lookup candidate for its "
                         "position and learns when to copy it (default: off)")
    tr.add_argument("--hint-dropout", type=float, default=None,
                    help="hinted heads: share of blocks trained without hints (default: 0.15)")
    tr.add_argument("--copy-gate", action=argparse.BooleanOptionalAction, default=None,
                    help="train a copying head: a learned gate mixes each depth's prompt-lookup candidate into "
                         "its draft distribution (default: off)")
    tr.add_argument("--copy-lr", type=float, default=None, help="copying heads: the copy gate's peak learning rate (default: 0.01)")
    tr.add_argument("--checkpoint-every", type=_positive("checkpoint every"), default=None,
                    help="steps between checkpoints (and held-out metrics)")
    tr.add_argument("--val-blocks", type=_positive("val blocks"), default=None, help="held-out blocks scored per checkpoint")
    tr.add_argument("--seed", type=int, default=None, help="data order and init seed")
    tr.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="tau and speedup per budget on the reference engine (greedy)")
    ev.add_argument("--target", default="default", help="default or a HF model directory")
    ev.add_argument("--head", default="default", help="default, dflash-t, random, or a head directory")
    ev.add_argument("--prompts", default="humaneval", help="humaneval, sharegpt-heldout, or a JSON/JSONL file")
    ev.add_argument("--limit", type=_positive("limit"), default=40, help="first N prompts of the set")
    ev.add_argument("--budgets", type=_budgets, default=(16, 32, 64, 128, 256), help="comma-separated tree budgets")
    ev.add_argument("--max-new-tokens", type=_positive("max new tokens"), default=128, help="new tokens per prompt")
    ev.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and head dtype")
    ev.add_argument("--refresh", action="store_true", help="re-expand each tree after a path-conditioned head pass")
    ev.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                    help="merge the prompt-lookup continuation into each draft tree, same budget (default: on)")
    ev.add_argument("--per-depth", action="store_true",
                    help="top-1 per draft depth and chain tau of the head beside prompt lookup, on the same anchors")
    ev.add_argument("--json", action="store_true", help="print JSON lines")
    ev.set_defaults(func=cmd_eval)

    serve = sub.add_parser(
        "serve",
        help="launch sglang.launch_server on 127.0.0.1 with JETFLOW, the default target and head",
        description="Unknown flags are passed to sglang.launch_server unchanged.",
        allow_abbrev=False,
    )
    serve.add_argument("--target", default="default", help="default or a HF model directory")
    serve.add_argument("--head", default="default", help="default, random, or a head directory")
    serve.add_argument("--port", type=_positive("port"), default=30000, help="port on 127.0.0.1")
    serve.add_argument("--budget", type=int, default=64,
                       help="tree nodes per round at most, root included (1..512; --speculative-num-draft-tokens)")
    serve.add_argument("--no-spec", action="store_true", help="serve the target alone")
    serve.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                       help="choose each round's tree size by load and draft confidence, --budget being the cap "
                            "(default: on); --no-adaptive verifies --budget nodes every round (JETFLOW_BUDGET=static)")
    serve.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                       help="merge each request's prompt-lookup continuation into its draft tree (default: on)")
    serve.add_argument("--dtype", choices=SERVING_DTYPES, default="auto",
                       help="target and head dtype; auto (default): bf16 where its matmuls are native, else float32")
    serve.add_argument("--max-total-tokens", type=_positive("max total tokens"), default=8192, help="KV cache size")
    serve.set_defaults(func=cmd_serve, passthrough=True)

    bench = sub.add_parser("bench", help="tokens/s and tau of an SGLang server with and without JETFLOW")
    bench.add_argument("--target", default="default", help="default or a HF model directory")
    bench.add_argument("--head", default="default", help="default, random, or a head directory")
    bench.add_argument("--prompts", default="humaneval", help="demo, humaneval, sharegpt-heldout, or a JSON/JSONL file")
    bench.add_argument("--limit", type=_positive("limit"), default=8, help="first N prompts of the set")
    bench.add_argument("--budget", type=int, default=64, help="tree nodes per round at most, root included (1..512)")
    bench.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                       help="the JETFLOW server chooses each round's tree size by load and draft confidence, --budget "
                            "being the cap (default: on); --no-adaptive verifies --budget nodes every round")
    bench.add_argument("--max-new-tokens", type=_positive("max new tokens"), default=256, help="new tokens per prompt")
    bench.add_argument("--ignore-eos", action="store_true", help="always decode max-new-tokens tokens")
    bench.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                       help="JETFLOW merges each request's prompt-lookup continuation into its tree (default: on)")
    bench.add_argument("--dtype", choices=SERVING_DTYPES, default="auto",
                       help="dtype of both servers; auto (default): bf16 where its matmuls are native, else float32. "
                            "Each answer that differs from the target alone's is re-checked and labelled by cause; "
                            "one with no cause exits 1. float32 is the exact check: any difference exits 1")
    bench.add_argument("--show-text", action="store_true", help="print each answer")
    bench.add_argument("--out", default=None, help="write the JSON report here")
    bench.add_argument("--json", action="store_true", help="print the report as one JSON line")
    bench.set_defaults(func=cmd_bench)

    export = sub.add_parser("export", help="write a head in the published DFlash / JetSpec layout (SGLang DFLASH, vLLM)")
    export.add_argument("head", help="a head directory (ours or already published)")
    export.add_argument("out", help="new directory to write (must not exist)")
    export.add_argument("--format", choices=["dflash", "jetspec"], default="dflash",
                        help="dflash: dflash_config + is_causal; jetspec: also dflash_config.causal_head")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.sglang_args = unknown[1:] if unknown[:1] == ["--"] else unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = args.func(args)
    except JetFlowError as exc:
        print(f"jetflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
