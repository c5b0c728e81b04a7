"""The reference engine: batch-1 speculative generation on HF transformers (`jetflow generate`,
`jetflow eval`, the losslessness tests), over the same head, tree, acceptance and lookup code as
the SGLang worker.

* :mod:`.engine`: `ReferenceEngine` (one round: propose, tree, verify, accept, commit) and
  `generate_ar`, plain decoding with the target alone;
* :mod:`.proposer`: its proposer interface `Proposer`, and `HeadProposer`, the JetFlow head behind it;
* :mod:`.target`: the HF target with tap hooks and KV compaction (also used by training and tools).
"""
