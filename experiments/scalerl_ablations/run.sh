#!/bin/bash
# The ScaleRL loss comparison and leave-one-out at small scale; see README.md here.
#
#   bash experiments/scalerl_ablations/run.sh ROOT [SEEDS] [BASE] [NAMES]
#       e.g. ROOT=/tmp/ablations SEEDS="0 1"
#
# Every run is `rlscale.main` on configs/scalerl.py:BASE (default `sync`: the synchronous loop
# with 4 optimizer steps per batch, as measured on the quickstart task; `testbed=l`: pipeline
# mode on the ladder's size-l testbed) with one variant; NAMES (default: all) picks runs from
# the list below. All runs share one SFT warm start (sft.reuse_from): the first run's, or
# $WARM (e.g. the ladder's ROOT/l_s0). RL seeds vary with --config.seed. Finished runs
# are skipped, so the script can be re-run after an interruption. Then fits every run.
# Not run: drop=no_positive_resampling and drop=interruption. Both are exactly void at this
# scale: 80 steps x 32 prompts see fewer prompts than one epoch of the 4000 (a retired prompt
# would only be skipped in a later epoch), and no completion reaches the 24-token thinking
# budget (train/interrupted_frac is 0 throughout), so those runs equal the full recipe.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [SEEDS]}
SEEDS=${2:-0}
BASE=${3:-sync}
NAMES=${4:-}
PY=${PYTHON:-python}
RUNS=(
  "full:"
  "loss_ppo_clip:loss=ppo_clip"
  "loss_gspo:loss=gspo"
  "minus_prompt_mean:drop=prompt_mean"
  "minus_batch_std:drop=batch_std"
  "minus_zero_variance:drop=zero_variance"
  "bf16_full:bf16"
  "bf16_minus_fp32_head:drop=fp32_head,bf16"
)
WARM=${WARM:-$ROOT/full_s0}
mkdir -p "$ROOT/logs"
for seed in $SEEDS; do
  for run in "${RUNS[@]}"; do
    name=${run%%:*}; variant=${run#*:}
    [ -n "$NAMES" ] && [[ " $NAMES " != *" $name "* ]] && continue
    dir=$ROOT/${name}_s$seed
    [ -f "$dir/summary.json" ] && continue
    reuse=()
    [ "$dir" != "$WARM" ] && reuse=(--config.sft.reuse_from="$WARM")
    echo "== $name seed $seed"
    $PY -m rlscale.main --config "configs/scalerl.py:$BASE${variant:+,$variant}" --workdir "$dir" \
      --config.seed="$seed" "${reuse[@]}" > "$ROOT/logs/${name}_s$seed.log" 2>&1
    grep -E "eval_pass@1|scaling fit" "$ROOT/logs/${name}_s$seed.log" || true
  done
done
# Fit each run on its first half of compute and check the prediction on the second half.
$PY tools/fit_scaling.py "$ROOT"/*_s* --out "$ROOT/fits" --y eval/pass@1 --fit-until-frac 0.5
