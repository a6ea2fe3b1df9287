#!/usr/bin/env bash
# One jaxes run on a single multi-GPU machine without SLURM: one process over all (or the chosen)
# GPUs, so no coordinator; the mesh spans the node's devices.
#
#   launch/gpu/node.sh [--gpus 0,1,...] [--docker] [--dry-run] -- COMMAND...
#
#   --gpus LIST   restrict the run to these GPUs (CUDA_VISIBLE_DEVICES)
#   --docker      first run launch/docker/setup.sh (engine + sandbox image; needs root)
#   --dry-run     print every command instead of running it
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=SCRIPTDIR/../dryrun.sh
source launch/dryrun.sh

die() {
  echo "node.sh: $1" >&2
  exit 2
}

gpus="" docker=0 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) [ $# -ge 2 ] || die "--gpus needs a value"; gpus=$2; shift 2 ;;
    --gpus=*) gpus=${1#*=}; shift ;;
    --docker) docker=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) sed -n '2,9s/^# \{0,1\}//p' "$0" >&2; exit 0 ;;
    --) shift; break ;;
    *) die "unknown argument $1 (flags, then -- COMMAND...)" ;;
  esac
done
[ $# -gt 0 ] || die "missing the run as -- COMMAND..."
[ -z "$gpus" ] || [[ "$gpus" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpus expects a list like 0,1,2,3, got '$gpus'"

run nvidia-smi -L
[ "$docker" = 0 ] || run bash launch/docker/setup.sh
# A single process: drop any multi-process variables inherited from the caller's shell.
launch=(env -u JAX_COORDINATOR_ADDRESS -u JAX_NUM_PROCESSES -u JAX_PROCESS_ID)
[ -z "$gpus" ] || launch+=(CUDA_VISIBLE_DEVICES="$gpus")
run "${launch[@]}" "$@"
