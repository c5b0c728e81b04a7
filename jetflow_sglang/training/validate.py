"""Per-depth draft quality on held-out sequences, beside the prompt-lookup baseline.

For a set of anchors a in sequences the target wrote (or teacher-forced text), the head
drafts depths 1..B-1 from the features of positions < a in one pass; depth d scores a
hit when its argmax is the token at a+d. Chain τ is 1 + the number of leading depths
that hit: the tokens a chain draft would commit per verify. Prompt lookup
(`jetflow_sglang.lookup`) is scored on the same anchors. Used at every training
checkpoint and by `jetflow eval --per-depth`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.lookup import lookup_draft, lookup_hints_batched
from jetflow_sglang.training.blocks import head_forward_sequences

SEQUENCES_PER_PASS = 8


def chain_tau(hits: Tensor) -> float:
    """1 + mean number of leading hits per block. hits: [nb, D] bool."""
    if len(hits) == 0:
        return 1.0
    return 1.0 + float(hits.int().cumprod(1).sum(1).float().mean())


@dataclass
class ValidationSet:
    sequences: list[tuple[Tensor, Tensor]]  # (input_ids [T], features [T, F]) per sequence
    anchors: list[Tensor]  # per sequence: the anchor positions scored
    labels: Tensor  # [nb, D] the token at a+d (-1 past the end)
    lookup_tokens: Tensor  # [nb, D] the prompt-lookup chain (a hinted head's hints), -2 where there is none

    @property
    def lookup_hits(self) -> Tensor:
        """[nb, D] bool: the lookup chain's token at depth d is the token at a+d."""
        return (self.lookup_tokens == self.labels) & (self.labels >= 0)

    @classmethod
    def from_store(cls, store, block_size: int, max_blocks: int = 0, seed: int = 0) -> "ValidationSet":
        """Anchors at the response positions of every stored sequence (at most `max_blocks`,
        drawn evenly at random with a fixed seed)."""
        candidates = []
        for index in range(len(store)):
            length, start = int(store.lengths[index]), int(store.prompt_lens[index])
            candidates += [(index, a) for a in range(max(start - 1, 1), length - 1)]
        if max_blocks and len(candidates) > max_blocks:
            candidates = sorted(random.Random(seed).sample(candidates, max_blocks))
        chosen: dict[int, list[int]] = {}
        for index, anchor in candidates:
            chosen.setdefault(index, []).append(anchor)
        depth = block_size - 1
        sequences, anchors, labels, lookup_tokens = [], [], [], []
        for index, positions in chosen.items():
            rows = store.sequence(index)
            ids = store.input_ids[rows]
            sequences.append((ids, store.features[rows]))
            anchors.append(torch.tensor(positions))
            id_list = ids.tolist()
            for a in positions:
                truth = id_list[a + 1 : a + 1 + depth]
                truth += [-1] * (depth - len(truth))
                draft = lookup_draft(id_list[: a + 1], depth)
                draft += [-2] * (depth - len(draft))
                labels.append(truth)
                lookup_tokens.append(draft)
        return cls(sequences, anchors, torch.tensor(labels, dtype=torch.long).view(-1, depth),
                   torch.tensor(lookup_tokens, dtype=torch.long).view(-1, depth))  # fmt: skip

    @torch.no_grad()
    def draft_tokens(self, head: JetFlowHead, hints: bool = True) -> Tensor:
        """The head's top-1 token per anchor and depth [nb, D] (target ids); a hinted head reads
        the lookup hints of each anchor, a copying head mixes them in (hints=False: neither, every
        slot plain MASK)."""
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        out = []
        for first in range(0, len(self.sequences), SEQUENCES_PER_PASS):
            group = self.sequences[first : first + SEQUENCES_PER_PASS]
            group_anchors = self.anchors[first : first + SEQUENCES_PER_PASS]
            lengths = torch.tensor([len(ids) for ids, _ in group])
            width = int(lengths.max())
            input_ids = torch.zeros(len(group), width, dtype=torch.long)
            features = torch.zeros(len(group), width, group[0][1].shape[-1], dtype=group[0][1].dtype)
            for row, (ids, feats) in enumerate(group):
                input_ids[row, : len(ids)] = ids
                features[row, : len(ids)] = feats
            rows = torch.cat([torch.full((len(a),), row) for row, a in enumerate(group_anchors)])
            anchors = torch.cat(group_anchors)
            args = [t.to(device) for t in (features.to(dtype), input_ids, rows, anchors, lengths, torch.zeros_like(anchors))]
            keep = None if hints else torch.zeros(len(anchors), dtype=torch.bool, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype != torch.float32):
                hidden, _ = head_forward_sequences(head, *args, 0, keep)
                slot_hints = None
                if hints and head.copy_gate is not None:  # a copying head drafts the top of its copy mixture
                    slot_hints = lookup_hints_batched(input_ids.to(device), rows.to(device), anchors.to(device), hidden.shape[1],
                                                      head.config.lookup_hint_ngram)  # fmt: skip
                picks = head.draft_candidates(hidden, 1, slot_hints)[1][..., 0]
            out.append(picks.cpu())
        return torch.cat(out)

    def score(self, head: JetFlowHead) -> dict:
        """Per-depth top-1 and chain τ of the head and of prompt lookup on the same anchors; for a
        hinted head also its scores with the hints blanked and how it used them (`hint_use`)."""
        was_training = head.training
        head.eval()
        try:
            drafted = self.draft_tokens(head)
            scores = self.score_tokens(drafted)
            if head.config.reads_hints:
                blanked = self.score_tokens(self.draft_tokens(head, hints=False))
                scores["blanked_top1"], scores["blanked_chain_tau"] = blanked["top1"], blanked["chain_tau"]
                scores["hint_use"] = self.hint_use(drafted)
        finally:
            head.train(was_training)
        labels = self.labels[self.labels >= 0]
        inside = torch.isin(labels, head.draft_vocab.cpu()) if head.draft_vocab is not None else torch.ones_like(labels, dtype=torch.bool)
        scores["draft_vocab_coverage"] = round(float(inside.float().mean()) if len(labels) else 1.0, 4)
        return scores

    def hint_use(self, drafted: Tensor) -> dict:
        """Per depth, over slots with a label and a hint: the share with a hint, the copy rate
        P(top-1 = hint), P(right | hint right), the correction rate P(right | hint wrong) and the
        harm P(wrong | hint right)."""
        labelled = self.labels >= 0
        hinted = labelled & (self.lookup_tokens >= 0)
        hint_right = hinted & (self.lookup_tokens == self.labels)
        hint_wrong = hinted & ~hint_right
        right = drafted == self.labels

        def share(hit: Tensor, among: Tensor) -> list[float]:
            return [round(x, 4) for x in ((hit & among).sum(0) / among.sum(0).clamp(min=1)).tolist()]

        return {
            "hinted": share(hinted, labelled),
            "copy": share(drafted == self.lookup_tokens, hinted),
            "right_if_hint_right": share(right, hint_right),
            "right_if_hint_wrong": share(right, hint_wrong),
            "harm": share(~right, hint_right),
        }

    def score_tokens(self, drafted: Tensor) -> dict:
        """`score` for drafted tokens [nb, D] (target ids, one per anchor and depth)."""
        hits = (drafted == self.labels) & (self.labels >= 0)
        has_label = (self.labels >= 0).sum(0).clamp(min=1)
        either = hits | self.lookup_hits  # the ceiling of a per-depth choice between the two
        return {
            "blocks": len(self.labels),
            "top1": [round(x, 4) for x in (hits.sum(0) / has_label).tolist()],
            "chain_tau": round(chain_tau(hits), 4),
            "lookup_top1": [round(x, 4) for x in (self.lookup_hits.sum(0) / has_label).tolist()],
            "lookup_chain_tau": round(chain_tau(self.lookup_hits), 4),
            "either_top1": [round(x, 4) for x in (either.sum(0) / has_label).tolist()],
        }


def plot_per_depth(evals: list[dict], path: Path, title: str = "held-out top-1 per depth") -> None:
    """Top-1 per depth of the last evaluation beside prompt lookup, and chain τ over steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `train` extra is not installed
        return
    last = evals[-1]
    depths = list(range(1, len(last["top1"]) + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=100)
    left.plot(depths, last["top1"], marker="o", label=f"head (step {last.get('step', '?')})")
    left.plot(depths, last["lookup_top1"], marker="x", linestyle="--", label="prompt lookup")
    left.set_xlabel("draft depth")
    left.set_ylabel("top-1")
    left.set_ylim(0, 1)
    left.set_title(title)
    left.legend()
    if all("step" in e for e in evals):
        steps = [e["step"] for e in evals]
        right.plot(steps, [e["chain_tau"] for e in evals], marker="o", label="head")
        right.plot(steps, [e["lookup_chain_tau"] for e in evals], linestyle="--", label="prompt lookup")
        right.set_xlabel("step")
    right.set_ylabel("chain τ")
    right.set_title("held-out chain τ")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
