#!/bin/bash
# The off-policy study's runs (protocol.md): 9 arms x 6 seeds (0-5, fixed in the protocol) of
# experiments/off_policy/config.py on the ladder's size-l testbed, pipeline mode k = 8, a
# bfloat16 generator. Run from the repository root:
#
#   bash experiments/off_policy/run.sh ROOT [SEEDS] [ARMS]
#       e.g. bash experiments/off_policy/run.sh /tmp/off_policy
#
# Workdirs go to ROOT/ARM_sSEED; every run shares one SFT warm start (sft.reuse_from): $WARM
# if given, else ROOT/none_s0's (the first run builds it). Order: seed by seed, every arm of
# a seed before the next seed, so an interrupted study has whole seeds. A finished run
# (summary.json) is skipped, so the script can be re-run after an interruption. Each finished
# run is stored at once as experiments/off_policy/runs/ARM_sSEED.jsonl (store.py). Then
# analyze.py writes results.json and the plots.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [SEEDS] [ARMS]}
SEEDS=${2:-"0 1 2 3 4 5"}
ARMS=${3:-"none tis generator_ratio icepop masked_is geometric_rejection k3_rejection m2po rollout_kl"}
PY=${PYTHON:-python}
STUDY=experiments/off_policy
WARM=${WARM:-$ROOT/none_s0}
mkdir -p "$ROOT/logs"
for seed in $SEEDS; do
  for arm in $ARMS; do
    dir=$ROOT/${arm}_s$seed
    if [ ! -f "$dir/summary.json" ]; then
      reuse=()
      [ "$dir" != "$WARM" ] && reuse=(--config.sft.reuse_from="$WARM")
      echo "== $arm seed $seed"
      /usr/bin/time -f "${arm}_s$seed %e s" -a -o "$ROOT/logs/times.txt" \
        $PY -m rlscale.main --config "$STUDY/config.py:arm=$arm" --workdir "$dir" \
        --config.seed="$seed" "${reuse[@]}" > "$ROOT/logs/${arm}_s$seed.log" 2>&1
    fi
    $PY "$STUDY/store.py" "$dir"
  done
done
$PY "$STUDY/analyze.py" --plot "$STUDY/curves.png"
