"""The benchmark harness: SGLang servers as named variants, greedy requests through the OpenAI
client, interleaved rounds with per-cell medians, a printed table, JSON and an optional PNG.

`jetflow bench` (`jetflow_sglang.bench`) and the scripts in ``benchmarks/`` are configurations of it:

    variants = [Variant("target"), Variant.jetflow("adaptive", head_dir, 64, env=PROFILE)]
    with Fleet(target, work_dir("budget"), dtype) as fleet:
        fleet.start_all(variants)
        fleet.warm_up(prompts[0])
        runs = interleave(3, [1, 4], fleet.names, lambda name, c: fleet.batch(name, prompts, c))
    print(format_table([Column("variant", "name", width=12, left=True), ...], rows))
    write_json(out, report)

A `Variant` is a server's launcher flags, environment, dtype and, for another checkout's code,
its directory (`baseline_code`). A `Fleet` starts variants through `jetflow_sglang.server`
(127.0.0.1, a log per variant) and stops every one on exit, also on errors and Ctrl-C. `request`
sends one greedy request and reads back tokens/s and tau (SGLang's ``spec_tokens_details``);
`batch` sends a prompt set with c requests in flight. `interleave` runs rounds x cells x
variants, every variant in turn within a cell, so all see the same machine state; `medians`
reduces a cell's rounds. Servers run with ``JETFLOW_PROFILE=1`` (`PROFILE`) log a profile line
every 20 rounds; `last_profile` reads the latest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Mapping, Optional, Sequence, Union

from jetflow_sglang import server as sglang_server
from jetflow_sglang.budget import COST_TABLE_ENV
from jetflow_sglang.prompts import Prompt, load_prompts

PROFILE_MARK = "JETFLOW profile "
PROFILE = {"JETFLOW_PROFILE": "1"}  # the worker logs its per-phase profile (`last_profile`)
WARMUP = Prompt(id="warmup", text="Hi", kind="chat")


# --- prompts, models, flags ------------------------------------------------------------------


def bench_prompts(spec: str, limit: Optional[int]) -> list[Prompt]:
    """The first `limit` prompts of a set (demo, humaneval, sharegpt-heldout, or a JSON/JSONL file)."""
    prompts = load_prompts(spec)
    return prompts[:limit] if limit else prompts


def resolve(target: str = "default", head: str = "default") -> tuple[str, str]:
    """(target directory, head directory) from the names `jetflow` takes."""
    from jetflow_sglang.assets import head_dir_for, resolve_target

    target_dir = resolve_target(target)
    return str(target_dir), str(head_dir_for(head, target_dir))


def cost_env(cost_table: Optional[str]) -> dict[str, str]:
    """``JETFLOW_COST_TABLE`` for a server, when a table is given."""
    return {COST_TABLE_ENV: cost_table} if cost_table else {}


def work_dir(name: str) -> Path:
    """A fresh folder for a run's server logs and files."""
    return Path(tempfile.mkdtemp(prefix=f"jetflow-{name}-"))


_ARGS: dict[str, tuple[Any, str]] = {
    "target": (str, "default or a HF model directory"),
    "head": (str, "default, random, or a head directory"),
    "prompts": (str, "demo, humaneval, sharegpt-heldout, or a JSON/JSONL file"),
    "limit": (int, "first N prompts of the set"),
    "budget": (int, "tree nodes per round (--speculative-num-draft-tokens); adaptive: the cap"),
    "rounds": (int, "interleaved repeats over every variant; medians are reported"),
    "max_new_tokens": (int, "new tokens per prompt"),
    "cost_table": (str, "JETFLOW_COST_TABLE of the adaptive server (benchmarks/verify_cost.py)"),
    "dtype": (str, "dtype of every server (auto: bf16 where its matmuls are native, else float32)"),
    "out": (str, "write the JSON report here"),
}


def add_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """The flags the benchmarks share, each with its default here (``--max-new-tokens`` from
    ``max_new_tokens=128``); ``--dtype`` takes auto, float32 or bfloat16 (resolve it with
    `serving_dtype`)."""
    for name, default in defaults.items():
        kind, text = _ARGS[name]
        flag = "--" + name.replace("_", "-")
        if name == "dtype":
            parser.add_argument(flag, default=default, choices=["auto", "float32", "bfloat16"], help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)
    return parser


def serving_dtype(choice: str) -> str:
    """A server's ``--dtype`` from auto, float32 or bfloat16."""
    from jetflow_sglang.reference.target import serving_dtype as resolve_dtype

    return resolve_dtype(choice)


# --- variants and servers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One server configuration: launcher flags, environment, dtype (None: the fleet's) and the
    launcher's directory (None: the fleet's; `baseline_code` for another checkout)."""

    name: str
    flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    dtype: Optional[str] = None
    cwd: Optional[str] = None

    @classmethod
    def jetflow(cls, name: str, head: str, budget: int, *flags: str, env: Optional[Mapping[str, str]] = None,
                dtype: Optional[str] = None, cwd: Optional[str] = None) -> "Variant":  # fmt: skip
        """JETFLOW with `head` at tree budget `budget` (the cap when adaptive), plus `flags`."""
        return cls(name, (*sglang_server.jetflow_args(head, budget), *flags), dict(env or {}), dtype, cwd)

    def on(self, code: Path, costs: Path) -> "Variant":
        """This variant on another checkout's code (`baseline_code`), with its own measured-cost
        folder, so the two codes' adaptive servers share no costs; named "<name> baseline"."""
        env = {**self.env, "PYTHONPATH": str(code), "JETFLOW_COST_CACHE": str(costs)}
        return Variant(f"{self.name} baseline", self.flags, env, self.dtype, str(code))


def baseline_code(checkout: Path, work: Path) -> Path:
    """A folder whose jetflow_sglang and jetflow_kernels are the checkout's (PYTHONPATH and the
    launcher's directory put it ahead of the installed package)."""
    if not (checkout / "jetflow_sglang").is_dir() or not (checkout / "kernels").is_dir():
        raise SystemExit(f"--baseline: {checkout} is not a checkout of this project")
    code = work / "baseline-code"
    code.mkdir()
    (code / "jetflow_sglang").symlink_to(checkout.resolve() / "jetflow_sglang")
    (code / "jetflow_kernels").symlink_to(checkout.resolve() / "kernels")
    return code


def refusal(exc: RuntimeError) -> str:
    """The line of a failed start that says why (an unsupported feature or an error), else its first."""
    lines = [line for line in str(exc).splitlines() if "not supported" in line or "Error" in line]
    return (lines[-1] if lines else str(exc).splitlines()[0]).strip()


class Fleet:
    """Servers of one target, by variant name; a context manager that stops them all."""

    def __init__(self, target: str, work: Path, dtype: str, max_total_tokens: int = 8192, cwd: Optional[str] = None) -> None:
        """`cwd`: the launchers' directory unless a variant names its own (None: this process's;
        ``python -m`` puts it first on the server's import path)."""
        self.target, self.work, self.dtype, self.max_total_tokens = target, work, dtype, max_total_tokens
        self.cwd = cwd
        self._starts = 0
        self.servers: dict[str, sglang_server.Server] = {}
        self.logs: dict[str, Path] = {}
        self._clients: dict[str, Any] = {}
        self._model: Optional[str] = None

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def names(self) -> list[str]:
        return list(self.servers)

    def start(self, variant: Variant, log: Optional[Path] = None) -> sglang_server.Server:
        """Start a variant and wait until it is healthy; RuntimeError with its log tail if not."""
        self.logs[variant.name] = log or self.work / f"server{self._starts}.log"
        self._starts += 1
        server = sglang_server.start(
            self.target, self.logs[variant.name], *variant.flags, env=dict(variant.env), dtype=variant.dtype or self.dtype,
            max_total_tokens=self.max_total_tokens, cwd=variant.cwd or self.cwd,
        )  # fmt: skip
        self.servers[variant.name] = server
        return server

    def start_all(self, variants: Iterable[Variant]) -> None:
        for variant in variants:
            self.start(variant)

    def stop(self, name: Optional[str] = None) -> None:
        """Stop one variant's server (its log stays), or every one."""
        for key in [name] if name else list(self.servers):
            self.servers.pop(key).stop()
            self._clients.pop(key, None)

    def client(self, name: str) -> Any:
        """The OpenAI client of a variant's server (no retries, an hour's timeout)."""
        if name not in self._clients:
            from openai import OpenAI

            self._clients[name] = OpenAI(base_url=self.servers[name].url + "/v1", api_key="none", max_retries=0, timeout=3600)
        return self._clients[name]

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.client(next(iter(self.servers))).models.list().data[0].id
        return self._model

    def request(self, name: str, prompt: Prompt, **options: Any) -> dict:
        """`request` on a variant's server."""
        return request(self.client(name), self.model, prompt, **options)

    def batch(self, name: str, prompts: Sequence[Prompt], concurrency: int, **options: Any) -> dict:
        """`batch` on a variant's server."""
        return batch(self.client(name), self.model, prompts, concurrency, **options)

    def warm_up(self, prompt: Prompt = WARMUP, max_new_tokens: int = 8) -> None:
        """One short request to every server."""
        for name in self.servers:
            self.request(name, prompt, max_new_tokens=max_new_tokens)

    def profile(self, name: str) -> Optional[dict]:
        """The variant's last profile line (`last_profile`), None without one."""
        log = self.logs[name]
        return last_profile(log) if log.exists() else None


# --- requests -----------------------------------------------------------------------------------


def request(client: Any, model: str, prompt: Prompt, *, max_new_tokens: int = 256, ignore_eos: bool = False) -> dict:
    """One greedy request: its text, token ids (the prompt's too) and the stop token it ended on
    (SGLang's ``matched_stop`` when an id), tokens/s, and tau from ``spec_tokens_details``. Chat
    prompts go to ``/v1/chat/completions``, code prompts to ``/v1/completions``."""
    extra = {"ignore_eos": ignore_eos, "return_spec_tokens_details": True, "return_token_ids": True}
    t0 = time.perf_counter()
    if prompt.kind == "chat":
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt.text}],
            temperature=0, max_tokens=max_new_tokens, extra_body=extra,
        )  # fmt: skip
        choice = response.choices[0]
        text, ids = choice.message.content or "", (choice.model_extra or {}).get("response_token_ids")
    else:
        response = client.completions.create(
            model=model, prompt=prompt.text, temperature=0, max_tokens=max_new_tokens, extra_body=extra
        )
        choice = response.choices[0]
        text, ids = choice.text, (choice.model_extra or {}).get("token_ids")
    seconds = time.perf_counter() - t0
    tokens = response.usage.completion_tokens
    details = ((response.model_extra or {}).get("sglext") or {}).get("spec_tokens_details") or {}
    verify = details.get("spec_verify_ct") or 0
    stop = (choice.model_extra or {}).get("matched_stop", getattr(choice, "matched_stop", None))
    return {
        "text": text,
        "ids": list(ids or []),
        "prompt_ids": list((choice.model_extra or {}).get("prompt_token_ids") or []),
        "stop": stop if isinstance(stop, int) and not isinstance(stop, bool) else None,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 3),
        "tau": round(1 + details.get("spec_num_correct_drafts", 0) / verify, 3) if verify else None,
    }


def batch(client: Any, model: str, prompts: Sequence[Prompt], concurrency: int, **options: Any) -> dict:
    """Every prompt through `request`, `concurrency` in flight: output tokens/s over the wall
    time, the median tau, the texts in prompt order, and each request's result."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: request(client, model, p, **options), prompts))
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"tokens_per_s": tokens / seconds, "tau": median(r["tau"] for r in results), "seconds": seconds,
            "tokens": tokens, "texts": [r["text"] for r in results], "requests": results}  # fmt: skip


# --- rounds and medians -------------------------------------------------------------------------


def interleave(rounds: int, cells: Sequence[Hashable], names: Sequence[str],
               measure: Callable[[str, Any], Any]) -> list[dict[str, list]]:  # fmt: skip
    """`measure(name, cell)` for every round, cell and variant name, in that nesting: each round
    goes over all cells in turn and each cell over every variant, so a cell's variants are
    measured minutes apart on the same machine. Returns, per cell in order, each name's results
    over the rounds."""
    runs: list[dict[str, list]] = [{name: [] for name in names} for _ in cells]
    for _ in range(rounds):
        for cell, by_name in zip(cells, runs):
            for name in names:
                by_name[name].append(measure(name, cell))
    return runs


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(runs: Sequence[Mapping[str, Any]], keys: Iterable[str], digits: Optional[int] = 3) -> dict[str, Optional[float]]:
    """Per key, the median over the runs (None values left out), rounded to `digits`."""
    out = {}
    for key in keys:
        value = median(run.get(key) for run in runs)
        out[key] = round(value, digits) if value is not None and digits is not None else value
    return out


# --- table, JSON, PNG ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A table column: its header, the row key or a function of the row, a format spec and a width
    (None values print as "-")."""

    header: str
    value: Union[str, Callable[[dict], Any]]
    fmt: str = ""
    width: int = 10
    left: bool = False

    def cell(self, row: dict) -> str:
        value = self.value(row) if callable(self.value) else row.get(self.value)
        text = "-" if value is None else format(value, self.fmt)
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"

    def head(self) -> str:
        return f"{self.header:<{self.width}}" if self.left else f"{self.header:>{self.width}}"


def format_table(columns: Sequence[Column], rows: Iterable[dict], title: str = "") -> str:
    """A fixed-width table: the header (with `title` after it), then one line per row."""
    lines = [" ".join(c.head() for c in columns) + (f"   ({title})" if title else "")]
    lines += [" ".join(c.cell(row) for c in columns) for row in rows]
    return "\n".join(lines)


def write_json(path: Union[str, Path], report: Any, indent: int = 2) -> Path:
    """Write the report (its folder made; through a ``.partial`` file, so a reader never sees half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=indent) + "\n")
    partial.rename(path)
    return path


def plot_lines(path: Union[str, Path], panels: Mapping[str, Mapping[str, tuple[Sequence, Sequence]]], xlabel: str,
               ylabel: str, log2_x: bool = True, dashed: Sequence[str] = ()) -> Path:  # fmt: skip
    """A PNG with one panel per title, one line per label from its (xs, ys); labels in `dashed`
    are drawn black and dashed (a baseline). Needs matplotlib (the ``train`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        xs_all: set = set()
        for label, (xs, ys) in lines.items():
            style = dict(marker="s", color="black", linestyle="--") if label in dashed else dict(marker="o")
            ax.plot(list(xs), list(ys), label=label, **style)
            xs_all.update(xs)
        if log2_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(xs_all), [str(x) for x in sorted(xs_all)])
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# --- server profiles -----------------------------------------------------------------------------


def profiles(log: Path) -> list[dict]:
    """Every cumulative profile line a JETFLOW worker logged (``JETFLOW_PROFILE=1``), oldest first."""
    lines = [line for line in Path(log).read_text(errors="replace").splitlines() if PROFILE_MARK in line]
    return [json.loads(line.split(PROFILE_MARK, 1)[1]) for line in lines]


def last_profile(log: Path) -> Optional[dict]:
    """The latest profile line of a server log, None without one."""
    found = profiles(log)
    return found[-1] if found else None
