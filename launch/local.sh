#!/usr/bin/env bash
# Rehearse a multi-host run on one machine: N processes, each with its own fake CPU devices,
# joined through a coordinator on loopback (what jaxes.distributed.initialize() reads).
#
#   launch/local.sh [--devices K] [--logdir DIR] [--grace S] N -- COMMAND...
#
#   --devices K   CPU devices per process (default 4; XLA_FLAGS=--xla_force_host_platform_device_count)
#   --logdir DIR  also write each process's raw output to DIR/process-I.log
#   --grace S     seconds between SIGTERM and SIGKILL when stopping the others (default 5)
#
# Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT (a free port), JAX_NUM_PROCESSES=N,
# JAX_PROCESS_ID=I and JAX_PLATFORMS=cpu; its output lines are prefixed with [pI]. When a process
# fails, or on Ctrl-C, every other process (with its children) is stopped; the exit status is the
# failed process's, and the message names it.
set -euo pipefail

usage() {
  sed -n '2,14s/^# \{0,1\}//p' "$0" >&2
  exit "${1:-2}"
}
die() {
  echo "local.sh: $1" >&2
  exit 2
}

devices=4
logdir=""
grace=5
num=""
while [ $# -gt 0 ]; do
  case "$1" in
    --devices) [ $# -ge 2 ] || die "--devices needs a value"; devices=$2; shift 2 ;;
    --devices=*) devices=${1#*=}; shift ;;
    --logdir) [ $# -ge 2 ] || die "--logdir needs a value"; logdir=$2; shift 2 ;;
    --logdir=*) logdir=${1#*=}; shift ;;
    --grace) [ $# -ge 2 ] || die "--grace needs a value"; grace=$2; shift 2 ;;
    --grace=*) grace=${1#*=}; shift ;;
    -h | --help) usage 0 ;;
    --) shift; break ;;
    -*) die "unknown flag $1 (see --help)" ;;
    *) [ -z "$num" ] || die "one process count expected, got '$num' and '$1'"; num=$1; shift ;;
  esac
done
[ -n "$num" ] || die "missing the process count N (usage: local.sh N -- COMMAND...)"
[[ "$num" =~ ^[1-9][0-9]*$ ]] || die "process count must be a positive integer, got '$num'"
[[ "$devices" =~ ^[1-9][0-9]*$ ]] || die "--devices must be a positive integer, got '$devices'"
[[ "$grace" =~ ^[0-9]+$ ]] || die "--grace must be a whole number of seconds, got '$grace'"
[ $# -gt 0 ] || die "missing the command after --"
if [ -n "$logdir" ]; then
  mkdir -p "$logdir"
fi

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Keep the caller's other XLA flags; replace only the device count.
xla_flags="$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g') --xla_force_host_platform_device_count=$devices"

prefix() {  # prefix [pI] to each line as it arrives, optionally keeping a raw copy
  trap '' INT  # Ctrl-C stops the processes; their last lines still get through
  if [ -n "$logdir" ]; then
    tee "$logdir/process-$1.log"
  else
    cat
  fi | while IFS= read -r line || [ -n "$line" ]; do printf '[p%s] %s\n' "$1" "$line"; done
}

fifos=$(mktemp -d)
pids=()
running=()
printers=()
stop_all() {  # SIGTERM every process group still running, SIGKILL after the grace period
  local i t
  for i in "${!pids[@]}"; do
    if [ "${running[i]}" = 1 ]; then
      kill -TERM -- "-${pids[i]}" 2>/dev/null || true
    fi
  done
  for ((t = 0; t < grace * 10; t++)); do
    local alive=0
    for i in "${!pids[@]}"; do
      [ "${running[i]}" = 1 ] && kill -0 "${pids[i]}" 2>/dev/null && alive=1
    done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if [ "${running[i]}" = 1 ]; then
      kill -KILL -- "-${pids[i]}" 2>/dev/null || true
      wait "${pids[i]}" 2>/dev/null || true
      running[i]=0
    fi
  done
}
finish() {  # let the printers drain what the processes wrote, then clean up
  wait "${printers[@]}" 2>/dev/null || true
  rm -rf "$fifos"
}
trap 'echo "local.sh: interrupted; stopping all processes" >&2; stop_all; finish; exit 130' INT TERM

describe() {  # exit status -> words
  if [ "$1" -gt 128 ] && name=$(kill -l "$(($1 - 128))" 2>/dev/null); then
    echo "was killed by SIG$name (status $1)"
  else
    echo "exited with status $1"
  fi
}

for ((i = 0; i < num; i++)); do
  mkfifo "$fifos/$i"
  prefix "$i" <"$fifos/$i" &
  printers[i]=$!
done
set -m  # each process in its own process group, so stopping it reaches its children too
for ((i = 0; i < num; i++)); do
  JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$num" JAX_PROCESS_ID="$i" \
    JAX_PLATFORMS=cpu XLA_FLAGS="$xla_flags" "$@" >"$fifos/$i" 2>&1 &
  pids[i]=$!
  running[i]=1
done
set +m
echo "local.sh: started $num processes (pids ${pids[*]}), $devices CPU devices each, coordinator 127.0.0.1:$port" >&2

left=$num
while [ "$left" -gt 0 ]; do
  for i in "${!pids[@]}"; do
    [ "${running[i]}" = 1 ] || continue
    kill -0 "${pids[i]}" 2>/dev/null && continue
    rc=0
    wait "${pids[i]}" || rc=$?
    running[i]=0
    left=$((left - 1))
    if [ "$rc" != 0 ]; then
      echo "local.sh: process $i (pid ${pids[i]}) $(describe "$rc"); stopping the other processes" >&2
      stop_all
      finish
      exit "$rc"
    fi
  done
  sleep 0.1
done
finish
echo "local.sh: all $num processes exited with status 0" >&2
