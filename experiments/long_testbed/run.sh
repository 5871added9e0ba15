#!/bin/bash
# The long-completion testbed's runs (protocol.md): the warm start's ceiling, then 5 seeds of
# the full ScaleRL recipe on configs/scalerl.py:testbed=long_m. From the repository root:
#
#   bash experiments/long_testbed/run.sh ROOT [SEEDS]
#       e.g. bash experiments/long_testbed/run.sh /tmp/long_testbed
#
# Workdirs go to ROOT/full_sSEED; every run shares one SFT warm start (sft.reuse_from): $WARM
# if given, else ROOT/full_s0's (the first run builds it). Once the warm start exists, its
# ceiling (pass@1 and pass@64 on 200 held-out problems) is measured once and stored as
# experiments/long_testbed/ceiling.json; the protocol's gate on it stops the script before
# any other seed. A finished run (summary.json) is skipped, so the script can be re-run after
# an interruption; each is stored at once as experiments/long_testbed/runs/full_sSEED.jsonl
# (store.py). Then analyze.py writes results.json and the plot.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [SEEDS]}
SEEDS=${2:-"0 1 2 3 4"}
PY=${PYTHON:-python}
STUDY=experiments/long_testbed
CONFIG=configs/scalerl.py:testbed=long_m
WARM=${WARM:-$ROOT/full_s0}
mkdir -p "$ROOT/logs"
for seed in $SEEDS; do
  dir=$ROOT/full_s$seed
  if [ ! -f "$dir/summary.json" ]; then
    reuse=()
    [ "$dir" != "$WARM" ] && reuse=(--config.sft.reuse_from="$WARM")
    echo "== full seed $seed"
    /usr/bin/time -f "full_s$seed %e s" -a -o "$ROOT/logs/times.txt" \
      $PY -m rlscale.main --config "$CONFIG" --workdir "$dir" --config.seed="$seed" \
      "${reuse[@]}" > "$ROOT/logs/full_s$seed.log" 2>&1
  fi
  $PY "$STUDY/store.py" "$dir"
  if [ ! -f "$STUDY/ceiling.json" ]; then
    $PY -m rlscale.main.evaluate --config "$CONFIG" --checkpoint "$WARM/sft" --k 64 --n 200 \
      --seed 0 --output "$STUDY/ceiling.json" > "$ROOT/logs/ceiling.log" 2>&1
  fi
  $PY "$STUDY/analyze.py" --results "$ROOT/results.json" > /dev/null  # The gate, read early.
  if ! $PY -c "import json, sys; sys.exit(json.load(open('$ROOT/results.json'))['numbers']['gate.ceiling'] < 1)"; then
    echo "the warm start fails the ceiling gate (protocol.md): no further seeds"
    break
  fi
done
$PY "$STUDY/analyze.py" --plot "$STUDY/curves.png"
