#!/usr/bin/env bash
# Stage an HF checkpoint (and optionally task data) on every worker's local disk.
#
# Usage: tpu_scripts/stage.sh --name NAME --zone ZONE --checkpoint SRC [options]
#
#   --name NAME         TPU name
#   --zone ZONE         its zone
#   --project PROJECT   default: gcloud's configured project
#   --checkpoint SRC    HF checkpoint directory (config.json, *.safetensors, tokenizer files):
#                       gs://bucket/path or a local directory
#   --data SRC          task data directory, gs://... or local (optional): it holds train/ and
#                       validation/, each with task files (.parquet/.jsonl/.json, the reference
#                       layout); `python -m envace_jax.data.validate` checks them first
#   --bucket gs://B/P   where local sources are uploaded first (required for local sources)
#   --dry-run           print the commands instead of running them
#   --help              this text
#
# Each worker copies SRC from Cloud Storage to $HOME/envace/models/<basename of SRC>, the
# directory the configs read (configs/qwen3_8b.py uses ~/envace/models/Qwen3-8B); task data goes
# to $HOME/envace/data (DATA_DIR in envace_jax/planner/tpu_configs.py), whose train/ and validation/ the
# configs read as data.train_files and data.eval_files. Every worker reads only the slices of
# the weights its chips hold, but each needs the files on its own disk.
#
# Examples:
#   tpu_scripts/stage.sh --name envace-v5p --zone us-east5-a \
#       --checkpoint gs://my-bucket/models/Qwen3-8B
#   tpu_scripts/stage.sh --name envace-v5e --zone us-central1-a \
#       --checkpoint ./Qwen3-1.7B --bucket gs://my-bucket/staging

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project checkpoint data bucket" "" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
require checkpoint "${OPT_CHECKPOINT:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
gcloud_common
if [[ -n ${OPT_BUCKET:-} ]]; then
  [[ $OPT_BUCKET == gs://* ]] || die "--bucket '$OPT_BUCKET': expected gs://bucket[/prefix]"
fi

remote="set -euo pipefail"

# stage KIND SRC: upload a local SRC to the bucket, then have every worker pull it.
stage() {
  local kind=$1 src=${2%/} url base
  base=$(basename "$src")
  if [[ $src == gs://* ]]; then
    url=$src
  else
    [[ -d $src ]] || die "--$kind '$src': not a directory (or give a gs:// path)"
    if [[ $kind == data ]]; then
      for sub in train validation; do
        [[ -d $src/$sub ]] || die "--data '$src': no $sub/ directory (the configs read $sub/)"
      done
    fi
    [[ -n ${OPT_BUCKET:-} ]] || die "--$kind '$src' is local: give --bucket gs://... to upload it to"
    url=${OPT_BUCKET%/}/$kind/$base
    run gcloud storage rsync --recursive "$src" "$url"
  fi
  local dest="\$HOME/envace/data"
  [[ $kind == checkpoint ]] && dest="\$HOME/envace/models/$base"
  remote+="
mkdir -p \"$dest\"
gcloud storage rsync --recursive $(quote "$url") \"$dest\"
echo \"staged $(quote "$url") -> $dest\""
}

stage checkpoint "$OPT_CHECKPOINT"
[[ -n ${OPT_DATA:-} ]] && stage data "$OPT_DATA"
run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker=all "${GCLOUD_COMMON[@]}" \
  --command="$remote"
