#!/usr/bin/env bash
# Show or stream a run's log from one worker (worker 0 writes the metrics and progress lines).
#
# Usage: tpu_scripts/logs.sh --name NAME --zone ZONE --run RUN [options]
#
#   --name NAME        TPU name
#   --zone ZONE        its zone
#   --project PROJECT  default: gcloud's configured project
#   --run RUN          the run name given to launch.sh
#   --worker N|all     which worker's log (default 0)
#   --lines N          how many last lines to show (default 100)
#   --follow           keep streaming new lines (Ctrl-C stops watching, not the run)
#   --dry-run          print the gcloud command instead of running it
#   --help             this text
#
# Example:
#   tpu_scripts/logs.sh --name envace-v5p --zone us-east5-a --run qwen3-8b-r1 --follow

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project run worker lines" "follow" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
require run "${OPT_RUN:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
check_run "$OPT_RUN"
worker=${OPT_WORKER:-0}
[[ $worker == all || $worker =~ ^[0-9]+$ ]] || die "--worker '$worker': expected a number or all"
lines=${OPT_LINES:-100}
[[ $lines =~ ^[0-9]+$ ]] || die "--lines '$lines': expected a number"
gcloud_common

tail_flags="-n $lines"
[[ ${OPT_FOLLOW:-0} == 1 ]] && tail_flags+=" -F"
remote="tail $tail_flags \"\$HOME/envace/logs/$OPT_RUN.log\""
run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker="$worker" "${GCLOUD_COMMON[@]}" \
  --command="$remote"
