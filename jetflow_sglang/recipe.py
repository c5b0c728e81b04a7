"""`make train-default`: the recipe behind the shipped heads, one command end to end.

Stages (each a `jetflow` subcommand in a subprocess, its log under the work folder):
regenerate ShareGPT answers with the target -> train the JetFlow head (causal, with
revealed prefixes) -> train the DFlash-T baseline (bidirectional) on the same data and
steps -> evaluate both on HumanEval and the held-out ShareGPT slice -> ship both under
`jetflow_sglang/heads/` with a model card each. Finished stages are recorded in
`recipe.json` with their wall time and skipped on a rerun, so an interrupted recipe
resumes (regeneration resumes inside its stage as well).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from jetflow_sglang.errors import JetFlowError

HEADS = {"jetflow": "causal", "dflash-t": "bidirectional"}
SHIPPED_NAMES = {"jetflow": "SmolLM2-135M-Instruct", "dflash-t": "SmolLM2-135M-Instruct-dflash-t"}
EVAL_SETS = ("humaneval", "sharegpt-heldout")
MAX_SHIPPED_MB = 20


@dataclass
class RecipeConfig:
    work: str = "out/train-default"
    data: str = ""  # default: $JETFLOW_HOME/data/SmolLM2-135M-Instruct-sharegpt-regen
    prompts: int = 640  # first ShareGPT train-split prompts (those over 512 prompt tokens are skipped)
    max_new_tokens: int = 256
    regen_backend: str = "auto"  # auto | sglang | hf
    steps: int = 240
    batch_tokens: int = 4096
    lr: float = 2e-3
    warmup_steps: int = 20
    layers: int = 2
    reveal: float = 0.2  # JetFlow head only: share of blocks with a revealed true prefix
    eval_limits: tuple[int, int] = (40, 20)  # HumanEval, held-out ShareGPT
    eval_max_new_tokens: int = 32
    eval_dtype: str = "bfloat16"
    budgets: str = "16,32,64,128,256"
    ship: bool = True
    ship_to: str = ""  # default: the package's heads/ folder


def _data_dir(config: RecipeConfig) -> Path:
    from jetflow_sglang.assets import jetflow_home

    return Path(config.data) if config.data else jetflow_home() / "data" / "SmolLM2-135M-Instruct-sharegpt-regen"


class Stages:
    """Runs `jetflow` subcommands once each, recording wall time in recipe.json."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.record_path = work / "recipe.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.is_file() else {"stages": {}}

    def run(self, name: str, args: list[str]) -> str:
        """stdout of `jetflow <args>`; stderr (progress bars) goes to <name>.log."""
        done = self.record["stages"].get(name)
        if done:
            print(f"[recipe] {name}: done earlier ({done['seconds']:.0f} s)", flush=True)
            return done["stdout"]
        print(f"[recipe] {name}: jetflow {' '.join(args)}", flush=True)
        start = time.perf_counter()
        with open(self.work / f"{name}.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "jetflow_sglang.cli", *args], stdout=subprocess.PIPE, stderr=log, text=True)
        if proc.returncode != 0:
            raise JetFlowError(f"stage {name} failed (exit {proc.returncode}); see {self.work / (name + '.log')}")
        seconds = time.perf_counter() - start
        self.record["stages"][name] = {"args": args, "seconds": round(seconds, 1), "stdout": proc.stdout}
        self.record_path.write_text(json.dumps(self.record, indent=1))
        print(f"[recipe] {name}: {seconds:.0f} s", flush=True)
        return proc.stdout

    def seconds(self, name: str) -> float:
        return self.record["stages"][name]["seconds"]


def run_recipe(config: RecipeConfig) -> dict:
    work = Path(config.work)
    work.mkdir(parents=True, exist_ok=True)
    data = _data_dir(config)
    stages = Stages(work)
    stages.run("regenerate", [
        "regenerate", "--prompts", "sharegpt", "--limit", str(config.prompts),
        "--max-new-tokens", str(config.max_new_tokens), "--backend", config.regen_backend, "--out", str(data),
    ])
    train_results = {}
    for name, mask in HEADS.items():
        args = [
            "train", "--data", str(data), "--out", str(work / name), "--mask", mask, "--layers", str(config.layers),
            "--steps", str(config.steps), "--batch-tokens", str(config.batch_tokens), "--lr", str(config.lr),
            "--warmup-steps", str(config.warmup_steps),
        ]
        if mask == "causal" and config.reveal > 0:
            args += ["--reveal", str(config.reveal)]
        if (work / name / "train_state.json").is_file():
            args.append("--resume")  # an interrupted training stage picks up its last checkpoint
        train_results[name] = json.loads(stages.run(f"train-{name}", args).strip().splitlines()[-1])
    evals: dict[str, dict[str, list[dict]]] = {}
    for name in HEADS:
        for prompts, limit in zip(EVAL_SETS, config.eval_limits):
            out = stages.run(f"eval-{name}-{prompts}", [
                "eval", "--head", str(work / name), "--prompts", prompts, "--limit", str(limit),
                "--budgets", config.budgets, "--max-new-tokens", str(config.eval_max_new_tokens),
                "--dtype", config.eval_dtype, "--json",
            ])
            evals.setdefault(name, {})[prompts] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    report = {"config": asdict(config), "data": data_summary(data), "train": train_results, "eval": evals,
              "stage_seconds": {k: v["seconds"] for k, v in stages.record["stages"].items()}}
    (work / "report.json").write_text(json.dumps(report, indent=1))
    if config.ship:
        for name in HEADS:
            ship_head(name, work, report, Path(config.ship_to) if config.ship_to else None)
    return report


def data_summary(data: Path) -> dict:
    from jetflow_sglang.data import iter_examples

    examples = list(iter_examples(data))
    return {
        "examples": len(examples),
        "prompt_tokens": sum(len(e["prompt_ids"]) for e in examples),
        "response_tokens": sum(len(e["response_ids"]) for e in examples),
    }


def tau_table(report: dict, name: str) -> str:
    rows = ["| prompts | " + " | ".join(f"N={r['budget']}" for r in report["eval"][name][EVAL_SETS[0]]) + " |"]
    rows.append("|---" * (len(report["eval"][name][EVAL_SETS[0]]) + 1) + "|")
    for prompts, rows_ in report["eval"][name].items():
        rows.append(f"| {prompts} τ | " + " | ".join(f"{r['tau']:.2f}" for r in rows_) + " |")
        rows.append(f"| {prompts} speedup | " + " | ".join(f"{r['speedup']:.2f}x" for r in rows_) + " |")
        rows.append(f"| {prompts} identical to AR | " + " | ".join("yes" if r["identical"] else "NO" for r in rows_) + " |")
    return "\n".join(rows)


def model_card(name: str, report: dict) -> str:
    config, data, train = report["config"], report["data"], report["train"][name]
    seconds = report["stage_seconds"]
    mask = HEADS[name]
    limits = dict(zip(EVAL_SETS, config["eval_limits"]))
    title = "JetFlow draft head" if name == "jetflow" else "DFlash-T baseline head (bidirectional block mask)"
    reveal = f", reveal {config['reveal']}" if mask == "causal" and config["reveal"] > 0 else ""
    bf16_note = "" if config["eval_dtype"] == "float32" else (
        " \"Identical\" compares token ids with plain decoding in the same dtype: in bf16 a\n"
        "tree verify and a one-token decode round differently, so a near-tie can flip one argmax\n"
        "and the texts part there. In fp32 the outputs are identical (`tests/test_engine.py`)."
    )
    return f"""# {title} for SmolLM2-135M-Instruct

Made by `make train-default` (`python -m jetflow_sglang.recipe`). Load it with
`--head {'default' if name == 'jetflow' else 'dflash-t'}` (`jetflow generate/eval/serve/bench`).

- **Head**: {config['layers']} decoder layers at hidden 576, block size 16, {mask} block mask, bf16 weights
  (the target's embedding and lm_head are shared, not stored).
- **Data**: the first {config['prompts']} ShareGPT V3 first-user-turn prompts of the training split
  ({data['examples']} within the 512-token prompt cap), answered greedily by the target itself
  (at most {config['max_new_tokens']} new tokens): {data['prompt_tokens']:,} prompt and
  {data['response_tokens']:,} response tokens. HumanEval and the held-out ShareGPT slice are never trained on.
- **Training**: {train['steps']} steps of ~{config['batch_tokens']} target tokens, forward KL to the target's
  distribution, AdamW lr {config['lr']} (warmup {config['warmup_steps']}, cosine){reveal};
  final loss {train['final_loss']:.3f}; {train['seconds_per_step']} s/step on a 2-core CPU (AMX bf16).
- **Wall time on that machine**: regeneration {seconds['regenerate'] / 60:.1f} min (shared by both heads),
  training {seconds[f'train-{name}'] / 60:.1f} min{' (plus the one-time target feature cache, if this run built it)' if name == 'jetflow' else ''},
  evaluation {sum(seconds[f'eval-{name}-{p}'] for p in EVAL_SETS) / 60:.1f} min.

![loss](loss.png)

## τ (committed tokens per target forward), greedy, reference engine

First {limits['humaneval']} HumanEval prompts and first {limits['sharegpt-heldout']} held-out ShareGPT prompts,
{config['eval_max_new_tokens']} new tokens each, {config['eval_dtype']}; speedup is the median per prompt of
tokens/s against plain decoding in the same process.{bf16_note}

{tau_table(report, name)}
"""


def ship_head(name: str, work: Path, report: dict, heads_dir: Path | None = None) -> Path:
    from jetflow_sglang.assets import SHIPPED_HEADS
    from jetflow_sglang.head import WEIGHTS_FILE

    source = work / name
    dest = (heads_dir or SHIPPED_HEADS) / SHIPPED_NAMES[name]
    size_mb = (source / WEIGHTS_FILE).stat().st_size / 2**20
    if size_mb > MAX_SHIPPED_MB:
        raise JetFlowError(f"{source / WEIGHTS_FILE} is {size_mb:.1f} MB, over the {MAX_SHIPPED_MB} MB shipping limit")
    staging = dest.with_name(dest.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for file in ("config.json", WEIGHTS_FILE, "loss.png"):
        shutil.copy2(source / file, staging / file)
    (staging / "README.md").write_text(model_card(name, report))
    (staging / "eval.json").write_text(json.dumps(report["eval"][name], indent=1) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    print(f"[recipe] shipped {dest} ({size_mb:.1f} MB)", flush=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jetflow_sglang.recipe", description=__doc__.splitlines()[0])
    defaults = RecipeConfig()
    for field in ("work", "data", "prompts", "steps", "batch_tokens", "lr", "reveal", "eval_max_new_tokens"):
        value = getattr(defaults, field)
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--no-ship", action="store_true", help="train and evaluate, but leave the shipped heads alone")
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k in RecipeConfig.__dataclass_fields__}
    try:
        report = run_recipe(RecipeConfig(**fields, ship=not args.no_ship))
    except JetFlowError as exc:
        print(f"jetflow recipe: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report["stage_seconds"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
