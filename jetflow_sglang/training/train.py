"""`jetflow train`: distill a JetFlow head from its frozen target on cached target features.

The frozen target runs once over the data (`features.py`: tap features and the target's
top-k next-token log-probs cached on disk, shared by every head trained on that data),
so a step runs no target forward and no target lm_head. Per step, a batch of sequences
(about `batch_tokens` tokens) is drafted from every anchor a of its responses at once
(or a random share of them): block [x_a, MASK x (B-1)] attends to the context K/V of
positions < a, which each sequence computes once for all its blocks, and within the
block causally (or bidirectionally: the DFlash-T baseline). Slot d is trained towards
the target's distribution for position a+d (its top-k plus the tail mass): forward KL
(default), reverse KL over the same buckets, or hard-label SFT; uniform over depths,
none on the anchor slot. The draft lm_head covers the `draft_vocab` most frequent target
tokens of the data only and runs in chunks, so the logits of a whole step never exist
at once. With `reveal`, a random prefix of a block holds the true tokens instead of
MASK, so the head can also refine a drafted path. Under `torchrun` the head trains with
DistributedDataParallel (gloo on CPU, nccl on CUDA); rank 0 writes checkpoints and the
held-out per-depth metrics (`validate.py`) at each checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head import JetFlowConfig, JetFlowHead, draft_id_map
from jetflow_sglang.training import distributed
from jetflow_sglang.training.blocks import BlockDrafter

from jetflow_sglang.lookup import lookup_hints_batched
from jetflow_sglang.training.objective import (LOSSES, copy_gate_loss, depth_weights, draw_slots, loss_and_backward,
                                               most_frequent_tokens, slot_targets, slot_tokens, vocab_coverage)  # fmt: skip


@dataclass
class TrainConfig:
    target: str = "default"
    data: str = "data/regenerated"  # one data directory, or several joined by commas
    val_data: str = ""  # a data directory for held-out per-depth metrics (none: skip them)
    out: str = "out/head"
    loss: str = "fkl"
    mask: str = "causal"  # causal | bidirectional
    block_size: int = 16
    layers: int = 2
    steps: int = 1000
    batch_tokens: int = 4096  # target tokens per step; blocks are drawn at their response positions
    anchor_fraction: float = 1.0  # share of a sequence's response positions drafted from per step
    max_seq_len: int = 768
    draft_vocab: int = 16384  # draft over the most frequent target tokens of the data; 0 = all
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    reveal: float = 0.0  # probability that a block reveals a random prefix of true tokens
    depth_decay: float = 0.0  # loss weight exp(-(d-1)/depth_decay) at depth d; 0: uniform
    depth_sampling: bool = True  # with depth_decay: draw slots with probability = weight instead of weighting
    tap_norm: bool = True  # RMS-normalize each tapped layer's features before the head's fc
    anchor_fusion: bool = True  # the anchor slot fuses its embedding with the features before it
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3 attention, as published DFlash heads)
    mask_token_id: int = -1  # >= 0: MASK is this target embedding row (published layout), not a parameter
    init_from_target: bool = False  # start the head's layers as copies of the target's last layers
    init_head: str = ""  # start from this head's weights (a new schedule and optimizer: continue a finished run)
    lookup_hint: bool = False  # MASK slots read the prompt-lookup candidate for their position (a hinted head)
    hint_dropout: float = 0.15  # hinted heads: share of blocks trained without hints (kind 0), as after a retraction
    copy_gate: bool = False  # mix each depth's lookup hint into the draft distribution by a learned gate (a copying head)
    copy_lr: float = 1e-2  # the copy gate's peak learning rate (a few hundred weights: it may move fast)
    checkpoint_every: int = 200
    val_blocks: int = 1024  # held-out blocks scored at each checkpoint
    seed: int = 0
    resume: bool = False


def learning_rate(config: TrainConfig, step: int, peak: float | None = None) -> float:
    """Linear warm-up to `peak` (the head's: config.lr), then a cosine to min_lr_ratio of it."""
    peak = config.lr if peak is None else peak
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = peak * config.min_lr_ratio
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


# ------------------------------------------------------------------------- the forward
def draw_anchors(lengths: Tensor, starts: Tensor, fraction: float, rng: random.Random) -> tuple[Tensor, Tensor]:
    """(rows, anchors), sorted by row: anchor a predicts a+1.., needs context (a >= 1) and at
    least one label (a <= length-2); anchors start one before the response, so every block
    predicts target-written tokens."""
    rows, anchors = [], []
    for row, (length, start) in enumerate(zip(lengths.tolist(), starts.tolist())):
        candidates = list(range(max(start - 1, 1), length - 1))
        if fraction < 1.0:
            candidates = sorted(rng.sample(candidates, max(1, round(fraction * len(candidates))))) if candidates else []
        rows += [row] * len(candidates)
        anchors += candidates
    return torch.tensor(rows, dtype=torch.long), torch.tensor(anchors, dtype=torch.long)


# --------------------------------------------------------------------------------- data
class Batches:
    """Random batches of cached sequences, about `batch_tokens` tokens each."""

    def __init__(self, store, config: TrainConfig) -> None:
        self.store = store
        self.config = config

    def get(self, rng: random.Random, pad_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """input_ids [b, T], features [b, T, F], lengths [b], response starts [b], sequence indices [b]."""
        store, chosen, tokens = self.store, [], 0
        while tokens < self.config.batch_tokens:
            index = rng.randrange(len(store))
            chosen.append(index)
            tokens += int(store.lengths[index])
        chosen_t = torch.tensor(chosen)
        lengths = store.lengths[chosen_t]
        offsets = store.offsets[chosen_t]
        width = int(lengths.max())
        columns = torch.arange(width)
        valid = columns[None, :] < lengths[:, None]
        rows = (offsets[:, None] + columns[None, :]).clamp(max=store.num_tokens - 1)
        input_ids = torch.where(valid, store.input_ids[rows], torch.full_like(rows, pad_id))
        features = store.features[rows] * valid[..., None]
        return input_ids, features, lengths, store.prompt_lens[chosen_t], chosen_t


def _check_config(config: TrainConfig) -> None:
    if config.loss not in LOSSES:
        raise JetFlowError(f"--loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
    if config.mask not in ("causal", "bidirectional"):
        raise JetFlowError(f"--mask must be causal or bidirectional, got {config.mask!r}")
    if config.steps < 1 or config.batch_tokens < 1 or config.layers < 1:
        raise JetFlowError("steps, batch tokens and layers must be at least 1")
    if config.block_size < 2:
        raise JetFlowError(f"block size must be at least 2, got {config.block_size}")
    if not 0 < config.anchor_fraction <= 1:
        raise JetFlowError(f"--anchor-fraction must be in (0, 1], got {config.anchor_fraction}")
    if config.depth_decay < 0:
        raise JetFlowError(f"--depth-decay must be 0 (uniform) or positive, got {config.depth_decay}")
    if not 0 <= config.hint_dropout <= 1:
        raise JetFlowError(f"--hint-dropout must be in [0, 1], got {config.hint_dropout}")
    if config.copy_lr < 0:
        raise JetFlowError(f"--copy-lr must be 0 or positive, got {config.copy_lr}")
    if config.draft_vocab < 0:
        raise JetFlowError(f"--draft-vocab must be 0 (all) or a positive size, got {config.draft_vocab}")


def load_examples(data_dir: Path, tokenizer) -> list[dict]:
    from jetflow_sglang.training.data import iter_examples, read_meta, tokenizer_fingerprint

    meta = read_meta(data_dir)
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise JetFlowError(f"{data_dir} was made with another tokenizer than the target's")
    examples = list(iter_examples(data_dir))
    if not examples:
        raise JetFlowError(f"{data_dir} holds no examples")
    return examples


def load_store(target, target_dir: Path, data: str, max_seq_len: int, log=print):
    """The feature store of one data directory or several joined by commas (built once, cached)."""
    from jetflow_sglang.training.features import FeatureStore, build_or_load

    stores = []
    for data_dir in [Path(d) for d in data.split(",") if d]:
        examples = load_examples(data_dir, target.tokenizer)
        stores.append(build_or_load(target, target_dir, data_dir, examples, max_seq_len, log=log))
    if not stores:
        raise JetFlowError("no --data directory given")
    return FeatureStore.concat(stores)


@torch.no_grad()
def load_init_head(head_spec: str, target_dir: Path, head_config: JetFlowConfig) -> JetFlowHead:
    """The head a run starts from (`default` or a directory); its architecture must be this run's,
    except that a hinted or copying run may start from a head without that path (which then starts
    at zero: `start_from`)."""
    from jetflow_sglang.assets import load_head

    start = load_head(head_spec, target_dir)
    mine, theirs = head_config.to_json_dict(), start.config.to_json_dict()
    adds = [k for k in ("lookup_hint", "lookup_copy") if mine["jetflow"][k] and not theirs["jetflow"][k]]
    if adds:
        theirs = {**theirs, "jetflow": {**theirs["jetflow"], "lookup_hint_ngram": mine["jetflow"]["lookup_hint_ngram"],
                                        **{k: True for k in adds}}}  # fmt: skip
    differing = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differing:
        raise JetFlowError(f"--init-head {head_spec} does not match this run's head: {', '.join(differing)} differ")
    return start


@torch.no_grad()
def start_from(head: JetFlowHead, start: JetFlowHead) -> None:
    """Copy `start`'s weights and draft vocabulary into `head` (`load_init_head` checked that they
    fit); a plain head started as a hinted or copying one gets a zero hint path and an untrained
    copy gate, and keeps those it has."""
    missing, unexpected = head.load_state_dict(start.state_dict(), strict=False)
    if unexpected or any(not k.startswith(("hint_", "copy_gate.")) for k in missing):
        raise JetFlowError(f"the starting head's weights do not fit: {missing + unexpected}")
    with torch.no_grad():
        if any(k.startswith("hint_") for k in missing):
            head.hint_proj.weight.zero_()
            head.hint_kind_embedding.zero_()
        if any(k.startswith("copy_gate.") for k in missing):
            head.copy_gate.reset()


@torch.no_grad()
def init_from_target(head: JetFlowHead, target_model) -> None:
    """Head layers start as the target's last layers (the ones that read the last tap's
    output), the final norm as the target's, and `fc` as a pass-through of the last tap:
    at step 0 the context K/V the first head layer sees are the target's own."""
    layers = target_model.model.layers[-head.config.num_layers :]
    for head_layer, layer in zip(head.layers, layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(head_layer, name).weight.copy_(getattr(layer.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head_layer, name).weight.copy_(getattr(layer.mlp, name).weight)
        head_layer.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        head_layer.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    head.norm.weight.copy_(target_model.model.norm.weight)
    hidden = head.config.target_hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, -hidden:] = torch.eye(hidden)
    head.hidden_norm.weight.copy_(layers[0].input_layernorm.weight)


def train(config: TrainConfig, log=print) -> dict:
    from tqdm import tqdm

    from jetflow_sglang.assets import resolve_target
    from jetflow_sglang.reference.target import Target, fast_dtype
    from jetflow_sglang.training.validate import ValidationSet

    _check_config(config)
    rank, world, device = distributed.setup()
    if config.copy_gate and world > 1:
        raise JetFlowError("--copy-gate trains on one process only (its loss sits outside the data-parallel graph)")
    out = Path(config.out)
    target_dir = resolve_target(config.target)
    compute_dtype = fast_dtype() if device.type == "cpu" else torch.bfloat16
    target = Target(target_dir, dtype=compute_dtype)
    vocab = target.config.vocab_size
    draft_vocab_size = config.draft_vocab if 0 < config.draft_vocab < vocab else 0
    head_config = JetFlowConfig.for_target(
        target.config, num_layers=config.layers, block_size=config.block_size, causal=config.mask == "causal",
        draft_vocab_size=draft_vocab_size, tap_norm=config.tap_norm, anchor_fusion=config.anchor_fusion,
        qk_norm=config.qk_norm, mask_from_target=config.mask_token_id >= 0, mask_token_id=config.mask_token_id,
        lookup_hint=config.lookup_hint, lookup_copy=config.copy_gate,
    )  # fmt: skip
    if not config.resume and (out / "config.json").exists():
        raise JetFlowError(f"{out} already holds a head; pass --resume or choose another --out")
    start_head = load_init_head(config.init_head, target_dir, head_config) if config.init_head and not config.resume else None
    target.set_tap_layers(head_config.target_layer_ids)
    quiet = lambda *_: None  # noqa: E731
    if rank == 0:
        store = load_store(target, target_dir, config.data, config.max_seq_len, log=log)
    if world > 1:
        torch.distributed.barrier()  # rank 0 built the cache; the others only read it
    if rank != 0:
        store = load_store(target, target_dir, config.data, config.max_seq_len, log=quiet)
    val = None
    if config.val_data and rank == 0:
        val_store = load_store(target, target_dir, config.val_data, config.max_seq_len, log=log)
        val = ValidationSet.from_store(val_store, config.block_size, config.val_blocks, seed=config.seed)
    embedding, lm_head = target.embedding.to(device), target.lm_head.to(device)
    torch.manual_seed(config.seed)
    head = JetFlowHead(head_config).init_weights(config.seed)
    coverage = 1.0
    if draft_vocab_size:
        ids, coverage = most_frequent_tokens(store, draft_vocab_size, vocab)
        head.set_draft_vocab(ids)
    if config.init_from_target and not config.resume:
        init_from_target(head, target.model)
    if start_head is not None:
        start_from(head, start_head)
        del start_head
        if head.draft_vocab is not None:  # the inherited vocabulary's coverage of this data
            coverage = vocab_coverage(store, head.draft_vocab, vocab)
    head = head.to(device).bind_target(embedding, lm_head)
    del target  # only its embedding and lm_head are needed from here on
    gate = set(head.copy_gate.parameters()) if head.copy_gate is not None else set()
    groups = [{"params": [p for p in head.parameters() if p not in gate], "peak": config.lr}]
    if gate:  # same schedule shape, its own peak; no weight decay on a gate's few weights
        groups.append({"params": list(head.copy_gate.parameters()), "peak": config.copy_lr, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    step, history, evals = 0, [], []
    if config.resume:
        step, history, evals = _resume(head, optimizer, out, config)
    to_draft = draft_id_map(None if head.draft_vocab is None else head.draft_vocab.cpu(), vocab)
    weights = depth_weights(config.block_size - 1, config.depth_decay)
    drafter = BlockDrafter(head)
    if world > 1:
        drafter = torch.nn.parallel.DistributedDataParallel(drafter)
    batches = Batches(store, config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16)
    head.train()
    start, first_step, blocks_seen, tokens_seen = time.perf_counter(), step, 0, 0
    if rank == 0 and val is not None and step == 0:
        evals.append({"step": 0, **val.score(head)})
        log(f"held-out at step 0: {_val_line(evals[-1])}")
    with tqdm(total=config.steps, initial=step, desc="train", unit="step", disable=rank != 0) as bar:
        while step < config.steps:
            # Every draw of a step comes from (seed, rank, step): a resumed run repeats it exactly.
            rng = random.Random(f"{config.seed}/{rank}/{step}")
            generator = torch.Generator().manual_seed(rng.getrandbits(63))
            input_ids, features, lengths, starts, seq_index = batches.get(rng, pad_id=0)
            rows, anchors = draw_anchors(lengths, starts, config.anchor_fraction, rng)
            width, sampled = config.block_size, config.depth_decay > 0 and config.depth_sampling
            if sampled and config.mask == "causal":
                # Depth sampling by truncation: the step runs depths 1..L with P(L >= d) = w_d, so
                # the kept slots' mean has the weighted loss's expected gradient at ~sum(w)/(B-1)
                # of the cost (exact per slot: a causal slot does not see the slots after it).
                width = 1 + int((weights > torch.rand((), generator=generator)).sum())
            revealed = torch.randint(0, width - 1, (len(rows),), generator=generator)
            reveal = torch.where(torch.rand(len(rows), generator=generator) < config.reveal, revealed, 0)
            hint_keep = torch.rand(len(rows), generator=generator) >= config.hint_dropout if config.lookup_hint else None
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step, group["peak"])
            batch = [t.to(device) for t in (features, input_ids, rows, anchors, lengths, reveal)]
            with autocast:
                hidden, label_positions = drafter(*batch, width, None if hint_keep is None else hint_keep.to(device))
                topk_ids, topk_logprobs, labels = slot_targets(store, seq_index[rows], label_positions.cpu(), to_draft, reveal)
                loss_weights = weights[: width - 1]
                if sampled:
                    if config.mask != "causal":  # bidirectional slots see each other: run all, draw the losses
                        topk_ids, labels = draw_slots(topk_ids, labels, weights, generator)
                    loss_weights = None
                loss, hits, _ = loss_and_backward(head, hidden, topk_ids.to(device), topk_logprobs.to(device),
                                                  labels.to(device), config.loss, loss_weights)  # fmt: skip
                copy_loss = None
                if head.copy_gate is not None:
                    tokens, kinds = lookup_hints_batched(input_ids, rows, anchors, width - 1, head.config.lookup_hint_ngram)
                    keep = torch.arange(1, width)[None, :] > reveal[:, None]  # a revealed slot holds its true token
                    if hint_keep is not None:
                        keep = keep & hint_keep[:, None]
                    true_tokens = slot_tokens(store, seq_index[rows], label_positions.cpu())
                    hints = (tokens.to(device), (kinds * keep).to(device))
                    copy_loss = copy_gate_loss(head, hidden, hints, true_tokens.to(device), generator)
                    copy_loss.backward()
                    copy_loss = copy_loss.item()
            torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            blocks_seen += len(rows) * world
            tokens_seen += int(lengths.sum()) * world
            predicted = labels >= 0
            depth_top1 = (hits.sum(0) / predicted.sum(0).clamp(min=1)).tolist()
            history.append({"step": step, "loss": loss, "lr": learning_rate(config, step - 1), "blocks": len(rows),
                            "top1": [round(x, 4) for x in depth_top1],
                            **({"copy_loss": round(copy_loss, 4)} if copy_loss is not None else {})})  # fmt: skip
            elapsed = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", top1_d1=f"{depth_top1[0]:.2f}", blocks_s=f"{blocks_seen / elapsed:.0f}")
            if rank == 0 and (step % config.checkpoint_every == 0 or step == config.steps):
                if val is not None:
                    evals.append({"step": step, **val.score(head)})
                    log(f"held-out at step {step}: {_val_line(evals[-1])}")
                _checkpoint(head, optimizer, out, config, step, history, evals)
    seconds = time.perf_counter() - start
    fingerprints = None
    if world > 1:
        fingerprints = distributed.rank_fingerprints(head)
        torch.distributed.destroy_process_group()
        if any(f != fingerprints[0] for f in fingerprints):
            raise JetFlowError(f"data-parallel ranks ended with different weights: {fingerprints}")
    steps_run = max(1, step - first_step)
    return {
        "out": str(out),
        "steps": step,
        "final_loss": history[-1]["loss"],
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / steps_run, 3),
        "blocks_per_s": round(blocks_seen / seconds, 1) if seconds > 0 else None,
        "draft_vocab": draft_vocab_size or vocab,
        "draft_vocab_coverage": round(coverage, 4),
        "held_out": evals[-1] if evals else None,
        "rank_fingerprints": fingerprints,
    }


def _val_line(row: dict) -> str:
    depths = row["top1"]
    return (f"top-1 d1 {depths[0]:.3f} d2 {depths[1]:.3f} d4 {depths[3]:.3f} d8 {depths[7]:.3f}, "
            f"chain tau {row['chain_tau']:.3f} (lookup {row['lookup_chain_tau']:.3f})"
            + (f", hints blanked {row['blanked_chain_tau']:.3f}, copy d1 {row['hint_use']['copy'][0]:.2f}" if "hint_use" in row else ""))  # fmt: skip


def _checkpoint(head: JetFlowHead, optimizer, out: Path, config: TrainConfig, step: int, history: list, evals: list) -> None:
    """Head weights (safetensors, bf16: what ships) plus resume state (fp32 weights and optimizer)."""
    from safetensors.torch import save_file

    from jetflow_sglang.training.validate import plot_per_depth

    out.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".saving")
    head_bf16 = JetFlowHead(head.config)
    head_bf16.load_state_dict(head.state_dict())
    head_bf16.to(torch.bfloat16).save(staging)
    for path in staging.iterdir():
        path.replace(out / path.name)
    staging.rmdir()
    state = {f"head.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    for index, param in enumerate(head.parameters()):
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value):
                state[f"optim.{index}.{key}"] = value.reshape(-1) if value.dim() == 0 else value.contiguous()
    save_file(state, str(out / "train_state.safetensors"))
    meta = {"step": step, "config": asdict(config), "history": history, "held_out": evals}
    (out / "train_state.json").write_text(json.dumps(meta))
    plot_loss(history, out / "loss.png", title=f"{config.loss}, {config.mask} mask")
    if evals:
        plot_per_depth(evals, out / "per_depth.png")


def plot_loss(history: list[dict], path: Path, title: str = "") -> None:
    """Loss per step (light) and its 50-step running mean."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `train` extra is not installed
        return
    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    window = 50
    smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, alpha=0.3, linewidth=0.8, label="loss")
    ax.plot(steps, smooth, linewidth=1.5, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _resume(head: JetFlowHead, optimizer, out: Path, config: TrainConfig) -> tuple[int, list, list]:
    from safetensors.torch import load_file

    meta_path, state_path = out / "train_state.json", out / "train_state.safetensors"
    if not meta_path.is_file() or not state_path.is_file():
        raise JetFlowError(f"nothing to resume in {out}")
    meta = json.loads(meta_path.read_text())
    saved = meta["config"]
    defaults = TrainConfig()  # checkpoints from before a field existed were trained with its default
    for key in ("loss", "mask", "block_size", "layers", "target", "draft_vocab", "tap_norm", "anchor_fusion", "qk_norm", "mask_token_id",
                "lookup_hint", "hint_dropout", "copy_gate"):  # fmt: skip
        if saved.get(key, getattr(defaults, key)) != getattr(config, key):
            raise JetFlowError(f"resume checkpoint in {out} was trained with {key}={saved.get(key)!r}, not {getattr(config, key)!r}")
    state = load_file(str(state_path))
    head.load_state_dict({k[len("head.") :]: v for k, v in state.items() if k.startswith("head.")})
    for index, param in enumerate(head.parameters()):
        entries = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"optim.{index}.")}
        if entries:
            optimizer.state[param] = {k: (v.reshape(()) if k == "step" else v) for k, v in entries.items()}
    return int(meta["step"]), list(meta["history"]), list(meta.get("held_out", []))
