"""Shared fixtures: the default target and shipped head on disk (`prepared`, `target_dir`,
`head_dir`), and the target loaded in fp32 (so tree verify and plain decoding agree to rounding)
with a seeded random head bound to it. Helpers the tests import are in helpers/."""

from __future__ import annotations

import os

import pytest
import torch

from jetflow_sglang.assets import load_target_and_head, prepare

# Chat prompts that end in EOS within a few dozen tokens, and raw completions that run on.
PROMPTS = [
    ("Say hello in one word.", True),
    ("What is 2+2? Answer with a number only.", True),
    ("Reply with OK.", True),
    ("Is the sky blue? Yes or no.", True),
    ("Explain recursion in one sentence.", True),
    ("List three fruits.", True),
    ("def add(a, b):", False),
    ("The capital of France is", False),
    ("for i in range(10):", False),
    ("Write a haiku about rain.", True),
]


@pytest.fixture(scope="session", autouse=True)
def fresh_cost_cache(tmp_path_factory):
    """Adaptive servers started by the tests measure their costs anew: they neither read nor
    extend the tables a user's servers saved under $JETFLOW_HOME/costs."""
    from jetflow_sglang.cost_cache import COST_CACHE_ENV

    os.environ[COST_CACHE_ENV] = str(tmp_path_factory.mktemp("costs"))


@pytest.fixture(scope="session")
def prepared() -> dict:
    return prepare("default")


@pytest.fixture(scope="session")
def target_dir(prepared) -> str:
    return str(prepared["target"])


@pytest.fixture(scope="session")
def head_dir(prepared) -> str:
    return str(prepared["head"])


@pytest.fixture(scope="session")
def target_and_head(prepared):
    torch.manual_seed(0)
    return load_target_and_head(prepared["target"], "random", torch.float32)


@pytest.fixture(scope="session")
def target(target_and_head):
    return target_and_head[0]


@pytest.fixture(scope="session")
def random_head(target_and_head):
    return target_and_head[1]


@pytest.fixture(scope="session")
def prompt_ids(target) -> list[list[int]]:
    return [target.encode_prompt(text, chat) for text, chat in PROMPTS]
