#!/bin/sh
# The study's runs: the tool and no-tool arms of configs/tool_rl.py, two seeds each, from one
# warm start (the first run's, reused by the others). Then copy each run's metrics.jsonl into
# experiments/tool_rl/runs/NAME/ and run analyze.py. Run from the repository root.
set -e
W=${1:-/tmp/rlscale_tool_rl}
run() {
  name=$1; shift
  /usr/bin/time -f "$name %e s" python -m rlscale.main --config "$@" --workdir "$W/$name"
  mkdir -p "experiments/tool_rl/runs/$name"
  cp "$W/$name/metrics.jsonl" "experiments/tool_rl/runs/$name/"
}
run tool_s0 configs/tool_rl.py ${WARM:+--config.sft.reuse_from=$WARM}  # WARM: a warm start to reuse
run tool_s1 configs/tool_rl.py --config.seed=1 --config.sft.reuse_from="$W/tool_s0"
run notool_s0 configs/tool_rl.py:tool=False --config.sft.reuse_from="$W/tool_s0"
run notool_s1 configs/tool_rl.py:tool=False --config.seed=1 --config.sft.reuse_from="$W/tool_s0"
