"""`jetflow regenerate`: responses written by the target itself, the head's training data.

Prompts are rendered with the target's chat template; the target answers them
(greedy, or sampled with a recorded seed) through SGLang's offline Engine, the fastest measured
here (`benchmarks/regen_speed.py`); where SGLang does not run, through a batched plain-PyTorch
decoder (`batch_decode`, 2.2x HF `generate`), which stays as a dependency-light reference. The `corpus` backend
instead keeps the corpus's own answer (ShareGPT's), which training then runs through the target
teacher-forced: the soft labels are still the target's. Output is JSONL shards of
token ids plus meta.json (target, tokenizer fingerprint, sampling, backend); a rerun
skips ids already written, so an interrupted run resumes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from jetflow_sglang.prompts import load_prompts
from jetflow_sglang.training.data import (
    iter_examples,
    read_meta,
    shard_paths,
    tokenizer_fingerprint,
    write_meta,
    write_shard,
)
from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.reference.target import encode_prompt


@dataclass(frozen=True)
class RegenerateConfig:
    target: str
    prompts: str = "sharegpt"
    out: str = "data/regenerated"
    limit: int | None = None
    skip: int = 0  # prompts to pass over first
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 32
    backend: str = "auto"  # auto | sglang | torch | hf | corpus
    dtype: str = "auto"  # auto (bf16 where its matmuls are native, else float32) | float32 | bfloat16
    tp: int = 1  # SGLang's tensor-parallel ranks (a target larger than one GPU); the sglang backend only


class HFBackend:
    def __init__(self, target_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype), use_safetensors=True).eval()

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], config: RegenerateConfig, pad_id: int) -> list[list[int]]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])  # left padding
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        sampled = config.temperature > 0
        out = self.model.generate(
            input_ids,
            attention_mask=attention,
            max_new_tokens=config.max_new_tokens,
            do_sample=sampled,
            temperature=config.temperature if sampled else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
        )
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        responses = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
            responses.append(row[:cut])
        return responses

    def close(self) -> None:
        pass


class TorchBackend:
    """The target's HF modules run by `batch_decode.BatchDecoder` (preallocated KV cache)."""

    def __init__(self, target_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        from jetflow_sglang.training.batch_decode import BatchDecoder

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype), use_safetensors=True)
        self.decoder = BatchDecoder(model)

    def generate(self, batch: list[list[int]], config: RegenerateConfig, pad_id: int) -> list[list[int]]:
        return self.decoder.generate(batch, config.max_new_tokens, config.temperature, config.seed)

    def close(self) -> None:
        pass


class SGLangBackend:
    def __init__(self, target_dir: Path, dtype: str, tp: int = 1) -> None:
        import sglang

        self.engine = sglang.Engine(model_path=str(target_dir), dtype=dtype, max_total_tokens=65536, log_level="error",
                                    tp_size=tp)  # fmt: skip

    def generate(self, batch: list[list[int]], config: RegenerateConfig, pad_id: int) -> list[list[int]]:
        params = {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature}
        if config.temperature > 0:
            params["sampling_seed"] = config.seed
        outputs = self.engine.generate(input_ids=batch, sampling_params=params)
        return [list(o["output_ids"]) for o in outputs]

    def close(self) -> None:
        self.engine.shutdown()


class CorpusBackend:
    """The corpus's own answers (cut at max_new_tokens, ended with the target's EOS)."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], str]) -> None:
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, batch: list[list[int]], config: RegenerateConfig, pad_id: int) -> list[list[int]]:
        eos = self.tokenizer.eos_token_id
        responses = []
        for ids in batch:
            answer = self.tokenizer(self.answers[tuple(ids)], add_special_tokens=False)["input_ids"]
            responses.append((answer + [eos])[: config.max_new_tokens])
        return responses

    def close(self) -> None:
        pass


def check_backend_ranks(name: str, tp: int) -> None:
    """Only SGLang's Engine answers over several tensor-parallel ranks."""
    if tp > 1 and name not in ("auto", "sglang"):
        raise JetFlowError(f"--tp {tp} needs the sglang backend (the {name} backend runs on one device)")


def make_backend(name: str, target_dir: Path, dtype: str, tp: int = 1):
    """auto: SGLang's Engine (the fastest measured, GPU or CPU: benchmarks/regen_speed.py), else the
    batched torch decoder, else HF generate for a model family the decoder does not run. tp > 1:
    SGLang's Engine over that many tensor-parallel ranks, with no fallback."""
    check_backend_ranks(name, tp)
    if tp > 1:
        try:
            return SGLangBackend(target_dir, dtype, tp)
        except Exception as exc:
            raise JetFlowError(f"SGLang engine did not start at --tp {tp}: {exc}") from None
    if name == "torch":
        return TorchBackend(target_dir, dtype)
    if name == "hf":
        return HFBackend(target_dir, dtype)
    try:
        return SGLangBackend(target_dir, dtype)
    except Exception as exc:  # SGLang may not run on this machine: fall back when asked to
        if name == "sglang":
            raise JetFlowError(f"SGLang engine did not start: {exc}") from None
        import logging

        logging.getLogger(__name__).warning("SGLang engine did not start (%s); regenerating without it", exc)
    try:
        return TorchBackend(target_dir, dtype)
    except JetFlowError:
        return HFBackend(target_dir, dtype)


def regenerate(config: RegenerateConfig) -> dict:
    from transformers import AutoTokenizer

    from jetflow_sglang.assets import resolve_target
    from jetflow_sglang.reference.target import check_model_dir, serving_dtype

    if config.max_new_tokens < 1 or config.batch_size < 1:
        raise JetFlowError("max new tokens and batch size must be at least 1")
    check_backend_ranks(config.backend, config.tp)
    target_dir = check_model_dir(resolve_target(config.target))
    dtype = serving_dtype(config.dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    out = Path(config.out)
    meta = {
        "target": target_dir.name,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "prompts": config.prompts,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "seed": config.seed,
        "source": "corpus" if config.backend == "corpus" else "target",
    }
    if out.exists() and shard_paths(out):
        previous = read_meta(out)
        if previous.get("tokenizer") != meta["tokenizer"]:
            raise JetFlowError(f"{out} holds data made with another tokenizer; use a new --out")
        if previous.get("source", "target") != meta["source"]:
            raise JetFlowError(f"{out} holds answers from the {previous.get('source', 'target')}, not the {meta['source']}; use a new --out")
        done = {row["id"] for row in iter_examples(out)}
        earlier_backends, earlier_dtypes = list(previous.get("backends", [])), list(previous.get("dtypes", []))
    else:
        done, earlier_backends, earlier_dtypes = set(), [], []
    prompts = load_prompts(config.prompts)[config.skip :][: config.limit]
    todo, answers = [], {}
    for prompt in prompts:
        if prompt.id in done or (config.backend == "corpus" and not prompt.answer):
            continue
        ids = encode_prompt(tokenizer, prompt.text, prompt.kind == "chat")
        if len(ids) <= config.max_prompt_tokens:
            todo.append((prompt.id, ids))
            answers[tuple(ids)] = prompt.answer
    todo.sort(key=lambda item: len(item[1]))  # similar lengths batch together
    out.mkdir(parents=True, exist_ok=True)
    write_meta(out, {**meta, "backends": earlier_backends, "dtypes": earlier_dtypes})
    if not todo:
        return {"out": str(out), "examples": len(done), "new": 0}

    from tqdm import tqdm

    backend = CorpusBackend(tokenizer, answers) if config.backend == "corpus" else make_backend(config.backend, target_dir, dtype, config.tp)
    used = {CorpusBackend: "corpus", HFBackend: "hf", SGLangBackend: "sglang", TorchBackend: "torch"}[type(backend)]
    meta["backends"] = sorted(set(earlier_backends) | {used})  # every backend that wrote shards here
    meta["dtypes"] = sorted(set(earlier_dtypes) | ({dtype} if used != "corpus" else set()))  # ... and its dtypes
    write_meta(out, meta)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    shard_index = len(shard_paths(out))
    new_tokens, start = 0, time.perf_counter()
    try:
        with tqdm(total=len(todo), desc="regenerate", unit="prompt") as bar:
            for first in range(0, len(todo), config.batch_size):
                chunk = todo[first : first + config.batch_size]
                responses = backend.generate([ids for _, ids in chunk], config, pad_id)
                rows = [
                    {"id": pid, "prompt_ids": ids, "response_ids": resp, "temperature": config.temperature}
                    for (pid, ids), resp in zip(chunk, responses)
                ]
                write_shard(out, shard_index, rows)
                shard_index += 1
                new_tokens += sum(len(r) for r in responses)
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    finally:
        backend.close()
    return {"out": str(out), "examples": len(done) + len(todo), "new": len(todo), "new_tokens": new_tokens, "config": asdict(config)}
