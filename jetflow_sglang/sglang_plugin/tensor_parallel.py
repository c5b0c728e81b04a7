"""JETFLOW under tensor parallelism (``--tp N``): every rank drafts and accepts the same tree.

Each rank holds the head whole (replicated) and runs the whole round: draft pass, tree build,
acceptance, bookkeeping. Its inputs are the same on every rank: the fused target features are
captured at layer inputs, after the all-reduce (full hidden states); the verify logits are
gathered over the vocabulary as SGLang gathers them for its own sampler; lookups read the same
committed ids. Two inputs differ per rank, and are made the same here:

* the target's embedding and lm_head are vocabulary shards: gathered whole once, at load
  (`full_vocab_rows`);
* the adaptive budget's clock: each rank times its own rounds, and a rank that chose another tree
  size would verify another shape (a hang at the next all-reduce). `RankSync` hands every rank
  rank 0's cost table at start and rank 0's seconds after each round, so every rank's policy sees
  the same rounds and makes the same choices; only rank 0 saves the cost cache.

Sampled rounds draw their acceptance uniforms from each rank's own generator. SGLang seeds every
rank alike and its own sampler relies on that; `RankSync.same_acceptance` does not: in a round
with sampled requests, every rank takes rank 0's accepted paths and bonus tokens.

With ``JETFLOW_TEST_TP_CHECK=1`` every round also compares the committed tokens across ranks and
stops the server on the first difference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from jetflow_sglang.accept import Acceptance
from jetflow_sglang.budget import BudgetPolicy


def tp_group():
    """SGLang's tensor-parallel group, or None with one rank."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return group if group.world_size > 1 else None


def full_vocab_rows(module: torch.nn.Module, vocab_size: int) -> Tensor:
    """The first `vocab_size` rows of a (vocab-parallel) embedding or lm_head, whole on every rank.

    A sharded one (SGLang's ``VocabParallelEmbedding`` / ``ParallelLMHead``) holds contiguous rows
    of the padded vocabulary per rank in rank order; they are all-gathered once (a target with
    added (LoRA) vocabulary rows, laid out otherwise, is refused)."""
    weight = module.weight
    shards = int(getattr(module, "tp_size", 1) or 1)
    if shards == 1:
        return weight[:vocab_size]
    if getattr(module, "num_embeddings", None) != getattr(module, "org_vocab_size", None):
        raise ValueError("JETFLOW under --tp: a target with added vocabulary rows is not supported")
    group = tp_group()
    if group is None or group.world_size != shards:
        raise ValueError(f"JETFLOW under --tp: the vocabulary is cut in {shards} shards, the TP group has "
                         f"{1 if group is None else group.world_size} ranks")  # fmt: skip
    full = group.all_gather(weight.data.contiguous(), dim=0)
    return full[:vocab_size]


class RankSync:
    """What every rank's budget policy must share under ``--tp`` (see the module doc); inert with
    one rank."""

    def __init__(self, check_commits: bool = False) -> None:
        self.group = tp_group()
        self.check_commits = check_commits and self.group is not None

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank_in_group

    def share_costs(self, policy: BudgetPolicy) -> None:
        """Every rank starts from rank 0's cost table (loaded from its cache, or empty)."""
        if self.group is not None and policy.measuring:
            policy.cost = self.group.broadcast_object(policy.cost if self.rank == 0 else None, src=0)

    def same_seconds(self, policy: BudgetPolicy, verify: float, draft: Optional[float]) -> tuple[float, Optional[float]]:
        """Rank 0's seconds for this round's verify and draft pass (None: no draft pass)."""
        if self.group is None or not policy.measuring:
            return verify, draft
        seconds = torch.tensor([verify, -1.0 if draft is None else draft], dtype=torch.float64)
        torch.distributed.broadcast(seconds, src=self.group.ranks[0], group=self.group.cpu_group)
        verify, draft = seconds.tolist()
        return verify, (None if draft < 0 else draft)

    def same_acceptance(self, acceptance: Acceptance, all_greedy: bool) -> Acceptance:
        """Rank 0's acceptance in a round with sampled requests (greedy ones are the same on every
        rank: the same logits, the same picks)."""
        if self.group is None or all_greedy:
            return acceptance
        width = acceptance.path.shape[1]
        packed = torch.cat([acceptance.path, acceptance.num_accepted[:, None], acceptance.bonus[:, None]], 1)
        packed = packed.to("cpu", torch.int64).contiguous()
        torch.distributed.broadcast(packed, src=self.group.ranks[0], group=self.group.cpu_group)
        packed = packed.to(acceptance.path.device)
        return Acceptance(path=packed[:, :width].to(acceptance.path.dtype),
                          num_accepted=packed[:, width].to(acceptance.num_accepted.dtype),
                          bonus=packed[:, width + 1].to(acceptance.bonus.dtype))  # fmt: skip

    def check_same_commits(self, tokens: Tensor) -> None:
        """Test mode: stop on the first round whose committed tokens differ between ranks."""
        if not self.check_commits:
            return
        mine = tokens.detach().to("cpu", torch.int64).flatten()
        gathered = [torch.empty_like(mine) for _ in range(self.group.world_size)]
        torch.distributed.all_gather(gathered, mine, group=self.group.cpu_group)
        if any(not torch.equal(gathered[0], other) for other in gathered[1:]):
            raise RuntimeError(f"JETFLOW under --tp: ranks committed different tokens this round: {[g.tolist() for g in gathered]}")
