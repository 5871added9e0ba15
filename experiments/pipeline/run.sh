#!/bin/bash
# Synchronous vs PipelineRL (k = 1, 4, 8) vs async PPO (k = 8) on the quickstart task; see
# README.md here.
#
#   bash experiments/pipeline/run.sh ROOT [SEEDS] [EXTRA]   e.g. ROOT=/tmp/pipeline SEEDS="0 1"
#
# Every run is `rlscale.main` on configs/quickstart.py (80 steps of 32 prompts x 8 samples)
# with one pipeline setting; all share the first run's SFT warm start (sft.reuse_from), RL
# seeds vary with --config.seed, and EXTRA (e.g. "--config.pipeline.generator_devices=1",
# with XLA_FLAGS giving 2 host devices) is passed to every run. Finished runs are skipped,
# so the script can be re-run after an interruption. Then fits every run.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [SEEDS] [EXTRA]}
SEEDS=${2:-0}
EXTRA=${3:-}
PY=${PYTHON:-python}
RUNS=(
  "sync:"
  "pipeline_k1:--config.pipeline.mode=pipeline --config.pipeline.max_staleness=1"
  "pipeline_k4:--config.pipeline.mode=pipeline --config.pipeline.max_staleness=4"
  "pipeline_k8:--config.pipeline.mode=pipeline --config.pipeline.max_staleness=8"
  "async_ppo_k8:--config.pipeline.mode=async_ppo --config.pipeline.max_staleness=8"
)
WARM=$ROOT/sync_s0
mkdir -p "$ROOT/logs"
for seed in $SEEDS; do
  for run in "${RUNS[@]}"; do
    name=${run%%:*}; flags=${run#*:}
    dir=$ROOT/${name}_s$seed
    [ -f "$dir/summary.json" ] && continue
    reuse=()
    [ "$dir" != "$WARM" ] && reuse=(--config.sft.reuse_from="$WARM")
    echo "== $name seed $seed"
    # shellcheck disable=SC2086  # The flags are separate words.
    $PY -m rlscale.main --config configs/quickstart.py --workdir "$dir" \
      --config.seed="$seed" "${reuse[@]}" $flags $EXTRA > "$ROOT/logs/${name}_s$seed.log" 2>&1
    grep -E "eval_pass@1|scaling fit" "$ROOT/logs/${name}_s$seed.log" || true
  done
done
$PY tools/fit_scaling.py "$ROOT"/*_s* --out "$ROOT/fits" --y eval/pass@1
