#!/usr/bin/env bash
# Launch a training run on every worker of a TPU VM at once (after a memory-plan check).
#
# Usage: tpu_scripts/launch.sh --name NAME --zone ZONE --accelerator SLICE --config FILE[:VARIANT]
#            --run RUN [options] [-- MAIN_FLAGS...]
#
#   --name NAME            TPU name
#   --zone ZONE            its zone
#   --project PROJECT      default: gcloud's configured project
#   --accelerator SLICE    the slice (v5p-32, v5e-8, ...), for the memory planner
#   --config FILE[:VAR]    job config, relative to the package (configs/qwen3_8b.py:v5p-32)
#   --run RUN              run name: workdir $HOME/envace/runs/RUN on every worker, log
#                          $HOME/envace/logs/RUN.log, pid $HOME/envace/logs/RUN.pid
#   --bucket gs://B/P      checkpoints to gs://B/P/RUN/checkpoints (recommended on pod slices:
#                          every worker writes its shards there and a rerun resumes from it)
#   --skip-plan            do not run the memory planner first
#   --dry-run              print the gcloud commands instead of running them
#   --help                 this text
#
# MAIN_FLAGS go to envace_jax.main (and --config.* overrides to the planner too). First, on
# worker 0, `python -m envace_jax.planner` checks that the config fits the slice and the launch
# stops if it does not. Then every worker starts tpu_scripts/worker_run.sh in the background.
# Rerunning the same command resumes from the newest checkpoint.
#
# Example:
#   tpu_scripts/launch.sh --name envace-v5p --zone us-east5-a --accelerator v5p-32 \
#       --config configs/qwen3_8b.py:v5p-32 --run qwen3-8b-r1 --bucket gs://my-bucket/runs

set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

parse_args "name zone project accelerator config run bucket" "skip-plan" "$@"
require name "${OPT_NAME:-}"
require zone "${OPT_ZONE:-}"
require config "${OPT_CONFIG:-}"
require run "${OPT_RUN:-}"
check_name "$OPT_NAME"
check_zone "$OPT_ZONE"
check_run "$OPT_RUN"
[[ ${OPT_CONFIG%%:*} == *.py ]] || die "--config '$OPT_CONFIG': expected FILE.py or FILE.py:VARIANT"
if [[ ${OPT_SKIP_PLAN:-0} != 1 ]]; then
  require accelerator "${OPT_ACCELERATOR:-}"
  accelerator=$(accelerator_type "$OPT_ACCELERATOR")
fi
gcloud_common

# The workdir is relative to $HOME/envace/src, where the job runs: $HOME/envace/runs/RUN.
main_flags=(--config="$OPT_CONFIG" --workdir="../runs/$OPT_RUN")
if [[ -n ${OPT_BUCKET:-} ]]; then
  [[ $OPT_BUCKET == gs://* ]] || die "--bucket '$OPT_BUCKET': expected gs://bucket[/prefix]"
  main_flags+=(--config.schedule.checkpoint_dir="${OPT_BUCKET%/}/$OPT_RUN/checkpoints")
fi
overrides=()
for flag in "${EXTRA[@]}"; do
  [[ $flag == --config.* ]] && overrides+=("$flag")
done

src="cd \"\$HOME/envace/src\""
if [[ ${OPT_SKIP_PLAN:-0} != 1 ]]; then
  plan="$src && \"\$HOME/envace/venv/bin/python\" -m envace_jax.planner \
$(quote --config="$OPT_CONFIG" --topology="$accelerator" ${overrides[@]+"${overrides[@]}"})"
  run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker=0 "${GCLOUD_COMMON[@]}" --command="$plan"
fi

job=$(quote "${main_flags[@]}" ${EXTRA[@]+"${EXTRA[@]}"})
log="\$HOME/envace/logs/$OPT_RUN"
start="set -euo pipefail
$src
mkdir -p \"\$HOME/envace/logs\" \"\$HOME/envace/runs\"
if [ -f \"$log.pid\" ] && kill -0 \"\$(cat \"$log.pid\")\" 2>/dev/null; then
  echo \"run $OPT_RUN is already running on \$(hostname)\" >&2
  exit 1
fi
setsid nohup bash tpu_scripts/worker_run.sh -- $job >\"$log.log\" 2>&1 </dev/null &
echo \$! >\"$log.pid\"
echo \"started $OPT_RUN on \$(hostname): pid \$!\""
run gcloud compute tpus tpu-vm ssh "$OPT_NAME" --worker=all "${GCLOUD_COMMON[@]}" --command="$start"
note "follow it: tpu_scripts/logs.sh --name $OPT_NAME --zone $OPT_ZONE --run $OPT_RUN --follow"
