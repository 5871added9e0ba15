#!/bin/bash
# The iso-compute study's runs (protocol.md): 29 cells x 3 independent seeds on the ladder's
# size-l testbed, then each finished run stored and the analysis. From the repository root:
#
#   WARM=/tmp/ladder/l_s0 bash experiments/iso_compute_v2/run.sh ROOT
#
# WARM: a workdir holding the ladder's size-l SFT warm start (configs/ladder.py:size=l, e.g.
# experiments/ladder/run.sh's l_s0). The sweep skips finished runs, so the script resumes
# after an interruption; `store` alone stores what has finished so far:
#
#   bash experiments/iso_compute_v2/run.sh ROOT store
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [store]}
PY=${PYTHON:-python}
STUDY=experiments/iso_compute_v2
if [ "${2:-}" != store ]; then
  $PY tools/sweep.py --config configs/ladder.py:size=l --workdir "$ROOT" \
    --budgets 2048,8192,32768 --rollouts 2,4,8,16,32 --prompts 8,32 --min_steps 4 \
    --evals 2 --seeds 3 --set sft.reuse_from="${WARM:?set WARM to the size-l warm start}"
fi
for dir in "$ROOT"/C*__seed_*; do
  [ -f "$dir/summary.json" ] && $PY "$STUDY/store.py" "$dir"
done
$PY "$STUDY/analyze.py"
