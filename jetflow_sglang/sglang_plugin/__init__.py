"""SGLang plugins shipped with jetflow-sglang: a CPU platform and a CPU attention backend."""
