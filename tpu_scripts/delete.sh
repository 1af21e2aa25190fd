#!/usr/bin/env bash
# Delete a TPU VM or pod slice (and its queued resource). Workers' disks are lost: keep
# checkpoints in a gs:// bucket (launch.sh --bucket) and fetch results first (collect.sh).
#
# Usage: tpu_scripts/delete.sh --name NAME --zone ZONE [options]
#
#   --name NAME        TPU name
#   --zone ZONE        its zone
#   --project PROJECT  default: gcloud's configured project
#   --queued           it was created as a queued resource (create.sh's default for
#                      multi-host slices): delete the queued resource and its TPU
#   --dry-run          print the gcloud command instead of running it
#   --help             this text
#
# Example:
#   tpu_scripts/delete.sh --name envace-v5p --zone us-east5-a --queued

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project" "queued" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
gcloud_common

if [[ ${OPT_QUEUED:-0} == 1 ]]; then
  run gcloud compute tpus queued-resources delete "$OPT_NAME" "${GCLOUD_COMMON[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$OPT_NAME" "${GCLOUD_COMMON[@]}" --quiet
fi
