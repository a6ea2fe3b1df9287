#!/usr/bin/env bash
# One jaxes run on a Cloud TPU VM slice: create it, install the package (and the docker sandbox
# engine) on every worker, start the same command on all workers at once, follow the logs, stop,
# delete. Every step is a gcloud command; --dry-run prints them all instead of running them.
#
#   launch/tpu/run.sh --name NAME --zone ZONE [flags] SUBCOMMAND [-- COMMAND...]
#
# Subcommands:
#   up        create + setup + start (needs COMMAND)
#   create    gcloud compute tpus tpu-vm create
#   setup     copy the committed tree (git archive HEAD) to every worker, install it into
#             ~/jaxes-venv with jax[tpu], and set up the docker engine and sandbox image
#   start     start COMMAND on every worker (JAXES_DISTRIBUTED=auto; output in ~/jaxes-run/run.log)
#   logs      follow worker 0's log (--worker=all for every worker's)
#   status    whether the run is alive on each worker, with its last log lines
#   stop      stop the run on every worker (SIGTERM to its process group, SIGKILL after 30 s)
#   delete    delete the slice
#
# Flags:
#   --name NAME            TPU VM name (required)
#   --zone ZONE            zone (required), e.g. us-east5-a for v5p
#   --project PROJECT      GCP project (default: gcloud's configured one)
#   --accelerator TYPE     accelerator type (default v5p-64: 32 chips on 8 workers)
#   --version VERSION      TPU software version (default v2-alpha-tpuv5, the v5p runtime)
#   --spot                 create a Spot slice (cheaper, can be preempted)
#   --jax SPEC             JAX to install on the workers (default jax[tpu]==0.10.2)
#   --no-docker            skip the docker engine and image (for env.sandbox=local runs)
#   --env KEY=VALUE        extra environment for COMMAND (repeatable)
#   --worker W             worker(s) for logs/status (default 0 for logs, all for status)
#   --dry-run              print every command instead of running it
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=SCRIPTDIR/../dryrun.sh
source "$root/launch/dryrun.sh"

usage() {
  sed -n '2,32s/^# \{0,1\}//p' "$0" >&2
  exit "${1:-2}"
}
die() {
  echo "run.sh: $1" >&2
  exit 2
}

name="" zone="" project="" accelerator="v5p-64" version="v2-alpha-tpuv5" spot=0
jax_spec="jax[tpu]==0.10.2" docker=1 worker="" dry_run=0 subcommand=""
extra_env=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name | --zone | --project | --accelerator | --version | --jax | --env | --worker)
      [ $# -ge 2 ] || die "$1 needs a value"
      flag=${1#--}; value=$2; shift 2 ;;
    --name=* | --zone=* | --project=* | --accelerator=* | --version=* | --jax=* | --env=* | --worker=*)
      flag=${1%%=*}; flag=${flag#--}; value=${1#*=}; shift ;;
    --spot) spot=1; shift; continue ;;
    --no-docker) docker=0; shift; continue ;;
    --dry-run) dry_run=1; shift; continue ;;
    -h | --help) usage 0 ;;
    --) shift; break ;;
    -*) die "unknown flag $1 (see --help)" ;;
    *) [ -z "$subcommand" ] || die "one subcommand expected, got '$subcommand' and '$1'"
       subcommand=$1; shift; continue ;;
  esac
  case "$flag" in
    name) name=$value ;;
    zone) zone=$value ;;
    project) project=$value ;;
    accelerator) accelerator=$value ;;
    version) version=$value ;;
    jax) jax_spec=$value ;;
    env) [[ "$value" == [A-Za-z_]*=* ]] || die "--env expects KEY=VALUE, got '$value'"
         extra_env+=("$value") ;;
    worker) worker=$value ;;
  esac
done
command_args=("$@")

case "$subcommand" in
  up | create | setup | start | logs | status | stop | delete) ;;
  "") die "missing the subcommand (up, create, setup, start, logs, status, stop, delete)" ;;
  *) die "unknown subcommand '$subcommand' (up, create, setup, start, logs, status, stop, delete)" ;;
esac
[ -n "$name" ] || die "--name is required"
[ -n "$zone" ] || die "--zone is required"
case "$subcommand" in
  up | start) [ ${#command_args[@]} -gt 0 ] || die "$subcommand needs the run as -- COMMAND..." ;;
  *) [ ${#command_args[@]} -eq 0 ] || die "$subcommand takes no COMMAND" ;;
esac

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[ -z "$project" ] || where+=(--project="$project")
ssh_all() {  # ssh_all WORKER REMOTE-COMMAND-LINE
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker="$1" --command "$2"
}
archive="${TMPDIR:-/tmp}/jaxes-$name.tar.gz"

do_create() {
  local args=("${gcloud_tpu[@]}" create "$name" "${where[@]}" --accelerator-type="$accelerator"
              --version="$version")
  [ "$spot" = 0 ] || args+=(--spot)
  run "${args[@]}"
}
do_setup() {
  # Only committed files travel, so every worker runs exactly the commit named in the log.
  run git -C "$root" archive --format=tar.gz --output="$archive" HEAD
  run "${gcloud_tpu[@]}" scp "$archive" "$name:jaxes.tar.gz" "${where[@]}" --worker=all
  local setup=(bash jaxes/launch/tpu/worker.sh setup --jax "$jax_spec")
  [ "$docker" = 1 ] || setup+=(--no-docker)
  ssh_all all "rm -rf jaxes && mkdir jaxes && tar -xzf jaxes.tar.gz -C jaxes && $(quote "${setup[@]}")"
}
do_start() {
  local start=(bash jaxes/launch/tpu/worker.sh start)
  local kv
  for kv in "${extra_env[@]}"; do
    start+=(--env "$kv")
  done
  ssh_all all "$(quote "${start[@]}" -- "${command_args[@]}")"
}

case "$subcommand" in
  up) do_create; do_setup; do_start ;;
  create) do_create ;;
  setup) do_setup ;;
  start) do_start ;;
  logs) ssh_all "${worker:-0}" "tail -n 200 -F jaxes-run/run.log" ;;
  status) ssh_all "${worker:-all}" "bash jaxes/launch/tpu/worker.sh status" ;;
  stop) ssh_all all "bash jaxes/launch/tpu/worker.sh stop" ;;
  delete) run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet ;;
esac
