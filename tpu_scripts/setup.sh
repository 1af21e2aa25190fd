#!/usr/bin/env bash
# Set up every worker of a TPU VM: a Python venv with jax[tpu] and this package.
#
# Usage: tpu_scripts/setup.sh --name NAME --zone ZONE [options]
#
#   --name NAME        TPU name
#   --zone ZONE        its zone
#   --project PROJECT  default: gcloud's configured project
#   --source DIR       package checkout to copy to the workers (default: this repository)
#   --git URL          clone URL instead of copying a checkout (with --ref BRANCH_OR_TAG)
#   --ref REF          git branch or tag for --git (default: main)
#   --jax SPEC         pip requirement for JAX (default: 'jax[tpu]>=0.9,<0.11')
#   --dry-run          print the commands instead of running them
#   --help             this text
#
# On each worker: $HOME/envace/src (the package), $HOME/envace/venv (python3 -m venv, with
# JAX for TPU and the package installed editable), then a check that JAX sees the TPU chips.
#
# Example:
#   tpu_scripts/setup.sh --name envace-v5p --zone us-east5-a

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project source git ref jax" "" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
gcloud_common
jax_spec=${OPT_JAX:-'jax[tpu]>=0.9,<0.11'}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

fetch=""
if [[ -n ${OPT_GIT:-} ]]; then
  [[ -z ${OPT_SOURCE:-} ]] || die "--git and --source exclude each other"
  fetch="rm -rf \"\$HOME/envace/src\" && git clone --depth 1 --branch $(quote "${OPT_REF:-main}") \
$(quote "$OPT_GIT") \"\$HOME/envace/src\""
else
  source_dir=${OPT_SOURCE:-$repo}
  [[ -f $source_dir/setup.py ]] || die "--source '$source_dir': no setup.py there"
  tarball=${TMPDIR:-/tmp}/envace_jax-$OPT_NAME.tar.gz
  note "packing $source_dir"
  run tar -czf "$tarball" -C "$source_dir" --exclude=.venv --exclude=.git --exclude=workdir \
    --exclude=.cache --exclude=__pycache__ .
  run gcloud compute tpus tpu-vm scp "$tarball" "$OPT_NAME:envace_jax.tar.gz" --worker=all \
    "${GCLOUD_COMMON[@]}"
  fetch="rm -rf \"\$HOME/envace/src\" && mkdir -p \"\$HOME/envace/src\" && \
tar -xzf \"\$HOME/envace_jax.tar.gz\" -C \"\$HOME/envace/src\""
fi

remote="set -euo pipefail
mkdir -p \"\$HOME/envace/logs\" \"\$HOME/envace/models\" \"\$HOME/envace/data\" \"\$HOME/envace/runs\"
$fetch
if [ ! -x \"\$HOME/envace/venv/bin/python\" ]; then
  python3 -m venv \"\$HOME/envace/venv\" || {
    sudo apt-get update -q && sudo apt-get install -y -q python3-venv &&
      python3 -m venv \"\$HOME/envace/venv\"
  }
fi
\"\$HOME/envace/venv/bin/pip\" install -q --upgrade pip
\"\$HOME/envace/venv/bin/pip\" install -q $(quote "$jax_spec")
\"\$HOME/envace/venv/bin/pip\" install -q -e \"\$HOME/envace/src\"
\"\$HOME/envace/venv/bin/python\" -c 'import jax; print(\"worker\", jax.process_index(), jax.local_device_count(), jax.local_devices()[0].device_kind)'"
run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker=all "${GCLOUD_COMMON[@]}" \
  --command="$remote"
note "set up. Next: tpu_scripts/stage.sh (checkpoint, data), then tpu_scripts/launch.sh"
