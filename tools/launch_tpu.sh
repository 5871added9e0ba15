#!/usr/bin/env bash
# Runs one command on every worker of a Cloud TPU VM slice (docs/pods_and_planning.md,
# "Running on a pod").
#
# Creates the slice, or reuses it when it is up (a preempted or stopped slice is deleted and
# created again), copies this checkout's committed tree to every worker, installs it with the
# TPU extra, and runs COMMAND on all workers at once from the checkout. On a TPU VM JAX finds
# its peers itself (TPU_WORKER_HOSTNAMES), so `python -m rlscale.main` joins the multi-host job
# with no further settings. Running the same line again after a preemption recreates the
# slice and resumes the run from the latest checkpoint in its --workdir, which must be storage
# every worker sees and that outlives the slice (a Filestore share, a gcsfuse mount: -m).
#
# Usage: tools/launch_tpu.sh -n NAME -z ZONE -t TYPE [-v RUNTIME] [-p PROJECT] [-s]
#                            [-m SETUP_COMMAND] -- COMMAND...
#   -n  the slice's name            -t  accelerator type (v5p-32, v6e-16, ...)
#   -z  the zone                    -v  TPU VM runtime (default: the one Google lists for TYPE)
#   -p  the gcloud project          -s  a spot (preemptible) slice
#   -m  run on every worker after installing (mount the shared workdir, say)
# Example:
#   tools/launch_tpu.sh -n rl -z us-east5-b -t v6e-16 -s \
#       -m 'sudo mkdir -p /mnt/runs && sudo mount 10.0.0.2:/runs /mnt/runs' -- \
#       python -m rlscale.main --config configs/scalerl.py --workdir /mnt/runs/scalerl
set -euo pipefail

usage() {
  sed -n '/^# Usage:/,/^#   -m/p' "$0" | cut -c3- >&2
  exit 2
}

name="" zone="" type="" runtime="" project="" spot="" setup=""
while getopts "n:z:t:v:p:m:s" opt; do
  case "$opt" in
    n) name="$OPTARG" ;;
    z) zone="$OPTARG" ;;
    t) type="$OPTARG" ;;
    v) runtime="$OPTARG" ;;
    p) project="$OPTARG" ;;
    m) setup="$OPTARG" ;;
    s) spot=1 ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift
for required in name zone type; do
  if [[ -z "${!required}" ]]; then
    echo "error: -${required:0:1} (${required}) is required" >&2
    usage
  fi
done
(($#)) || { echo "error: no COMMAND after --" >&2 && usage; }
if [[ -z "$runtime" ]]; then # cloud.google.com/tpu/docs/runtimes, for JAX.
  case "$type" in
    v6e-*) runtime="v2-alpha-tpuv6e" ;;
    v5p-*) runtime="v2-alpha-tpuv5" ;;
    v5litepod-* | v5e-*) runtime="v2-alpha-tpuv5-lite" ;;
    *) runtime="tpu-ubuntu2204-base" ;;
  esac
fi

tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
[[ -n "$project" ]] && where+=(--project "$project")

state=$("${tpu[@]}" describe "$name" "${where[@]}" --format='value(state)' 2>/dev/null || true)
case "$state" in
  PREEMPTED | TERMINATED | STOPPED)
    echo "slice $name is $state: deleting it to create it again" >&2
    "${tpu[@]}" delete "$name" "${where[@]}" --quiet
    state=""
    ;;
esac
if [[ -z "$state" ]]; then
  create=(create "$name" "${where[@]}" --accelerator-type "$type" --version "$runtime")
  [[ -n "$spot" ]] && create+=(--spot)
  "${tpu[@]}" "${create[@]}"
fi

# The committed tree (what a resumed run will run again), not uncommitted edits.
archive=$(mktemp --suffix=.tar.gz)
trap 'rm -f "$archive"' EXIT
git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
"${tpu[@]}" scp "$archive" "$name:rlscale.tar.gz" "${where[@]}" --worker=all
install="rm -rf rlscale && mkdir rlscale && tar -xzf rlscale.tar.gz -C rlscale"
install+=" && python3 -m pip install -q -e './rlscale[tpu]'"
[[ -n "$setup" ]] && install+=" && $setup"
"${tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$install"
"${tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "cd rlscale && ${*@Q}"
