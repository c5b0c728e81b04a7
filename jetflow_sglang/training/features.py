"""Target features and soft labels for training: one frozen-target pass over the data, on disk.

Every head trained on a data directory with the same target and tap layers reads the
same cache (the JetFlow head and its bidirectional baseline share one target pass),
and a training step runs no target forward and no target lm_head: per token the cache
holds the fused tap features (the head's context) and the target's top-k next-token
log-probs over its full vocabulary (the soft label of the position after it; the rest
of the mass is the tail, 1 - sum of the top-k).

Layout: ``DATA/features-<key>/part-NNNNN.safetensors`` (examples sorted by length, in
groups) and ``meta.json``; ``<key>`` hashes the target config and dtype, the taps, the
sequence cap, k and the data shards, so a change to any of them builds a new cache. Parts are
written atomically and skipped when present: an interrupted build resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from jetflow_sglang.errors import JetFlowError

CACHE_VERSION = 2
EXAMPLES_PER_PART = 256
SOFT_TOPK = 32


@dataclass
class FeatureStore:
    """Sequences back to back: sequence i is rows offsets[i]:offsets[i+1]."""

    input_ids: Tensor  # [total] int64
    features: Tensor  # [total, n_taps * H] bf16
    topk_ids: Tensor  # [total, k] int64: the target's top-k tokens for the position after each row
    topk_logprobs: Tensor  # [total, k] float32, their log-probs over the full target vocabulary
    offsets: Tensor  # [n + 1] int64
    prompt_lens: Tensor  # [n] int64

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def sequence(self, index: int) -> slice:
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))

    @classmethod
    def concat(cls, stores: list["FeatureStore"]) -> "FeatureStore":
        if len(stores) == 1:
            return stores[0]
        lengths = torch.cat([s.lengths for s in stores])
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)
        return cls(
            input_ids=torch.cat([s.input_ids for s in stores]),
            features=torch.cat([s.features for s in stores]),
            topk_ids=torch.cat([s.topk_ids for s in stores]),
            topk_logprobs=torch.cat([s.topk_logprobs for s in stores]),
            offsets=offsets,
            prompt_lens=torch.cat([s.prompt_lens for s in stores]),
        )


def cache_key(target_dir: Path, tap_layers: list[int], max_seq_len: int, data_dir: Path, dtype: str = "") -> str:
    from jetflow_sglang.training.data import shard_paths

    shards = [(p.name, p.stat().st_size) for p in shard_paths(data_dir)]
    blob = json.dumps(
        {
            "version": CACHE_VERSION,
            "target": hashlib.sha256((Path(target_dir) / "config.json").read_bytes()).hexdigest(),
            "taps": list(tap_layers),
            "max_seq_len": max_seq_len,
            "topk": SOFT_TOPK,
            "dtype": dtype,
            "shards": shards,
        }
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _part_batches(examples: list[dict], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped so a padded batch holds about tokens_per_batch tokens (examples are length-sorted)."""
    batches, current, width = [], [], 0
    for index, example in enumerate(examples):
        width = max(width, len(example["ids"]))
        if current and width * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, width = [], len(example["ids"])
        current.append(index)
    if current:
        batches.append(current)
    return batches


def soft_labels(final_hidden: Tensor, lm_head: Tensor, k: int = SOFT_TOPK, chunk: int = 2048) -> tuple[Tensor, Tensor]:
    """The target's top-k next-token ids and log-probs [n, k] from final normed hidden states [n, H]."""
    ids, logprobs = [], []
    for rows in final_hidden.split(chunk):
        logits = torch.nn.functional.linear(rows.to(lm_head.dtype), lm_head).float()
        values, indices = logits.topk(k, dim=-1)
        ids.append(indices)
        logprobs.append(values - torch.logsumexp(logits, -1, keepdim=True))
    return torch.cat(ids), torch.cat(logprobs)


@torch.inference_mode()
def featurize(target, examples: list[dict], tokens_per_batch: int = 8192) -> dict[str, Tensor]:
    """Features and soft labels of examples {"ids", "prompt_len"} (one target pass, padded batches)."""
    pad = target.tokenizer.pad_token_id or 0
    ids_out, features_out, topk_ids_out, topk_lp_out = [], [], [], []
    for batch in _part_batches(examples, tokens_per_batch):
        rows = [examples[i]["ids"] for i in batch]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        final_hidden, features = target.hidden_and_features(input_ids, attention)
        for row, ids in enumerate(rows):
            ids_out.append(torch.tensor(ids))
            features_out.append(features[row, : len(ids)].to(torch.bfloat16))
            top_ids, top_lp = soft_labels(final_hidden[row, : len(ids)], target.lm_head)
            topk_ids_out.append(top_ids.to(torch.int32))
            topk_lp_out.append(top_lp.to(torch.float16))
    return {
        "input_ids": torch.cat(ids_out),
        "features": torch.cat(features_out).contiguous(),
        "topk_ids": torch.cat(topk_ids_out).contiguous(),
        "topk_logprobs": torch.cat(topk_lp_out).contiguous(),
        "lengths": torch.tensor([len(e["ids"]) for e in examples]),
        "prompt_lens": torch.tensor([e["prompt_len"] for e in examples]),
    }


def store_from_parts(parts: list[dict[str, Tensor]]) -> FeatureStore:
    lengths = torch.cat([p["lengths"] for p in parts])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    return FeatureStore(
        input_ids=torch.cat([p["input_ids"] for p in parts]).long(),
        features=torch.cat([p["features"] for p in parts]),
        topk_ids=torch.cat([p["topk_ids"] for p in parts]).long(),
        topk_logprobs=torch.cat([p["topk_logprobs"] for p in parts]).float(),
        offsets=offsets,
        prompt_lens=torch.cat([p["prompt_lens"] for p in parts]).long(),
    )


def build_or_load(target, target_dir: Path, data_dir: Path, examples: list[dict], max_seq_len: int,
                  tokens_per_batch: int = 8192, log=print) -> FeatureStore:  # fmt: skip
    """The feature cache of `examples` (as read from data_dir) for the target's current taps."""
    from safetensors.torch import load_file, save_file

    key = cache_key(target_dir, target.tap_layers, max_seq_len, data_dir, str(target.dtype))
    cache = Path(data_dir) / f"features-{key}"
    rows = [
        {"ids": (e["prompt_ids"] + e["response_ids"])[:max_seq_len], "prompt_len": len(e["prompt_ids"])}
        for e in examples
        if e["response_ids"]
    ]
    if not rows:
        raise JetFlowError(f"{data_dir} holds no examples with a response")
    cache.mkdir(exist_ok=True)
    rows.sort(key=lambda r: len(r["ids"]))
    parts = [rows[i : i + EXAMPLES_PER_PART] for i in range(0, len(rows), EXAMPLES_PER_PART)]
    todo = [i for i in range(len(parts)) if not (cache / f"part-{i:05d}.safetensors").is_file()]
    if todo:
        total = sum(len(r["ids"]) for i in todo for r in parts[i])
        log(f"target features: {len(todo)} of {len(parts)} parts to build ({total} tokens) in {cache}")
        start, done = time.perf_counter(), 0
        for i in todo:
            tensors = featurize(target, parts[i], tokens_per_batch)
            staging = cache / f".part-{i:05d}.safetensors"
            save_file(tensors, str(staging))
            staging.replace(cache / f"part-{i:05d}.safetensors")
            done += int(tensors["lengths"].sum())
            log(f"  part {i + 1}/{len(parts)}: {done}/{total} tokens, {done / (time.perf_counter() - start):.0f} tok/s")
        (cache / "meta.json").write_text(json.dumps({"key": key, "taps": target.tap_layers, "examples": len(rows),
                                                     "tokens": sum(len(r["ids"]) for r in rows)}))  # fmt: skip
    return store_from_parts([load_file(str(cache / f"part-{i:05d}.safetensors")) for i in range(len(parts))])
