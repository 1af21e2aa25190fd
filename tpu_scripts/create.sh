#!/usr/bin/env bash
# Create a Cloud TPU VM or pod slice and wait until it is ready.
#
# Usage: tpu_scripts/create.sh --name NAME --zone ZONE --accelerator SLICE [options]
#
#   --name NAME              TPU name (lower case, digits, '-')
#   --zone ZONE              e.g. us-central2-b, us-east5-a
#   --accelerator SLICE      v5e-8 (v5litepod-8), v5p-32, v6e-8, ...
#   --project PROJECT        default: gcloud's configured project
#   --version VERSION        TPU VM software; default per generation (v2-alpha-tpuv5-lite,
#                            v2-alpha-tpuv5, v2-alpha-tpuv6e)
#   --spot                   Spot capacity (cheaper, can be preempted)
#   --queued | --direct      a queued resource (the default for multi-host slices) or a direct
#                            create (the default for single-host VMs)
#   --valid-until-duration D queued only: give up if not provisioned within D (e.g. 6h)
#   --network NET, --subnetwork SUBNET, --service-account EMAIL
#   --timeout SECONDS        how long to wait for a queued resource (default 7200)
#   --dry-run                print the gcloud commands instead of running them
#   --help                   this text
#
# The VM gets the cloud-platform scope so that workers can read and write gs:// buckets
# (checkpoints, staged models) with the service account's permissions.
#
# Examples:
#   tpu_scripts/create.sh --name envace-v5p --zone us-east5-a --accelerator v5p-32 --spot
#   tpu_scripts/create.sh --name envace-v5e --zone us-central1-a --accelerator v5e-8

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone accelerator project version valid-until-duration network subnetwork \
service-account timeout" "spot queued direct" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
require accelerator "${OPT_ACCELERATOR:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
type=$(accelerator_type "$OPT_ACCELERATOR")
version=${OPT_VERSION:-$(runtime_version "$OPT_ACCELERATOR")}
hosts=$(host_count "$OPT_ACCELERATOR")
timeout=${OPT_TIMEOUT:-7200}
[[ $timeout =~ ^[0-9]+$ ]] || die "--timeout '$timeout': expected seconds"
[[ ${OPT_QUEUED:-0} == 1 && ${OPT_DIRECT:-0} == 1 ]] && die "--queued and --direct exclude each other"
queued=0
if [[ ${OPT_QUEUED:-0} == 1 ]] || { ((hosts > 1)) && [[ ${OPT_DIRECT:-0} != 1 ]]; }; then
  queued=1
fi
if [[ -n ${OPT_VALID_UNTIL_DURATION:-} ]] && ((!queued)); then
  die "--valid-until-duration applies to queued resources only (add --queued)"
fi
gcloud_common

options=(--accelerator-type="$type" --scopes=https://www.googleapis.com/auth/cloud-platform)
[[ ${OPT_SPOT:-0} == 1 ]] && options+=(--spot)
[[ -n ${OPT_NETWORK:-} ]] && options+=(--network="$OPT_NETWORK")
[[ -n ${OPT_SUBNETWORK:-} ]] && options+=(--subnetwork="$OPT_SUBNETWORK")
[[ -n ${OPT_SERVICE_ACCOUNT:-} ]] && options+=(--service-account="$OPT_SERVICE_ACCOUNT")

note "$type ($hosts host(s)), runtime $version, $([[ $queued == 1 ]] && echo queued || echo direct)"
if ((queued)); then
  [[ -n ${OPT_VALID_UNTIL_DURATION:-} ]] &&
    options+=(--valid-until-duration="$OPT_VALID_UNTIL_DURATION")
  run gcloud compute tpus queued-resources create "$OPT_NAME" --node-id="$OPT_NAME" \
    --runtime-version="$version" "${GCLOUD_COMMON[@]}" "${options[@]}"
  describe=(gcloud compute tpus queued-resources describe "$OPT_NAME" "${GCLOUD_COMMON[@]}"
    --format='value(state.state)')
  if ((DRY_RUN)); then
    quote "${describe[@]}"
    exit 0
  fi
  deadline=$((SECONDS + timeout))
  while :; do
    state=$("${describe[@]}")
    note "queued resource $OPT_NAME: $state"
    case $state in
      ACTIVE) break ;;
      FAILED | SUSPENDED) die "queued resource $OPT_NAME is $state; see: ${describe[*]% --format*}" ;;
    esac
    ((SECONDS < deadline)) || die "queued resource $OPT_NAME still $state after ${timeout}s"
    sleep 30
  done
else
  run gcloud compute tpus tpu-vm create "$OPT_NAME" --version="$version" \
    "${GCLOUD_COMMON[@]}" "${options[@]}"
fi
note "ready: $OPT_NAME. Next: tpu_scripts/setup.sh --name $OPT_NAME --zone $OPT_ZONE"
