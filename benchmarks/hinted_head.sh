#!/usr/bin/env bash
# Hinted and copying heads: data, training and evaluation, end to end; every stage resumes when rerun.
#   bash benchmarks/hinted_head.sh [LEG ...]     (default: every leg, in this order)
# Legs: hinted, control, hinted-more (a head that reads the lookup hint as an input), copy (the
# shipped head, frozen, plus a copy gate that mixes the hint into its draft distribution),
# hinted-copy (both, trained from the shipped head). STEPS (env, default 500) scales every leg.
# Data (the target's own greedy answers, bf16, SGLang Engine) under $JETFLOW_HOME/data:
# python-stdlib code prompts past the 2,000 the shipped head trained on, ShareGPT train prompts
# past 9,000, and the validation slice (held-out metrics at each checkpoint). The control is the
# hinted leg's run without hints, so that more training on code is not credited to the hints.
# Outputs under out/hinted/.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-500}
LEGS=("$@")
[ ${#LEGS[@]} -gt 0 ] || LEGS=(hinted control hinted-more copy hinted-copy)
J=.venv/bin/jetflow
D=${JETFLOW_HOME:-$HOME/.cache/jetflow}/data
O=out/hinted
mkdir -p "$O"
$J regenerate --prompts sharegpt-validation --max-new-tokens 256 --dtype bfloat16 --out "$D/sharegpt-validation-regen"
$J regenerate --prompts python-stdlib --skip 2000 --limit 500 --max-new-tokens 256 --dtype bfloat16 --out "$D/stdlib-regen-2000"
$J regenerate --prompts sharegpt --skip 9000 --limit 250 --max-new-tokens 256 --dtype bfloat16 --out "$D/sharegpt-regen-9000"
DATA=(--data "$D/stdlib-regen-2000,$D/sharegpt-regen-9000" --val-data "$D/sharegpt-validation-regen"
      --anchor-fraction 0.25 --draft-vocab 16384 --depth-decay 4 --reveal 0.1 --val-blocks 512 --mask causal
      --layers 2 --batch-tokens 2048)
run_leg() {  # NAME STEPS, then its flags: trains once to STEPS (resumes), records $O/NAME.done
  local run=$1 steps=$2; shift 2
  local resume=(); [ -f "$O/$run/train_state.json" ] && resume=(--resume)
  if [ ! -f "$O/$run.done" ] || [ "$(cat "$O/$run.done")" != "$steps" ]; then
    $J train "$@" --steps "$steps" "${resume[@]}" --out "$O/$run" | tee "$O/$run.json"
    echo "$steps" > "$O/$run.done"
  fi
}
for leg in "${LEGS[@]}"; do
  case $leg in
    hinted) run_leg hinted "$STEPS" --init-head default --lr 3e-4 --warmup-steps 30 --checkpoint-every 100 "${DATA[@]}" --lookup-hint ;;
    control) run_leg control "$STEPS" --init-head default --lr 3e-4 --warmup-steps 30 --checkpoint-every 100 "${DATA[@]}" ;;
    # The hinted head's held-out chain tau still rose at its last checkpoint: continue it, twice the
    # steps at twice the peak learning rate (the hint path starts from zero), on the same data.
    hinted-more) run_leg hinted-more $((2 * STEPS)) --init-head "$O/hinted" --lookup-hint --lr 6e-4 --warmup-steps 30 \
                   --checkpoint-every 250 "${DATA[@]}" ;;
    # The copy gate alone (a few hundred weights) on the frozen shipped head (--lr 0).
    copy) run_leg copy $((STEPS * 3 / 5)) --init-head default --copy-gate --lr 0 --copy-lr 1e-2 --warmup-steps 10 \
            --checkpoint-every 100 "${DATA[@]}" ;;
    # Hint input and copy gate together, from the shipped head.
    hinted-copy) run_leg hinted-copy $((3 * STEPS)) --init-head default --lookup-hint --copy-gate --lr 6e-4 --copy-lr 1e-2 \
                   --warmup-steps 30 --checkpoint-every 250 "${DATA[@]}" ;;
    *) echo "hinted_head.sh: unknown leg $leg (hinted, control, hinted-more, copy, hinted-copy)" >&2; exit 2 ;;
  esac
done
