#!/usr/bin/env bash
# Run this worker's process of a training job (launch.sh starts it on every worker at once).
#
# Usage: tpu_scripts/worker_run.sh [options] -- MAIN_FLAGS...
#
#   --port PORT        jax.distributed coordinator port on worker 0 (default 8476)
#   --worker-id N      this worker's index (default: the TPU VM metadata's agent-worker-number)
#   --endpoints LIST   the slice's workers in order, comma separated, each 'host' or
#                      'name:id:ip' (default: the metadata's worker-network-endpoints)
#   --python PATH      interpreter (default: $HOME/envace/venv/bin/python)
#   --dry-run          print the command (with its environment) instead of running it
#   --help             this text
#
# On a multi-host slice it sets JAX_COORDINATOR_ADDRESS (worker 0's address and PORT),
# JAX_NUM_PROCESSES and JAX_PROCESS_ID; envace_jax.main hands them to jax.distributed.initialize
# before anything touches a device. On one host the job runs as a single process.
#
# Example (what launch.sh runs on each worker):
#   bash tpu_scripts/worker_run.sh -- --config=configs/qwen3_8b.py:v5p-32 \
#       --workdir="$HOME/envace/runs/r1"

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "port worker-id endpoints python" "" "$@"
((${#EXTRA[@]})) || die "give the job's flags after --, e.g. -- --config=... --workdir=..."
port=${OPT_PORT:-8476}
[[ $port =~ ^[0-9]+$ ]] || die "--port '$port': expected a number"

metadata() {
  curl -sf -H 'Metadata-Flavor: Google' \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" ||
    die "cannot read TPU VM metadata '$1' (not on a TPU VM?); pass --worker-id and --endpoints"
}

worker=${OPT_WORKER_ID:-}
[[ -n $worker ]] || worker=$(metadata agent-worker-number)
endpoints=${OPT_ENDPOINTS:-}
[[ -n $endpoints ]] || endpoints=$(metadata worker-network-endpoints)
[[ $worker =~ ^[0-9]+$ ]] || die "worker id '$worker': expected a number"

IFS=, read -r -a workers <<<"$endpoints"
hosts=()
for entry in "${workers[@]}"; do
  IFS=: read -r -a parts <<<"$entry"
  case ${#parts[@]} in
    1) hosts+=("${parts[0]}") ;;
    3) hosts+=("${parts[2]}") ;;
    *) die "worker endpoint '$entry': expected 'host' or 'name:id:ip'" ;;
  esac
done
((${#hosts[@]})) || die "no worker endpoints in '$endpoints'"
((worker < ${#hosts[@]})) || die "worker id $worker is not below the ${#hosts[@]} workers"

python=${OPT_PYTHON:-$HOME/envace/venv/bin/python}
command=(env)
if ((${#hosts[@]} > 1)); then
  command+=(JAX_COORDINATOR_ADDRESS="${hosts[0]}:$port" JAX_NUM_PROCESSES="${#hosts[@]}"
    JAX_PROCESS_ID="$worker")
fi
command+=("$python" -m envace_jax.main "${EXTRA[@]}")
note "worker $worker of ${#hosts[@]}"
if ((DRY_RUN)); then
  quote "${command[@]}"
else
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  exec "${command[@]}"
fi
