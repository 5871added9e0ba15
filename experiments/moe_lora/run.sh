#!/bin/bash
# The MoE/LoRA study's runs (protocol.md), on the ladder's size-l testbed, seeds fixed in the
# protocol. Run from the repository root:
#
#   bash experiments/moe_lora/run.sh ROOT [PARTS]      e.g. bash experiments/moe_lora/run.sh /tmp/ml "c a b"
#
# PARTS (default "c a b", the protocol's order) picks the sub-studies:
#   a  a_dense_sS, a_moe_sS for S in SEEDS (0-5): synchronous, fp32, equal active parameters.
#   b  b_replay_on_sS, b_replay_off_sS (0-5): the MoE in pipeline mode, k = 8, bf16 generator;
#      needs `learner.router_replay` (until it lands, config resolution refuses the runs).
#   c  the sweep c_sweep_METHOD_lrLR_sS (S in 0 1; METHOD full, r1, r8, r64; three rates
#      each), then c_confirm_METHOD_lrLR_sS at each method's selected rate (analyze.py
#      --select, from the stored sweep runs) for S in CONFIRM_SEEDS (10-15).
# Workdirs go to ROOT/NAME. The dense runs share one SFT warm start ($WARM_DENSE, else the
# first dense run's) and the MoE runs another ($WARM_MOE, else a_moe_s0's, or the first MoE
# run made). A finished run (summary.json) is skipped, so the script can be re-run after an
# interruption; each finished run is stored at once as experiments/moe_lora/runs/NAME.jsonl
# (store.py). Then analyze.py writes results.json and the plots.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [PARTS]}
PARTS=${2:-"c a b"}
SEEDS=${SEEDS:-"0 1 2 3 4 5"}
SWEEP_SEEDS=${SWEEP_SEEDS:-"0 1"}
CONFIRM_SEEDS=${CONFIRM_SEEDS:-"10 11 12 13 14 15"}
PY=${PYTHON:-python}
STUDY=experiments/moe_lora
WARM_DENSE=${WARM_DENSE:-}
WARM_MOE=${WARM_MOE:-}
declare -A LRS=([full]="2.5e-5 7.5e-5 2.25e-4" [r1]="2.5e-4 7.5e-4 2.25e-3"
  [r8]="2.5e-4 7.5e-4 2.25e-3" [r64]="2.5e-4 7.5e-4 2.25e-3")
declare -A RANK=([full]=0 [r1]=1 [r8]=8 [r64]=64)
mkdir -p "$ROOT/logs"

# run NAME WARMVAR SEED VARIANT: one run, its warm start from (or made into) $WARMVAR.
run() {
  local name=$1 warmvar=$2 seed=$3 variant=$4 dir=$ROOT/$1
  if [ ! -f "$dir/summary.json" ]; then
    local reuse=()
    [ -n "${!warmvar}" ] && [ "${!warmvar}" != "$dir" ] && reuse=(--config.sft.reuse_from="${!warmvar}")
    echo "== $name"
    /usr/bin/time -f "$name %e s" -a -o "$ROOT/logs/times.txt" \
      $PY -m rlscale.main --config "$STUDY/config.py:$variant" --workdir "$dir" \
      --config.seed="$seed" "${reuse[@]}" > "$ROOT/logs/$name.log" 2>&1
  fi
  [ -z "${!warmvar}" ] && printf -v "$warmvar" %s "$dir"
  $PY "$STUDY/store.py" "$dir"
}

for part in $PARTS; do
  case $part in
    a) for s in $SEEDS; do
         run "a_dense_s$s" WARM_DENSE "$s" arm=dense
         run "a_moe_s$s" WARM_MOE "$s" arm=moe
       done ;;
    b) for s in $SEEDS; do
         run "b_replay_on_s$s" WARM_MOE "$s" arm=replay_on
         run "b_replay_off_s$s" WARM_MOE "$s" arm=replay_off
       done ;;
    c) for s in $SWEEP_SEEDS; do
         for m in full r1 r8 r64; do
           for lr in ${LRS[$m]}; do
             run "c_sweep_${m}_lr${lr}_s$s" WARM_DENSE "$s" "arm=lora,lora_rank=${RANK[$m]},lr=$lr"
           done
         done
       done
       for m in full r1 r8 r64; do
         lr=$($PY "$STUDY/analyze.py" --select "$m")
         for s in $CONFIRM_SEEDS; do
           run "c_confirm_${m}_lr${lr}_s$s" WARM_DENSE "$s" "arm=lora,lora_rank=${RANK[$m]},lr=$lr"
         done
       done ;;
    *) echo "unknown part $part (a, b or c)" >&2; exit 1 ;;
  esac
done
$PY "$STUDY/analyze.py" --plot "$STUDY/curves.png"
