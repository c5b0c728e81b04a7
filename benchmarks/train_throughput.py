"""Training throughput of the head, before and after each lever: blocks (of 16) per second.

    .venv/bin/python benchmarks/train_throughput.py --rounds 3 --out benchmarks/results/train_throughput.json

One optimizer step (forward, loss, backward, AdamW) per variant per round, the variants
interleaved round-robin in one process so that they see the same machine state; the
figure is the median over rounds. Sequences are synthetic with the shapes of the
recipe's data (SmolLM2-135M target: 5 taps x 576 features, 49,152-token vocabulary,
sequences of 150-450 tokens whose last ~70% are the response), so the script needs no
data, only the prepared target (for its embedding and lm_head).

Variants (each adds one lever to the one above it):
  before-bf16   the trainer of commit 4c8a039 as it ran: 8 anchors per sequence, each block
                with its own copy of the context K/V under a dense mask, full-vocabulary
                draft logits, the target's lm_head applied to a cached hidden state per
                slot, bf16 autocast (emulated, so slow, on a CPU without AMX/AVX512-BF16)
  before        the same in this machine's fast dtype (fp32 there): the algorithmic baseline
  packed        every anchor of a sequence in one pass over shared context K/V, loss in
                row chunks; soft labels: the target's top-k computed per step
  +vocab16k     the draft lm_head over the 16,384 most frequent tokens
  +cached       the target's top-k log-probs read from the feature cache (the new default)
  vocab8k / vocab32k / full-vocab   the new default with other draft vocabularies
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from jetflow_sglang import harness
from jetflow_sglang.head import JetFlowConfig, JetFlowHead, draft_id_map
from jetflow_sglang.reference.target import fast_dtype
from jetflow_sglang.training import objective as O
from jetflow_sglang.training import blocks as B
from jetflow_sglang.training import train as T
from jetflow_sglang.training.features import FeatureStore, soft_labels

SOFT_K = 32


def synthetic_store(target_config, sequences: int, seed: int) -> tuple[FeatureStore, torch.Tensor]:
    """A feature store of random sequences and the final hidden states the old trainer cached."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lengths = [rng.randint(150, 450) for _ in range(sequences)]
    prompts = [int(length * rng.uniform(0.2, 0.4)) for length in lengths]
    total, hidden = sum(lengths), target_config.hidden_size
    taps = len(JetFlowConfig.for_target(target_config).target_layer_ids)
    offsets = torch.zeros(sequences + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    final_hidden = torch.randn(total, hidden, generator=gen)
    store = FeatureStore(
        input_ids=torch.randint(0, 16000, (total,), generator=gen),
        features=torch.randn(total, taps * hidden, generator=gen).to(torch.bfloat16),
        topk_ids=torch.randint(0, 16000, (total, SOFT_K), generator=gen),
        topk_logprobs=torch.linspace(-0.5, -12, SOFT_K).expand(total, -1).clone(),
        offsets=offsets,
        prompt_lens=torch.tensor(prompts),
    )
    return store, final_hidden


def old_step(head: JetFlowHead, store, final_hidden, lm_head, batches, rng, compute_dtype) -> int:
    """One step of the trainer at commit 4c8a039 (kept here as the 'before' reference)."""
    input_ids, features, lengths, starts, seq_index = batches.get(rng, 0)
    rows, anchors = [], []
    for row, (length, start) in enumerate(zip(lengths.tolist(), starts.tolist())):
        for _ in range(8):
            rows.append(row)
            anchors.append(rng.randint(max(start - 1, 1), length - 2))
    rows, anchors = torch.tensor(rows), torch.tensor(anchors)
    batch, seq_len, _ = features.shape
    block = head.config.block_size
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
        positions = anchors[:, None] + torch.arange(block)
        in_range = positions < lengths[rows][:, None]
        true_tokens = input_ids[rows[:, None], positions.clamp(max=seq_len - 1)]
        block_tokens = torch.full_like(true_tokens, head.config.mask_token_id)
        block_tokens[:, 0] = true_tokens[:, 0]
        context = head.context_kv(features, torch.arange(seq_len).expand(batch, -1))
        context = [(k[rows], v[rows]) for k, v in context]
        visible = torch.arange(seq_len)[None, :] < anchors[:, None]
        mask = torch.cat([visible[:, None, :].expand(-1, block, -1), head.block_mask(block, "cpu").expand(len(rows), -1, -1)], -1)[:, None]
        hidden = head.forward_block(block_tokens, positions, context, mask)
        draft_logits = head.logits(hidden[:, 1:])
        label_positions = torch.where(in_range, positions, -1)[:, 1:]
        hidden_rows = store.offsets[seq_index][rows][:, None] + (label_positions - 1).clamp(min=0)
        soft = F.linear(final_hidden[hidden_rows].to(lm_head.dtype), lm_head)
        valid = (label_positions >= 0).flatten()
        log_q = F.log_softmax(draft_logits.flatten(0, 1)[valid].float(), -1)
        log_p = F.log_softmax(soft.flatten(0, 1)[valid].float(), -1)
        loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    loss.backward()
    return len(rows)


def new_step(head: JetFlowHead, store, final_hidden, lm_head, batches, rng, compute_dtype, cached: bool, to_draft) -> int:
    input_ids, features, lengths, starts, seq_index = batches.get(rng, 0)
    rows, anchors = T.draw_anchors(lengths, starts, batches.config.anchor_fraction, rng)
    reveal = torch.zeros_like(rows)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
        if not cached:  # the target's top-k for every position of the batch, this step
            token_rows = torch.cat([torch.arange(store.offsets[i], store.offsets[i + 1]) for i in seq_index.tolist()])
            ids, logprobs = soft_labels(final_hidden[token_rows], lm_head, SOFT_K)
            store.topk_ids[token_rows], store.topk_logprobs[token_rows] = ids, logprobs
        hidden, label_positions = B.head_forward_sequences(head, features, input_ids, rows, anchors, lengths, reveal)
        topk_ids, topk_logprobs, labels = O.slot_targets(store, seq_index[rows], label_positions, to_draft, reveal)
        O.loss_and_backward(head, hidden, topk_ids, topk_logprobs, labels, "fkl")
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument("--variants", default="before-bf16,before,packed,+vocab16k,+cached,vocab8k,vocab32k,full-vocab",
                        help="comma-separated subset of the variants")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="target tokens per step (new trainer)")
    parser.add_argument("--anchor-fraction", type=float, default=0.5, help="share of response positions drafted from")
    parser.add_argument("--old-batch-tokens", type=int, default=4096, help="target tokens per step (before)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)

    from jetflow_sglang.assets import load_target_and_head

    compute_dtype = fast_dtype()
    target, _ = load_target_and_head("default", "random", compute_dtype)
    lm_head, embedding = target.lm_head.detach(), target.embedding.detach()
    store, final_hidden = synthetic_store(target.config, 400, seed=0)
    vocab = target.config.vocab_size

    def make(draft_vocab: int) -> tuple[JetFlowHead, torch.Tensor]:
        head = JetFlowHead(JetFlowConfig.for_target(target.config, num_layers=2, draft_vocab_size=draft_vocab)).init_weights(0)
        if draft_vocab:
            head.set_draft_vocab(O.most_frequent_tokens(store, draft_vocab, vocab)[0])
        return head.bind_target(embedding, lm_head), draft_id_map(head.draft_vocab, vocab)

    new_config = T.TrainConfig(batch_tokens=args.batch_tokens, anchor_fraction=args.anchor_fraction)
    old_config = T.TrainConfig(batch_tokens=args.old_batch_tokens)
    variants = {
        "before-bf16": (0, None, old_config, torch.bfloat16),
        "before": (0, None, old_config, compute_dtype),
        "packed": (0, False, new_config, compute_dtype),
        "+vocab16k": (16384, False, new_config, compute_dtype),
        "+cached": (16384, True, new_config, compute_dtype),
        "vocab8k": (8192, True, new_config, compute_dtype),
        "vocab32k": (32768, True, new_config, compute_dtype),
        "full-vocab": (0, True, new_config, compute_dtype),
    }
    chosen = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen if v not in variants]
    if unknown:
        parser.error(f"unknown variants: {', '.join(unknown)}")
    heads = {name: make(variants[name][0]) for name in chosen}
    samples: dict[str, list[tuple[float, int, int]]] = {name: [] for name in chosen}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name in chosen:
            draft_vocab, cached, config, dtype = variants[name]
            head, to_draft = heads[name]
            batches = T.Batches(store, config)
            rng = random.Random(f"{name}/{round_}")
            start = time.perf_counter()
            if cached is None:
                blocks = old_step(head, store, final_hidden, lm_head, batches, rng, dtype)
            else:
                blocks = new_step(head, store, final_hidden, lm_head, batches, rng, dtype, cached, to_draft)
            seconds = time.perf_counter() - start
            head.zero_grad(set_to_none=True)
            if round_:
                samples[name].append((seconds, blocks, config.batch_tokens))
                print(f"round {round_} {name:<11} {blocks:>5} blocks {seconds:6.2f} s  {blocks / seconds:7.1f} blocks/s", flush=True)
    rows = []
    base = None
    for name in chosen:
        rate = statistics.median(b / s for s, b, _ in samples[name])
        tokens = statistics.median(t / s for s, _, t in samples[name])
        base = base or rate
        rows.append({"variant": name, "blocks_per_s": round(rate, 1), "target_tokens_per_s": round(tokens, 1),
                     "vs_first": round(rate / base, 2)})  # fmt: skip
    print(f"\n{'variant':<12}{'blocks/s':>10}{'target tok/s':>14}{'vs ' + chosen[0]:>12}")
    for row in rows:
        print(f"{row['variant']:<12}{row['blocks_per_s']:>10.1f}{row['target_tokens_per_s']:>14.1f}{row['vs_first']:>11.2f}x")
    report = {"dtype": str(compute_dtype), "threads": torch.get_num_threads(), "rounds": args.rounds, "rows": rows,
              "batch_tokens": args.batch_tokens, "anchor_fraction": args.anchor_fraction,
              "old_batch_tokens": args.old_batch_tokens}  # fmt: skip
    if args.out:
        harness.write_json(args.out, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
