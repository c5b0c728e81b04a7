"""What a JETFLOW launch resolves its tree-budget policy to, and what it refuses before any model
loads: server args resolved by SGLang itself in this process (the JETFLOW validator runs inside,
installed by ``load_plugins``), no server started.

* The budget is adaptive by default (``--speculative-num-draft-tokens`` is its cap);
  ``JETFLOW_BUDGET=static`` asks for a static one; SGLang's ``--speculative-adaptive`` asks for
  the default, so it contradicts ``JETFLOW_BUDGET=static``.
* A cost table (``JETFLOW_COST_TABLE``) recorded in another dtype, or on another machine, than
  the server's is refused in one line.
* ``--enable-deterministic-inference`` on the CPU platform is refused: SGLang refuses it with
  the platform's attention backend; with another backend named, JETFLOW does, with its reason.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def assets() -> dict:
    from sglang.srt.plugins import load_plugins

    from jetflow_sglang.assets import prepare

    load_plugins()
    return prepare("default")


@pytest.fixture
def env(monkeypatch):
    """The budget settings unset (as in a plain launch), restored afterwards."""
    for name in ("JETFLOW_BUDGET", "JETFLOW_COST_TABLE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _resolve(assets: dict, **extra):
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(assets["target"]),
        speculative_algorithm="JETFLOW",
        speculative_draft_model_path=str(assets["head"]),
        speculative_num_draft_tokens=64,
        max_total_tokens=4096,
        **extra,
    )
    return runtime_context.create_context(args, role="scheduler")


def _refusal(assets: dict, **extra) -> str:
    with pytest.raises(ValueError) as info:
        _resolve(assets, **extra)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_adaptive_by_default_static_on_request(assets, env):
    from jetflow_sglang.budget import policy_name

    _resolve(assets)
    _resolve(assets, speculative_adaptive=True)  # asks for the default: accepted
    assert "JETFLOW_BUDGET" not in os.environ and policy_name() == "adaptive"  # what the worker reads
    env.setenv("JETFLOW_BUDGET", "static")
    _resolve(assets)
    assert policy_name() == "static"
    assert "JETFLOW: --speculative-adaptive contradicts JETFLOW_BUDGET=static" in _refusal(assets, speculative_adaptive=True)
    env.setenv("JETFLOW_BUDGET", "fast")
    assert "JETFLOW: JETFLOW_BUDGET must be one of static, adaptive, sweep, got 'fast'" in _refusal(assets)


def test_cost_table_of_another_dtype_or_machine_is_refused(assets, env, tmp_path):
    from jetflow_sglang.budget import host_fingerprint

    here = host_fingerprint("cpu")
    costs = {"verify_ms": {"1": 10, "64": 40}, "draft_ms": {"1": 3}}
    tables = {}
    for name, origin in (("here", {"dtype": "float32", **here}), ("bf16", {"dtype": "bfloat16", **here}),
                         ("elsewhere", {"dtype": "float32", **here, "device_name": "Another CPU"})):  # fmt: skip
        tables[name] = tmp_path / f"{name}.json"
        tables[name].write_text(json.dumps({**costs, **origin}))
    env.setenv("JETFLOW_COST_TABLE", str(tables["here"]))
    _resolve(assets, dtype="float32")
    env.setenv("JETFLOW_COST_TABLE", str(tables["bf16"]))
    message = _refusal(assets, dtype="float32")
    assert message.startswith("JETFLOW: cost table") and "measured in bfloat16, but this server runs float32" in message
    _resolve(assets, dtype="bfloat16")
    env.setenv("JETFLOW_COST_TABLE", str(tables["elsewhere"]))
    assert "measured on another machine (device: 'Another CPU' there" in _refusal(assets, dtype="float32")


def test_deterministic_inference_is_refused_on_the_cpu_platform(assets, env):
    assert "deterministic inference" in _refusal(assets, enable_deterministic_inference=True)  # SGLang's own refusal
    message = _refusal(assets, enable_deterministic_inference=True, attention_backend="triton")
    assert message.startswith("JETFLOW: --enable-deterministic-inference is not supported on the CPU platform")
    assert "bf16 rounding" in message
