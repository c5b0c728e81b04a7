"""Test-only parts of jetflow-sglang: nothing here is used in serving unless a ``JETFLOW_TEST_*``
variable asks for it.

* :mod:`.oracle`: `OracleProposer`, a reference-engine proposer that knows the target's greedy
  continuation (or, with ``accept_prob``, a proposer of set quality);
* :mod:`.paged_oracle`: `PagedOracleProposer`, the SGLang worker's batch form of it;
* :mod:`.hooks`: the ``JETFLOW_TEST_*`` environment hooks, read once when the worker is built;
* :mod:`.feature_dump`: the target features the worker hands the head, dumped for a test;
* :mod:`.modelled_costs`: the adaptive budget on a fixed cost table's clock, the same on every machine.
"""
