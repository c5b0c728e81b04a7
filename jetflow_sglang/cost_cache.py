"""Costs an adaptive server measured, kept for its next start.

The adaptive tree budget (`budget.BudgetPolicy`) prices each round from a table of measured
verify, plain-step and draft seconds (`budget.CostTable`). Without `JETFLOW_COST_TABLE` it
measures that table from its first rounds; this module keeps what it measured in
``$JETFLOW_HOME/costs/<target>-<dtype>-<digest>.json`` and starts the next server of the same key
from it (`open_cost_cache`). The key (`cost_key`) is what the costs depend on: the machine and
the serving dtype (`BudgetPolicy.origin`: `budget.host_fingerprint` and the dtype), the target's
architecture (its config.json), the head's (its config: trained weights change what is accepted,
not what a pass costs), the tree width and the attention backend. A file is the JSON
`JETFLOW_COST_TABLE` loads, with its key and each size's sample count (`Curve.samples`) beside
it: a size measured once is still untrusted when loaded, and its count goes on from there. It is
written atomically (a temporary file renamed into place) every `SAVE_EVERY` rounds when rounds
were measured since, never in between. A file that cannot be read, or that records another key,
is ignored with a warning: the costs are measured anew. `JETFLOW_COST_TABLE` overrides the cache:
nothing is then read or written here. No calibration pass runs at startup: the costs are the
serving rounds' own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, is_dataclass
from pathlib import Path

from jetflow_sglang.assets import jetflow_home
from jetflow_sglang.budget import COST_TABLE_ENV, BudgetPolicy, CostTable

logger = logging.getLogger(__name__)

COSTS_DIR = "costs"  # under $JETFLOW_HOME
COST_CACHE_ENV = "JETFLOW_COST_CACHE"  # another folder for the cached tables (tests: one per session)
SAVE_EVERY = 100  # rounds between saves (a save only where rounds were measured since)
CURVES = ("verify", "draft", "plain")  # the `CostTable` fields, as named under "samples"


def target_config(target: str | os.PathLike) -> dict | str:
    """The target's architecture: its config.json less bookkeeping (keys starting with "_",
    transformers_version); the model path itself where it has none here (a hub id)."""
    config = Path(target) / "config.json"
    if not config.is_file():
        return str(target)
    data = json.loads(config.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}


def cost_key(origin: dict, target: str | os.PathLike, head: object, width: int, attention: str | None = None) -> dict:
    """What measured costs depend on, as plain JSON: `origin` (the serving dtype and
    `budget.host_fingerprint`), the target's config (`target_config` of its model path), the
    head's config (a dataclass or a dict), the tree width and the attention backend."""
    key = {"origin": origin, "target": target_config(target), "head": asdict(head) if is_dataclass(head) else head,
           "width": width, "attention": attention}  # fmt: skip
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def cache_path(key: dict, target: str | os.PathLike) -> Path:
    """``$JETFLOW_HOME/costs/<target folder name>-<dtype>-<digest of key>.json`` (``$JETFLOW_COST_CACHE``
    instead of ``$JETFLOW_HOME/costs`` where set)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{Path(target).name}-{key['origin'].get('dtype', 'auto')}")
    return Path(os.environ.get(COST_CACHE_ENV) or jetflow_home() / COSTS_DIR) / f"{label}-{digest}.json"



def measured_rounds(table: CostTable) -> int:
    """Samples over the table's sizes: grows with every round observed, so a change says the
    costs moved."""
    return sum(sum(getattr(table, name).samples.values()) for name in CURVES)


def table_from_json(data: dict) -> CostTable:
    """`CostTable.from_json`, with each size's sample count restored from "samples" (a size
    without one counts as trusted, as in a table measured beforehand)."""
    table = CostTable.from_json(data)
    samples = data.get("samples") or {}
    try:
        for name in CURVES:
            curve = getattr(table, name)
            curve.samples = {int(k): int(v) for k, v in (samples.get(name) or {}).items()}
            if any(k not in curve.seconds_at or v < 1 for k, v in curve.samples.items()):
                raise ValueError(f"{name} samples must be counts >= 1 of measured sizes")
    except (TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"cost table samples: {exc}") from None
    return table


class CostCache:
    """One key's cost table file: read at startup, written back while serving."""

    def __init__(self, path: Path, key: dict) -> None:
        self.path, self.key = path, key
        self.saved_rounds = 0  # `measured_rounds` at the last save or load
        self.saves = 0
        self.writable = True  # off after a failed write: warned once, serving goes on

    def load(self) -> CostTable | None:
        """The table saved for this key; None where there is none, or (warned) where the file
        cannot be read or records another key."""
        if not self.path.is_file():
            return None
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            if data.get("key") != self.key:
                raise ValueError("it records another machine, target, dtype or head")
            table = table_from_json(data)
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            logger.warning("JETFLOW: cost table %s ignored (%s); measuring anew", self.path, str(exc).splitlines()[0])
            return None
        self.saved_rounds = measured_rounds(table)
        return table

    def save(self, table: CostTable, origin: dict) -> None:
        """Write the table, with its sample counts, `origin` and the key beside it, atomically."""
        samples = {name: {str(k): v for k, v in sorted(getattr(table, name).samples.items())} for name in CURVES}
        data = {**table.to_json(), "samples": samples, **origin, "key": self.key}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".partial")
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(json.dumps(data, indent=1) + "\n")
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            logger.warning("JETFLOW: cannot save the cost table to %s (%s); costs are measured anew at each start",
                           self.path, exc)  # fmt: skip
            self.writable = False
            return
        if not self.saves:
            logger.info("JETFLOW: cost table saved to %s", self.path)
        self.saves += 1
        self.saved_rounds = measured_rounds(table)

    def after_round(self, policy: BudgetPolicy, rounds: int) -> None:
        """Every `SAVE_EVERY` rounds: save the policy's costs if it measured rounds since (and is
        still adaptive: CUDA graphs turn it static after startup). No file I/O otherwise."""
        if rounds % SAVE_EVERY or not (self.writable and policy.adaptive):
            return
        if measured_rounds(policy.cost) != self.saved_rounds:
            self.save(policy.cost, policy.origin)


def open_cost_cache(policy: BudgetPolicy, target: str | os.PathLike, head: object, width: int,
                    attention: str | None = None) -> CostCache | None:  # fmt: skip
    """The cache of an adaptive policy without `JETFLOW_COST_TABLE` (else None: nothing cached),
    its saved table, if any, loaded into the policy (logged in one line)."""
    if not policy.adaptive or os.environ.get(COST_TABLE_ENV):
        return None
    key = cost_key(policy.origin, target, head, width, attention)
    cache = CostCache(cache_path(key, target), key)
    table = cache.load()
    if table is None:
        logger.info("JETFLOW: no cost table saved for this machine, target, dtype and head; measuring (saved to %s)", cache.path)
        return cache
    policy.cost = table
    sizes = len(table.verify.seconds_at) + len(table.plain.seconds_at) + len(table.draft.seconds_at)
    logger.info("JETFLOW: cost table from %s (%d sizes)", cache.path, sizes)
    return cache
