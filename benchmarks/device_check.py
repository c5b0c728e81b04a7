"""Device check for one NVIDIA GPU without network (issue 5): the kernel tests on CUDA, then
CUDA-event timings (median of many) on a Qwen3-8B-shaped target with random bf16 weights: target
verify of an N-node draft tree over a prefix (HF SDPA with a 4D tree mask; the packed custom
mask through FlashInfer), the JetFlow head's draft pass, and the tree kernels against their
torch references. Prints a table last and writes JSON (relative paths: from the repo root).

--dry-run: the same steps on a tiny Qwen3 on CPU, with perf_counter, the kernels' torch
fallbacks, and the packed mask unpacked into SDPA (its logits must equal the 4D-mask run's). Its
kernel tests are "partial": only their CPU-side ones can run there.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor

from device_models import QWEN3_8B, TOY, Verifier, additive_mask, build_models, follow_picks

ROOT = Path(__file__).resolve().parent.parent
KERNEL_OPS = ("tree_build", "tree_masks", "accept_greedy", "accept_sampling")
WIDTH = 7  # per-depth top-k of the tree (the engine's default)
SAMPLING = (0.6, 20, 0.95)  # temperature, top_k, top_p of the sampling-acceptance rows


def log(message: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    name: str  # prefill, head, verify, or a kernel op
    impl: str  # verify: hf_sdpa_4d or packed_mask (FlashInfer on CUDA); kernels: kernel or reference
    n: int  # tree budget (tokens for the prefill and head rows)
    status: str = "ok"  # ok, skipped: why, error: what
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    iters: int = 0
    extra: dict = field(default_factory=dict)


class Bench:
    """Times callables, one row each: CUDA events (perf_counter on CPU), every run from an idle
    device; rows that would start after the deadline are skipped."""

    def __init__(self, device: torch.device, iters: int, warmup: int, deadline_s: float) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.rows: list[Row] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def time_once(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def row(self, name: str, impl: str, n: int, fn: Callable[[], object], iters: int | None = None,
            after: Callable[[], object] = lambda: None, skip: str | None = None, **extra) -> Row:
        row = Row(name, impl, n, extra=extra)
        self.rows.append(row)
        label = f"{name:15s} {impl:11s} N={n:<5d}"
        if skip or time.monotonic() > self.deadline:
            row.status = f"skipped: {skip or 'deadline'}"
            log(f"{label} {row.status}")
            return row
        t0, times = time.monotonic(), []
        try:
            for i in range(self.warmup + (iters or self.iters)):
                elapsed = self.time_once(fn)
                after()
                if i >= self.warmup:
                    times.append(elapsed)
        except Exception as exc:  # noqa: BLE001 -- one broken row must not cost the others
            row.status = f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            log(f"{label} {row.status}")
            return row
        times.sort()
        row.iters, row.median_ms = len(times), statistics.median(times)
        row.p10_ms, row.p90_ms = times[len(times) // 10], times[(len(times) * 9) // 10]
        log(f"{label} median {row.median_ms:9.3f} ms ({len(times)} runs, {time.monotonic() - t0:.1f}s)")
        return row


# --------------------------------------------------------------------------- steps


# The gpu-marked tests the device check runs on CUDA. A dry run selects the same files by name:
# the CUDA tests (they skip without a GPU) and the fast CPU wrapper tests; the interpreter runs
# would take minutes.
KERNEL_TEST_FILES = ("tests/test_kernels.py", "tests/test_verify_attention.py", "tests/test_tree.py",
                     "tests/test_seeded_sampling.py")  # fmt: skip
DRY_RUN_SELECTION = "on_cuda or cpu_wrappers or rejects_bad_budgets"


def pytest_counts(summary: str) -> dict[str, int]:
    """Outcome counts of pytest's last summary line ("1 failed, 7 passed, 2 skipped in 3.1s",
    "=== 2 errors in 0.5s ==="); "error" and "errors" both count as errors."""
    counts: dict[str, int] = {}
    for n, kind in re.findall(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b", summary):
        kind = "errors" if kind.startswith("error") else kind
        counts[kind] = counts.get(kind, 0) + int(n)
    return counts


def judge_tests(returncode: int, summary: str, dry_run: bool) -> tuple[str, str, dict[str, int]]:
    """(status, what the run proved, counts) of the kernel tests' pytest run. status: passed
    (every selected test ran and passed), partial (a dry run: the CPU-side tests passed, the CUDA
    ones skipped), or failed. On the GPU every selected test must run: a skip there is a check
    that did not happen, so it fails the device check."""
    counts = pytest_counts(summary)
    passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    selected = passed + skipped + failed
    if failed:
        return "failed", f"{failed} of {selected} selected tests failed or errored", counts
    if returncode != 0:
        return "failed", f"pytest exited {returncode}", counts
    if passed == 0:
        return "failed", "no selected test ran", counts
    if skipped and not dry_run:
        return "failed", f"{skipped} of {selected} GPU tests skipped: on the GPU a check that did not run fails", counts
    if skipped:
        return "partial", (f"{passed} of {selected} passed (the CPU-side tests); {skipped} skipped without CUDA, "
                           "so the GPU kernels themselves are unchecked"), counts  # fmt: skip
    return "passed", f"all {passed} selected tests passed" + ("" if dry_run else " on CUDA"), counts


def run_kernel_tests(dry_run: bool, timeout_s: float) -> dict:
    """The gpu-marked tests of KERNEL_TEST_FILES on CUDA (`-m gpu`): jetflow_kernels against their
    references, SGLang's Triton verify attention reading the tree mask, our mask packing against
    FlashInfer's, and the seed hash against SGLang's kernel. A dry run: DRY_RUN_SELECTION."""
    selection = ["-k", DRY_RUN_SELECTION] if dry_run else ["-m", "gpu"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TEST_FILES, *selection]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this env's ninja (FlashInfer JIT)
    result, t0 = {"command": " ".join(cmd[2:])}, time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        lines = proc.stdout.strip().splitlines()
        summary = lines[-1] if lines else proc.stderr.strip()[-300:]
        status, proved, counts = judge_tests(proc.returncode, summary, dry_run)
        result.update(status=status, proved=proved, summary=summary, counts=counts)
        if status == "failed":
            result["output_tail"] = proc.stdout[-3000:] + proc.stderr[-2000:]
    except subprocess.TimeoutExpired:
        result.update(status="timeout", proved="nothing: timed out", summary=f"timed out after {timeout_s:.0f}s")
    result["seconds"] = round(time.monotonic() - t0, 1)
    log(f"kernel tests {result['status']}: {result['proved']} ({result['summary']}, {result['seconds']}s)")
    return result


FLASHINFER_BUILD = """
import sys, torch, flashinfer
heads, kv_heads, head_dim = map(int, sys.argv[1:])
q = torch.randn(16, heads, head_dim, dtype=torch.bfloat16, device="cuda")
k, v = (torch.randn(kv_heads, 1040, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
packed = torch.full(((16 * 1040 + 7) // 8,), 255, dtype=torch.uint8, device="cuda")
out = flashinfer.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed, kv_layout="HND")
torch.cuda.synchronize()
print("flashinfer custom-mask prefill ok", tuple(out.shape))
"""


def start_flashinfer_build(log_path: Path) -> subprocess.Popen:
    """FlashInfer JIT-compiles its custom-mask prefill on first use (no AOT cache is installed):
    build it in the background (same dtypes and head_dim); the in-process call then loads it."""
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # this env's ninja
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shape = [str(QWEN3_8B[k]) for k in ("num_attention_heads", "num_key_value_heads", "head_dim")]
    with open(log_path, "w") as out:
        return subprocess.Popen([sys.executable, "-c", FLASHINFER_BUILD, *shape], stdout=out, stderr=subprocess.STDOUT)


def wait_flashinfer(proc: subprocess.Popen, timeout_s: float, kill: bool) -> str | None:
    """None once the background build has worked, else why not (the build is stopped if `kill`)."""
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        if kill:
            proc.kill()
            proc.wait()
        log(f"FlashInfer build still running after {time.monotonic() - t0:.0f}s more{'; stopped' if kill else ''}")
        return "FlashInfer JIT build did not finish in time"
    log(f"FlashInfer build exited {code} (waited {time.monotonic() - t0:.1f}s)")
    return None if code == 0 else "FlashInfer build failed (see flashinfer_warmup.log)"


@dataclass
class Setup:
    """What the timed rows share: the models, the prefix in the cache, one draft and its trees."""

    verifier: Verifier
    vocab: int
    prefix: int
    dtype: torch.dtype
    anchor: Tensor  # [1] the last prefix token
    prefix_lens: Tensor  # [1]
    topk: tuple  # per-depth top-k (log-probs, tokens) of the head's draft, [1, D, WIDTH] each
    max_depth: int
    trees: dict = field(default_factory=dict)  # N -> DraftTree (Triton build)
    masks: dict = field(default_factory=dict)  # N -> TreeMasks (Triton masks)


def verify_rows(bench: Bench, s: Setup, impl: str, skip: str | None = None) -> None:
    s.verifier.use(impl)
    for n, tree in s.trees.items():
        mask = additive_mask(s.masks[n].ancestors, s.prefix, s.dtype)  # built once per tree, outside the timing
        s.verifier.packed = s.masks[n].packed_mask
        bench.row("verify", impl, n, lambda: s.verifier.forward(tree.tokens, s.masks[n].positions, mask),  # noqa: B023
                  after=lambda: s.verifier.reset(s.prefix), skip=skip)


def kernel_rows(bench: Bench, s: Setup, n: int) -> None:
    """Each kernel at budget N and its torch reference (twice the runs: they are short)."""
    import jetflow_kernels as jk
    from jetflow_kernels.tree_masks import tree_masks_reference

    from jetflow_sglang.accept import accept_tree

    tree, device, depth = s.trees[n], s.anchor.device, s.max_depth
    picks = follow_picks(tree)
    logits = torch.randn(1, n, s.vocab, device=device)
    logits.scatter_add_(2, picks[..., None], torch.full((1, n, 1), 30.0, device=device))  # sampling walks deep too
    params = [torch.tensor([v], device=device) for v in SAMPLING]
    sampling = (tree, logits, torch.rand(1, n, device=device), *params, depth)
    ops = {
        "tree_build": (lambda: jk.build_tree_from_topk(s.anchor, *s.topk, n),
                       lambda: jk.build_tree_reference(s.anchor, *s.topk, n)),
        "tree_masks": (lambda: jk.tree_masks(tree.parents, tree.depths, s.prefix_lens),
                       lambda: tree_masks_reference(tree.parents, tree.depths, s.prefix_lens)),
        "accept_greedy": (lambda: jk.accept_greedy(tree, picks, depth), lambda: accept_tree(tree, picks, depth)),
        "accept_sampling": (lambda: jk.accept_sampling(*sampling), lambda: jk.accept_sampling_reference(*sampling)),
    }
    accepted = int(accept_tree(tree, picks, depth).num_accepted[0])
    for op, (kernel, reference) in ops.items():
        bench.row(op, "kernel", n, kernel, iters=bench.iters * 2, accepted=accepted)
        bench.row(op, "reference", n, reference, iters=bench.iters * 2, accepted=accepted)


def sglang_draft_rows(bench: Bench, head, features: Tensor, positions: Tensor, anchor: Tensor, prefix_lens: Tensor
                      ) -> dict:
    """The draft pass as the SGLang worker runs it: the head's context K/V at KV slots read through
    req_to_token by the paged attention kernel, eagerly and replayed from a CUDA graph (the padded
    replay path without capture on a dry run). Returns the max differences of the top-WIDTH draft
    log-probs between paths, and the dense logits' scale."""
    from jetflow_sglang.sglang_plugin.proposer import DraftRequest, PagedHeadProposer
    from jetflow_sglang.tree import top_candidates

    device, prefix = anchor.device, int(prefix_lens[0])
    block = head.config.block_size
    req_to_token = torch.arange(prefix + block, dtype=torch.int32, device=device)[None]
    proposer = PagedHeadProposer(head, req_to_token, prefix + block, device, WIDTH)
    proposer.write_context(features[0], torch.arange(prefix, device=device), positions[0])
    request = DraftRequest(anchor, prefix_lens, torch.zeros(1, dtype=torch.int64, device=device), [[]], ["0"])
    dense_logits = head.draft(anchor, prefix_lens, head.context_kv(features, positions)).float()
    dense = top_candidates(dense_logits, WIDTH)[0]
    eager = proposer.propose(request)[0]
    bench.row("head", "paged_eager", block, lambda: proposer.propose(request))
    # Without CUDA there is no capture: a batch of 1 padded to 2 still checks the replay bookkeeping.
    proposer.use_graphs([1, 2, 4] if device.type == "cuda" else [2, 4], "graph" if device.type == "cuda" else "padded")
    replayed = proposer.propose(request)[0]
    bench.row("head", "paged_graph", block, lambda: proposer.propose(request))
    diffs = {"paged_vs_dense": float((eager - dense).abs().max()), "graph_vs_eager": float((replayed - eager).abs().max()),
             "logit_scale": float(dense_logits.abs().max())}
    log(f"draft paths: {diffs}")
    return diffs


def compare_verify(s: Setup, n: int) -> dict:
    """Logits of one verify with the packed mask against the 4D-mask SDPA run."""
    logits = []
    for impl in ("hf_sdpa_4d", "packed_mask"):
        s.verifier.use(impl)
        s.verifier.packed = s.masks[n].packed_mask
        mask = additive_mask(s.masks[n].ancestors, s.prefix, s.dtype)
        logits.append(s.verifier.forward(s.trees[n].tokens, s.masks[n].positions, mask)[0].float())
        s.verifier.reset(s.prefix)
    diff = float((logits[0] - logits[1]).abs().max())
    agree = float((logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean())
    log(f"packed vs 4D mask at N={n}: max |logit diff| {diff:.3g}, argmax agreement {agree:.3f}")
    return {"n": n, "status": "ok", "max_abs_logit_diff": diff, "argmax_agreement": agree,
            "logit_scale": float(logits[0].abs().max())}


# --------------------------------------------------------------------------- main


def measure(args: argparse.Namespace, bench: Bench, report: dict, dtype: torch.dtype, fi_build: subprocess.Popen | None
            ) -> None:
    """Steps (2) and (3): build the target and head, then time every row."""
    import jetflow_kernels as jk
    from jetflow_kernels._dispatch import interpreting

    if interpreting():  # TRITON_INTERPRET=1: the Triton kernels on CPU tensors too (slow)
        report["kernel_backend"] = "triton interpreter"
    device, prefix, t0 = bench.device, report["prefix"], time.monotonic()
    torch.manual_seed(0)
    config, target, head = build_models(args.dry_run, device, dtype)
    head_params = round(sum(p.numel() for p in head.parameters()) / 1e6, 1)
    report["head"] = {"layers": head.config.num_layers, "block_size": head.config.block_size,
                      "taps": head.config.target_layer_ids, "params_m": head_params}
    log(f"built target ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B params) and head ({head_params}M) "
        f"on {device} in {time.monotonic() - t0:.1f}s")
    verifier = Verifier(target, head.config.target_layer_ids)
    if fi_build is not None:  # clean timings: let the JIT build finish first, within half the budget
        still_running = wait_flashinfer(fi_build, args.deadline_s / 2 - bench.elapsed(), kill=False)
        report["flashinfer_build_overlapped_timings"] = still_running is not None

    # Prefill of the prefix (each run from an empty cache), then the cache every verify extends.
    prompt = torch.randint(0, config.vocab_size, (1, prefix), device=device)
    positions = torch.arange(prefix, device=device)[None]
    bench.row("prefill", "hf_sdpa", prefix, lambda: verifier.forward(prompt, positions),
              iters=max(3, bench.iters // 6), after=verifier.reset)
    verifier.reset()
    features = verifier.forward(prompt, positions)[1]

    # Head: context K/V of the prefix, the draft pass, and the context extension of one round.
    context = head.context_kv(features, positions)
    anchor, prefix_lens = prompt[:, -1], torch.tensor([prefix], device=device)
    bench.row("head", "draft", head.config.block_size, lambda: head.draft(anchor, prefix_lens, context))
    bench.row("head", "context_kv", 8, lambda: head.context_kv(features[:, :8], positions[:, :8]))
    report["draft_paths"] = sglang_draft_rows(bench, head, features, positions, anchor, prefix_lens)
    topk = head.draft_candidates(head.draft_hidden(anchor, prefix_lens, context), WIDTH)
    s = Setup(verifier, config.vocab_size, prefix, dtype, anchor, prefix_lens, topk, head.config.block_size - 1)
    for n in report["budgets"]:
        s.trees[n] = tree = jk.build_tree_from_topk(anchor, *topk, n)
        s.masks[n] = jk.tree_masks(tree.parents, tree.depths, prefix_lens)
    report["tree_depths"] = {n: int(t.depths.max()) for n, t in s.trees.items()}

    verify_rows(bench, s, "hf_sdpa_4d")
    for n in report["budgets"]:
        kernel_rows(bench, s, n)
    # The packed custom mask (FlashInfer on CUDA) last: it may still wait for its build.
    skip = "--skip-flashinfer" if args.skip_flashinfer else None
    if fi_build is not None:
        skip = wait_flashinfer(fi_build, bench.deadline - time.monotonic() - 60, kill=True)
    verify_rows(bench, s, "packed_mask", skip)
    n = min(report["budgets"], key=lambda b: abs(b - 16))
    skip = skip or ("deadline" if time.monotonic() > bench.deadline else None)
    report["packed_vs_4d"] = {"n": n, "status": f"skipped: {skip}"} if skip else compare_verify(s, n)


# Largest |logit diff| between two paths that must agree, relative to the logit scale: fp32 on a
# dry run, bf16 on the GPU (a different kernel's summation order moves bf16 logits by ~1e-2).
PATH_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
MIN_ARGMAX_AGREEMENT = {"float32": 1.0, "bfloat16": 0.97}  # bf16: near-ties may flip


def path_failures(report: dict, skip_flashinfer: bool = False) -> list[str]:
    """What the paths that must agree did not: the SGLang draft pass (paged, and replayed from a
    graph) against the dense draft, and the packed-mask verify (FlashInfer on the GPU) against the
    4D-mask SDPA verify. On the GPU, a packed-mask check that did not run is a failure too,
    unless --skip-flashinfer asked for that."""
    dtype, failures = report["dtype"], []
    tolerance = PATH_TOLERANCE.get(dtype, 3e-2)
    paths = report.get("draft_paths") or {}
    if not paths:
        failures.append("draft paths: not compared")
    for name in ("paged_vs_dense", "graph_vs_eager"):
        if name in paths and not paths[name] <= tolerance * max(paths["logit_scale"], 1.0):
            failures.append(f"draft paths: {name} max |logit diff| {paths[name]:.3g} over {tolerance:g} x scale {paths['logit_scale']:.3g}")
    check = report.get("packed_vs_4d") or {}
    if check.get("status") == "ok":
        if not check["max_abs_logit_diff"] <= tolerance * max(check["logit_scale"], 1.0):
            failures.append(f"packed vs 4D mask: max |logit diff| {check['max_abs_logit_diff']:.3g} over {tolerance:g} x scale")
        if check["argmax_agreement"] < MIN_ARGMAX_AGREEMENT.get(dtype, 0.97):
            failures.append(f"packed vs 4D mask: argmax agreement {check['argmax_agreement']:.3f}")
    elif not report["dry_run"] and not skip_flashinfer:
        failures.append(f"packed vs 4D mask: {check.get('status', 'not run')}")
    return failures


def run(args: argparse.Namespace) -> int:
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        log("no CUDA device (use --dry-run on CPU)")
        return 2
    args.deadline_s = args.deadline_s or (420.0 if cuda else 300.0)  # dry run: never skip a step on a busy CPU
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    bench = Bench(device, args.iters or (30 if cuda else 3), warmup=3 if cuda else 1, deadline_s=args.deadline_s)
    out_path = Path(args.out)
    report: dict = {
        "dry_run": args.dry_run, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "dtype": str(dtype).removeprefix("torch."),
        "versions": {pkg: installed_version(pkg) for pkg in ("torch", "transformers", "triton", "flashinfer-python")},
        "prefix": args.prefix or (1024 if cuda else 64), "budgets": [int(n) for n in args.budgets.split(",")],
        "target_config": QWEN3_8B if cuda else TOY, "iters": bench.iters, "deadline_s": args.deadline_s,
        "kernel_backend": "triton" if cuda else "torch fallback", "kernel_tests": {}, "packed_vs_4d": {},
    }
    fi_build = None
    if cuda and not args.skip_flashinfer:
        fi_build = start_flashinfer_build(out_path.with_name("flashinfer_warmup.log"))
    if args.skip_tests:
        report["kernel_tests"] = {"status": "skipped", "proved": "nothing: --skip-tests", "summary": "--skip-tests"}
    else:  # (1)
        report["kernel_tests"] = run_kernel_tests(args.dry_run, timeout_s=min(240.0, args.deadline_s / 2))
    try:  # (2), (3)
        measure(args, bench, report, dtype, fi_build)
    except Exception:  # noqa: BLE001 -- still write what was measured
        report["fatal"] = traceback.format_exc()
        log(f"stopped early:\n{report['fatal']}")
    finally:
        if fi_build is not None and fi_build.poll() is None:
            fi_build.kill()

    # (4) JSON, then the table last.
    report["rows"] = [asdict(r) for r in bench.rows]
    report["wall_s"] = round(bench.elapsed(), 1)
    report["path_failures"] = [] if "fatal" in report else path_failures(report, args.skip_flashinfer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out_path}")
    print(table(report))
    tests_ok = ("passed", "skipped", "partial") if args.dry_run else ("passed", "skipped")  # skipped: --skip-tests
    failed = "fatal" in report or report["kernel_tests"]["status"] not in tests_ok or report["path_failures"]
    return 1 if failed or any(r.status.startswith("error") for r in bench.rows) else 0


def table(report: dict) -> str:
    rows = {(r["name"], r["impl"], r["n"]): r for r in report["rows"]}

    def ms(key: tuple) -> str:
        row = rows.get(key)
        if row is None or row["median_ms"] is None:
            return "ERR" if row is not None and row["status"].startswith("error") else "skip"
        value = row["median_ms"]
        return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"

    budgets, prefix, dry = report["budgets"], report["prefix"], report["dry_run"]
    columns = "".join(f"{f'N={n}':>16}" for n in budgets)
    lines = [
        (f"JetFlow device check {report['date']}: {report['device']}, {report['dtype']}, median ms "
         f"({'perf_counter, DRY RUN at toy size' if dry else 'CUDA events'})"),
        (f"kernel tests: {report['kernel_tests'].get('status')}: {report['kernel_tests'].get('proved')} "
         f"({report['kernel_tests'].get('summary')})"),
        f"{f'target verify, prefix {prefix}':26s}{columns}",
    ]
    packed = "packed mask, CPU SDPA" if dry else "FlashInfer packed mask"
    for impl, label in (("hf_sdpa_4d", "HF SDPA, 4D mask"), ("packed_mask", packed)):
        lines.append(f"  {label:24s}" + "".join(f"{ms(('verify', impl, n)):>16}" for n in budgets))
    lines.append(f"{'kernel / torch reference':26s}{columns}")
    for op in KERNEL_OPS:
        cells = (f"{ms((op, 'kernel', n))} / {ms((op, 'reference', n))}" for n in budgets)
        lines.append(f"  {op:24s}" + "".join(f"{cell:>16}" for cell in cells))
    block = report.get("head", {}).get("block_size", 16)
    lines.append(f"head draft pass (block {block}, context {prefix}): dense {ms(('head', 'draft', block))}, "
                 f"SGLang paged {ms(('head', 'paged_eager', block))}, paged from graph {ms(('head', 'paged_graph', block))}")
    lines.append(f"  draft paths max |logit diff|: {report.get('draft_paths', {})}")
    lines.append(f"head context_kv (8 tokens) {ms(('head', 'context_kv', 8))};  "
                 f"target prefill ({prefix}) {ms(('prefill', 'hf_sdpa', prefix))}")
    check = report["packed_vs_4d"]
    if check.get("status") == "ok":
        lines.append(f"packed vs 4D mask logits at N={check['n']}: max |diff| {check['max_abs_logit_diff']:.3g} "
                     f"(logit scale {check['logit_scale']:.3g}), argmax agreement {check['argmax_agreement']:.3f}")
    not_ok = [f"{r['name']}/{r['impl']}/N={r['n']}: {r['status']}" for r in report["rows"] if r["status"] != "ok"]
    lines += [f"not timed: {line}" for line in not_ok[:6]] + [f"... {len(not_ok) - 6} more"] * (len(not_ok) > 6)
    lines += [f"PATHS DISAGREE: {line}" for line in report.get("path_failures", [])]
    if "fatal" in report:
        lines.append("STOPPED EARLY: " + report["fatal"].strip().splitlines()[-1])
    lines.append(f"kernels: {report['kernel_backend']}; wall {report['wall_s']}s")
    return "\n".join(lines)


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def use_checkout() -> None:
    """jetflow_sglang and jetflow_kernels (kernels/, via a symlink) from this checkout, installed
    or not, here and in the pytest run."""
    alias = Path(tempfile.mkdtemp(prefix="jetflow_device_check_"))
    atexit.register(shutil.rmtree, alias, True)
    (alias / "jetflow_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    paths = [str(ROOT), str(alias)]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every step at toy size on CPU")
    parser.add_argument("--out", default="out/device_check.json", help="JSON report (default out/device_check.json)")
    parser.add_argument("--budgets", default="1,16,64,128,256", help="tree budgets N (default 1,16,64,128,256)")
    parser.add_argument("--prefix", type=int, default=0, help="tokens cached before the tree (default 1024; dry run 64)")
    parser.add_argument("--iters", type=int, default=0, help="timed runs per row (default 30; dry run 3; kernels 2x)")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no row later than this many seconds (default 420; dry run 300)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the kernel tests (KERNEL_TEST_FILES)")
    parser.add_argument("--skip-flashinfer", action="store_true", help="skip the FlashInfer packed-mask rows")
    return parser.parse_args(argv)


if __name__ == "__main__":
    use_checkout()
    with torch.inference_mode():
        sys.exit(run(parse_args()))
