"""The SGLang worker's test proposer (``JETFLOW_TEST_ORACLE``, read by :mod:`.hooks`): an oracle that
knows each listed prompt's greedy continuation (a JSON file of ``[[prompt_ids, continuation_ids], ...]``)
and puts the true tokens at random ranks of each depth's top-k (`OracleProposer` per request). Prompts
the oracle does not know are drafted by the head, so one server serves both kinds at once.
"""

from __future__ import annotations

import json
import zlib

import torch
from torch import Tensor

from jetflow_sglang.sglang_plugin.proposer import BatchProposer, DraftRequest
from jetflow_sglang.testing.oracle import OracleProposer
from jetflow_sglang.tree import Candidates


class PagedOracleProposer:
    """Test proposer: one `OracleProposer` per known prompt (its greedy continuation); the
    head (`fallback`) drafts every other request and keeps its context K/V for all."""

    def __init__(self, path: str, fallback: BatchProposer, vocab_size: int, width: int, seed: int = 0,
                 accept_prob: float | None = None) -> None:  # fmt: skip
        """path: JSON list of [prompt ids, greedy continuation]. accept_prob p (``JETFLOW_TEST_ORACLE_ACCEPT``)
        makes it a proposer of set quality (`OracleProposer` accept_prob)."""
        with open(path) as f:
            pairs = json.load(f)
        self.accept_prob = accept_prob
        self.continuations = {tuple(prompt): list(prompt) + list(cont) for prompt, cont in pairs}
        self.fallback = fallback
        self.block_size = fallback.block_size
        self.vocab_size, self.width, self.seed = vocab_size, width, seed
        self._oracles: dict[str, OracleProposer] = {}
        self._last_round: dict[str, int] = {}

    def write_context(self, features: Tensor, slots: Tensor, positions: Tensor) -> None:
        self.fallback.write_context(features, slots, positions)

    def propose(self, request: DraftRequest) -> Candidates:
        live = set(request.rids)
        for rid in [r for r in self._oracles if r not in live]:
            del self._oracles[rid], self._last_round[rid]
        known = [tuple(p) in self.continuations for p in request.prompts]
        head_top = self.fallback.propose(request) if not all(known) else None
        rows = []
        for i, rid in enumerate(request.rids):
            if not known[i]:
                rows.append((head_top[0][i : i + 1], head_top[1][i : i + 1]))
                continue
            oracle = self._oracles.get(rid)
            position = int(request.seq_lens[i])
            if oracle is None:
                prompt = tuple(request.prompts[i])
                # Seeded by the prompt, not by arrival order: a prompt drafts the same at any concurrency.
                oracle = OracleProposer(self.continuations[prompt], self.vocab_size, self.block_size, self.width,
                                        seed=self.seed + zlib.crc32(repr(prompt).encode()),
                                        accept_prob=self.accept_prob)  # fmt: skip
                self._oracles[rid] = oracle
                oracle.length = position  # first decode round (or back after a retraction)
            else:
                oracle.advance_to(position, rounds=request.round_index - self._last_round[rid])
            self._last_round[rid] = request.round_index
            logprobs, tokens = oracle.propose_topk(request.anchors[i : i + 1], position, self.width)
            rows.append((logprobs.to(request.anchors.device), tokens.to(request.anchors.device)))
        return torch.cat([r[0] for r in rows], 0), torch.cat([r[1] for r in rows], 0)
