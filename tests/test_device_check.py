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
    # Here only the CPU-side kernel tests can run; the CUDA ones skip (on the GPU a skip fails), and
    # the report says so rather than "passed".
    counts = kernel_tests["counts"]
    assert kernel_tests["status"] == "partial", kernel_tests
    assert counts.get("passed", 0) >= 2 and counts.get("skipped", 0) >= 1 and not counts.get("failed"), kernel_tests
    assert kernel_tests["proved"].startswith(f"{counts['passed']} of {counts['passed'] + counts['skipped']} passed")

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
    assert table[1].startswith("kernel tests: partial: ") and "unchecked" in table[1]
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


# Summary lines as pytest prints them (-q: no "=" rules; without -q they surround the line), one
# run a row: pytest exit status | last line | status on the GPU | status on a dry run. The last
# row's exit status is one the summary does not explain.
GPU_RUNS_TABLE = """
0 | 10 passed in 41.20s | passed | passed
0 | 10 passed, 3 warnings in 41.20s | passed | passed
0 | ======================== 10 passed, 2 deselected in 40.02s ======================== | passed | passed
0 | 9 passed, 1 skipped in 40.02s | failed | partial
0 | 2 passed, 8 skipped, 2 warnings in 9.81s | failed | partial
0 | 1 skipped in 0.40s | failed | failed
1 | 1 failed, 9 passed in 40.00s | failed | failed
1 | 1 failed, 1 passed, 8 skipped in 9.00s | failed | failed
1 | 9 passed, 1 error in 40.00s | failed | failed
2 | 1 error in 0.52s | failed | failed
2 | !!!!!!!!!!!!!!!!!!!! Interrupted: 2 errors during collection !!!!!!!!!!!!!!!!!!!! | failed | failed
5 | no tests ran in 0.01s | failed | failed
5 | 12 deselected in 0.30s | failed | failed
1 | 10 passed in 41.20s | failed | failed
"""
GPU_RUNS = [
    (int(code), line, on_gpu, on_dry_run)
    for code, line, on_gpu, on_dry_run in (row.split(" | ") for row in GPU_RUNS_TABLE.strip().splitlines())
]


def _device_check():
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import device_check

    return device_check


def test_a_skipped_gpu_test_fails_the_device_check():
    """On the GPU every selected test must run and pass; a dry run may skip the CUDA ones, and
    then says how many of which ran ("partial"), not "passed"."""
    judge = _device_check().judge_tests
    for code, line, on_gpu, on_dry_run in GPU_RUNS:
        assert judge(code, line, dry_run=False)[0] == on_gpu, line
        assert judge(code, line, dry_run=True)[0] == on_dry_run, line
    status, proved, counts = judge(0, "2 passed, 8 skipped, 2 warnings in 9.81s", dry_run=True)
    assert counts == {"passed": 2, "skipped": 8}
    assert proved.startswith("2 of 10 passed") and "8 skipped without CUDA" in proved
    status, proved, _ = judge(0, "9 passed, 1 skipped in 40.02s", dry_run=False)
    assert proved.startswith("1 of 10 GPU tests skipped")
    assert judge(1, "9 passed, 1 error in 40.00s", dry_run=False)[2] == {"passed": 9, "errors": 1}
    assert judge(2, "3 errors in 0.52s", dry_run=False)[1].startswith("3 of 3 selected tests failed")


def test_the_judge_reads_what_this_pytest_prints(tmp_path: Path) -> None:
    """The same rule on a real pytest run: one test passes, one skips."""
    import sys

    (tmp_path / "test_two.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\ndef test_skips():\n    pytest.skip('no CUDA GPU')\n"
    )
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    summary = proc.stdout.strip().splitlines()[-1]
    judge = _device_check().judge_tests
    status, proved, _ = judge(proc.returncode, summary, dry_run=False)
    assert (status, proved) == ("failed", "1 of 2 GPU tests skipped: on the GPU a check that did not run fails"), summary
    assert judge(proc.returncode, summary, dry_run=True)[0] == "partial", summary


def _gpu_marked(path: Path) -> list[str]:
    import ast

    def is_gpu(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Attribute) and target.attr == "gpu" and ast.unparse(target).endswith("mark.gpu")

    tree = ast.parse(path.read_text())
    return [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(map(is_gpu, f.decorator_list))]


def test_device_check_runs_every_gpu_marked_test():
    """Every gpu-marked test is in a file the device check's GPU run (`-m gpu`) collects, and its
    name is one the dry run's selection picks (so the dry run shows it skipping)."""
    device_check = _device_check()
    root = SCRIPT.parent.parent
    files = {str(p.relative_to(root)): _gpu_marked(p) for p in sorted((root / "tests").glob("test_*.py"))}
    marked = {path: names for path, names in files.items() if names}
    assert set(marked) <= set(device_check.KERNEL_TEST_FILES), set(marked) - set(device_check.KERNEL_TEST_FILES)
    assert {"tests/test_tree.py", "tests/test_seeded_sampling.py"} <= set(marked)  # the two issue 40 moved there
    words = device_check.DRY_RUN_SELECTION.split(" or ")
    for path, names in marked.items():
        assert all(any(word in name for word in words) for name in names), (path, names, words)
    defined = [n for p in device_check.KERNEL_TEST_FILES for n in _functions(root / p)]
    assert all(any(word in name for name in defined) for word in words), words  # each word selects a test


def _functions(path: Path) -> list[str]:
    import ast

    return [f.name for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef)]
