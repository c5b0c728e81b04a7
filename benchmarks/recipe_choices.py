"""Recipe choices measured at equal wall time: init from the target vs random, 1/2/3 head layers,
learning rate. Each variant trains from scratch on the same data (the same feature cache) for the
same number of seconds, then is scored on the same held-out blocks.

    .venv/bin/python benchmarks/recipe_choices.py --data $D/sharegpt-regen,$D/sharegpt-corpus \
        --val-data $D/sharegpt-validation-corpus --minutes 6 --out benchmarks/results/recipe_choices.json

Equal wall time: a short timing run of each variant (`--timing-steps` steps, no held-out
scoring) gives its seconds per step, and the variant then runs as many steps as fit in
`--minutes` with its own full cosine schedule. The reference variant is the shipped recipe
(2 layers, random init, lr 2e-3); every other variant changes one thing. A variant whose
result JSON exists in `--work` is not rerun, so an interrupted sweep resumes (a variant cut
short starts over). Prints a table (held-out top-1 per depth, chain tau, prompt lookup's chain
tau on the same blocks) of every variant finished in `--work` and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = {"layers": "2", "lr": "2e-3"}
VARIANTS = {
    "2 layers, random init, lr 2e-3 (shipped recipe)": {},
    "2 layers, init from target": {"init-from-target": None},
    "1 layer": {"layers": "1"},
    "3 layers": {"layers": "3"},
    "lr 6e-3": {"lr": "6e-3"},
    "lr 7e-4": {"lr": "7e-4"},
    "lr 3e-4": {"lr": "3e-4"},
}


def train_args(args: argparse.Namespace, variant: dict, out: Path, steps: int, val: bool) -> list[str]:
    options = {**BASE, **variant}
    command = [sys.executable, "-m", "jetflow_sglang.cli", "train", "--data", args.data, "--out", str(out),
               "--steps", str(steps), "--batch-tokens", str(args.batch_tokens), "--anchor-fraction",
               str(args.anchor_fraction), "--warmup-steps", str(min(30, max(1, steps // 10))),
               "--depth-decay", "4", "--reveal", "0.1", "--seed", str(args.seed), "--checkpoint-every", str(steps)]  # fmt: skip
    for key, value in options.items():
        command += [f"--{key}"] + ([] if value is None else [value])
    if val:
        command += ["--val-data", args.val_data, "--val-blocks", str(args.val_blocks)]
    return command


def run_train(command: list[str]) -> dict:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"recipe_choices: jetflow train failed (exit {proc.returncode}): {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def result_path(work: Path, name: str) -> Path:
    return work / ("".join(c if c.isalnum() else "-" for c in name.split(" (")[0]).strip("-") + ".json")


def measure(args: argparse.Namespace, name: str, variant: dict, work: Path) -> dict:
    done = result_path(work, name)
    if done.is_file():
        return json.loads(done.read_text())
    with tempfile.TemporaryDirectory(prefix="jetflow-timing-") as timing:
        timed = run_train(train_args(args, variant, Path(timing) / "head", args.timing_steps, val=False))
    seconds_per_step = timed["seconds_per_step"]
    steps = max(1, int(args.minutes * 60 / seconds_per_step))
    out = work / done.stem
    shutil.rmtree(out, ignore_errors=True)  # a variant cut short reruns whole: its step count is its wall time
    result = run_train(train_args(args, variant, out, steps, val=True))
    row = {"variant": name, "steps": steps, "timed_seconds_per_step": seconds_per_step,
           "train_seconds": result["seconds"], **result["held_out"]}  # fmt: skip
    done.write_text(json.dumps(row))
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':<50} {'steps':>5} {'d1':>6} {'d2':>6} {'d4':>6} {'d8':>6} {'chain tau':>9} {'lookup tau':>10}")
    for r in rows:
        t = r["top1"]
        print(f"{r['variant']:<50} {r['steps']:>5} {t[0]:>6.3f} {t[1]:>6.3f} {t[3]:>6.3f} {t[7]:>6.3f} "
              f"{r['chain_tau']:>9.3f} {r['lookup_chain_tau']:>10.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="training data directories, joined by commas")
    parser.add_argument("--val-data", required=True, help="held-out data directory scored at the end of each run")
    parser.add_argument("--minutes", type=float, default=6.0, help="training wall time per variant")
    parser.add_argument("--timing-steps", type=int, default=6, help="steps of the timing run of each variant")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="target tokens per step")
    parser.add_argument("--anchor-fraction", type=float, default=0.25, help="share of response positions drafted from")
    parser.add_argument("--val-blocks", type=int, default=512, help="held-out blocks scored per variant")
    parser.add_argument("--seed", type=int, default=0, help="training seed (the same for every variant)")
    parser.add_argument("--variants", default=None, help="comma list of variant numbers (1-based) to run; default all")
    parser.add_argument("--work", default="out/recipe-choices", help="heads and per-variant results (resume)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    if args.minutes <= 0 or args.timing_steps < 1:
        raise SystemExit("recipe_choices: --minutes must be > 0 and --timing-steps >= 1")
    names = list(VARIANTS)
    if args.variants:
        try:
            names = [names[int(i) - 1] for i in args.variants.split(",")]
        except (ValueError, IndexError):
            raise SystemExit(f"recipe_choices: --variants takes numbers 1..{len(VARIANTS)}, got {args.variants!r}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(json.dumps(measure(args, name, VARIANTS[name], work)), flush=True)
        # Every variant finished in --work so far, also those of an earlier --variants run.
        rows = [json.loads(result_path(work, n).read_text()) for n in VARIANTS if result_path(work, n).is_file()]
        if args.out:
            config = {**vars(args), "data": ",".join(Path(d).name for d in args.data.split(",")),
                      "val_data": Path(args.val_data).name}  # no machine paths in results
            Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print_table(rows)


if __name__ == "__main__":
    main()
