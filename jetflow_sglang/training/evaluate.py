"""`jetflow eval`: tau and speedup per tree budget on the reference engine, greedy.

Per prompt, plain decoding runs first and the speculative runs at every budget follow
in the same process, so AR and speculative timings see the same machine state; the
per-budget figures are medians over prompts (tau: total committed / total rounds).

`--per-depth` instead scores the head's draft at every anchor of the target's own
greedy continuation of each prompt: top-1 per depth and chain τ, beside prompt lookup
on the same anchors (`training/validate.py`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.prompts import Prompt, load_prompts
from jetflow_sglang.reference.engine import ReferenceEngine, generate_ar
from jetflow_sglang.reference.proposer import HeadProposer


@dataclass(frozen=True)
class EvalConfig:
    target: str = "default"
    head: str = "default"
    prompts: str = "humaneval"
    limit: int | None = 40
    budgets: tuple[int, ...] = (16, 32, 64, 128, 256)
    max_new_tokens: int = 128
    width: int = 7
    dtype: str = "float32"
    refresh: bool = False  # path-conditioned second head pass per round
    lookup: bool = True  # merge the prompt-lookup continuation into each tree (same budget)
    per_depth: bool = False  # score top-1 per depth against prompt lookup instead of timing the engine


def resolve_head_spec(spec: str) -> str:
    """`dflash-t` names the shipped bidirectional baseline head."""
    if spec != "dflash-t":
        return spec
    from jetflow_sglang.assets import SHIPPED_HEADS, DEFAULT_TARGET_NAME

    path = SHIPPED_HEADS / f"{DEFAULT_TARGET_NAME}-dflash-t"
    if not (path / "config.json").is_file():
        raise JetFlowError("no shipped dflash-t head yet: train one with `make train-default`")
    return str(path)


def evaluate(config: EvalConfig):
    """Yields one report dict per budget."""
    from jetflow_sglang.assets import load_target_and_head

    target, head = load_target_and_head(config.target, resolve_head_spec(config.head), getattr(torch, config.dtype))
    if config.refresh and not head.config.causal:
        raise JetFlowError("--refresh needs a causal head (it reads real tokens in place of MASKs); this one is bidirectional")
    prompts: list[Prompt] = load_prompts(config.prompts)[: config.limit]
    engines = {
        b: ReferenceEngine(
            target, HeadProposer(head), budget=b, width=config.width, refresh=config.refresh, lookup=config.lookup
        )
        for b in config.budgets
    }
    per_budget = {b: {"committed": 0, "rounds": 0, "tps": [], "speedup": [], "identical": True} for b in config.budgets}
    ar_tps = []
    for prompt in prompts:
        ids = target.encode_prompt(prompt.text, prompt.kind == "chat")
        ar = generate_ar(target, ids, config.max_new_tokens)
        ar_tps.append(ar.tokens_per_s)
        for budget, engine in engines.items():
            result = engine.generate(ids, config.max_new_tokens)
            stats = per_budget[budget]
            stats["committed"] += sum(a + 1 for a in result.accept_lengths)
            stats["rounds"] += result.rounds
            stats["tps"].append(result.tokens_per_s)
            stats["speedup"].append(result.tokens_per_s / ar.tokens_per_s)
            stats["identical"] &= result.tokens == ar.tokens
    for budget in config.budgets:
        stats = per_budget[budget]
        yield {
            "head": config.head,
            "prompts": config.prompts,
            "budget": budget,
            "refresh": config.refresh,
            "lookup": config.lookup,
            "tau": round(stats["committed"] / stats["rounds"], 3) if stats["rounds"] else 1.0,
            "tokens_per_s": round(statistics.median(stats["tps"]), 2),
            "ar_tokens_per_s": round(statistics.median(ar_tps), 2),
            "speedup": round(statistics.median(stats["speedup"]), 3),
            "identical": stats["identical"],
        }


def evaluate_per_depth(config: EvalConfig) -> dict:
    """Top-1 per depth and chain τ of the head and of prompt lookup, on every anchor of the
    target's greedy continuations of the prompts."""
    from jetflow_sglang.assets import load_target_and_head
    from jetflow_sglang.training.features import featurize, store_from_parts
    from jetflow_sglang.training.validate import ValidationSet

    target, head = load_target_and_head(config.target, resolve_head_spec(config.head), getattr(torch, config.dtype))
    examples = []
    for prompt in load_prompts(config.prompts)[: config.limit]:
        ids = target.encode_prompt(prompt.text, prompt.kind == "chat")
        continuation = generate_ar(target, ids, config.max_new_tokens).tokens
        examples.append({"ids": ids + continuation, "prompt_len": len(ids)})
    target.set_tap_layers(head.config.target_layer_ids)
    store = store_from_parts([featurize(target, examples)])
    scores = ValidationSet.from_store(store, head.config.block_size).score(head)
    return {"head": config.head, "prompts": config.prompts, "per_depth": True, **scores}
