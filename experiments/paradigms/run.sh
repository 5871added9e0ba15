#!/bin/bash
# Training paradigms on one compute axis, and test-time scaling; README.md here.
#
#   bash experiments/paradigms/run.sh ROOT [SEEDS] [ROWS]      e.g. ROOT=/tmp/paradigms
#
# Rows (each the quickstart's task, policy and warm start, 80 steps, one per seed):
#   online         configs/quickstart.py: online RL with the verifier's reward (CISPO, GRPO
#                  group advantages scaled by the batch std)
#   offline_dpo    configs/dpo.py: DPO on pairs made once from the warm start's samples
#   iterative_dpo  configs/iterative_dpo.py: DPO rounds on the current policy's pairs
#   distill        configs/distill.py: on-policy distillation from online seed 0's policy
#   rm_rl          configs/rm_rl.py: online RL rewarded by a reward model made from the warm
#                  start's pairs (RLMT-style); the verifier only measures
#   prm_rl         online, plus a PRM's step rewards (process_advantages(mix=add))
# The PRM: Monte-Carlo step labels of online seed 0's samples (4 continuations per step
# prefix, by that policy), a PRM trained on them from the warm start. Test-time scaling: the
# warm start and online seed 0's policy, 64 samples of 200 held-out problems, best-of-N under
# the policy's logprob, the reward model (rm_rl seed 0's) and the PRM (min, last, product);
# and PRM-guided step search (beam 4, 4 expansions) against best-of-16 (16 samples each).
# WARM=DIR reuses a quickstart workdir's warm start (its data, tokenizer and SFT) for every
# run; without it, online seed 0 trains it. Finished parts are skipped: re-run to resume.
set -euo pipefail
ROOT=${1:?usage: run.sh ROOT [SEEDS] [ROWS]}
SEEDS=${2:-0 1 2}
ROWS=${3:-online offline_dpo iterative_dpo distill rm_rl prm_rl}
PY=${PYTHON:-python}
mkdir -p "$ROOT/logs"
PRM_CHAIN="group_advantages(scale=batch_std) | process_advantages(mix=add, coef=0.5)"
PRM_CHAIN+=" | token_ratio | cispo(eps_max=4.0) | aggregate(mode=prompt_mean)"

run() {  # run NAME CONFIG [OVERRIDES...]
  local name=$1 config=$2
  shift 2
  [ -f "$ROOT/$name/summary.json" ] && return
  local warm=${WARM:-$ROOT/online_s0}
  local reuse=(--config.sft.reuse_from="$warm")
  [ "$name" = online_s0 ] && [ -z "${WARM:-}" ] && reuse=()
  echo "== $name"
  $PY -m rlscale.main --config "$config" --workdir "$ROOT/$name" "${reuse[@]}" "$@" \
    > "$ROOT/logs/$name.log" 2>&1
}

prm() {  # The PRM, from online seed 0's policy.
  [ -f "$ROOT/prm/process_reward.json" ] && return
  run online_s0 configs/quickstart.py --config.seed=0
  echo "== prm"
  [ -f "$ROOT/prm_labels.jsonl" ] || $PY -m rlscale.main.label_steps \
    --config configs/quickstart.py --checkpoint "$ROOT/online_s0/final" \
    --n 500 --k 4 --rollouts 4 --delimiter "=" --out "$ROOT/prm_labels.jsonl" > "$ROOT/logs/prm_label.log" 2>&1
  $PY -m rlscale.main.train_prm --labels "$ROOT/prm_labels.jsonl" --heldout_frac 0.1 \
    --init "$ROOT/online_s0/sft" --steps 300 --lr 1e-4 --out "$ROOT/prm" \
    > "$ROOT/logs/prm_train.log" 2>&1
}

for seed in $SEEDS; do
  for row in $ROWS; do
    s=(--config.seed="$seed")
    case $row in
      online) run "online_s$seed" configs/quickstart.py "${s[@]}" ;;
      offline_dpo) run "offline_dpo_s$seed" configs/dpo.py "${s[@]}" ;;
      iterative_dpo) run "iterative_dpo_s$seed" configs/iterative_dpo.py "${s[@]}" ;;
      distill)
        run online_s0 configs/quickstart.py --config.seed=0
        run "distill_s$seed" configs/distill.py "${s[@]}" \
          --config.teacher.checkpoint="$ROOT/online_s0/final" ;;
      rm_rl) run "rm_rl_s$seed" configs/rm_rl.py "${s[@]}" ;;
      prm_rl)
        prm
        run "prm_rl_s$seed" configs/quickstart.py "${s[@]}" --config.reward.prm="$ROOT/prm" \
          --config.objective.chain="$PRM_CHAIN" ;;
      *) echo "unknown row $row" >&2; exit 2 ;;
    esac
  done
done

# Test-time scaling of the warm start and the RL-trained policy.
if [ -d "$ROOT/prm" ] && [ -d "$ROOT/rm_rl_s0/reward_model" ]; then
  for ckpt in sft final; do
    out=$ROOT/test_time_$ckpt.json
    [ -f "$out" ] || $PY -m rlscale.main.evaluate --config configs/quickstart.py \
      --checkpoint "$ROOT/online_s0/$ckpt" --k 64 --n 200 \
      --best_of 1,2,4,8,16,32,64 --scorer logprob,reward_model,prm \
      --reward_model "$ROOT/rm_rl_s0/reward_model" --prm "$ROOT/prm" \
      --prm_aggregation min,last,product \
      --output "$out" --plot "$ROOT/test_time_$ckpt.png" > "$ROOT/logs/test_time_$ckpt.log" 2>&1
    # PRM-guided step search (beam 4 x 4 expansions) against best-of-16 at about equal tokens.
    out=$ROOT/step_search_$ckpt.json
    [ -f "$out" ] || $PY -m rlscale.main.evaluate --config configs/quickstart.py \
      --checkpoint "$ROOT/online_s0/$ckpt" --k 16 --n 200 --best_of 1,2,4,8,16 \
      --scorer logprob,prm --prm "$ROOT/prm" --prm_aggregation last --step_search 4,4 \
      --output "$out" --plot "$ROOT/step_search_$ckpt.png" > "$ROOT/logs/step_search_$ckpt.log" 2>&1
  done
fi
$PY experiments/paradigms/analyze.py "$ROOT"
