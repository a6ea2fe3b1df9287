#!/usr/bin/env bash
# Idempotent: make a Docker engine answer and build the sandbox base image if it is absent.
# Exits 0 with a printed reason when no engine can start (the docker tests then skip).
#   DOCKERD_LOG (default /var/log/jaxes-dockerd.log), DOCKERD_WAIT_S (default 60),
#   JAXES_SANDBOX_IMAGE (default jaxes-sandbox:latest)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

log_file="${DOCKERD_LOG:-/var/log/jaxes-dockerd.log}"
wait_s="${DOCKERD_WAIT_S:-60}"
image="${JAXES_SANDBOX_IMAGE:-jaxes-sandbox:latest}"

skip() {
  echo "docker setup: $1; docker sandbox tests will skip" >&2
  exit 0
}

command -v docker >/dev/null || skip "no docker client on PATH (apt-get install docker.io)"

if docker info >/dev/null 2>&1; then
  echo "docker setup: an engine already answers"
else
  command -v dockerd >/dev/null || skip "no engine answers and dockerd is not installed"
  [ "$(id -u)" = 0 ] || skip "no engine answers and starting dockerd needs root"
  echo "docker setup: starting dockerd (log: $log_file)"
  nohup dockerd >"$log_file" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 "$wait_s"); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || break
    sleep 1
  done
  if ! docker info >/dev/null 2>&1; then
    echo "docker setup: last lines of $log_file:" >&2
    tail -n 15 "$log_file" >&2
    skip "dockerd did not answer within ${wait_s} s"
  fi
  echo "docker setup: dockerd answers (pid $dockerd_pid)"
fi

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "docker setup: image $image present"
  exit 0
fi
echo "docker setup: building $image (debootstrap; takes minutes)"
start=$(date +%s)
if ! python3 -m jaxes.envs.images.base_image build --tag "$image"; then
  skip "building $image failed"
fi
echo "docker setup: $image built in $(( $(date +%s) - start )) s"
