#!/bin/bash
# The model-size ladder: every size with each RL seed, evaluated, then the fits; README.md here.
#
#   bash experiments/ladder/run.sh ROOT [SEEDS] [SIZES]    e.g. ROOT=/tmp/ladder SEEDS="0 1 2"
#
# Each size's seed-0 run trains its SFT warm start; its other seeds share it (sft.reuse_from)
# and vary only the RL seed. Finished runs are skipped, so the script can be re-run after an
# interruption. Each warm start and final policy is also scored by `rlscale.main.evaluate` (500
# held-out problems x 4 samples: `answered` and `accuracy_answered` tell format from skill).
# Then: Tan et al.'s law over all sizes, with the largest held out (inter-model prediction),
# and every run's own first-half prediction (WORKDIR/scaling/fit.json) in one table.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [SEEDS] [SIZES]}
SEEDS=${2:-0 1 2}
SIZES=${3:-xs s m l xl}
PY=${PYTHON:-python}
mkdir -p "$ROOT/logs"
for seed in $SEEDS; do
  for size in $SIZES; do
    dir=$ROOT/${size}_s$seed
    if [ ! -f "$dir/summary.json" ]; then
      reuse=()
      [ "$seed" != 0 ] && reuse=(--config.sft.reuse_from="$ROOT/${size}_s0")
      echo "== $size seed $seed"
      $PY -m rlscale.main --config "configs/ladder.py:size=$size" --workdir "$dir" \
        --config.seed="$seed" "${reuse[@]}" > "$ROOT/logs/${size}_s$seed.log" 2>&1
    fi
    for ckpt in sft final; do
      [ "$ckpt" = sft ] && [ "$seed" != 0 ] && continue  # One warm start per size.
      out=$dir/eval_$ckpt.json
      [ -f "$out" ] || $PY -m rlscale.main.evaluate --config "configs/ladder.py:size=$size" \
        --checkpoint "$dir/$ckpt" --k 4 --n 500 --output "$out" > /dev/null
    done
  done
done
largest=$ROOT/${SIZES##* }_s0
$PY tools/fit_scaling.py --law tan "$ROOT"/*_s[0-9]* --out "$ROOT/tan" \
  --holdout-size "$($PY -c "from rlscale.scaling import runs; print(runs.model_size('$largest'))")"
$PY experiments/ladder/analyze.py "$ROOT"
