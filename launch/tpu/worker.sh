#!/usr/bin/env bash
# Runs on each TPU VM worker (launch/tpu/run.sh calls it over gcloud ssh --worker=all), from the
# home directory where the tree was unpacked into ./jaxes.
#
#   worker.sh setup [--jax SPEC] [--no-docker]   python >= 3.11 venv in ~/jaxes-venv with the
#                                                package and SPEC; docker engine + sandbox image
#   worker.sh start [--env KEY=VALUE]... -- COMMAND...
#                                                COMMAND in ~/jaxes, detached, in its own process
#                                                group; output in ~/jaxes-run/run.log
#   worker.sh status                             alive or not, and the last log lines
#   worker.sh stop                               SIGTERM the run's process group, SIGKILL after 30 s
set -euo pipefail
venv="$HOME/jaxes-venv"
rundir="$HOME/jaxes-run"
tree="$HOME/jaxes"
host=$(hostname)

die() {
  echo "worker.sh on $host: $1" >&2
  exit 2
}

running_pid() {  # the run's pid if it is alive
  local pid
  [ -f "$rundir/run.pid" ] || return 1
  pid=$(cat "$rundir/run.pid")
  kill -0 "$pid" 2>/dev/null && echo "$pid"
}

find_python() {  # the first python >= 3.11 on PATH
  local candidate
  for candidate in python3.13 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

setup() {
  local jax_spec="jax[tpu]==0.10.2" docker=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --jax) [ $# -ge 2 ] || die "--jax needs a value"; jax_spec=$2; shift 2 ;;
      --no-docker) docker=0; shift ;;
      *) die "setup: unknown argument $1" ;;
    esac
  done
  local python packages=()
  if ! python=$(find_python); then
    packages+=(python3.11 python3.11-venv)   # TPU VM images ship Ubuntu 22.04's Python 3.10
    python=python3.11
  fi
  [ "$docker" = 0 ] || packages+=(docker.io debootstrap)
  if [ ${#packages[@]} -gt 0 ]; then
    sudo DEBIAN_FRONTEND=noninteractive apt-get update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}"
  fi
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -e "$tree" "$jax_spec"
  "$venv/bin/python" -c 'import jax, jaxes; print("worker setup:", jax.__version__, jax.devices()[:1])' \
    || die "the package or JAX does not import; see the messages above"
  if [ "$docker" = 1 ]; then
    sudo usermod -aG docker "$USER"   # the run (a later ssh login) may then talk to the engine
    # setup.sh builds the image with python3 -m jaxes.envs.images.base_image: put the venv's python first.
    sudo env PATH="$venv/bin:$PATH" bash "$tree/launch/docker/setup.sh"
  fi
  echo "worker setup on $host: done"
}

start() {
  local env_args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --env) [ $# -ge 2 ] || die "--env needs KEY=VALUE"; env_args+=("$2"); shift 2 ;;
      --) shift; break ;;
      *) die "start: unknown argument $1 (the run goes after --)" ;;
    esac
  done
  [ $# -gt 0 ] || die "start: missing the command after --"
  [ -x "$venv/bin/python" ] || die "no $venv: run 'launch/tpu/run.sh ... setup' first"
  local pid
  if pid=$(running_pid); then
    die "a run is already going (pid $pid); 'launch/tpu/run.sh ... stop' it first"
  fi
  mkdir -p "$rundir"
  cd "$tree"
  # setsid: the run leads its own process group, which 'stop' signals as a whole (sandboxes too).
  # JAXES_DISTRIBUTED=auto: jax.distributed.initialize() finds the slice's workers itself.
  setsid nohup env PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" JAXES_DISTRIBUTED=auto \
    "${env_args[@]}" "$@" >"$rundir/run.log" 2>&1 </dev/null &
  echo $! >"$rundir/run.pid"
  echo "worker $host: started pid $! ($*), log $rundir/run.log"
}

status() {
  local pid
  if pid=$(running_pid); then
    echo "worker $host: running (pid $pid)"
  else
    echo "worker $host: not running"
  fi
  [ ! -f "$rundir/run.log" ] || tail -n 3 "$rundir/run.log"
}

stop() {
  local pid
  if ! pid=$(running_pid); then
    echo "worker $host: not running"
    return 0
  fi
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 300); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  echo "worker $host: stopped pid $pid"
}

case "${1:-}" in
  setup | start | status | stop) action=$1; shift; "$action" "$@" ;;
  *) die "usage: worker.sh setup|start|status|stop [...]" ;;
esac
