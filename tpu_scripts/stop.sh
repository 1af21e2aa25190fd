#!/usr/bin/env bash
# Stop a run on every worker (the processes launch.sh started), optionally the VM too.
#
# Usage: tpu_scripts/stop.sh --name NAME --zone ZONE --run RUN [options]
#
#   --name NAME        TPU name
#   --zone ZONE        its zone
#   --project PROJECT  default: gcloud's configured project
#   --run RUN          the run name given to launch.sh
#   --vm               also stop the TPU VM (single-host VMs only; pod slices are deleted
#                      with delete.sh instead). A stopped VM keeps its disk.
#   --dry-run          print the gcloud commands instead of running them
#   --help             this text
#
# Each worker signals the process whose id launch.sh recorded ($HOME/envace/logs/RUN.pid).
# Checkpoints already written stay; launching the same run again resumes from the newest.
#
# Example:
#   tpu_scripts/stop.sh --name envace-v5p --zone us-east5-a --run qwen3-8b-r1

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project run" "vm" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
require run "${OPT_RUN:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
check_run "$OPT_RUN"
gcloud_common

pid="\$HOME/envace/logs/$OPT_RUN.pid"
remote="if [ -f \"$pid\" ] && kill -0 \"\$(cat \"$pid\")\" 2>/dev/null; then
  kill -TERM \"\$(cat \"$pid\")\"
  echo \"stopped $OPT_RUN on \$(hostname)\"
else
  echo \"$OPT_RUN is not running on \$(hostname)\"
fi"
run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker=all "${GCLOUD_COMMON[@]}" \
  --command="$remote"
if [[ ${OPT_VM:-0} == 1 ]]; then
  run gcloud compute tpus tpu-vm stop "$OPT_NAME" "${GCLOUD_COMMON[@]}"
fi
