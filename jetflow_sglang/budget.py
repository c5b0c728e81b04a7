"""Load-aware tree budget: each round, the tree size that maximizes expected committed tokens
per second for the whole batch.

The verify shape is one size n for every request of a round (SGLang's tree verify is
``[bs, n]``). For each candidate n on a ladder (1, 2, 4, ... up to the cap):

    rate(n) = sum over requests of E_b(n)  /  (draft seconds(bs) + verify seconds(bs * n))

E_b(n) is 1 (the bonus token) plus the expected accepted drafts of the likeliest n nodes: the
sum of each node's probability of being on the accepted path, read from its path score and
depth through a calibration of the acceptance observed so far (a head's probabilities are not
calibrated; a prompt-lookup chain node's score is a fixed guess), capped by its ancestors' so
the n nodes form a tree (`tree.prune_tree`). Costs come from a table of measured rounds
(`CostTable`): verify seconds by verify tokens, plain steps (n = 1) and draft seconds by batch
size, read through a non-decreasing fit, linear between and past the measured sizes; until two
tree sizes are measured twice each, the ladder is measured smallest first. A table measured
beforehand (`benchmarks/verify_cost.py`) can seed it; every round updates it (EMA); without one
the policy measures its own costs from the first rounds (a server keeps them for its next
start: `cost_cache`). A table recorded in another dtype or on another machine than the one
serving is refused (`check_table_origin`). Under load bs * n
grows and small trees win. When rounds with a head draft pass have been committing fewer
tokens per second than this round would without one (measured, EMA per batch size, each
against a plain step; a plain step counts 1; rounds verifying lookup chains alone where this
round found chains, else a plain step; the chains' value also counts, in every head round that
held them, what they alone would have committed there: `observe_chains_beside_head`, so both
are measured on the same text), the next rounds skip the head: they verify the
prompt-lookup chains alone, or the root alone where no request has one, running the head every
`PROBE_EVERY`-th round to see whether that changed. Rounds that verify lookup chains without
the head are measured the same way: when they have been committing fewer tokens per second
than a plain step (text that repeats little: the chains are mostly wrong), the next rounds
verify the root alone, a plain decode step. Such a round needs no probe to see whether that
changed: it checks the skipped chains' first tokens against what the target committed and
values the chains from that (`observe_skipped_chains`), so they return when text repeats. A
head probe that loses time (a head pass at a large batch) comes more rarely: often enough that
probes lose at most `PROBE_SHARE` of the plain steps' time between them. Against a plain step,
a drafting round (head or chains) must be worth more than 1 (`pay_bar`): what it costs beyond
its own seconds (requests that advance unevenly finish apart, so later rounds run partly empty
and new requests come in more, smaller prefills) shows in no round's tokens per second.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from jetflow_sglang.accept import Acceptance
from jetflow_sglang.tree import FILLER_SCORE, DraftTree, path_scores, prune_order

POLICIES = ("static", "adaptive", "sweep")  # sweep: every ladder size in turn (benchmarks/verify_cost.py)
DEFAULT_POLICY = "adaptive"  # the budget given is the cap; JETFLOW_BUDGET=static verifies it every round
BUDGET_ENV = "JETFLOW_BUDGET"
COST_TABLE_ENV = "JETFLOW_COST_TABLE"
# Default cap on requests x tree size per verify batch: SGLang sizes its verify CUDA graphs and their
# logits buffer (rows x vocab x 4 bytes, 1.2 GB for a 152k vocab) from max batch x budget; the
# adaptive policy keeps every round's batch x size under it.
VERIFY_TOKENS_PER_BATCH = 2048
# Calibration bins over a node's path log-prob (upper edges; the last bin ends at 0).
SCORE_EDGES = (-9.0, -7.0, -6.0, -5.0, -4.0, -3.5, -3.0, -2.5, -2.0, -1.6, -1.2, -0.9, -0.6, -0.3, 0.0)
PRIOR_NODES = 8.0  # pseudo-observations at the level above, per bin or cell
CALIBRATION_DEPTHS = 8  # depth cells 0..7 (deeper nodes share the last)
EMA = 0.2
MIN_SAMPLES = 2  # rounds at a size before the cost table trusts it (a loaded table counts as this)
MAX_WEIGHT = 20  # samples weighing a size in the monotone fit (recent EMA values stay live)
PROBE_EVERY = 8  # while drafting does not pay, every 8th round drafts anyway to see if that changed
PROBE_SHARE = 0.02  # ... or more rarely: probes may cost at most this share of the plain steps' time
# A round that drafts must buy this much more than a plain step where other requests share the
# batch: requests that advance at different rates finish apart, so the batch then runs partly
# empty and admits new requests in more, smaller prefills (measured at 16 fixed-length requests
# in flight), a cost no round sees in its own tokens per second. A lone request pays none of it.
PAY_MARGIN = 0.1
VALUE_EMA = 0.1


def budget_ladder(cap: int) -> list[int]:
    """Candidate tree sizes: powers of two below the cap, and the cap."""
    sizes, n = [], 1
    while n < cap:
        sizes.append(n)
        n *= 2
    return sizes + [cap]


@dataclass
class Curve:
    """Measured seconds by size (EMA per size), read through a non-decreasing fit
    (pool-adjacent-violators, weighted by samples) so one noisy round cannot make a bigger size
    look cheaper than a smaller one; linear between and past the measured sizes."""

    seconds_at: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)  # a size loaded from a file counts as trusted

    def trusted(self) -> list[int]:
        return [m for m in self.seconds_at if self.samples.get(m, MIN_SAMPLES) >= MIN_SAMPLES]

    def known(self, size: int) -> bool:
        """Inside the measured range, each end measured at least `MIN_SAMPLES` times."""
        measured = self.trusted()
        return bool(measured) and min(measured) <= size <= max(measured)

    def _fit(self) -> tuple[list[int], list[float]]:
        points = sorted(self.seconds_at)
        blocks: list[list[float]] = []  # [value, weight, points in block]
        for m in points:
            blocks.append([self.seconds_at[m], float(min(self.samples.get(m, MIN_SAMPLES), MAX_WEIGHT)), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (v1, w1, n1), (v2, w2, n2) = blocks[-2], blocks.pop()
                blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
        return points, [v for v, _, n in blocks for _ in range(int(n))]

    def seconds(self, size: int) -> float:
        points, values = self._fit()
        if not points:
            raise ValueError("nothing measured yet")
        i = bisect_left(points, size)
        if i < len(points) and points[i] == size:
            return values[i]
        if len(points) == 1:
            return values[0]
        i = min(max(i, 1), len(points) - 1)  # the segment around it, or the nearest end segment
        lo, hi = i - 1, i
        slope = (values[hi] - values[lo]) / (points[hi] - points[lo])
        return max(values[lo] + slope * (size - points[lo]), values[0])

    def observe(self, size: int, seconds: float) -> None:
        old = self.seconds_at.get(size)
        self.seconds_at[size] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        self.samples[size] = self.samples.get(size, 0 if old is None else MIN_SAMPLES) + 1  # a loaded size stays trusted

    def to_ms(self) -> dict[str, float]:
        return {str(k): round(v * 1e3, 4) for k, v in sorted(self.seconds_at.items())}

    @classmethod
    def from_ms(cls, data: dict, what: str) -> "Curve":
        seconds = {int(k): float(v) / 1e3 for k, v in data.items()}
        if any(k < 1 or not v > 0 for k, v in seconds.items()):
            raise ValueError(f"cost table: {what} must be >= 1 and times > 0")
        return cls(seconds)


@dataclass
class CostTable:
    """What a round costs: the verify (tree verify + acceptance) of a tree by verify tokens
    (bs * n), a plain step (the root alone, n = 1) by batch size, and the draft pass (head, tree
    build, free branch) by batch size. Plain steps are kept apart because bs requests of one
    token cost more than one request of bs nodes (each request attends over its own context):
    on one tokens axis, root-only rounds at batch 16 priced a 16-node tree at batch 1 a quarter
    too high."""

    verify: Curve = field(default_factory=Curve)
    draft: Curve = field(default_factory=Curve)
    plain: Curve = field(default_factory=Curve)

    def plain_seconds(self, batch: int) -> float:
        """A plain step at this batch size: measured (within the measured batch sizes), or else a
        verify of `batch` tokens, or else the nearest measured plain step."""
        if self.plain.known(batch) or not self.verify.seconds_at:
            return self.plain.seconds(batch)
        return self.verify.seconds(batch)

    def round_seconds(self, batch: int, n: int) -> float:
        """The verify of n nodes per request at this batch size."""
        return self.plain_seconds(batch) if n == 1 else self.verify.seconds(batch * n)

    def known(self, batch: int, n: int) -> bool:
        return (n == 1 and self.plain.known(batch)) or self.verify.known(batch * n)

    def observe_round(self, batch: int, n: int, seconds: float) -> None:
        if n == 1:
            self.plain.observe(batch, seconds)
        else:
            self.verify.observe(batch * n, seconds)

    def to_json(self) -> dict:
        return {"verify_ms": self.verify.to_ms(), "draft_ms": self.draft.to_ms(), "plain_ms": self.plain.to_ms()}

    @classmethod
    def from_json(cls, data: dict) -> "CostTable":
        try:
            return cls(Curve.from_ms(data["verify_ms"], "verify tokens"), Curve.from_ms(data.get("draft_ms") or {}, "batch sizes"),
                       Curve.from_ms(data.get("plain_ms") or {}, "batch sizes"))  # fmt: skip
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cost table needs {{'verify_ms': {{tokens: ms}}, 'draft_ms': {{batch: ms}}}}: {exc!r}") from None
        except ValueError as exc:
            if "cost table" in str(exc):
                raise
            raise ValueError(f"cost table: sizes must be integers and times numbers: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: object = None, host: dict | None = None) -> "CostTable":
        """The table in `path`; refused where it records another dtype than `dtype` or another
        machine than `host` (`check_table_origin`; None: not checked)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read cost table {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"cost table {path} is not a JSON object")
        check_table_origin(data, path, dtype, host)
        return cls.from_json(data)


def dtype_name(dtype: object) -> str | None:
    """float32 | bfloat16 | float16 for a torch dtype or an SGLang --dtype value; None for auto
    (resolved later, from the model) or anything else."""
    text = str(dtype).removeprefix("torch.").lower()
    aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
    text = aliases.get(text, text)
    return text if text in ("float32", "bfloat16", "float16") else None


def host_fingerprint(device: torch.device | str = "cpu", name: bool = True) -> dict:
    """What a cost table records of the machine that measured it: the architecture, whether it
    ran on CUDA, and (name) the GPU's or the CPU's model and, on a CPU, its core count. Costs
    measured on one machine price rounds wrongly on another."""
    device = torch.device(device)
    host = {"machine": platform.machine(), "cuda": device.type == "cuda"}
    if name and device.type == "cuda":
        host["device_name"] = torch.cuda.get_device_name(device)
    elif name:
        host["device_name"] = _cpu_model()
        host["cpus"] = os.cpu_count()
    return host


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table_origin(data: dict) -> dict:
    """What a cost table says of where it was measured: `dtype` (or, in older tables,
    `config.dtype`) and the `host_fingerprint` keys it has."""
    origin = {k: data[k] for k in ("machine", "cuda", "device_name", "cpus", "tp") if data.get(k) is not None}
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    dtype = dtype_name(data.get("dtype") or config.get("dtype"))
    if dtype:
        origin["dtype"] = dtype
    return origin


def check_table_origin(data: dict, path: object, dtype: object = None, host: dict | None = None) -> None:
    """Refuse, in one line, a cost table recorded in another dtype than `dtype` or on another
    machine than `host` (a `host_fingerprint`). Only what both sides state is compared: a table
    without these keys, or a serving dtype not yet known (None, auto), passes."""
    origin, serving = table_origin(data), dtype_name(dtype)
    remedy = f"measure one here with benchmarks/verify_cost.py, or unset {COST_TABLE_ENV} (the adaptive budget measures its own costs)"
    if serving and origin.get("dtype") not in (None, serving):
        raise ValueError(f"cost table {path} was measured in {origin['dtype']}, but this server runs {serving}: {remedy}")
    for key, what in (("cuda", "on CUDA"), ("machine", "architecture"), ("device_name", "device"), ("cpus", "CPU count"),
                      ("tp", "tensor-parallel ranks")):  # fmt: skip
        if host and key in origin and key in host and origin[key] != host[key]:
            raise ValueError(f"cost table {path} was measured on another machine ({what}: {origin[key]!r} there, "
                             f"{host[key]!r} here): {remedy}")  # fmt: skip


class AcceptanceCalibration:
    """Observed share of verified nodes on the accepted path, per path-score bin and per (score
    bin, depth): a prompt-lookup chain node deep in its chain is accepted far more often than a
    head node of the same score. Each level is shrunk toward the one above it (depth cell ->
    score bin -> the score's own probability) where it has few observations."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.edges = torch.tensor(SCORE_EDGES, device=device)
        self.bins = len(SCORE_EDGES) + 1
        cells = self.bins * CALIBRATION_DEPTHS
        zeros = lambda n: torch.zeros(n, dtype=torch.float64, device=device)  # noqa: E731
        self.bin_nodes, self.bin_accepted = zeros(self.bins), zeros(self.bins)
        self.cell_nodes, self.cell_accepted = zeros(cells), zeros(cells)

    def _index(self, scores: Tensor, depths: Tensor) -> tuple[Tensor, Tensor]:
        bins = torch.bucketize(scores.float().clamp(max=0.0), self.edges)
        return bins, bins * CALIBRATION_DEPTHS + depths.clamp(max=CALIBRATION_DEPTHS - 1)

    def probabilities(self, scores: Tensor, depths: Tensor) -> Tensor:
        """Calibrated probability that each node (path score, depth) is on the accepted path."""
        bins, cells = self._index(scores, depths)
        own = scores.float().clamp(max=0.0).exp().double()
        bin_rate = (self.bin_accepted[bins] + PRIOR_NODES * own) / (self.bin_nodes[bins] + PRIOR_NODES)
        rate = (self.cell_accepted[cells] + PRIOR_NODES * bin_rate) / (self.cell_nodes[cells] + PRIOR_NODES)
        return rate.float()

    def observe(self, scores: Tensor, depths: Tensor, on_path: Tensor) -> None:
        """scores, depths: [m] path scores and depths of verified non-root nodes; on_path: [m] bool."""
        bins, cells = self._index(scores, depths)
        hits = on_path.double()
        self.bin_nodes += torch.bincount(bins, minlength=self.bins).double()
        self.bin_accepted += torch.bincount(bins, weights=hits, minlength=self.bins)
        self.cell_nodes += torch.bincount(cells, minlength=self.cell_nodes.numel()).double()
        self.cell_accepted += torch.bincount(cells, weights=hits, minlength=self.cell_nodes.numel())


class BudgetPolicy:
    """Chooses each round's tree size (see the module doc); `static` always takes the cap."""

    def __init__(self, cap: int, mode: str = "static", cost: CostTable | None = None, device: torch.device | str = "cpu",
                 origin: dict | None = None) -> None:  # fmt: skip
        if mode not in POLICIES:
            raise ValueError(f"budget policy must be one of {', '.join(POLICIES)}, got {mode!r}")
        self.cap, self.mode, self.device = cap, mode, torch.device(device)
        self.origin = origin or {}  # dtype and host_fingerprint, reported with the costs measured here
        self.ladder = budget_ladder(cap)
        self.cost = cost or CostTable()
        self.calibration = AcceptanceCalibration(device)
        self.chosen: dict[int, int] = {}  # tree size -> rounds (for reports and tests)
        self.draft_value: dict[int, float] = {}  # batch size -> EMA of (head-drafted round's rate / plain step's)
        self.chain_value: dict[int, float] = {}  # the same for rounds verifying lookup chains without the head
        self.chains_off: dict[int, bool] = {}  # batch size -> whether the last round there skipped the chains
        self.undrafted: dict[int, int] = {}  # batch size -> rounds verified without a draft since
        # batch size -> EMA of a head round's seconds beyond those of the plain steps that would
        # commit as many tokens (0 when it pays): how rarely to probe
        self.head_loss: dict[int, float] = {}
        self.skipped_drafts = 0
        self.skipped_chains = 0
        # root|chains|head|credited -> batch size -> [rounds, seconds, committed tokens] (reports)
        self.round_totals: dict[str, dict[int, list[float]]] = {k: {} for k in ("root", "chains", "head", "credited")}

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive"

    @property
    def measuring(self) -> bool:
        return self.mode != "static"

    def node_probabilities(self, tree: DraftTree) -> Tensor:
        """[b, N] calibrated probability that each node is on the accepted path (root 1), capped
        by its ancestors' (a node is never likelier than its parent)."""
        probs = self.calibration.probabilities(path_scores(tree), tree.depths)
        probs[:, 0] = 1.0
        return path_scores(tree, probs)

    def expected_commits(self, tree: DraftTree, probs: Tensor | None = None) -> Tensor:
        """[N] expected committed tokens of the whole batch when the likeliest n nodes are
        verified (`prune_tree` by `node_probabilities`), for n = 1..N (index n - 1)."""
        probs = self.node_probabilities(tree) if probs is None else probs
        ordered = probs.gather(1, prune_order(tree, probs))
        return ordered.cumsum(1).sum(0)

    def skip_draft(self, batch: int, chains_found: bool = True) -> bool:
        """True when the head's draft pass has lately not paid at this batch size and no probe is
        due: the round then verifies what prompt lookup found, or the root alone, with no head
        pass. Paid means its rounds committed more tokens per second, against a plain step, than
        this round would without it (EMAs as measured, a new batch size starting from the
        nearest measured one): the lookup chains where some were found, else the root alone (a
        plain step, worth 1), and at least `pay_bar`. Chain rounds are measured only
        where text repeats, so their value says nothing of a round without chains."""
        bar = pay_bar(batch)
        without_head = max(bar, _nearest(self.chain_value, batch, bar)) if chains_found else bar
        if not self.adaptive or _nearest(self.draft_value, batch, bar) >= without_head:
            return False
        if _probe_due(self.undrafted, batch, self._probe_interval(batch)):
            return False
        self.skipped_drafts += 1
        return True

    def skip_chains(self, batch: int) -> bool:
        """In a round without the head where prompt lookup found chains: True when such rounds
        have lately committed fewer tokens per second than `pay_bar` plain steps at this batch
        size. The round then verifies the root alone and values the chains it skipped from
        what the target commits (`observe_skipped_chains`) instead of probing them: a probe at
        a large batch loses time, and sets requests apart that would otherwise finish together.
        Where other requests share the batch, chains once skipped come back only above the bar
        by another `PAY_MARGIN`: a value that hovers near the bar would otherwise switch them on
        for a lucky stretch, and each such stretch sets the batch's requests apart."""
        if not self.adaptive:
            return False
        bar = pay_bar(batch)
        if batch > 1 and _nearest(self.chains_off, batch, False):
            bar += PAY_MARGIN  # once off, back only on clearly better evidence: no flapping on EMA luck
        skip = _nearest(self.chain_value, batch, bar) < bar
        self.chains_off[batch] = skip
        self.skipped_chains += skip
        return skip

    def _probe_interval(self, batch: int) -> int:
        """Rounds between head probes: `PROBE_EVERY`, or more where a probe round loses more than
        `PROBE_SHARE` of that many plain steps."""
        loss = _nearest(self.head_loss, batch, 0.0)
        if loss <= 0.0 or not (self.cost.verify.seconds_at or self.cost.plain.seconds_at):
            return PROBE_EVERY
        return max(PROBE_EVERY, math.ceil(loss / (PROBE_SHARE * self.cost.plain_seconds(batch))))

    def choose(self, tree: DraftTree) -> tuple[int, Tensor | None]:
        """This round's tree size, and the node priority to prune the tree to it by (None: the
        tree's own scores)."""
        if self.mode == "static":
            size, probs = min(self.cap, tree.budget), None  # a lookup-only tree may be smaller
        elif self.mode == "sweep":
            ladder = [n for n in self.ladder if n <= tree.budget]
            size, probs = ladder[sum(self.chosen.values()) % len(ladder)], None
        else:
            probs = self.node_probabilities(tree)
            size = self._best_size(tree, probs)
        self.chosen[size] = self.chosen.get(size, 0) + 1
        return size, probs

    def _best_size(self, tree: DraftTree, probs: Tensor) -> int:
        batch = tree.tokens.shape[0]
        candidates = [n for n in self.ladder if n <= tree.budget and (n == 1 or batch * n <= VERIFY_TOKENS_PER_BATCH)]
        if len(self.cost.verify.trusted()) < 2:  # too little to extrapolate from: measure, smallest first
            for n in candidates:
                if not self.cost.known(batch, n):
                    return n
        commits = self.expected_commits(tree, probs).tolist()
        draft = self.cost.draft.seconds(batch) if self.cost.draft.seconds_at else 0.0  # paid whatever n is
        rates = {n: commits[n - 1] / (draft + self.cost.round_seconds(batch, n)) for n in candidates}
        return max(candidates, key=lambda n: (rates[n], -n))

    def clock(self) -> float:
        """perf_counter seconds; while measuring on a GPU, after the queued work ran."""
        if self.measuring and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def observe(self, tree: DraftTree, path: Tensor, verify_seconds: float, draft_seconds: float | None) -> None:
        """After a verify of `tree` (the verified nodes): path [b, d] the accepted path's node
        indices from the root (-1 padded); the seconds the verify and the draft pass (None: no
        draft this round) took."""
        if not self.measuring:
            return
        if tree.budget > 1:
            on_path = torch.zeros(tree.tokens.shape, dtype=torch.bool, device=path.device)
            on_path.scatter_(1, path.clamp(min=0), path >= 0)
            self.calibration.observe(path_scores(tree)[:, 1:].flatten(), tree.depths[:, 1:].flatten(), on_path[:, 1:].flatten())
        batch = tree.tokens.shape[0]
        self.cost.observe_round(batch, tree.budget, verify_seconds)
        if draft_seconds is not None:
            self.cost.draft.observe(batch, draft_seconds)
        # What this round bought: committed tokens per second against a plain step's, kept apart
        # for rounds with and without the head's draft pass.
        committed = int((path >= 0).sum())
        seconds, plain = (draft_seconds or 0.0) + verify_seconds, self.cost.plain_seconds(batch)
        value = committed / seconds * plain / batch
        kind = "head" if draft_seconds is not None else ("chains" if tree.budget > 1 else "root")
        _total(self.round_totals[kind], batch, seconds, committed)
        if kind == "root":
            return  # a plain step: worth 1 by definition
        _ema(self.draft_value if kind == "head" else self.chain_value, batch, value, VALUE_EMA)
        if kind == "head":
            _ema(self.head_loss, batch, max(0.0, seconds - committed * plain / batch), VALUE_EMA)

    def observe_skipped_chains(self, chains: DraftTree, next_tokens: Tensor) -> None:
        """After a root-only round that skipped the lookup chains `chains` (`skip_chains`): what
        verifying them would have bought, fed to the chain rounds' value as a measured round is.
        Each chain's first token is checked against the token the target committed (free
        evidence); deeper ones count as the calibration expects given that first hit (P(d on
        path | depth 1 on path) = P(d) / P(1)). Chains come back as soon as the text starts
        repeating, without waiting for a probe."""
        if not self.adaptive or chains.budget < 2:
            return
        batch = chains.tokens.shape[0]
        probs = self.node_probabilities(chains)
        size = self._best_size(chains, probs)
        if size < 2:
            return
        first_hit = (chains.tokens[:, 1] == next_tokens) & (chains.scores[:, 1] > FILLER_SCORE / 2)
        given_hit = probs[:, 1:size].sum(1) / probs[:, 1].clamp(min=1e-6)
        commits = float((1.0 + first_hit.float() * given_hit).sum())
        plain, seconds = self.cost.plain_seconds(batch), self.cost.round_seconds(batch, size)
        _total(self.round_totals["credited"], batch, seconds, commits)
        _ema(self.chain_value, batch, commits / seconds * plain / batch, VALUE_EMA)

    def observe_chains_beside_head(self, chains: DraftTree, tree: DraftTree, acceptance: Acceptance) -> None:
        """After a head round (`tree`, verified, and its `acceptance`) whose requests also had lookup
        chains (`chains`: their chain-only tree, `LookupBranch.chain_tree`): what a round verifying the
        chains alone would have committed, fed to the chain rounds' value as a measured round is.
        That round takes the size this policy would give the chain tree; each request then commits
        its chain's leading tokens that equal what the target committed here (exact up to the
        round's last committed token), at most that size less the root, and a bonus. Rounds that
        verify chains alone are taken where text repeats, and at one request they run a copy out
        to its end: without this their value was measured on other text than the head's, and the
        head was skipped on streaks of copies (at one request on HumanEval, 50 of 340 rounds)."""
        if not self.adaptive or chains.budget < 2:  # a chain-only tree of one node: no request had a chain
            return
        real = chains.scores[:, 1:] > FILLER_SCORE / 2
        probs = self.node_probabilities(chains)
        size = self._best_size(chains, probs)
        if size < 2:
            return  # the chain round would verify the root alone: a plain step, worth 1
        committed = acceptance.committed_tokens(tree)
        reach = min(size - 1, committed.shape[1])
        match = (chains.tokens[:, 1 : 1 + reach] == committed[:, :reach]) & real[:, :reach]
        batch = chains.tokens.shape[0]
        commits = float((1 + match.int().cumprod(1).sum(1)).sum())
        plain, seconds = self.cost.plain_seconds(batch), self.cost.round_seconds(batch, size)
        _total(self.round_totals["credited"], batch, seconds, commits)
        _ema(self.chain_value, batch, commits / seconds * plain / batch, VALUE_EMA)

    def report(self) -> dict:
        return {"mode": self.mode, "cap": self.cap, "chosen": dict(sorted(self.chosen.items())),
                "skipped_drafts": self.skipped_drafts, "skipped_chains": self.skipped_chains,
                "cost": self.cost.to_json(), "origin": self.origin, "rounds_by_batch": self.totals_report()}  # fmt: skip

    def totals_report(self) -> dict:
        """Per round kind and batch size: rounds, mean ms, committed tokens per request per round,
        and tokens per second against the root-only rounds' at that size (credited: lookup chains
        valued without being verified alone, by `observe_skipped_chains` and
        `observe_chains_beside_head`)."""
        report = {}
        for kind, by_batch in self.round_totals.items():
            rows = {}
            for batch, (rounds, seconds, committed) in sorted(by_batch.items()):
                row = {"rounds": int(rounds), "ms": round(1e3 * seconds / rounds, 2), "tokens": round(committed / rounds / batch, 3)}
                root = self.round_totals["root"].get(batch)
                if root and kind != "root":
                    row["vs_root"] = round((committed / seconds) / (root[2] / root[1]), 3)
                rows[str(batch)] = row
            report[kind] = rows
        return report


def pay_bar(batch: int) -> float:
    """What a drafting round must be worth, in plain steps, at this batch size (`PAY_MARGIN`)."""
    return 1.0 + (PAY_MARGIN if batch > 1 else 0.0)


def _nearest(values: dict[int, float], batch: int, default: float) -> float:
    """The estimate at this batch size, or at the nearest measured one (by ratio; the smaller on a
    tie): a batch size seen for the first time starts from its neighbour's, not from nothing."""
    if batch in values or not values:
        return values.get(batch, default)
    return values[min(values, key=lambda b: (abs(math.log(b / batch)), b))]


def _ema(values: dict, key, value: float, weight: float) -> None:
    old = values.get(key)
    values[key] = value if old is None else (1 - weight) * old + weight * value


def _total(totals: dict[int, list[float]], batch: int, seconds: float, committed: float) -> None:
    row = totals.setdefault(batch, [0, 0.0, 0.0])
    row[0] += 1
    row[1] += seconds
    row[2] += committed


def _probe_due(since: dict[int, int], batch: int, interval: int) -> bool:
    """Count a skipped round at this batch size; every `interval`-th is a probe instead."""
    if since.get(batch, 0) >= interval - 1:
        since[batch] = 0
        return True
    since[batch] = since.get(batch, 0) + 1
    return False


def policy_name() -> str:
    """`JETFLOW_BUDGET`: adaptive (the default, unset or empty) | static | sweep."""
    mode = os.environ.get(BUDGET_ENV) or DEFAULT_POLICY
    if mode not in POLICIES:
        raise ValueError(f"{BUDGET_ENV} must be one of {', '.join(POLICIES)}, got {mode!r}")
    return mode


def policy_from_env(cap: int, device: torch.device | str = "cpu", dtype: object = None, tp: int = 1) -> BudgetPolicy:
    """The policy `JETFLOW_BUDGET` names (`policy_name`; adaptive by default); `JETFLOW_COST_TABLE`:
    a measured cost table (JSON of `benchmarks/verify_cost.py`) to start from, refused where it
    was measured in another dtype than `dtype`, on another machine than this one, or (where it
    says) at another tensor-parallel size than `tp`: under ``--tp`` the verify is sharded across
    the ranks and the draft pass is not, so both cost otherwise. The origin it reports (and the
    cost cache keys on) states `tp` where it is above 1."""
    mode = policy_name()
    host = host_fingerprint(device)
    table = os.environ.get(COST_TABLE_ENV)
    cost = CostTable.load(table, dtype, {**host, "tp": tp}) if table else None
    origin = {**({"dtype": dtype_name(dtype)} if dtype_name(dtype) else {}), **host, **({"tp": tp} if tp > 1 else {})}
    return BudgetPolicy(cap, mode, cost, device, origin)

