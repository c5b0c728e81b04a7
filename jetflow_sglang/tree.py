"""Best-first draft tree from per-depth draft log-probs, and its attention masks.

The head drafts every depth in one pass, so a node's draft log-prob depends only
on its depth and token, and the cumulative score of a node is the sum of its
path's per-depth log-probs. Scores therefore never rise along a path, and
best-first expansion under a budget of N nodes selects exactly the N best
nodes under the total order (score desc, depth asc, expansion order): the root
plus the top N-1 of all paths through the per-depth top-k lists. Any node in
that set is also in the top N-1 of its own depth, so each depth can be pruned
to N-1 candidates before expanding the next: a loop over depths, vectorized
over the batch and the nodes.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_BUDGET = 512


@dataclass
class DraftTree:
    """A batch of draft trees, one per request, nodes in best-first (topological) order.

    Node 0 is the root: the anchor token (last committed token, not yet in the
    target's KV cache). Depth-d nodes are candidate tokens for position
    prefix_len + d.
    """

    tokens: Tensor  # [b, N] int64
    parents: Tensor  # [b, N] int64, parent index (< own index), -1 for the root
    depths: Tensor  # [b, N] int64, root 0
    scores: Tensor  # [b, N] float32, cumulative draft log-prob, root 0
    ancestors: Tensor  # [b, N, N] bool, [b, i, j]: node j is node i or one of its ancestors

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    def positions(self, prefix_lens: Tensor) -> Tensor:
        """Target positions of the nodes: prefix_len + depth. prefix_lens: [b]."""
        return prefix_lens[:, None] + self.depths


def budget_error(budget: int, num_depths: int | None = None, width: int | None = None) -> str | None:
    """Why `budget` cannot be a tree budget, or None: the one budget check of the package (the
    reference engine, the tree builders, the launcher and the `jetflow` commands all call it).
    Outside 1..MAX_BUDGET; or, given the draft depths and width, more nodes than the best-first
    tree of those lists can hold (`max_tree_nodes`)."""
    if not 1 <= budget <= MAX_BUDGET:
        return f"tree budget must be between 1 and {MAX_BUDGET}, got {budget}"
    if num_depths is not None and width is not None and budget > max_tree_nodes(num_depths, width):
        return (f"tree budget {budget} exceeds the {max_tree_nodes(num_depths, width)} nodes that "
                f"{num_depths} draft depths of width {width} can hold")  # fmt: skip
    return None


def check_budget(budget: int, num_depths: int | None = None, width: int | None = None) -> None:
    """`budget_error` as a ValueError."""
    error = budget_error(budget, num_depths, width)
    if error is not None:
        raise ValueError(error)


def max_tree_nodes(num_depths: int, width: int) -> int:
    """Largest tree the per-depth top-k lists allow, root included (capped above MAX_BUDGET)."""
    total, level = 1, 1
    for _ in range(num_depths):
        level *= width
        total += level
        if total > MAX_BUDGET:
            break
    return total


Candidates = tuple[Tensor, Tensor]  # per-depth top-k log-probs [..., k] float32 and their token ids [..., k] int64


CPU_CANDIDATE_ROWS = 16  # `top_candidates` rows per chunk on CPU


def top_candidates(logits: Tensor, width: int, vocab_ids: Tensor | None = None) -> Candidates:
    """The `width` best draft tokens per row of logits [..., K], sorted: log-probs (a log-softmax over
    the K rows in float32) and token ids, mapped through `vocab_ids` [K] when the K rows are a pruned
    draft vocabulary (the target's other tokens have probability 0, so the log-probs are the same as
    over the whole vocabulary). Both engines take their draft lists from here: the same trees at ties."""
    width = min(width, logits.shape[-1])
    if logits.device.type == "cpu" and logits[..., 0].numel() > CPU_CANDIDATE_ROWS:
        # On CPU, rows a few at a time: the float32 copy and log-softmax of a whole batch's
        # draft logits (16 requests x 15 depths x 16k) is 16 MB that misses the cache. Chunks of
        # 16 rows give the same lists: alone 6.7 instead of 17.3 ms at 16 requests, inside a
        # profiled draft pass 5.2 instead of 5.8 ms.
        flat = logits.reshape(-1, logits.shape[-1])
        chunks = [chunk.float().log_softmax(-1).topk(width, dim=-1) for chunk in flat.split(CPU_CANDIDATE_ROWS)]
        logprobs = torch.cat([c.values for c in chunks]).view(*logits.shape[:-1], width)
        index = torch.cat([c.indices for c in chunks]).view(*logits.shape[:-1], width)
    else:
        logprobs, index = logits.float().log_softmax(-1).topk(width, dim=-1)
    return logprobs, index if vocab_ids is None else vocab_ids[index]


def build_tree_from_topk(anchor_tokens: Tensor, topk_logprobs: Tensor, topk_tokens: Tensor, budget: int) -> DraftTree:
    """`build_tree` from per-depth top-k lists [b, D, k] (`top_candidates`): run over a vocabulary
    of the k listed tokens, mapped back to token ids. Equals `build_tree(anchor, logprobs, budget, k)`
    when the lists are `logprobs.topk(k)`, except where tied log-probs make `topk` order the sorted
    lists differently the second time."""
    batch, _, width = topk_logprobs.shape
    tree = build_tree(anchor_tokens, topk_logprobs, budget, width)
    is_root = tree.depths == 0
    list_index = torch.where(is_root, 0, (tree.depths - 1) * width + tree.tokens)  # non-root tokens are ranks
    listed = topk_tokens.reshape(batch, -1).to(torch.long).gather(1, list_index)
    tree.tokens = torch.where(is_root, tree.tokens, listed)
    return tree


def build_tree(anchor_tokens: Tensor, draft_logprobs: Tensor, budget: int, width: int = 7) -> DraftTree:
    """Best-first tree of `budget` nodes (root included).

    anchor_tokens: [b] root tokens. draft_logprobs: [b, D, V] log-probs for depths 1..D.
    """
    batch, num_depths, vocab = draft_logprobs.shape
    width = min(width, vocab)
    if width < 1:
        raise ValueError(f"tree width must be at least 1, got {width}")
    check_budget(budget, num_depths, width)
    device = draft_logprobs.device
    anchor_tokens = anchor_tokens.to(device=device, dtype=torch.long)
    topk_logprobs, topk_tokens = draft_logprobs.float().topk(width, dim=-1)  # [b, D, k], sorted
    keep = budget - 1
    layout = pool_layout(num_depths, width, keep)

    # Candidate pool, depth by depth, each depth's kept children sorted by score (index 0: the
    # root). A depth's children are its parents' (parent-major, rank-minor), so a child's
    # position in the sort gives its parent and its rank after the loop.
    level = topk_logprobs.new_zeros(batch, 1)
    pool_scores, orders = [level], []
    for depth, size in enumerate(layout.sizes):
        children = (level[:, :, None] + topk_logprobs[:, depth, None, :]).flatten(1)
        level, order = torch.sort(children, dim=1, descending=True, stable=True)
        level = level[:, :size]
        pool_scores.append(level)
        orders.append(order[:, :size])
    scores = torch.cat(pool_scores, 1)
    depths = torch.tensor(layout.depths, device=device)
    parents = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    tokens = anchor_tokens[:, None]
    if orders:
        order = torch.cat(orders, 1)
        parent_offsets = torch.tensor(layout.parent_offsets, device=device)
        parents = torch.cat([parents, order.div(width, rounding_mode="floor") + parent_offsets], 1)
        ranks = (depths[1:] - 1) * width + order.remainder(width)  # into the flattened [D * k] lists
        tokens = torch.cat([tokens, topk_tokens.reshape(batch, -1).gather(1, ranks)], 1)
    # Global best-first selection; the stable sort keeps depth order on ties, so a
    # parent always comes before its children.
    chosen = torch.sort(scores[:, 1:], dim=1, descending=True, stable=True).indices[:, :keep] + 1
    chosen = torch.cat([chosen.new_zeros(batch, 1), chosen], 1)
    new_index = torch.full_like(scores, -1, dtype=torch.long)
    new_index.scatter_(1, chosen, torch.arange(budget, device=device).expand(batch, -1))
    old_parents = parents.gather(1, chosen)
    tree_parents = torch.where(old_parents < 0, old_parents, new_index.gather(1, old_parents.clamp(min=0)))
    return DraftTree(
        tokens=tokens.gather(1, chosen),
        parents=tree_parents,
        depths=depths.expand(batch, -1).gather(1, chosen),
        scores=scores.gather(1, chosen),
        ancestors=ancestor_mask(tree_parents, num_depths),
    )


@dataclass(frozen=True)
class PoolLayout:
    """`build_tree`'s candidate pool for one (depths, width, keep): nodes kept per depth, and per
    pool node its depth and the pool index of the first node of its parent's depth."""

    sizes: tuple[int, ...]
    depths: tuple[int, ...]
    parent_offsets: tuple[int, ...]  # non-root nodes only


@functools.lru_cache(maxsize=256)
def pool_layout(num_depths: int, width: int, keep: int) -> PoolLayout:
    sizes, level = [], 1
    for _ in range(num_depths if keep else 0):
        level = min(keep, level * width)
        sizes.append(level)
    depths, parent_offsets, start, parent_start = [0], [], 1, 0
    for depth, size in enumerate(sizes, 1):
        depths += [depth] * size
        parent_offsets += [parent_start] * size
        parent_start, start = start, start + size
    return PoolLayout(tuple(sizes), tuple(depths), tuple(parent_offsets))


def refreshed_tree(tree: DraftTree, node_top: Candidates, depth_top: Candidates) -> DraftTree:
    """Best-first re-expansion of a tree with path-conditioned log-probs (the refresh pass).

    node_top: top-k lists [b, N, k] (`top_candidates`), row i from log q(next | path to node i of
    `tree`); depth_top: [b, D, k], the one-pass per-depth lists, used for the children of nodes
    the first tree did not hold. Same budget; a node's score is its path's sum, so scores never
    rise along a path and the heap pops parents before children. Ties go to the shallower node,
    then to the earlier push: deterministic.
    """
    batch, budget = tree.tokens.shape
    num_depths = depth_top[0].shape[1]
    rows = []
    for r in range(batch):
        first_tokens, first_parents = tree.tokens[r].tolist(), tree.parents[r].tolist()
        first_child = {(p, t): i for i, (p, t) in enumerate(zip(first_parents, first_tokens)) if i > 0}
        node_lp, node_tok = node_top[0][r].tolist(), node_top[1][r].tolist()
        depth_lp, depth_tok = depth_top[0][r].tolist(), depth_top[1][r].tolist()
        tokens, parents, depths, scores, origin = [first_tokens[0]], [-1], [0], [0.0], [0]
        heap: list[tuple[float, int, int, int, int]] = []
        push_order = itertools.count()

        def push_children(node: int) -> None:
            depth = depths[node]
            if depth >= num_depths:
                return
            first = origin[node]
            lps, toks = (node_lp[first], node_tok[first]) if first >= 0 else (depth_lp[depth], depth_tok[depth])
            for lp, token in zip(lps, toks):
                heapq.heappush(heap, (-(scores[node] + lp), depth + 1, next(push_order), node, token))

        push_children(0)
        while len(tokens) < budget and heap:
            neg_score, depth, _, parent, token = heapq.heappop(heap)
            first_parent = origin[parent]
            origin.append(first_child.get((first_parent, token), -1) if first_parent >= 0 else -1)
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg_score)
            push_children(len(tokens) - 1)
        rows.append((tokens, parents, depths, scores))
    device = tree.tokens.device
    as_tensor = lambda i, dtype: torch.tensor([row[i] for row in rows], dtype=dtype, device=device)  # noqa: E731
    parents = as_tensor(1, torch.long)
    return DraftTree(
        tokens=as_tensor(0, torch.long),
        parents=parents,
        depths=as_tensor(2, torch.long),
        scores=as_tensor(3, torch.float32),
        ancestors=ancestor_mask(parents, num_depths),
    )


def merge_chain(tree: DraftTree, chain: Tensor, chain_scores: Sequence[float]) -> DraftTree:
    """Put a token chain (depths 1..L after the root, e.g. a prompt-lookup continuation) into
    a batch-1 tree without changing its budget: the "free branch".

    The chain walks down from the root as far as the tree already holds it; each remaining
    chain token becomes a new node (child of the previous chain node) scored
    chain_scores[depth - 1] (non-increasing; past its end, its last step repeats), appended
    at the end, as long as it strictly beats the weakest
    removable leaf, which it replaces. Leaves are removed iteratively (a parent whose children
    are all gone becomes a leaf), never the root or a node of the chain's shared prefix; ties
    remove the later node. Kept nodes stay in their order and new nodes follow, so the order
    stays topological. When no chain node gets in, the tree itself is returned.
    """
    if tree.tokens.shape[0] != 1:
        raise ValueError(f"merge_chain takes a batch-1 tree, got batch {tree.tokens.shape[0]}")
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    depths, scores = tree.depths[0].tolist(), tree.scores[0].tolist()
    chain = [int(t) for t in chain.reshape(-1).tolist()]
    budget = len(tokens)

    # Shared prefix: follow the chain down the tree (siblings hold distinct tokens).
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    shared, node = [0], 0
    while len(shared) <= len(chain) and (node, chain[len(shared) - 1]) in child_of:
        node = child_of[(node, chain[len(shared) - 1])]
        shared.append(node)
    protected = set(shared)
    rest = chain[len(shared) - 1 :]
    first_depth = len(shared)  # depth of the first new chain node
    scores_by_depth = chain_depth_scores(chain_scores, first_depth + len(rest))
    new_scores = [float(torch.tensor(scores_by_depth[first_depth + k - 1], dtype=torch.float32)) for k in range(len(rest))]

    # Each new chain node (scores fall along the chain) replaces the weakest removable leaf it beats.
    children = [0] * budget
    for p in parents[1:]:
        children[p] += 1
    removed: set[int] = set()
    taken = 0
    for score in new_scores:
        leaves = [i for i in range(1, budget) if i not in removed and children[i] == 0 and i not in protected]
        if not leaves:
            break
        weakest = min(leaves, key=lambda i: (scores[i], -i))
        if not score > scores[weakest]:
            break
        removed.add(weakest)
        children[parents[weakest]] -= 1
        taken += 1
    if taken == 0:
        return tree

    kept = [i for i in range(budget) if i not in removed]
    new_index = {old: new for new, old in enumerate(kept)}
    out_tokens = [tokens[i] for i in kept]
    out_parents = [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
    out_depths = [depths[i] for i in kept]
    out_scores = [scores[i] for i in kept]
    parent = new_index[shared[-1]]
    for k in range(taken):
        out_tokens.append(rest[k])
        out_parents.append(parent)
        out_depths.append(first_depth + k)
        out_scores.append(new_scores[k])
        parent = len(out_tokens) - 1
    device = tree.tokens.device
    as_row = lambda values, dtype: torch.tensor([values], dtype=dtype, device=device)  # noqa: E731
    out = as_row(out_parents, torch.long)
    return DraftTree(
        tokens=as_row(out_tokens, torch.long),
        parents=out,
        depths=as_row(out_depths, torch.long),
        scores=as_row(out_scores, torch.float32),
        ancestors=ancestor_mask(out, max(out_depths)),
    )


def chain_depth_scores(chain_scores: Sequence[float], depths: int) -> list[float]:
    """`chain_scores` for depths 1..depths: past its end, its last step (or its only value) repeats."""
    scores = [float(x) for x in chain_scores[:depths]]
    if not scores:
        raise ValueError("chain scores need at least one depth")
    if scores[0] > 0 or any(b > a for a, b in zip(scores, scores[1:])):
        raise ValueError(f"chain scores must be log-probabilities that never rise with depth, got {scores}")
    step = scores[-1] - scores[-2] if len(scores) > 1 else scores[0]
    while len(scores) < depths:
        scores.append(scores[-1] + step)
    return scores


FILLER_SCORE = -1e4  # a node of a chain tree past its request's chain


def chain_tree(anchors: Tensor, chains: Sequence[Sequence[int]], max_depth: int, chain_scores: Sequence[float]) -> DraftTree:
    """Trees of token chains alone (e.g. prompt lookup, no head pass): each request's chain (at
    most `max_depth` tokens) is a path below its anchor, scored `chain_scores` per depth as a
    merged chain is. Shorter chains (or none) continue with filler nodes (the anchor's token)
    scored far below any chain node, which pruning drops first; verifying one is harmless (it
    is accepted only where the target picks that token)."""
    length = min(max((len(c) for c in chains), default=0), max_depth)
    device = anchors.device
    scores = [0.0, *chain_depth_scores(chain_scores, length)] if length else [0.0]
    rows_tokens, rows_scores = [], []
    for anchor, chain in zip(anchors.tolist(), chains):
        chain = [int(t) for t in chain[:length]]
        filler = length - len(chain)
        rows_tokens.append([anchor, *chain, *[anchor] * filler])
        rows_scores.append(scores[: len(chain) + 1] + [FILLER_SCORE - k for k in range(filler)])
    batch = len(rows_tokens)
    depths = torch.arange(length + 1, device=device).expand(batch, -1).contiguous()
    parents = depths - 1
    return DraftTree(
        tokens=torch.tensor(rows_tokens, dtype=torch.long, device=device),
        parents=parents,
        depths=depths,
        scores=torch.tensor(rows_scores, dtype=torch.float32, device=device),
        ancestors=ancestor_mask(parents, length),
    )


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[b, N, N] bool: [b, i, j] is True when j is i or an ancestor of i (pointer chasing by depth)."""
    batch, budget = parents.shape
    eye = torch.eye(budget, dtype=torch.bool, device=parents.device)
    ancestors = eye.expand(batch, -1, -1).clone()
    step_parent = parents.clamp(min=0)  # the root's parent is itself: the root is everyone's ancestor
    current = torch.arange(budget, device=parents.device).expand(batch, -1)
    for _ in range(min(max_depth, budget - 1)):
        current = step_parent.gather(1, current)
        ancestors.scatter_(2, current[..., None], True)
    return ancestors


def full_mask(tree: DraftTree, prefix_lens: Tensor) -> Tensor:
    """SGLang FULL_MASK: per request a row-major [N, prefix_len + N] bool block (prefix
    columns all True, then the ancestor mask), flattened and concatenated over the batch."""
    budget = tree.budget
    prefix_lens = prefix_lens.to(tree.tokens.device)
    max_prefix = int(prefix_lens.max()) if prefix_lens.numel() else 0
    columns = torch.arange(max_prefix + budget, device=tree.tokens.device)
    prefix = prefix_lens[:, None]
    tree_column = columns[None, :] - prefix  # [b, C]
    in_prefix = tree_column < 0
    in_tree = (tree_column >= 0) & (tree_column < budget)
    tree_bits = tree.ancestors.gather(2, tree_column.clamp(0, budget - 1)[:, None, :].expand(-1, budget, -1))
    padded = in_prefix[:, None, :] | (in_tree[:, None, :] & tree_bits)  # [b, N, C]
    valid = (columns[None, :] < prefix + budget)[:, None, :].expand(-1, budget, -1)
    return padded[valid]


def pack_bits(bits: Tensor, segment_lens: Tensor) -> tuple[Tensor, Tensor]:
    """FlashInfer `segment_packbits` with little bit order: each segment of the flat bool
    array is packed to bytes separately (padded to a byte). Returns (packed uint8, indptr in bytes)."""
    device = bits.device
    segment_lens = segment_lens.to(device=device, dtype=torch.long)
    packed_lens = (segment_lens + 7) // 8
    indptr = torch.zeros(segment_lens.numel() + 1, dtype=torch.long, device=device)
    indptr[1:] = packed_lens.cumsum(0)
    bit_start = torch.zeros_like(segment_lens)
    bit_start[1:] = segment_lens.cumsum(0)[:-1]
    segment_of_bit = torch.repeat_interleave(torch.arange(segment_lens.numel(), device=device), segment_lens)
    local = torch.arange(bits.numel(), device=device) - bit_start[segment_of_bit]
    padded = torch.zeros(int(indptr[-1]) * 8, dtype=torch.uint8, device=device)
    padded[indptr[segment_of_bit] * 8 + local] = bits.to(torch.uint8)
    weights = (2 ** torch.arange(8, device=device)).to(torch.uint8)
    packed = (padded.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)
    return packed, indptr


def packed_mask(tree: DraftTree, prefix_lens: Tensor) -> tuple[Tensor, Tensor]:
    """FlashInfer custom mask: the FULL_MASK of each request bit-packed (little endian) on its own."""
    budget = tree.budget
    segment_lens = budget * (prefix_lens.to(tree.tokens.device) + budget)
    return pack_bits(full_mask(tree, prefix_lens), segment_lens)


def root_only(anchor_tokens: Tensor) -> DraftTree:
    """A batch of one-node trees (the anchors): verifying it is a plain decode step."""
    batch = anchor_tokens.shape[0]
    device = anchor_tokens.device
    zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
    return DraftTree(
        tokens=anchor_tokens.long()[:, None],
        parents=zeros - 1,
        depths=zeros,
        scores=torch.zeros(batch, 1, device=device),
        ancestors=torch.ones(batch, 1, 1, dtype=torch.bool, device=device),
    )


def path_scores(tree: DraftTree, values: Tensor | None = None) -> Tensor:
    """[b, N] each node's value (default: its score) capped by its ancestors' (min along the
    root path). Head scores never rise along a path, so for a head-only tree this is
    `tree.scores`; a merged lookup chain node can outscore its parent, and the cap keeps
    every selection by it a tree."""
    capped = (tree.scores if values is None else values).clone()
    for depth in range(1, int(tree.depths.max()) + 1 if tree.depths.numel() else 0):
        at_depth = tree.depths == depth
        parent_capped = capped.gather(1, tree.parents.clamp(min=0))
        capped = torch.where(at_depth, torch.minimum(capped, parent_capped), capped)
    return capped


def prune_order(tree: DraftTree, priority: Tensor | None = None) -> Tensor:
    """[b, N] node indices best first by `path_scores(tree, priority)`, ties to the shallower then
    earlier node; the root first. Every prefix of it is a tree (a node's parent comes before it)."""
    capped = path_scores(tree, priority)
    capped[:, 0] = float("inf")
    # Lexicographic (score desc, depth asc, index asc) by stable sorts from the last key up.
    order = torch.sort(tree.depths, dim=1, stable=True).indices
    return order.gather(1, torch.sort(capped.gather(1, order), dim=1, descending=True, stable=True).indices)


def prune_tree(tree: DraftTree, budget: int, priority: Tensor | None = None) -> DraftTree:
    """The first `budget` nodes of each tree in `prune_order` (by `priority` [b, N], default the
    scores): every kept node's parent is kept, nodes stay topological. A head-only tree pruned
    by its scores to n nodes is the best-first tree of budget n."""
    check_budget(budget)
    if budget >= tree.budget:
        return tree
    batch, size = tree.tokens.shape
    device = tree.tokens.device
    chosen = prune_order(tree, priority)[:, :budget]
    new_index = torch.full((batch, size), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, chosen, torch.arange(budget, device=device).expand(batch, -1))
    old_parents = tree.parents.gather(1, chosen)
    parents = torch.where(old_parents < 0, old_parents, new_index.gather(1, old_parents.clamp(min=0)))
    # A kept node's ancestors are all kept: its rows and columns of the ancestor mask are the mask.
    ancestors = tree.ancestors.gather(1, chosen[:, :, None].expand(-1, -1, size))
    return DraftTree(
        tokens=tree.tokens.gather(1, chosen),
        parents=parents,
        depths=tree.depths.gather(1, chosen),
        scores=tree.scores.gather(1, chosen),
        ancestors=ancestors.gather(2, chosen[:, None, :].expand(-1, budget, -1)),
    )
