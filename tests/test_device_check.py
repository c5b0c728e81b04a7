"""benchmarks/device_check.sh --dry-run: every step of the GPU device check at toy size on CPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "device_check.sh"
BUDGETS = [1, 16, 64, 128, 256]
KERNEL_OPS = ["tree_build", "tree_masks", "accept_greedy", "accept_sampling"]


def test_device_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "device_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(out)], check=False, capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["budgets"] == BUDGETS and "fatal" not in report
    kernel_tests = report["kernel_tests"]
    assert kernel_tests["status"] == "passed", kernel_tests
    # Here only the CPU-side kernel tests can run; the CUDA ones skip (on the GPU a skip fails).
    assert kernel_tests["counts"].get("passed", 0) >= 2 and not kernel_tests["counts"].get("failed"), kernel_tests

    rows = {(r["name"], r["impl"], r["n"]): r for r in report["rows"]}
    expected = [("prefill", "hf_sdpa", report["prefix"]), ("head", "draft", 16), ("head", "context_kv", 8)]
    expected += [("head", "paged_eager", 16), ("head", "paged_graph", 16)]
    expected += [("verify", impl, n) for impl in ("hf_sdpa_4d", "packed_mask") for n in BUDGETS]
    expected += [(op, impl, n) for op in KERNEL_OPS for impl in ("kernel", "reference") for n in BUDGETS]
    assert sorted(rows) == sorted(expected)
    for key in expected:
        row = rows[key]
        assert row["status"] == "ok" and row["median_ms"] > 0 and row["iters"] >= 3, (key, row)

    # The SGLang draft path (paged attention; a batch of 1 padded to 2 as for graph replay) gives
    # the dense draft's logits.
    paths = report["draft_paths"]
    assert paths["paged_vs_dense"] < 1e-4 and paths["graph_vs_eager"] < 1e-5 and paths["logit_scale"] > 0, paths

    # The packed (FlashInfer-layout) mask gives the 4D-mask logits: the mask layout is right.
    check = report["packed_vs_4d"]
    assert check["status"] == "ok" and check["max_abs_logit_diff"] < 1e-4 and check["argmax_agreement"] == 1.0
    assert report["path_failures"] == []

    # The table comes last on stdout; progress goes to stderr.
    table = result.stdout.strip().splitlines()
    assert table[0].startswith("JetFlow device check") and "DRY RUN" in table[0]
    assert table[-1].startswith("kernels: torch fallback")
    assert any(line.strip().startswith("HF SDPA, 4D mask") for line in table)
    assert all(any(line.strip().startswith(op) for line in table) for op in KERNEL_OPS)
    assert "verify" in result.stderr


def test_paths_that_disagree_fail_the_device_check() -> None:
    """The exit status holds the draft paths and the packed-mask verify to a tolerance; on the GPU
    a packed-mask check that did not run (FlashInfer build failed, deadline) fails as well."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    from device_check import path_failures

    good = {"dtype": "bfloat16", "dry_run": False,
            "draft_paths": {"paged_vs_dense": 0.05, "graph_vs_eager": 0.0, "logit_scale": 20.0},
            "packed_vs_4d": {"status": "ok", "max_abs_logit_diff": 0.1, "logit_scale": 30.0, "argmax_agreement": 0.99}}  # fmt: skip
    assert path_failures(good) == []
    wrong_graph = dict(good, draft_paths=dict(good["draft_paths"], graph_vs_eager=3.0))
    assert [f.split(":")[1].split()[0] for f in path_failures(wrong_graph)] == ["graph_vs_eager"]
    wrong_mask = dict(good, packed_vs_4d=dict(good["packed_vs_4d"], argmax_agreement=0.5))
    assert "argmax agreement" in path_failures(wrong_mask)[0]
    not_run = dict(good, packed_vs_4d={"n": 16, "status": "skipped: FlashInfer build failed"})
    assert "FlashInfer build failed" in path_failures(not_run)[0] and path_failures(not_run, skip_flashinfer=True) == []
    dry = dict(not_run, dtype="float32", dry_run=True, draft_paths={"paged_vs_dense": 1e-3, "graph_vs_eager": 0.0, "logit_scale": 5.0})
    assert [f.split(":")[1].split()[0] for f in path_failures(dry)] == ["paged_vs_dense"]  # fp32 is held tighter
