#!/usr/bin/env bash
# The hinted head's data, training and evaluation, end to end; every stage resumes when rerun.
#   bash benchmarks/hinted_head.sh [STEPS]
# Data (the target's own greedy answers, bf16, SGLang Engine) under $JETFLOW_HOME/data:
# python-stdlib code prompts past the 2,000 the shipped head trained on, ShareGPT train prompts
# past 9,000, and the validation slice (held-out metrics at each checkpoint). Then, from the
# shipped head, the same steps twice: a hinted head (--lookup-hint) and a control without hints,
# so that more training on code is not credited to the hints; then the hinted head continued
# (hinted-more). Outputs under out/hinted/.
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
        --lr 3e-4 --warmup-steps 30 --anchor-fraction 0.25 --draft-vocab 16384 --depth-decay 4
        --reveal 0.1 --checkpoint-every 100 --val-blocks 512 --mask causal --layers 2 --batch-tokens 2048)
run_leg() {  # NAME STEPS, then its flags: trains once to STEPS (resumes), records $O/NAME.done
  local run=$1 steps=$2; shift 2
  local resume=(); [ -f "$O/$run/train_state.json" ] && resume=(--resume)
  if [ ! -f "$O/$run.done" ] || [ "$(cat "$O/$run.done")" != "$steps" ]; then
    $J train "$@" --steps "$steps" "${resume[@]}" --out "$O/$run" | tee "$O/$run.json"
    echo "$steps" > "$O/$run.done"
  fi
}
run_leg hinted "$STEPS" "${COMMON[@]}" --lookup-hint
run_leg control "$STEPS" "${COMMON[@]}"
# The hinted head's held-out chain tau still rose at its last checkpoint: continue it, twice the
# steps at twice the peak learning rate (the hint path starts from zero), on the same data.
MORE=(--data "$D/stdlib-regen-2000,$D/sharegpt-regen-9000" --val-data "$D/sharegpt-validation-regen"
      --anchor-fraction 0.25 --draft-vocab 16384 --depth-decay 4 --reveal 0.1 --checkpoint-every 250
      --val-blocks 512 --mask causal --layers 2 --batch-tokens 2048)
run_leg hinted-more $((2 * STEPS)) --init-head "$O/hinted" --lookup-hint --lr 6e-4 --warmup-steps 30 "${MORE[@]}"
