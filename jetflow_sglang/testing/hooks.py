"""The ``JETFLOW_TEST_*`` environment hooks of the SGLang JETFLOW worker, read in one place.

For tests and benchmarks only (docs/testing.md, "Test hooks"). The worker reads them once, when it
is built (`WorkerTestHooks.from_env`), and never looks at the environment during a round:

* ``JETFLOW_TEST_ORACLE=FILE``: draft the prompts listed in FILE with the oracle
  (:mod:`.paged_oracle`), the head drafting the rest;
* ``JETFLOW_TEST_ORACLE_ACCEPT=p``: with the oracle, a proposer of set quality
  (P(accepted length >= d) = p**d, `OracleProposer` accept_prob);
* ``JETFLOW_TEST_DRAFT_PADDING=1``: run the draft pass through the graph runner's padded-batch
  bookkeeping without CUDA;
* ``JETFLOW_TEST_DUMP_FEATURES=DIR``: dump the target features the worker hands the head
  (:mod:`.feature_dump`);
* ``JETFLOW_TEST_COSTS=FILE``: the adaptive budget prices and clocks every round by the cost table
  in FILE, not by the machine's clock (:mod:`.modelled_costs`);
* ``JETFLOW_TEST_TP_CHECK=1``: under ``--tp``, compare every round's committed tokens across ranks
  and stop on the first difference (`sglang_plugin.tensor_parallel.RankSync`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

ORACLE_ENV = "JETFLOW_TEST_ORACLE"
ORACLE_ACCEPT_ENV = "JETFLOW_TEST_ORACLE_ACCEPT"  # a float p: the oracle drafts with acceptance p per depth
DRAFT_PADDING_ENV = "JETFLOW_TEST_DRAFT_PADDING"
DUMP_FEATURES_ENV = "JETFLOW_TEST_DUMP_FEATURES"
COSTS_ENV = "JETFLOW_TEST_COSTS"
TP_CHECK_ENV = "JETFLOW_TEST_TP_CHECK"
TEST_DRAFT_BATCH_SIZES = (1, 2, 4, 8)  # the padded draft pass's batch-size buckets


@dataclass(frozen=True)
class WorkerTestHooks:
    oracle_file: Optional[str] = None
    oracle_accept: Optional[float] = None
    draft_padding: bool = False
    dump_features: Optional[str] = None
    costs: Optional[str] = None
    tp_check: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "WorkerTestHooks":
        accept = environ.get(ORACLE_ACCEPT_ENV)
        return cls(
            oracle_file=environ.get(ORACLE_ENV) or None,
            oracle_accept=float(accept) if accept else None,
            draft_padding=environ.get(DRAFT_PADDING_ENV) == "1",
            dump_features=environ.get(DUMP_FEATURES_ENV) or None,
            costs=environ.get(COSTS_ENV) or None,
            tp_check=environ.get(TP_CHECK_ENV) == "1",
        )
