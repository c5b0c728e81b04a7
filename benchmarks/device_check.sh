#!/usr/bin/env bash
# Device check (issue 5): kernel tests on CUDA, then timings of target verify, the head's draft
# pass and the tree kernels on a Qwen3-8B-shaped random target; a table last, JSON to --out.
#   benchmarks/device_check.sh [--out out/device_check.json]   # one NVIDIA GPU, under 8 minutes
#   benchmarks/device_check.sh --dry-run                       # every step at toy size on CPU
# Options: benchmarks/device_check.sh --help
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
exec "$PYTHON" benchmarks/device_check.py "$@"
