#!/usr/bin/env bash
#SBATCH --job-name=jaxes
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
# One jaxes run on a SLURM GPU cluster: one process per node, each seeing all of its node's GPUs,
# joined through a coordinator on the job's first node.
#
#   launch/gpu/slurm.sh [flags] -- COMMAND...
#
# Outside a job it submits itself with sbatch (the flags below become sbatch options); inside a
# job (sbatch, or salloc then this script) it starts COMMAND on every node with srun, with
# JAX_COORDINATOR_ADDRESS=<first host of SLURM_JOB_NODELIST>:PORT, JAX_NUM_PROCESSES=<nodes> and
# JAX_PROCESS_ID=<SLURM_PROCID>, and --kill-on-bad-exit so one failed node ends the step. With
# one node it runs one process over all that node's GPUs and no coordinator.
#
#   --nodes N              nodes (default 2)
#   --gpus-per-node G      GPUs per node (default 8; 0 for CPU-only nodes, e.g. a rehearsal)
#   --cpus-per-task C      CPU cores per node's process (default: sbatch's)
#   --partition P, --account A, --time T, --job-name J, --qos Q   passed to sbatch
#   --logdir DIR           sbatch output DIR/%x-%j.out (default slurm-logs, created)
#   --port PORT            coordinator port (default 20000 + job id mod 20000)
#   --docker               first run launch/docker/setup.sh on every node (needs root there)
#   --dry-run              print every command instead of running it
#
# The environment at submission (an activated venv with the package and jax[cuda12]) is
# exported to the job, as sbatch does by default.
set -euo pipefail

usage() {
  sed -n '5,26s/^# \{0,1\}//p' "$0" >&2
  exit "${1:-2}"
}
die() {
  echo "slurm.sh: $1" >&2
  exit 2
}

root="$(cd "$(dirname "$0")/../.." 2>/dev/null && pwd)"
if [ ! -f "$root/launch/dryrun.sh" ]; then
  # sbatch runs a copy of this script from its spool; the submission set --chdir to the tree.
  [ -f launch/dryrun.sh ] || die "cannot find the jaxes tree (run from its root)"
  root=$PWD
fi
cd "$root"
# shellcheck source=SCRIPTDIR/../dryrun.sh
source launch/dryrun.sh

nodes=2 gpus=8 cpus="" partition="" account="" time_limit="" job_name="jaxes" qos=""
logdir="slurm-logs" port="" docker=0 dry_run=0
sbatch_passthrough=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes | --gpus-per-node | --cpus-per-task | --partition | --account | --time | --job-name | \
    --qos | --logdir | --port)
      [ $# -ge 2 ] || die "$1 needs a value"
      flag=${1#--}; value=$2; shift 2 ;;
    --*=*)
      flag=${1%%=*}; flag=${flag#--}; value=${1#*=}; shift ;;
    --docker) docker=1; sbatch_passthrough+=("$1"); shift; continue ;;
    --dry-run) dry_run=1; shift; continue ;;
    -h | --help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown argument $1 (flags, then -- COMMAND...; see --help)" ;;
  esac
  case "$flag" in
    nodes) nodes=$value ;;
    gpus-per-node) gpus=$value ;;
    cpus-per-task) cpus=$value ;;
    partition) partition=$value ;;
    account) account=$value ;;
    time) time_limit=$value ;;
    job-name) job_name=$value ;;
    qos) qos=$value ;;
    logdir) logdir=$value ;;
    port) port=$value ;;
    *) die "unknown flag --$flag (see --help)" ;;
  esac
done
[ $# -gt 0 ] || die "missing the run as -- COMMAND..."
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got '$nodes'"
[[ "$gpus" =~ ^[0-9]+$ ]] || die "--gpus-per-node must be a whole number, got '$gpus'"
[ -z "$port" ] || [[ "$port" =~ ^[1-9][0-9]*$ ]] || die "--port must be a port number, got '$port'"

if [ -z "${SLURM_JOB_ID:-}" ]; then
  # Submit: sbatch copies this script to its spool, so the job is told where the tree is.
  args=(sbatch --job-name="$job_name" --nodes="$nodes" --ntasks-per-node=1)
  [ "$gpus" = 0 ] || args+=(--gpus-per-node="$gpus")
  args+=(--exclusive --chdir="$root" --output="$logdir/%x-%j.out")
  [ -z "$cpus" ] || args+=(--cpus-per-task="$cpus")
  [ -z "$partition" ] || args+=(--partition="$partition")
  [ -z "$account" ] || args+=(--account="$account")
  [ -z "$time_limit" ] || args+=(--time="$time_limit")
  [ -z "$qos" ] || args+=(--qos="$qos")
  inner=("${sbatch_passthrough[@]}")
  [ -z "$port" ] || inner+=(--port="$port")
  case "$logdir" in
    /*) run mkdir -p "$logdir" ;;
    *) run mkdir -p "$root/$logdir" ;;
  esac
  run "${args[@]}" "$root/launch/gpu/slurm.sh" "${inner[@]}" -- "$@"
  exit 0
fi

# Inside the job: the node count is the allocation's, whatever --nodes said at submission.
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[ -n "$nodes" ] || die "SLURM_JOB_ID is set but SLURM_JOB_NUM_NODES is not; is this a SLURM job?"
[ -n "${SLURM_JOB_NODELIST:-}" ] || die "SLURM_JOB_NODELIST is not set; is this a SLURM job?"
if [ "$docker" = 1 ]; then
  run srun --nodes="$nodes" --ntasks-per-node=1 bash launch/docker/setup.sh
fi
if [ "$nodes" = 1 ]; then
  # One node: one process over all its GPUs; nothing to coordinate.
  run srun --nodes=1 --ntasks=1 "$@"
  exit 0
fi
if command -v scontrol >/dev/null; then
  head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
elif [ "$dry_run" = 1 ]; then
  head_node="FIRST_HOST_OF_${SLURM_JOB_NODELIST}"
else
  die "scontrol is not on PATH, so the first host of $SLURM_JOB_NODELIST is unknown"
fi
coordinator="$head_node:${port:-$((20000 + SLURM_JOB_ID % 20000))}"
echo "slurm.sh: job $SLURM_JOB_ID, $nodes processes, coordinator $coordinator" >&2
# Each task takes its process index from SLURM_PROCID, which srun sets per task.
# shellcheck disable=SC2016  # $SLURM_PROCID is meant to expand in the task, not here
run env JAX_COORDINATOR_ADDRESS="$coordinator" JAX_NUM_PROCESSES="$nodes" \
  srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 --label \
  bash -c 'export JAX_PROCESS_ID=$SLURM_PROCID; exec "$@"' jaxes-task "$@"
