#!/usr/bin/env bash
# The hinted head's data, training and evaluation, end to end; every stage resumes when rerun.
#   bash benchmarks/hinted_head.sh [STEPS]
# Data (the target's own greedy answers, bf16, SGLang Engine) under $JETFLOW_HOME/data:
# python-stdlib code prompts past the 2,000 the shipped head trained on, ShareGPT train prompts
# past 9,000, and the validation slice (held-out metrics at each checkpoint). Then, from the
# shipped head, the same steps twice: a hinted head (--lookup-hint) and a control without hints,
# so that more training on code is not credited to the hints. Outputs under out/hinted/.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-500}
J=.venv/bin/jetflow
D=${JETFLOW_HOME:-$HOME/.cache/jetflow}/data
O=out/hinted
mkdir -p "$O"
$J regenerate --prompts sharegpt-validation --max-new-tokens 256 --dtype bfloat16 --out "$D/sharegpt-validation-regen"
$J regenerate --prompts python-stdlib --skip 2000 --limit 500 --max-new-tokens 256 --dtype bfloat16 --out "$D/stdlib-regen-2000"
$J regenerate --prompts sharegpt --skip 9000 --limit 250 --max-new-tokens 256 --dtype bfloat16 --out "$D/sharegpt-regen-9000"
COMMON=(--init-head default --data "$D/stdlib-regen-2000,$D/sharegpt-regen-9000" --val-data "$D/sharegpt-validation-regen"
        --steps "$STEPS" --lr 3e-4 --warmup-steps 30 --anchor-fraction 0.25 --draft-vocab 16384 --depth-decay 4
        --reveal 0.1 --checkpoint-every 100 --val-blocks 512 --mask causal --layers 2 --batch-tokens 2048)
for run in hinted control; do
  flags=(); [ "$run" = hinted ] && flags=(--lookup-hint)
  resume=(); [ -f "$O/$run/train_state.json" ] && resume=(--resume)
  if [ ! -f "$O/$run.done" ] || [ "$(cat "$O/$run.done")" != "$STEPS" ]; then
    $J train "${COMMON[@]}" "${flags[@]}" "${resume[@]}" --out "$O/$run" | tee "$O/$run.json"
    echo "$STEPS" > "$O/$run.done"
  fi
done
