"""The JETFLOW spec-v2 worker: draft a tree with the head, verify it in one target forward.

No separate SGLang draft model runner: the head is a plain torch module bound to
the target's embedding and lm_head, and its context K/V live in the proposer's
own buffers, indexed by the target's KV slot ids (radix-cache hits reuse them).

* Extend: the target forward with the head's tap layers captured
  (``CaptureHiddenMode.FULL``); the new tokens' fused features become head context
  K/V at the slots and positions the target just wrote.
* Decode: ``batch.seq_lens`` committed tokens have KV; the anchor (the pending
  bonus token, ``spec_info.bonus_tokens``) sits at position ``seq_len``. One draft
  pass (a hinted head also reads its lookup hints, :mod:`.hints`) giving each depth's top-k
  over the draft vocabulary (no target-vocabulary logits) -> best-first tree ->
  one TARGET_VERIFY forward with the FULL_MASK tree mask
  (graph-captured on GPUs, :mod:`.verify_input`) -> tree walk over logits penalized and
  cut as SGLang's sampler would (greedy, or the target's own sampling at each path node:
  :mod:`.node_acceptance`) ->
  the accepted path's target KV moves to the front slots ``[seq_len, seq_len + a]``
  and its features become head context K/V there. Committed tokens (accepted drafts
  then the bonus) go at the front of each request's row of width Q.

Tree build, masks and acceptance are ``jetflow_kernels``: Triton kernels on CUDA, their torch
references (``jetflow_sglang.tree`` / ``.accept``) elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from typing import Optional

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_exec, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.eagle_utils import eagle_prepare_for_verify

from jetflow_kernels import backend_name, build_tree_from_topk, tree_masks
from jetflow_sglang.budget import policy_from_env
from jetflow_sglang.cost_cache import open_cost_cache
from jetflow_sglang.head import JetFlowHead
from jetflow_sglang.testing.feature_dump import FeatureDump
from jetflow_sglang.testing.hooks import TEST_DRAFT_BATCH_SIZES, WorkerTestHooks
from jetflow_sglang.tree import DraftTree, prune_tree, root_only

from .committed_ids import CommittedIds
from .hints import BatchHints, RoundLookups
from .lookup_branch import LookupBranch, lookup_enabled, lookup_mode
from .node_acceptance import accept_round
from .proposer import BatchProposer, DraftRequest, PagedHeadProposer
from .request_support import request_error
from .tensor_parallel import RankSync, full_vocab_rows
from .tree_penalties import any_penalized
from .verify_input import verify_input

logger = logging.getLogger(__name__)

PROFILE_ENV = "JETFLOW_PROFILE"
PROFILE_EVERY = 20  # rounds between profile log lines (cumulative)


class JetFlowWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        spec = get_spec()
        self.budget = int(spec.speculative_num_draft_tokens)
        self.width = int(spec.speculative_eagle_topk)
        self.speculative_num_draft_tokens = self.budget
        model = self.model_runner.model
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        head = JetFlowHead.load(spec.speculative_draft_model_path, dtype=self.model_runner.dtype)
        head = head.to(self.device).eval().requires_grad_(False)
        # Under --tp the target's rows are vocabulary shards: gathered whole here, once.
        embedding = full_vocab_rows(model.model.embed_tokens, self.vocab_size)
        lm_head = embedding if model.lm_head is model.model.embed_tokens else full_vocab_rows(model.lm_head, self.vocab_size)
        self.head = head.bind_target(embedding, lm_head).pack_for_cpu()  # bf16 on CPU: oneDNN-layout weights
        self.block_size = head.config.block_size
        self.depths = self.block_size - 1
        # Before the target's attention backends and graphs are set up (scheduler order).
        model.set_dflash_layers_to_capture(list(head.config.target_layer_ids))
        self.proposer: Optional[BatchProposer] = None
        self.lookup = LookupBranch(self.depths) if lookup_enabled() else None
        self.lookup_only = lookup_mode() == "only"  # the head never drafts: the baseline
        hint_ngram = head.config.lookup_hint_ngram if head.config.reads_hints else 0
        self.lookups = RoundLookups(self.lookup, self.depths, hint_ngram)  # chains and a hinted or copying head's hints
        # Adaptive by default (the budget is its cap); JETFLOW_BUDGET=static: always the cap. A cost
        # table of another dtype or machine is refused here, where both are known.
        self.test_hooks = WorkerTestHooks.from_env()  # JETFLOW_TEST_*: read once, here
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        self.budget_policy = policy_from_env(self.budget, self.device, self.model_runner.dtype, tp)
        self.cost_cache = None
        self.ranks = RankSync(check_commits=self.test_hooks.tp_check)  # --tp: every rank chooses as rank 0
        if self.test_hooks.costs:
            from jetflow_sglang.testing.modelled_costs import modelled_policy

            logger.warning("JETFLOW: adaptive budget on the modelled costs in %s, not the clock (test)", self.test_hooks.costs)
            self.budget_policy = modelled_policy(self.test_hooks.costs, self.budget, self.device, self.budget_policy.origin)
        else:
            # Adaptive without JETFLOW_COST_TABLE: start from the costs the last server measured for
            # this machine, target, dtype and head; save this one's every cost_cache.SAVE_EVERY rounds.
            self.cost_cache = open_cost_cache(self.budget_policy, self.model_runner.model_config.model_path,
                                              head.config, self.width, get_exec().kernel.attention_backend)  # fmt: skip
            if self.cost_cache is not None and self.ranks.rank != 0:
                self.cost_cache.writable = False  # rank 0 saves for all
        self.ranks.share_costs(self.budget_policy)
        self.committed_ids = CommittedIds()  # token ids with KV per request (overlap: req.output_ids lags)
        self.profile = os.environ.get(PROFILE_ENV, "") == "1"
        self.feature_dump = FeatureDump(self.test_hooks.dump_features) if self.test_hooks.dump_features else None
        self.timings: dict[str, float] = defaultdict(float)
        self.rounds = 0

    # -- what the scheduler reads -----------------------------------------------------
    @property
    def draft_worker(self):
        return None

    def _draft_model_runners(self) -> tuple:
        return ()

    def weight_update_runners(self) -> list:
        return []

    def __getattr__(self, name):
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self.target_worker, name)

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None) -> None:
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()
        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        num_slots = int(kv_pool.size) + int(kv_pool.page_size) + 1
        self.head_proposer = PagedHeadProposer(self.head, self.req_to_token_pool.req_to_token, num_slots, self.device, self.width)
        self.proposer = self.head_proposer
        logger.info("JETFLOW: %s", self.buffer_report(num_slots))
        oracle = self.test_hooks.oracle_file
        if oracle:
            from jetflow_sglang.testing.paged_oracle import PagedOracleProposer

            logger.warning("JETFLOW: test oracle drafts the prompts listed in %s; the head drafts the rest", oracle)
            self.proposer = PagedOracleProposer(oracle, self.head_proposer, self.vocab_size, self.width,
                                                accept_prob=self.test_hooks.oracle_accept)  # fmt: skip

    def init_cuda_graphs(self) -> None:
        """Capture the head's draft pass at the target verify graphs' batch sizes (after SGLang
        captured those: scheduler order), unless graphs are off or the device is not CUDA."""
        verify_graphs = getattr(self.model_runner, "decode_cuda_graph_runner", None)
        if verify_graphs is not None and torch.device(self.device).type == "cuda":
            self.head_proposer.use_graphs(verify_graphs.capture_bs, "graph")
            if self.budget_policy.measuring:  # verify graphs hold one width: the cap
                logger.warning("JETFLOW: tree budget static at %d under CUDA graphs (the verify graphs are captured at "
                               "the cap only); launch with --cuda-graph-backend-decode disabled for the adaptive budget",
                               self.budget)  # fmt: skip
                self.budget_policy.mode = "static"
            if self.lookup_only:  # lookup-only trees vary in size; the verify graphs do not
                logger.warning("JETFLOW: JETFLOW_LOOKUP=only is off under CUDA graphs; the head drafts with the lookup branch")
                self.lookup_only = False
        elif self.test_hooks.draft_padding:
            logger.warning("JETFLOW: draft pass padded to batch sizes %s without capture (test)", TEST_DRAFT_BATCH_SIZES)
            self.head_proposer.use_graphs(TEST_DRAFT_BATCH_SIZES, "padded")

    def buffer_report(self, num_slots: int) -> str:
        """What the budget costs in memory, from the actual batch cap (`--max-running-requests`,
        which the JETFLOW validator bounds by the budget when unset) and context length."""
        max_bs = int(self.req_to_token_pool.size)
        verify_tokens = max_bs * self.budget
        context_len = int(self.model_runner.model_config.context_len)
        logits_mib = verify_tokens * self.vocab_size * 4 / 2**20
        mask_mib = verify_tokens * (context_len + self.budget) / 2**20
        keys = self.head_proposer.keys
        context_mib = 2 * keys.numel() * keys.element_size() / 2**20
        return (
            f"budget {self.budget}, width {self.width}, block {self.block_size}; up to {max_bs} requests "
            f"per verify ({verify_tokens} tree tokens): verify logits {logits_mib:.1f} MiB, tree mask at "
            f"context {context_len} {mask_mib:.1f} MiB; head context K/V {context_mib:.1f} MiB for "
            f"{num_slots} KV slots; jetflow kernels: {backend_name(self.device)}"
        )

    # -- forward -----------------------------------------------------------------------
    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._extend(batch, on_publish)
        if batch.forward_mode.is_idle() or len(batch.reqs) == 0:
            return self._idle(on_publish)
        return self._decode(batch, on_publish)

    def _idle(self, on_publish) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        draft_input = make_draft_input_v2(bonus_tokens=empty, new_seq_lens=empty)
        if on_publish is not None:
            on_publish(draft_input.new_seq_lens)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=empty,
            accept_lens=torch.empty((0,), dtype=torch.int32, device=self.device),
            new_seq_lens=draft_input.new_seq_lens,
            next_draft_input=draft_input,
            can_run_cuda_graph=False,
            speculative_num_draft_tokens=self.budget,
        )

    @torch.inference_mode()
    def _extend(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        for req in batch.reqs:
            error = request_error(req)
            if error is not None:  # admission (hooks.py) refuses these; never expected here
                logger.error("JETFLOW: %s (request %s decodes greedily)", error, req.rid)
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch.seq_lens)
        if batch.forward_mode.is_idle():
            out.next_draft_input = make_draft_input_v2(
                bonus_tokens=torch.empty((0,), dtype=torch.int64, device=self.device),
                new_seq_lens=torch.empty((0,), dtype=torch.int64, device=self.device),
            )
            return out
        hidden = out.logits_output.hidden_states
        extend_lens = list(batch.extend_lens)
        if hidden is None or hidden.shape[0] != sum(extend_lens):
            raise RuntimeError(
                f"JETFLOW: expected tapped target features for {sum(extend_lens)} prompt tokens, got "
                f"{None if hidden is None else tuple(hidden.shape)}"
            )
        positions = torch.cat(
            [torch.arange(p, p + n, device=self.device) for p, n in zip(batch.prefix_lens, extend_lens)]
        )
        self.proposer.write_context(hidden, batch.out_cache_loc, positions)
        self.committed_ids.on_extend(batch.reqs, batch.seq_lens)
        if self.feature_dump is not None:
            rids = [req.rid for req in batch.reqs]
            self.feature_dump.extend(rids, batch.input_ids, extend_lens, positions, hidden)
        out.logits_output.hidden_states = None
        out.next_draft_input = make_draft_input_v2(bonus_tokens=out.next_token_ids, new_seq_lens=batch.seq_lens)
        return out

    def _tick(self, name: str, start: float) -> float:
        now = time.perf_counter()
        if self.profile:
            self.timings[name] += now - start
        return now

    def _draft_tree(
        self, request: DraftRequest, chains: Optional[list], hints: Optional[BatchHints], head_drafts: bool, t: float
    ) -> tuple[DraftTree, Optional[DraftTree], float]:
        """Draft pass (a hinted head reads `hints`) -> best-first tree at the cap -> free branch
        (lookup chains) -> this round's size. Without the head: the lookup chains alone, or the root
        alone where none was found or where chain rounds have lately cost more than they committed
        (adaptive; the skipped chain tree is returned too, to be valued against what the target
        commits)."""
        skipped = None
        if head_drafts:
            if hints is not None:
                request.hint_tokens, request.hint_kinds = hints.tensors(self.device)
            topk_logprobs, topk_tokens = self.proposer.propose(request)
            t = self._tick("draft", t)
            tree = build_tree_from_topk(request.anchors, topk_logprobs, topk_tokens, self.budget)
            if chains is not None:
                tree = self.lookup.merge(tree, chains)
        elif any(chains or ()):
            tree = self.lookup.chain_tree(request.anchors, chains, self.budget)
            if self.budget_policy.skip_chains(request.anchors.shape[0]):
                skipped, tree = tree, root_only(request.anchors)
        else:
            tree = root_only(request.anchors)
        size, priority = self.budget_policy.choose(tree)
        return prune_tree(tree, size, priority), skipped, t

    @torch.inference_mode()
    def _decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        t = round_start = self.budget_policy.clock()
        bs = len(batch.reqs)
        seq_lens = batch.seq_lens.to(torch.int64)
        anchors = batch.spec_info.bonus_tokens.to(torch.int64)
        request = DraftRequest(
            anchors=anchors,
            seq_lens=seq_lens,
            req_pool_indices=batch.req_pool_indices,
            prompts=[req.origin_input_ids for req in batch.reqs],
            rids=[req.rid for req in batch.reqs],
            round_index=self.rounds,
        )
        self.committed_ids.keep_only(batch.reqs)
        chains, hints = self.lookups(batch.reqs, seq_lens, anchors, self.committed_ids)
        t = self._tick("lookup", t)
        # Adaptive: where the head's draft pass has not paid lately, rounds go without it.
        head_drafts = not self.lookup_only and not self.budget_policy.skip_draft(bs, any(chains or ()))
        tree, skipped_chains, t = self._draft_tree(request, chains, hints, head_drafts, t)
        budget = tree.budget  # this round's verify width (adaptive: up to the cap)
        draft_seconds = self.budget_policy.clock() - round_start if head_drafts else None
        masks = tree_masks(tree.parents, tree.depths, seq_lens, packed=False, ancestors=tree.ancestors)
        spec_input = verify_input(
            masks.full_mask, budget, self.depths, self.width,
            draft_tokens=tree.tokens.flatten(), positions=masks.positions.flatten(), seq_lens=seq_lens,
        )
        t = self._tick("tree", t)

        batch.spec_info = spec_input
        verify_start = self.budget_policy.clock()
        verify_batch, _ = eagle_prepare_for_verify(spec_input, self.req_to_token_pool, batch, self.target_worker)
        target = self.target_worker.forward_batch_generation(batch=None, forward_batch=verify_batch, is_verify=True)
        logits_output: LogitsProcessorOutput = target.logits_output
        t = self._tick("verify", t)

        verify_logits = logits_output.next_token_logits.view(bs, budget, -1)
        acceptance = accept_round(tree, verify_logits, batch, seq_lens, anchors, self.committed_ids, self.depths)
        all_greedy = batch.sampling_info is None or batch.sampling_info.is_all_greedy
        acceptance = self.ranks.same_acceptance(acceptance, all_greedy)  # --tp: rank 0's draws
        accept_lens = (acceptance.num_accepted + 1).to(torch.int32)
        verify_seconds, draft_seconds = self.ranks.same_seconds(self.budget_policy, self.budget_policy.clock() - verify_start,
                                                                draft_seconds)  # fmt: skip
        self.budget_policy.observe(tree, acceptance.path, verify_seconds, draft_seconds)
        if head_drafts and any(chains or ()) and self.budget_policy.adaptive:  # what the chains alone would have bought
            chain_only = self.lookup.chain_tree(request.anchors, chains, self.budget)
            self.budget_policy.observe_chains_beside_head(chain_only, tree, acceptance)
        if skipped_chains is not None:
            self.budget_policy.observe_skipped_chains(skipped_chains, acceptance.bonus)
        new_seq_lens = seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        span = min(budget, self.depths + 1)  # committed tokens never exceed either
        path = acceptance.path[:, :span]
        on_path = path >= 0
        verify_slots = verify_batch.out_cache_loc.view(bs, budget).to(torch.int64)
        front = verify_slots[:, :span]
        src = verify_slots.gather(1, path.clamp(min=0))
        moved = on_path & (src != front)
        if bool(moved.any()):
            self.token_to_kv_pool_allocator.get_kvcache().move_kv_cache(front[moved], src[moved])
        features = logits_output.hidden_states.view(bs, budget, -1)
        path_features = features.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, features.shape[-1]))
        positions = seq_lens[:, None] + torch.arange(span, device=self.device)[None, :]
        self.proposer.write_context(path_features[on_path], front[on_path], positions[on_path])
        logits_output.hidden_states = None

        committed = acceptance.committed_tokens(tree)[:, :span]
        self.ranks.check_same_commits(torch.where(on_path, committed, -1))  # JETFLOW_TEST_TP_CHECK only
        if self.feature_dump is not None:
            rids = [req.rid for req in batch.reqs]
            self.feature_dump.verify(rids, seq_lens, anchors, committed, acceptance.num_accepted, path_features)
        if self.lookups.reads_ids or any_penalized(batch.reqs):  # a host sync: only when read
            self.committed_ids.on_accept(batch.reqs, seq_lens, anchors, committed, acceptance.num_accepted)
        if batch.return_logprob:  # per request, its committed tokens' log-probs (SGLang slices accept_lens)
            logits = logits_output.next_token_logits.view(bs, budget, -1)
            logits_output.next_token_logprobs = committed_logprobs(logits, path, committed)
        next_token_ids = torch.zeros((bs, self.budget), dtype=torch.int64, device=self.device)  # stride: the cap
        next_token_ids[:, :span] = committed.clamp(min=0)
        batch.forward_mode = ForwardMode.DECODE
        self._tick("bookkeeping", t)
        self.rounds += 1
        if self.cost_cache is not None:
            self.cost_cache.after_round(self.budget_policy, self.rounds)
        if self.profile and self.rounds % PROFILE_EVERY == 0:
            total = sum(self.timings.values())
            report = {
                "rounds": self.rounds,
                "budget": self.budget,
                "tree_sizes": self.budget_policy.report(),
                "ms_per_round": {k: round(1000 * v / self.rounds, 2) for k, v in self.timings.items()},
                "share": {k: round(v / total, 4) for k, v in self.timings.items()},
            }
            logger.info("JETFLOW profile %s", json.dumps(report))
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_token_ids.flatten(),
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=make_draft_input_v2(bonus_tokens=acceptance.bonus, new_seq_lens=new_seq_lens),
            can_run_cuda_graph=target.can_run_cuda_graph,
            speculative_num_draft_tokens=self.budget,
        )


def committed_logprobs(logits: torch.Tensor, path: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
    """[b, span] target log-prob of each committed token at the path node that predicted it.
    logits: [b, N, V] verify logits; path: [b, span] node indices (-1 past the accepted path);
    committed: [b, span] tokens (accepted drafts, then the bonus). Entries past a request's
    committed count are meaningless."""
    rows = logits.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1])).float()
    return rows.gather(2, committed.clamp(min=0)[..., None])[..., 0] - rows.logsumexp(-1)
