"""`jetflow train`: distill a JetFlow head from its frozen target on regenerated data.

The frozen target runs once over the data (`features.py`: tap features and final hidden
states cached on disk, shared by every head trained on that data). Per step: random
anchors a are drawn in the responses of a batch of sequences; block [x_a, MASK x (B-1)]
attends to the context features of positions < a and, within the block, causally (or
bidirectionally: the DFlash-T baseline). Slot d is trained towards the target's
distribution for position a+d (its lm_head applied to the cached hidden state at a+d-1):
forward KL (default), reverse KL, or hard-label SFT, uniform over depths, none on the
anchor slot. With `reveal`, a random prefix of each block holds the true tokens instead
of MASK, so the head can also refine a drafted path. Under `torchrun` the head trains
with DistributedDataParallel (gloo on CPU, nccl on CUDA); rank 0 writes checkpoints.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow_sglang.errors import JetFlowError
from jetflow_sglang.head import JetFlowConfig, JetFlowHead

LOSSES = ("fkl", "rkl", "sft")


@dataclass
class TrainConfig:
    target: str = "default"
    data: str = "data/regenerated"
    out: str = "out/head"
    loss: str = "fkl"
    mask: str = "causal"  # causal | bidirectional
    block_size: int = 16
    layers: int = 2
    steps: int = 1000
    batch_tokens: int = 4096  # target tokens per step
    max_seq_len: int = 768
    anchors_per_seq: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    kl_temperature: float = 1.0
    reveal: float = 0.0  # probability that a block reveals a random prefix of true tokens
    init_from_target: bool = True  # start the head's layers as copies of the target's last layers
    checkpoint_every: int = 200
    seed: int = 0
    resume: bool = False


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def block_loss(draft_logits: Tensor, target_logits: Tensor, labels: Tensor, loss: str, temperature: float) -> Tensor:
    """Mean loss over valid slots. draft_logits/target_logits: [n, V]; labels: [n] (-1 = ignore)."""
    valid = labels >= 0
    if not valid.any():
        return draft_logits.sum() * 0.0
    draft_logits, target_logits, labels = draft_logits[valid].float(), target_logits[valid].float(), labels[valid]
    if loss == "sft":
        return F.cross_entropy(draft_logits, labels)
    log_q = F.log_softmax(draft_logits / temperature, -1)
    log_p = F.log_softmax(target_logits / temperature, -1)
    if loss == "fkl":  # KL(p || q)
        per_slot = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:  # KL(q || p)
        per_slot = (log_q.exp() * (log_q - log_p)).sum(-1)
    return per_slot.mean() * temperature**2


def sample_blocks(lengths: Tensor, response_starts: Tensor, anchors: int, block: int, generator: random.Random):
    """Anchors per sequence inside its response (so the block predicts target-written tokens)."""
    rows, positions = [], []
    for row, (length, start) in enumerate(zip(lengths.tolist(), response_starts.tolist())):
        low, high = max(start - 1, 1), length - 2  # anchor a predicts a+1..; needs context (a >= 1)
        if high < low:
            continue
        for _ in range(anchors):
            rows.append(row)
            positions.append(generator.randint(low, high))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long)


def head_forward_blocks(
    head: JetFlowHead,
    features: Tensor,
    input_ids: Tensor,
    rows: Tensor,
    anchors: Tensor,
    lengths: Tensor,
    reveal: Tensor,
) -> tuple[Tensor, Tensor]:
    """All blocks of a batch in one pass. Returns draft logits [nb, B-1, V] and label positions [nb, B-1]
    (the sequence position each slot predicts; -1 past the end)."""
    batch, seq_len, _ = features.shape
    block = head.config.block_size
    device = features.device
    offsets = torch.arange(block, device=device)
    positions = anchors[:, None] + offsets  # [nb, B]
    in_range = positions < lengths[rows][:, None]
    # Block tokens: anchor, then MASK; a revealed prefix holds the true tokens instead.
    true_tokens = input_ids[rows[:, None], positions.clamp(max=seq_len - 1)]
    block_tokens = torch.where(
        (offsets[None, :] <= reveal[:, None]) & in_range, true_tokens, torch.full_like(true_tokens, head.config.mask_token_id)
    )
    block_tokens[:, 0] = true_tokens[:, 0]
    # Per sequence: context K/V for all its positions, then each block attends to positions < anchor.
    context = head.context_kv(features, torch.arange(seq_len, device=device).expand(batch, -1))
    context = [(k[rows], v[rows]) for k, v in context]  # [nb, kv_heads, T, d]
    context_valid = torch.arange(seq_len, device=device)[None, :] < anchors[:, None]
    mask = torch.cat(
        [context_valid[:, None, :].expand(-1, block, -1), head.block_mask(block, device).expand(len(rows), -1, -1)], -1
    )[:, None]
    hidden = head.forward_block(block_tokens, positions, context, mask)
    label_positions = torch.where(in_range, positions, torch.full_like(positions, -1))[:, 1:]
    return head.logits(hidden[:, 1:]), label_positions


class Batches:
    """Random batches of cached sequences, about `batch_tokens` tokens each."""

    def __init__(self, store, config: TrainConfig) -> None:
        self.store = store
        self.config = config

    def get(self, rng: random.Random, pad_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """input_ids [b, T], features [b, T, F], lengths [b], response starts [b], row offsets [b]."""
        store, chosen, tokens = self.store, [], 0
        while tokens < self.config.batch_tokens:
            index = rng.randrange(len(store))
            chosen.append(index)
            tokens += int(store.lengths[index])
        lengths = store.lengths[chosen]
        offsets = store.offsets[chosen]
        width = int(lengths.max())
        columns = torch.arange(width)
        valid = columns[None, :] < lengths[:, None]
        rows = (offsets[:, None] + columns[None, :]).clamp(max=store.num_tokens - 1)
        input_ids = torch.where(valid, store.input_ids[rows], torch.full_like(rows, pad_id))
        features = store.features[rows] * valid[..., None]
        return input_ids, features, lengths, store.prompt_lens[chosen], offsets


def _check_config(config: TrainConfig) -> None:
    if config.loss not in LOSSES:
        raise JetFlowError(f"--loss must be one of {', '.join(LOSSES)}, got {config.loss!r}")
    if config.mask not in ("causal", "bidirectional"):
        raise JetFlowError(f"--mask must be causal or bidirectional, got {config.mask!r}")
    if config.steps < 1 or config.batch_tokens < 1 or config.layers < 1:
        raise JetFlowError("steps, batch tokens and layers must be at least 1")
    if config.block_size < 2:
        raise JetFlowError(f"block size must be at least 2, got {config.block_size}")


def load_examples(data_dir: Path, tokenizer) -> list[dict]:
    from jetflow_sglang.data import iter_examples, read_meta, tokenizer_fingerprint

    meta = read_meta(data_dir)
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise JetFlowError(f"{data_dir} was made with another tokenizer than the target's")
    examples = list(iter_examples(data_dir))
    if not examples:
        raise JetFlowError(f"{data_dir} holds no examples")
    return examples


class BlockDrafter(torch.nn.Module):
    """`head_forward_blocks` as a module, so DistributedDataParallel can wrap it."""

    def __init__(self, head: JetFlowHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, *args: Tensor) -> tuple[Tensor, Tensor]:
        return head_forward_blocks(self.head, *args)


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


def _distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device); starts the process group under torchrun."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


def train(config: TrainConfig, log=print) -> dict:
    from tqdm import tqdm

    from jetflow_sglang.assets import resolve_target
    from jetflow_sglang.features import build_or_load
    from jetflow_sglang.target import Target

    _check_config(config)
    rank, world, device = _distributed()
    out = Path(config.out)
    target_dir = resolve_target(config.target)
    target = Target(target_dir, dtype=torch.bfloat16)
    examples = load_examples(Path(config.data), target.tokenizer)
    head_config = JetFlowConfig.for_target(
        target.config, num_layers=config.layers, block_size=config.block_size, causal=config.mask == "causal"
    )
    if not config.resume and (out / "config.json").exists():
        raise JetFlowError(f"{out} already holds a head; pass --resume or choose another --out")
    target.set_tap_layers(head_config.target_layer_ids)
    if rank == 0:
        store = build_or_load(target, target_dir, Path(config.data), examples, config.max_seq_len, log=log)
    if world > 1:
        torch.distributed.barrier()  # rank 0 built the cache; the others only read it
    if rank != 0:
        store = build_or_load(target, target_dir, Path(config.data), examples, config.max_seq_len, log=lambda *_: None)
    embedding, lm_head = target.embedding.to(device), target.lm_head.to(device)
    torch.manual_seed(config.seed)
    head = JetFlowHead(head_config).init_weights(config.seed)
    if config.init_from_target and not config.resume:
        init_from_target(head, target.model)
    head = head.to(device).bind_target(embedding, lm_head)
    del target  # only its embedding and lm_head are needed from here on
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    step, history = 0, []
    if config.resume:
        step, history = _resume(head, optimizer, out, config)
    drafter = BlockDrafter(head)
    if world > 1:
        drafter = torch.nn.parallel.DistributedDataParallel(drafter)
    batches = Batches(store, config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    head.train()
    start, first_step = time.perf_counter(), step
    tokens_seen = 0
    with tqdm(total=config.steps, initial=step, desc="train", unit="step", disable=rank != 0) as bar:
        while step < config.steps:
            # Every draw of a step comes from (seed, rank, step): a resumed run repeats it exactly.
            rng = random.Random(f"{config.seed}/{rank}/{step}")
            generator = torch.Generator().manual_seed(rng.getrandbits(63))
            input_ids, features, lengths, starts, offsets = batches.get(rng, pad_id=0)
            rows, anchors = sample_blocks(lengths, starts, config.anchors_per_seq, config.block_size, rng)
            revealed = torch.randint(0, config.block_size - 1, (len(rows),), generator=generator)
            reveal = torch.where(torch.rand(len(rows), generator=generator) < config.reveal, revealed, 0)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step)
            batch = [t.to(device) for t in (features, input_ids, rows, anchors, lengths, reveal)]
            with autocast:
                draft_logits, label_positions = drafter(*batch)
                label_positions = label_positions.cpu()
                # Slot d predicts position a+d: its target distribution is the target's output at a+d-1.
                slot_rows = rows[:, None].expand_as(label_positions)
                hidden_rows = offsets[slot_rows] + (label_positions - 1).clamp(min=0)
                soft = F.linear(store.final_hidden[hidden_rows].to(device), lm_head)
            labels = torch.where(label_positions >= 0, input_ids[slot_rows, label_positions.clamp(min=0)], -1)
            # Revealed slots are inputs, not predictions.
            labels = torch.where(torch.arange(1, config.block_size)[None, :] <= reveal[:, None], -1, labels)
            loss = block_loss(
                draft_logits.flatten(0, 1), soft.flatten(0, 1), labels.flatten().to(device), config.loss, config.kl_temperature
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
            optimizer.step()
            step += 1
            tokens_seen += int(lengths.sum()) * world
            history.append({"step": step, "loss": loss.item(), "lr": learning_rate(config, step - 1)})
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_seen / (time.perf_counter() - start):.0f}")
            if rank == 0 and (step % config.checkpoint_every == 0 or step == config.steps):
                _checkpoint(head, optimizer, out, config, step, history)
    seconds = time.perf_counter() - start
    if world > 1:
        torch.distributed.destroy_process_group()
    return {
        "out": str(out),
        "steps": step,
        "final_loss": history[-1]["loss"],
        "seconds": round(seconds, 1),
        "seconds_per_step": round(seconds / max(1, step - first_step), 3),
    }


def _checkpoint(head: JetFlowHead, optimizer, out: Path, config: TrainConfig, step: int, history: list) -> None:
    """Head weights (safetensors, bf16: what ships) plus resume state (fp32 weights and optimizer)."""
    from safetensors.torch import save_file

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
    meta = {"step": step, "config": asdict(config), "history": history}
    (out / "train_state.json").write_text(json.dumps(meta))
    plot_loss(history, out / "loss.png", title=f"{config.loss}, {config.mask} mask")


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


def _resume(head: JetFlowHead, optimizer, out: Path, config: TrainConfig) -> tuple[int, list]:
    from safetensors.torch import load_file

    meta_path, state_path = out / "train_state.json", out / "train_state.safetensors"
    if not meta_path.is_file() or not state_path.is_file():
        raise JetFlowError(f"nothing to resume in {out}")
    meta = json.loads(meta_path.read_text())
    saved = meta["config"]
    for key in ("loss", "mask", "block_size", "layers", "target"):
        if saved.get(key) != getattr(config, key):
            raise JetFlowError(f"resume checkpoint in {out} was trained with {key}={saved.get(key)!r}, not {getattr(config, key)!r}")
    state = load_file(str(state_path))
    head.load_state_dict({k[len("head.") :]: v for k, v in state.items() if k.startswith("head.")})
    for index, param in enumerate(head.parameters()):
        entries = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"optim.{index}.")}
        if entries:
            optimizer.state[param] = {k: (v.reshape(()) if k == "step" else v) for k, v in entries.items()}
    return int(meta["step"]), list(meta["history"])
