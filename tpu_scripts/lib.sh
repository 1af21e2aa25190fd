# shellcheck shell=bash
# Shared by the tpu_scripts: option parsing, a runner that prints instead of running under
# --dry-run, and the TPU slice names gcloud expects. Sourced, never run.

DRY_RUN=0
# shellcheck disable=SC2034  # read by the scripts that source this file
EXTRA=()

die() {
  echo "error: $*" >&2
  exit 2
}

# Progress notes go to stderr, so that --dry-run's stdout holds only commands.
note() { echo "# $*" >&2; }

# usage: prints the comment block at the top of the calling script (its --help text).
usage() {
  sed -n '2,/^$/{/^$/d;s/^# \{0,1\}//;p;}' "$0"
}

# quote ARGS...: one shell command line that re-parses to exactly ARGS.
quote() {
  local out="" a q="'" esc="'\\''"
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
      out+="$a "
    else
      out+="'${a//$q/$esc}' "
    fi
  done
  printf '%s\n' "${out% }"
}

# run ARGS...: runs the command, or prints it under --dry-run.
run() {
  if ((DRY_RUN)); then
    quote "$@"
  else
    "$@"
  fi
}

# parse_args "VALUE OPTIONS" "FLAG OPTIONS" ARGS...
# Sets OPT_<NAME> (upper case, '-' -> '_') for every --name VALUE / --name=VALUE listed in the
# first word list and OPT_<NAME>=1 for every --flag listed in the second. --dry-run and --help
# are always known. Arguments after a lone -- are kept in EXTRA (passed through).
parse_args() {
  local values=" $1 " flags=" $2 dry-run help "
  shift 2
  EXTRA=()
  while (($#)); do
    local arg=$1 key val var
    shift
    if [[ $arg == -- ]]; then
      # shellcheck disable=SC2034  # read by the scripts that source this file
      EXTRA=("$@")
      break
    fi
    [[ $arg == -h ]] && arg=--help
    [[ $arg == --* ]] || die "unexpected argument '$arg' (see --help)"
    key=${arg#--}
    key=${key%%=*}
    var=OPT_$(tr 'a-z-' 'A-Z_' <<<"$key")
    if [[ $values == *" $key "* ]]; then
      if [[ $arg == *=* ]]; then
        val=${arg#*=}
      else
        (($#)) || die "--$key needs a value"
        val=$1
        shift
      fi
      printf -v "$var" '%s' "$val"
    elif [[ $flags == *" $key "* ]]; then
      [[ $arg != *=* ]] || die "--$key takes no value"
      printf -v "$var" '%s' 1
    else
      die "unknown option --$key (see --help)"
    fi
  done
  if [[ ${OPT_HELP:-0} == 1 ]]; then
    usage
    exit 0
  fi
  DRY_RUN=${OPT_DRY_RUN:-0}
}

# require NAME VALUE: dies naming --NAME when VALUE is empty.
require() {
  [[ -n $2 ]] || die "--$1 is required (see --help)"
}

# check_zone ZONE / check_name NAME / check_run RUN: reject values gcloud or paths would
# misread, with a message naming the option.
check_zone() {
  [[ $1 =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$1': expected a zone like us-central2-b"
}
check_name() {
  [[ $1 =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--name '$1': lower-case letters, digits and '-', starting with a letter"
}
check_run() {
  [[ $1 =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "--run '$1': letters, digits, '.', '_', '-'"
}

# Slice names. A slice is given as gcloud names it (v5litepod-8, v5p-32, v6e-8) or as
# v5e-8; these print the accelerator type, the TPU VM runtime version, and the host count.
_slice() {
  [[ $1 =~ ^(v5e|v5litepod|v5lite|v5p|v6e)-([0-9]+)$ ]] ||
    die "--accelerator '$1': expected v5e-N (v5litepod-N), v5p-N or v6e-N, e.g. v5p-32"
  SLICE_GEN=${BASH_REMATCH[1]}
  SLICE_SIZE=${BASH_REMATCH[2]}
  case $SLICE_GEN in
    v5e | v5litepod | v5lite) SLICE_GEN=v5e ;;
  esac
}
accelerator_type() {
  _slice "$1"
  case $SLICE_GEN in
    v5e) echo "v5litepod-$SLICE_SIZE" ;;
    *) echo "$SLICE_GEN-$SLICE_SIZE" ;;
  esac
}
runtime_version() {
  _slice "$1"
  case $SLICE_GEN in
    v5e) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v6e) echo v2-alpha-tpuv6e ;;
  esac
}
host_count() {
  _slice "$1"
  local chips=$SLICE_SIZE
  [[ $SLICE_GEN == v5p ]] && chips=$((SLICE_SIZE / 2))
  if [[ $SLICE_GEN == v5p ]] && ((chips <= 4)); then
    echo 1
  elif [[ $SLICE_GEN != v5p ]] && ((chips <= 8)); then
    echo 1
  else
    echo $((chips / 4))
  fi
}

# gcloud_common: the flags every gcloud call of a script shares (zone, project).
gcloud_common() {
  GCLOUD_COMMON=(--zone="$OPT_ZONE")
  if [[ -n ${OPT_PROJECT:-} ]]; then
    GCLOUD_COMMON+=(--project="$OPT_PROJECT")
  fi
}

# Every worker keeps everything under $HOME/envace: src/ (the package), venv/, models/, data/,
# runs/<run>/ (workdirs), logs/<run>.log and logs/<run>.pid.
