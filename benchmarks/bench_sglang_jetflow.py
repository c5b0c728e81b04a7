"""Single-request greedy tokens/s of the SGLang server with and without JETFLOW, per-request tau,
and the share of a decode round in draft / tree / verify / bookkeeping.

    .venv/bin/python benchmarks/bench_sglang_jetflow.py --prompts humaneval --limit 8 \
        --max-new-tokens 256 --budget 64 --out benchmarks/results/sglang_humaneval8.json

Both servers run on 127.0.0.1 (fp32, --max-total-tokens 8192); requests alternate between
them one at a time (see jetflow_sglang/served.py). Prints a table and writes JSON.
"""

from __future__ import annotations

import sys

from jetflow_sglang.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
