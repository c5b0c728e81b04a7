"""Regeneration throughput: the `jetflow regenerate` backends on the same prompts, interleaved.

    .venv/bin/python benchmarks/regen_speed.py --backends torch,sglang,hf --prompts 64 --batch-size 64 \
        --max-new-tokens 256 --rounds 2 --out benchmarks/results/regen_speed_cpu_bf16.json

Every backend is started once; each round then answers the same prompts (ShareGPT train-split
prompts past --skip, sorted by length and batched as `jetflow regenerate` does) with every
backend in turn, so the sides are minutes apart on the same machine. Reports answer tokens per
second (median over rounds, startup excluded), the ratio to the first backend, and the share of
answers token-identical to the first backend's (greedy; fp32 keeps near-ties apart the least).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from jetflow_sglang import harness
from jetflow_sglang.assets import resolve_target
from jetflow_sglang.reference.target import check_model_dir, encode_prompt, serving_dtype
from jetflow_sglang.prompts import load_prompts
from jetflow_sglang.training.regenerate import RegenerateConfig, make_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="torch,sglang,hf", help="comma-separated: torch, sglang, hf (the first is the reference)")
    parser.add_argument("--prompts", type=int, default=64, help="how many ShareGPT train-split prompts")
    parser.add_argument("--skip", type=int, default=4500, help="pass over the first N prompts (the shipped head's data)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per backend call")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (as regenerate does)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="target dtype")
    harness.add_args(parser, max_new_tokens=256, rounds=2, out=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    target_dir = check_model_dir(resolve_target("default"))
    dtype = serving_dtype(args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompts("sharegpt")[args.skip : args.skip + args.prompts]
    ids = sorted((encode_prompt(tokenizer, p.text, p.kind == "chat") for p in prompts), key=len)
    ids = [p for p in ids if len(p) <= args.max_prompt_tokens]
    batches = [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    config = RegenerateConfig(target="default", max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    names = args.backends.split(",")
    backends = {name: make_backend(name, target_dir, dtype) for name in names}
    answers: dict[str, list[list[int]]] = {}

    def measure(name: str, _cell: object) -> float:
        start, got = time.perf_counter(), []
        for batch in batches:
            got += backends[name].generate(batch, config, pad_id)
        answers[name] = got
        return time.perf_counter() - start

    try:
        seconds = harness.interleave(args.rounds, ["all"], names, measure)[0]
    finally:
        for backend in backends.values():
            backend.close()
    reference = names[0]
    rows = []
    for name in names:
        tokens = sum(len(a) for a in answers[name])
        tok_s = tokens / statistics.median(seconds[name])
        same = sum(a == b for a, b in zip(answers[name], answers[reference])) / len(ids)
        rows.append({"backend": name, "answer_tokens": tokens, "seconds": [round(s, 1) for s in seconds[name]],
                     "tokens_per_s": round(tok_s, 1), "identical_to_" + reference: round(same, 3)})  # fmt: skip
    base = rows[0]["tokens_per_s"]
    print(f"{len(ids)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, {dtype}, {args.rounds} rounds")
    print(f"| backend | answer tok/s | vs {reference} | identical to {reference} |\n|---|---|---|---|")
    for row in rows:
        row["ratio"] = round(row["tokens_per_s"] / base, 3)
        print(f"| {row['backend']} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f}x | {row['identical_to_' + reference]:.0%} |")
    if args.out:
        report = {"args": vars(args), "dtype": dtype, "machine": platform.processor() or platform.machine(), "rows": rows}
        harness.write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
