"""Regenerated-data shards: JSONL token ids of prompts and the target's (or a corpus's)
answers, with a meta.json naming the target, tokenizer and sampling (the prompts themselves:
`jetflow_sglang.prompts`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

from jetflow_sglang.assets import write_atomic
from jetflow_sglang.errors import JetFlowError

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
    write_atomic(Path(data_dir) / META_FILE, json.dumps(meta, indent=2) + "\n")


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
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path
