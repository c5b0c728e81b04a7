"""SGLang plugins shipped with jetflow-sglang: JETFLOW's speculative worker stack (spec_algo,
worker and the per-request modules beside it) and a CPU platform with its attention backend
(platform, attention, spec_ops)."""

ALGORITHM = "JETFLOW"  # the name users pass to --speculative-algorithm
