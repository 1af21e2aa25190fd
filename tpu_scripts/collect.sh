#!/usr/bin/env bash
# Copy a run's results from worker 0 (metrics, curves, summary, HF export) to a bucket.
#
# Usage: tpu_scripts/collect.sh --name NAME --zone ZONE --run RUN --bucket gs://B/P [options]
#
#   --name NAME        TPU name
#   --zone ZONE        its zone
#   --project PROJECT  default: gcloud's configured project
#   --run RUN          the run name given to launch.sh
#   --bucket gs://B/P  destination: gs://B/P/RUN/results/ (metrics.jsonl, tensorboard/,
#                      curves.png, summary.md, config.json, export/)
#   --dry-run          print the gcloud command instead of running it
#   --help             this text
#
# Only worker 0 writes metrics and the export; the other workers' workdirs hold nothing more.
#
# Example:
#   tpu_scripts/collect.sh --name envace-v5p --zone us-east5-a --run qwen3-8b-r1 \
#       --bucket gs://my-bucket/runs

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project run bucket" "" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
require run "${OPT_RUN:-}"
require bucket "${OPT_BUCKET:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
check_run "$OPT_RUN"
[[ $OPT_BUCKET == gs://* ]] || die "--bucket '$OPT_BUCKET': expected gs://bucket[/prefix]"
gcloud_common

dest=${OPT_BUCKET%/}/$OPT_RUN/results
remote="set -euo pipefail
cd \"\$HOME/envace/runs/$OPT_RUN\"
gcloud storage rsync --recursive --exclude='^checkpoints/' . $(quote "$dest")
echo \"copied \$(pwd) to $dest\""
run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker=0 "${GCLOUD_COMMON[@]}" --command="$remote"
