"""Docker sandbox backend: one container per episode, driven through the docker SDK.

Each episode gets a fresh container of the base image (``python -m jaxes.envs.images.base_image build``)
running ``sleep infinity`` under docker's init, with no network, memory/pids/cpu limits and
labels naming the run and its owner process. Setup and the final tests run as root; the agent's
commands run as ``user`` (uid 1000) in /home/user. Every container of a run is removed when its
handle closes, at ``shutdown`` and at interpreter exit; containers left by an earlier run whose
owner process is dead are removed when a new ``DockerSandbox`` starts.

Infrastructure faults (engine unreachable, container gone, create failing after retries, an exec
outliving its host-side deadline) raise ``SandboxError``; the agent's own timeouts do not.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import io
import os
import queue
import re
import shlex
import socket
import tarfile
import threading
import time
import uuid

import docker
import requests

from jaxes.envs.images.base_image import DEFAULT_TAG, SANDBOX_HOME, SANDBOX_UID, SANDBOX_USER
from jaxes.envs.tasks import final_tests, harbor
from jaxes.envs.sandboxes.sandbox import (ExecResult, HostError, OutputCapture, Sandbox, SandboxError,
                                SandboxHandle, TestReport, refused_command)
from jaxes.envs.tasks.task import Limits, Task

LABEL = "jaxes.sandbox"
RUN_LABEL = "jaxes.run"
OWNER_LABEL = "jaxes.owner"
TESTS_DIR = "/var/lib/jaxes-tests"   # root-only: the verifier's job files
STAGE = "/var/lib/jaxes-stage"      # root-only: task files on their way into the capped space
CTL = "/run/jaxes"                   # the agent shell's saved state (cwd, exported variables)
MAX_READ_BYTES = 16 << 20            # a command printing more than this is killed
KILL_EXIT_CODE = 137                 # what `timeout -s KILL` returns when it fires
KILL_WAIT_S = 10.0                   # how long a kill waits for the agent's processes to go
# Absolute paths: commands run as root are never looked up on the task's PATH, which may name
# a directory the agent can write (ENV PATH=/app/bin:$PATH would run its `timeout` as root).
TIMEOUT, SETPRIV, BASH, PYTHON = "/usr/bin/timeout", "/usr/bin/setpriv", "/bin/bash", "/usr/bin/python3"
SHELL_ENV = {
  "HOME": SANDBOX_HOME, "USER": SANDBOX_USER, "LOGNAME": SANDBOX_USER, "SHELL": "/bin/bash",
  "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
  "LC_ALL": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
# Kills every process of the agent's user but this shell in one `kill -1` pass, then waits
# (boundedly, without forking) until init has reaped them, so their pids are free again.
# Returns 1 if some are still there.
_REAP = """\
_jaxes_reap() {
  kill -KILL -1 2>/dev/null
  local _ p
  for _ in {1..500}; do
    for p in /proc/[0-9]*; do [ -O "$p" ] && [ "${p#/proc/}" != $$ ] && continue 2; done
    return 0
  done
  return 1
}"""
# Restores the previous command's cwd and exported variables, applies rlimits, runs the command
# sourced (so `cd`, `export` and `exit` behave as in a terminal), saves the state again and
# kills whatever the command left running (as the local backend's per-command pid namespace
# does), so background jobs, `setsid` escapees and fork bombs never outlive their command.
# `kill -1` reaches every process of the agent's user but the shell itself in one pass that the
# kernel makes atomic with respect to fork; the `timeout` above the shell runs as root, so it
# survives to report the command's exit status.
_PRELUDE = """\
ulimit -S -c 0
ulimit -t {cpu} -f {fsize_blocks} 2>/dev/null
cd {home}
if [ -f {ctl}/env ]; then . {ctl}/env 2>/dev/null; fi
if [ -f {ctl}/cwd ]; then cd "$(< {ctl}/cwd)" 2>/dev/null; fi
{reap}
trap 'pwd > {ctl}/cwd 2>/dev/null; export -p > {ctl}/env 2>/dev/null; _jaxes_reap' EXIT
printf '%s\\n' "$1" > {ctl}/cmd
shift
. {ctl}/cmd
"""
# Existing directories (/tmp, the home) keep their owner and mode.
_UNSTAGE = f"tar -C {STAGE} -cf - . | tar -C / -xpf - --no-overwrite-dir && rm -rf {STAGE}\n"
# Prints each argument that the agent's user could write, or owns, or whose parent directories it
# could write or owns (it could have put anything there).
_AGENT_WRITABLE = """\
for path in "$@"; do
  p="$path"
  while [ -n "$p" ]; do
    if [ -e "$p" ] && { [ -w "$p" ] || [ -O "$p" ]; }; then printf '%s\\n' "$path"; break; fi
    [ "$p" = / ] && break
    p="${p%/*}"; p="${p:-/}"
  done
done"""
ROOT_HOME = "/root"                               # test.sh's HOME, as in Harbor, when the agent
VERIFIER_HOME = "/var/lib/jaxes-verifier/home"   # could not touch it; else this one, made fresh
_DOCKER_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)


def _process_start_time(pid: int) -> str | None:
  """Kernel start time of ``pid`` (guards against pid reuse); None if no such process."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      # Field 22 (starttime); the command name (field 2) may contain spaces, so split after ')'.
      return f.read().rsplit(")", 1)[1].split()[19]
  except (FileNotFoundError, ProcessLookupError, IndexError):
    return None


def owner_tag(pid: int | None = None) -> str:
  pid = os.getpid() if pid is None else pid
  return f"{socket.gethostname()}:{pid}:{_process_start_time(pid)}"


def owner_alive(tag: str) -> bool:
  """Whether the process named by an owner label still runs. Other hosts' owners count as alive."""
  host, _, rest = tag.partition(":")
  pid, _, start_time = rest.partition(":")
  if host != socket.gethostname() or not pid.isdigit():
    return True
  return _process_start_time(int(pid)) == start_time


def remove_orphans(client) -> int:
  """Removes sandbox containers whose owner process (on this host) is dead. Returns how many."""
  removed = 0
  for container in client.containers.list(all=True, filters={"label": f"{LABEL}=1"},
                                          ignore_removed=True):
    if not owner_alive(container.labels.get(OWNER_LABEL, "")):
      _force_remove(container)
      removed += 1
  return removed


def list_run_containers(client, run_label: str) -> list:
  # ignore_removed: a container removed between the engine's listing and the SDK's inspection
  # of it (a pool refill, a concurrent sweep) is gone, not an error.
  return client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_label}"},
                                ignore_removed=True)


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
  """What one episode's container is created with: its image, limits, and the names of the
  image's ENV variables to blank in the container's own environment (a task-built image's ENV
  is the task's: the agent's commands get it, but docker would also hand it to every root exec,
  where LD_PRELOAD=/app/lib/x.so or PYTHONPATH=/app would run the agent's files as root)."""
  image: str
  memory_mb: int
  pids: int
  cpus: float
  blank_env: tuple[str, ...] = ()
  disk_mb: int = Limits().disk_mb   # cap of each of the agent's writable directories


def _force_remove(container) -> None:
  try:
    # v: with the anonymous volumes a task image's VOLUME made (they would outlive it on the
    # host's disk, holding what the agent wrote there).
    container.remove(force=True, v=True)
  except docker.errors.NotFound:
    pass
  except _DOCKER_ERRORS:
    # A removal already in progress or an engine hiccup; the run-label sweep retries later.
    pass


# The agent's writable space, capped per episode. overlay2 caps a container's writable layer only
# on xfs with project quotas (``--storage-opt size``); on any other backing filesystem (ext4
# here) nothing stops a write, so each directory the agent can write in our image is a size- and
# inode-capped tmpfs instead: a write stops at the cap with ENOSPC, the pages count against the
# container's memory limit, and they vanish with the container, never on the host's disk. A
# task-built image keeps its own home and /run (a tmpfs would hide what its recipe put there).
_INODES_PER_MB = 256
_RUN_MB = 16


def agent_tmpfs(disk_mb: int, our_image: bool) -> dict[str, str]:
  """Docker ``tmpfs=`` mounts for an episode: path -> mount options."""
  capped = f"size={disk_mb}m,nr_inodes={disk_mb * _INODES_PER_MB},exec"
  mounts = {"/tmp": f"{capped},mode=1777", "/var/tmp": f"{capped},mode=1777"}
  if our_image:
    mounts[SANDBOX_HOME] = f"{capped},mode=0755,uid={SANDBOX_UID},gid={SANDBOX_UID}"
    mounts["/run"] = f"size={_RUN_MB}m,nr_inodes={_RUN_MB * _INODES_PER_MB},mode=0755"
  return mounts


def _tar_files(files, home: str, prefix: str = "") -> bytes:
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w") as tar:
    for path, data in files:
      if not path.startswith("/"):
        raise SandboxError(f"task file path must be absolute, got {path!r}")
      info = tarfile.TarInfo((prefix + path).lstrip("/"))
      info.size = len(data)
      info.mode = 0o755 if data.startswith(b"#!") else 0o644
      owned = path == home or path.startswith(home + "/")
      info.uid = info.gid = SANDBOX_UID if owned else 0
      info.mtime = int(time.time())
      tar.addfile(info, io.BytesIO(data))
  return buffer.getvalue()


def _tar_private(path: str, data: bytes) -> bytes:
  """A tar of one root-only file in a root-only directory."""
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w") as tar:
    folder = tarfile.TarInfo(os.path.dirname(path).lstrip("/"))
    folder.type, folder.mode = tarfile.DIRTYPE, 0o700
    tar.addfile(folder)
    info = tarfile.TarInfo(path.lstrip("/"))
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))
  return buffer.getvalue()


class DockerSandbox(Sandbox):
  """Starts one container per episode. Thread-safe: sandbox workers may call ``start`` and use
  their handles concurrently.

  pool_size:      containers kept created and running ahead of demand (0 = none).
  cpus, memory_mb, pids: container limits; a task whose Limits ask for less gets less.
  create_retries: retries after a failed create/start, with exponential backoff.
  exec_grace_s:   an exec still running this long after its timeout is an infrastructure fault
                  (the container is removed and SandboxError raised).
  check_initial_state: run the task's initial_tests after setup; failing ones raise SandboxError.
  verifier_network: a docker network a Harbor test.sh gets (None: none, the default), joined
                  only once every agent process is gone and left before the reward is read:
                  for Terminal-Bench-2 tests that install their tools at test time.
  """

  def __init__(self, image: str = DEFAULT_TAG, run_label: str | None = None, pool_size: int = 0,
               cpus: float = 1.0, memory_mb: int = 2048, pids: int = 256,
               create_retries: int = 3, retry_backoff_s: float = 0.5,
               exec_grace_s: float = 15.0, setup_timeout_s: float = 120.0,
               check_initial_state: bool = False, verifier_network: str | None = None,
               client=None):
    if pool_size < 0 or create_retries < 0:
      raise ValueError("pool_size and create_retries must be >= 0")
    try:
      self._client = client or docker.from_env(max_pool_size=64)
      self._client.images.get(image)
    except docker.errors.ImageNotFound as err:
      raise SandboxError(
        f"docker image {image!r} not found; build it with `python -m jaxes.envs.images.base_image build "
        f"--tag {image}` (or bash launch/docker/setup.sh)") from err
    except _DOCKER_ERRORS as err:
      raise SandboxError(f"no docker engine answers: {err}") from err
    self.image = image
    self.run_label = run_label or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    self.cpus, self.memory_mb, self.pids = cpus, memory_mb, pids
    self.create_retries, self.retry_backoff_s = create_retries, retry_backoff_s
    self.exec_grace_s, self.setup_timeout_s = exec_grace_s, setup_timeout_s
    self.check_initial_state = check_initial_state
    self.verifier_network = verifier_network
    if verifier_network is not None:
      try:
        self._client.networks.get(verifier_network)
      except _DOCKER_ERRORS as err:
        raise SandboxError(f"verifier_network={verifier_network!r}: no such docker network "
                           f"({err})") from err
    self.pool_size = pool_size
    self._owner = owner_tag()
    self._closed = threading.Event()
    self._volumes: set[str] = set()   # anonymous volumes of this run's containers not seen gone
    self._volumes_lock = threading.Lock()
    self.orphans_removed = remove_orphans(self._client)
    for container in list_run_containers(self._client, self.run_label):
      _force_remove(container)
    self._pool: queue.Queue = queue.Queue()
    self._refiller = None
    if pool_size:
      self._refiller = concurrent.futures.ThreadPoolExecutor(
        max_workers=min(pool_size, 4), thread_name_prefix="jaxes-docker-pool")
      for _ in range(pool_size):
        self._refiller.submit(self._refill_one)
    atexit.register(self.shutdown)

  # -- containers ---------------------------------------------------------------------------

  def _default_spec(self) -> ContainerSpec:
    return ContainerSpec(self.image, self.memory_mb, self.pids, self.cpus)

  def _spec_for(self, task: Task) -> ContainerSpec:
    """The task's own image when it has one (built from its recipe), else ours; the task's
    limits where they ask for less than the sandbox's."""
    blank = tuple(sorted({key for key, _ in task.env} - set(SHELL_ENV))) if task.image else ()
    return ContainerSpec(task.image or self.image, min(self.memory_mb, task.limits.memory_mb),
                         min(self.pids, task.limits.processes), min(self.cpus, task.limits.cpus),
                         blank, disk_mb=task.limits.disk_mb)

  def _create_container(self, spec: ContainerSpec):
    # entrypoint=[]: a task image's ENTRYPOINT (and CMD) never runs; the episode's only
    # processes are docker's init, `sleep` and the execs we start.
    container = self._client.containers.create(
      spec.image, ["sleep", "infinity"], entrypoint=[], init=True, network_mode="none",
      user="root",
      working_dir=SANDBOX_HOME, environment={key: "" for key in spec.blank_env} or None,
      mem_limit=f"{spec.memory_mb}m",
      memswap_limit=f"{spec.memory_mb}m", pids_limit=spec.pids, nano_cpus=int(spec.cpus * 1e9),
      security_opt=["no-new-privileges"], tmpfs=agent_tmpfs(spec.disk_mb, spec.image == self.image),
      labels={LABEL: "1", RUN_LABEL: self.run_label, OWNER_LABEL: self._owner})
    with self._volumes_lock:
      self._volumes.update(m["Name"] for m in container.attrs.get("Mounts") or ()
                           if m.get("Type") == "volume")
    try:
      container.start()
    except BaseException:
      _force_remove(container)
      raise
    return container

  def _create_with_retries(self, spec: ContainerSpec):
    errors = []
    for attempt in range(self.create_retries + 1):
      if self._closed.is_set():
        raise SandboxError("sandbox is shut down")
      try:
        return self._create_container(spec)
      except _DOCKER_ERRORS as err:
        errors.append(f"attempt {attempt + 1}: {err}")
        if attempt < self.create_retries:
          time.sleep(self.retry_backoff_s * 2 ** attempt)
    raise SandboxError("could not start a container:\n" + "\n".join(errors))

  def _refill_one(self) -> None:
    try:
      container = self._create_with_retries(self._default_spec())
    except SandboxError:
      return  # start() creates on demand when the pool is empty
    if self._closed.is_set():
      _force_remove(container)
    else:
      self._pool.put(container)

  def _take_pooled(self):
    while True:
      try:
        container = self._pool.get_nowait()
      except queue.Empty:
        return None
      if not self._closed.is_set():
        self._refiller.submit(self._refill_one)
      try:
        container.reload()
        if container.status == "running":
          return container
      except _DOCKER_ERRORS:
        pass
      _force_remove(container)

  # -- episodes -----------------------------------------------------------------------------

  def start(self, task: Task) -> "DockerHandle":
    if self._closed.is_set():
      raise SandboxError("sandbox is shut down")
    spec = self._spec_for(task)
    container = None
    if self._refiller is not None and spec == self._default_spec():
      container = self._take_pooled()
    if container is None:
      container = self._create_with_retries(spec)
    handle = DockerHandle(self, container, task)
    try:
      handle.prepare()
    except BaseException:
      handle.close()
      raise
    return handle

  def leftovers(self) -> dict[str, int]:
    """Containers of this run that still exist (pooled ones included until shutdown), and the
    anonymous volumes (a task image's VOLUME) they made that still exist."""
    try:
      containers = len(list_run_containers(self._client, self.run_label))
      with self._volumes_lock:
        names = list(self._volumes)
      left = []
      for name in names:
        try:
          self._client.volumes.get(name)
          left.append(name)
        except docker.errors.NotFound:
          pass
      with self._volumes_lock:
        self._volumes &= set(left) | (self._volumes - set(names))
    except _DOCKER_ERRORS as err:
      raise SandboxError(f"cannot list containers: {err}") from err
    return {"containers": containers, "volumes": len(left)}

  def shutdown(self) -> None:
    """Removes every container this run created (pooled, live or leaked). Idempotent."""
    self._closed.set()
    if self._refiller is not None:
      self._refiller.shutdown(wait=True, cancel_futures=True)
    while not self._pool.empty():
      _force_remove(self._pool.get_nowait())
    try:
      for container in list_run_containers(self._client, self.run_label):
        _force_remove(container)
    except _DOCKER_ERRORS:
      pass  # engine gone: nothing we can remove; the next run's orphan sweep will
    atexit.unregister(self.shutdown)


class DockerHandle(SandboxHandle):
  """One episode's container. Like the local backend, each command is a fresh shell that
  restores the previous command's working directory and exported variables."""

  def __init__(self, sandbox: DockerSandbox, container, task: Task):
    self._sandbox = sandbox
    self._container = container
    self._task = task
    self._env = {**SHELL_ENV, **dict(task.env)}
    self._broken: SandboxError | None = None
    self._closed = False
    self._removed_by_us = False

  @property
  def container_id(self) -> str:
    return self._container.id

  def _fail(self, reason: str, cause: BaseException | None = None):
    # An engine that does not answer, or a container stopped or removed by someone else (an
    # operator, the engine) is the host's fault: retried, left out of fitness. Anything else
    # (an exec that hangs, the container OOM-killed by what the agent ran) the agent's
    # commands may have caused: a failed episode.
    host = isinstance(cause, requests.exceptions.ConnectionError) or self._stopped_from_outside()
    if host and not isinstance(cause, requests.exceptions.ConnectionError):
      reason += " (the container was stopped from outside, not by its memory limit)"
    self._broken = (HostError if host else SandboxError)(reason)
    raise self._broken from cause

  def _stopped_from_outside(self) -> bool:
    """Whether the container is gone or stopped, and not by the kernel's OOM killer (docker's
    ``State.OOMKilled``: the agent's processes filled its memory limit)."""
    if self._removed_by_us:
      return False
    try:
      self._container.reload()
    except docker.errors.NotFound:
      return True
    except _DOCKER_ERRORS:
      return False
    state = self._container.attrs.get("State") or {}
    return not state.get("Running", True) and not state.get("OOMKilled", False)

  def _exec(self, argv: list[str], user: str, timeout_s: float, cap_chars: int,
            environment: dict[str, str] | None = None) -> tuple[int, str, int, float, bool]:
    """Runs argv (which must end by itself within timeout_s) with ``environment`` (default:
    the task's); returns (exit code, capped output, true output length, seconds, flooded)."""
    if self._closed:
      raise HostError("exec on a closed sandbox handle")
    if self._broken:
      raise type(self._broken)(str(self._broken))
    api = self._sandbox._client.api
    started = time.monotonic()
    try:
      exec_id = api.exec_create(self._container.id, argv, user=user, workdir=SANDBOX_HOME,
                                environment=self._env if environment is None else environment)["Id"]
    except _DOCKER_ERRORS as err:
      self._fail(f"container {self._container.short_id} unusable: {err}", err)
    output = OutputCapture(cap_chars)
    stream_error: list[BaseException] = []
    flooded = threading.Event()

    def pump():
      read = 0
      try:
        for chunk in api.exec_start(exec_id, stream=True):
          if read < MAX_READ_BYTES:
            output.feed(chunk)
          read += len(chunk)
          if read >= MAX_READ_BYTES and not flooded.is_set():
            flooded.set()
            # Kill from another thread and keep draining: a stream nobody reads stalls the
            # engine's exec machinery for this container, the kill included.
            threading.Thread(target=self._kill_agent_processes, daemon=True).start()
      except BaseException as err:  # reported to the caller below
        stream_error.append(err)

    reader = threading.Thread(target=pump, daemon=True, name="jaxes-docker-exec")
    reader.start()
    reader.join(timeout_s + self._sandbox.exec_grace_s)
    if reader.is_alive():
      self._removed_by_us = True
      _force_remove(self._container)  # ends the stream, frees the reader thread
      reader.join(5.0)
      self._fail(f"exec in container {self._container.short_id} still running "
                 f"{self._sandbox.exec_grace_s:g} s past its {timeout_s:g} s timeout")
    if stream_error:
      self._fail(f"exec stream failed: {stream_error[0]}", stream_error[0])
    try:
      exit_code = api.exec_inspect(exec_id)["ExitCode"]
    except _DOCKER_ERRORS as err:
      self._fail(f"exec inspect failed: {err}", err)
    return ((-1 if exit_code is None else exit_code), output.text(), output.total_chars,
            time.monotonic() - started, flooded.is_set())

  def _kill_agent_processes(self) -> None:
    """Kills every process of the agent's user (a flooding or timed-out command and anything
    it spawned, even in a new session), then waits until they are gone.

    ``kill -KILL -1`` from a shell of the agent's user signals all of that user's processes in
    one pass the kernel makes atomic with respect to fork, so a fork bomb cannot outrun it
    (``pkill`` reads /proc first and misses children forked meanwhile). Being a builtin, it
    needs no fork itself, which matters when the bomb has used up the container's pids limit.
    Until init has reaped them their pids stay taken, so it waits for /proc to show none of the
    user's processes but the killing shell.
    """
    script = _REAP + "\n_jaxes_reap"
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
      try:
        exit_code, _ = self._container.exec_run([BASH, "--noprofile", "--norc", "-c", script],
                                                user=SANDBOX_USER)
      except _DOCKER_ERRORS:
        return  # the container is gone or the timeout still kills the command
      if exit_code == 0 or time.monotonic() > deadline:
        return
      time.sleep(0.05)

  def _root_script(self, script: str, timeout_s: float, cap_chars: int = 200_000,
                   environment: dict[str, str] | None = None):
    argv = [TIMEOUT, "-s", "KILL", f"{timeout_s:g}s", BASH, "-c", script]
    exit_code, output, _, seconds, _ = self._exec(argv, "root", timeout_s, cap_chars,
                                                  environment)
    return exit_code, output, seconds

  def prepare(self) -> None:
    """Places the task's files, runs its setup as root, hands /home/user to the agent."""
    task = self._task
    if task.files:
      try:
        # The engine's archive copy cannot see tmpfs mounts: stage, then move in from inside.
        self._container.put_archive("/", _tar_files(task.files, SANDBOX_HOME, prefix=STAGE))
      except _DOCKER_ERRORS as err:
        raise SandboxError(f"task {task.name}: placing files failed: {err}") from err
    timeout_s = self._sandbox.setup_timeout_s
    exit_code, output, seconds = self._root_script(
      f"set -e\n{_UNSTAGE if task.files else ''}mkdir -p /run/lock && chmod 1777 /run/lock\n"
      f"cd {SANDBOX_HOME}\n{task.setup}\n"
      f"mkdir -p {CTL} && chown -R {SANDBOX_UID}:{SANDBOX_UID} {SANDBOX_HOME} {CTL}", timeout_s)
    if exit_code != 0:
      what = "timed out" if exit_code == KILL_EXIT_CODE and seconds >= timeout_s else (
        f"exited {exit_code}")
      raise SandboxError(f"task {task.name}: setup {what}:\n{output[-2000:]}")
    if self._sandbox.check_initial_state and task.initial_tests:
      report = self._verify(task.initial_tests, "test_initial_state.py",
                            task.limits.test_timeout_s)
      if not report.passed:
        raise SandboxError(f"task {task.name}: initial-state tests failed:\n"
                           f"{report.report[-2000:]}")

  def exec(self, command: str, timeout_s: float) -> ExecResult:
    refused = refused_command(command)
    if refused is not None:
      return refused
    limits = self._task.limits
    prelude = _PRELUDE.format(cpu=limits.cpu_s, fsize_blocks=limits.file_size_mb * 1024,
                              home=SANDBOX_HOME, ctl=CTL, reap=_REAP)
    # timeout (root) runs the command in its own process group and SIGKILLs the whole group;
    # setpriv drops to the agent's user below it, out of reach of the agent's `kill -1`.
    argv = [TIMEOUT, "-s", "KILL", f"{timeout_s:g}s",
            SETPRIV, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--init-groups",
            "--inh-caps=-all", "--",
            BASH, "--noprofile", "--norc", "-c", prelude, "jaxes-shell", command]
    exit_code, output, chars, seconds, flooded = self._exec(
      argv, "root", timeout_s, limits.output_chars)
    timed_out = exit_code == KILL_EXIT_CODE and seconds >= timeout_s and not flooded
    if timed_out:  # the KILL skipped the prelude's clean-up
      self._kill_agent_processes()
    if flooded:
      output += f"\n[output exceeded {MAX_READ_BYTES >> 20} MiB; the command was killed]"
    return ExecResult(exit_code=-1 if (timed_out or flooded) else exit_code, output=output,
                      timed_out=timed_out, output_chars=chars)

  def _verify(self, source: str, filename: str, timeout_s: float) -> TestReport:
    """Runs a test file with pytest under ``final_tests.VERIFIER``: started as root, it reads
    its job (test source, per-run key) from a root-only file, deletes it, drops to the agent's
    uid and makes itself non-dumpable before any test runs, so the agent's programs that the
    tests run never run as root, cannot read the tests' expected values, and cannot ptrace
    the verifier or forge its MAC'd verdict. Agent processes are all killed first."""
    self._kill_agent_processes()
    limits = self._task.limits
    key = final_tests.new_key()
    job = final_tests.verifier_job(source, key, "pytest", path=f"{TESTS_DIR}/{filename}",
                                   cwd=SANDBOX_HOME, cpu_s=limits.cpu_s,
                                   mem_bytes=limits.memory_mb << 20, uid=SANDBOX_UID)
    job_path = f"{TESTS_DIR}/job-{uuid.uuid4().hex}.json"
    try:
      self._container.put_archive("/", _tar_private(job_path, job))
    except _DOCKER_ERRORS as err:
      self._fail(f"copying tests failed: {err}", err)
    argv = [TIMEOUT, "-s", "KILL", f"{timeout_s:g}s",
            PYTHON, "-I", "-B", "-c", final_tests.VERIFIER, job_path]
    # The shell's fixed environment, never the task's ENV (LD_LIBRARY_PATH, PYTHONPATH…), which
    # would otherwise steer the root-phase verifier.
    exit_code, output, _, seconds, _ = self._exec(argv, "root", timeout_s, 200_000, SHELL_ENV)
    timed_out = exit_code == KILL_EXIT_CODE and seconds >= timeout_s
    verdict = None if timed_out else final_tests.parse_verdict(output, key)
    if verdict is None:
      return TestReport(False, 0, final_tests.count_tests(source), timed_out, output)
    num_passed, num_failed, collected, status = verdict
    if status == final_tests.CWD_UNUSABLE:
      return TestReport(False, 0, final_tests.count_tests(source), False, output)
    if status != "ok":
      self._fail(f"the verifier could not run ({status}): {output[-500:]}")
    if not final_tests.counts_hold(source, num_passed, num_failed):
      return TestReport(False, 0, final_tests.count_tests(source), False,
                        f"{output}\n{final_tests.MORE_THAN_COLLECTED}")
    num_tests = num_passed + num_failed if collected else final_tests.count_tests(source)
    passed = collected and num_tests > 0 and num_failed == 0
    return TestReport(passed=passed, num_passed=num_passed if collected else 0,
                      num_tests=num_tests, timed_out=False, report=output)

  def _as_agent(self, script: str, timeout_s: float, environment: dict[str, str] | None = None,
                cap_chars: int = 200_000, argv_tail: list[str] = ()):
    """Runs a bash script (with ``argv_tail`` as its arguments) as the agent's user (not the
    agent's shell: no saved state)."""
    argv = [TIMEOUT, "-s", "KILL", f"{timeout_s:g}s",
            SETPRIV, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--init-groups",
            "--inh-caps=-all", "--", BASH, "--noprofile", "--norc", "-c", script, "jaxes-check",
            *argv_tail]
    exit_code, output, _, seconds, _ = self._exec(argv, "root", timeout_s, cap_chars,
                                                  environment)
    return exit_code, output, seconds

  def _verifier_env(self) -> dict[str, str]:
    """test.sh's environment: the image's ENV (Harbor's), minus every PATH entry, and every
    variable naming a path, that the agent could have written (an entry that is not absolute
    is such a path: it names the working directory), with root's HOME (what the image put
    there, a pre-installed tool, stays usable) unless the agent could write it, else a fresh
    one, and python's implicit imports (the working directory, the user site) off."""
    env = dict(SHELL_ENV)
    env.update(self._task.env)
    paths = sorted({p for value in env.values() for p in re.split(r"[\s:;,=]+", value)
                    if p.startswith("/")} | {ROOT_HOME})
    # One shell as the agent's user says which of them (or of their parents) it can write or
    # owns. Its processes are all gone by now; what they left is what counts.
    code, output, _ = self._as_agent(_AGENT_WRITABLE, 30.0, SHELL_ENV, argv_tail=paths)
    if code != 0:
      self._fail(f"task {self._task.name}: could not check the verifier's paths: {output[-300:]}")
    tainted = set(output.splitlines())
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":")
                           if p.startswith("/") and p not in tainted) or SHELL_ENV["PATH"]
    env = {key: value for key, value in env.items() if key == "PATH" or not (
      set(re.split(r"[\s:;,=]+", value)) & tainted)}
    env.update(HOME=VERIFIER_HOME if ROOT_HOME in tainted else ROOT_HOME, USER="root", LOGNAME="root", PYTHONNOUSERSITE="1",
               PYTHONSAFEPATH="1", PYTHONDONTWRITEBYTECODE="1")
    return env

  def _run_test_script(self) -> TestReport:
    """Harbor's verifier, run so that no file of the agent's can steer it: once every process
    of the agent's user is gone, the working directory is handed back to root, a fresh
    root-owned ``/tests`` and ``/logs/verifier`` (unwritable by the agent's uid) are made,
    and ``tests/test.sh`` runs as root, as in Harbor, in the image's working directory with
    ``_verifier_env``. The reward files are read by the host (regular files only, at most
    ``harbor.MAX_REWARD_BYTES``); anything unreadable is a failed episode, never an excluded one.
    Tests that run the agent's programs give them root in the container, as Harbor does: those
    programs can write the reward (docs/envs.md, "Harbor's verifier")."""
    self._kill_agent_processes()
    task, timeout_s = self._task, self._task.limits.test_timeout_s
    workdir = shlex.quote(task.workdir or SANDBOX_HOME)
    env = self._verifier_env()
    # The working directory goes back to root (as it was in the image, and as it is after a
    # Harbor agent, who runs as root): nothing in it is the agent's to change any more.
    give_back = f" && chown -hR 0:0 {workdir}" if workdir != "/" else ""
    exit_code, output, _ = self._root_script(
      f"rm -rf {harbor.TESTS_DIR} {harbor.LOGS_DIR} {VERIFIER_HOME} && "
      f"install -d -o 0 -g 0 -m 0755 /logs {harbor.LOGS_DIR} && "
      f"install -d -o 0 -g 0 -m 0700 {VERIFIER_HOME} && "
      f"{{ [ -d {ROOT_HOME} ] || install -d -o 0 -g 0 -m 0700 {ROOT_HOME}; }}{give_back}", 30.0,
      environment=SHELL_ENV)
    if exit_code != 0:
      self._fail(f"task {task.name}: could not prepare the verifier's folders: {output[-500:]}")
    files = [(f"{harbor.TESTS_DIR}/{path}", data) for path, data in task.verifier_files]
    try:
      self._container.put_archive("/", _tar_files(files, SANDBOX_HOME))
    except _DOCKER_ERRORS as err:
      self._fail(f"copying tests failed: {err}", err)
    network = self._sandbox.verifier_network
    if network is not None:   # docker joins no network to a container still in "none"
      self._network("disconnect", "none")
      self._network("connect", network)
    exit_code, output, seconds = self._root_script(
      f"cd {workdir} && exec {BASH} {harbor.TESTS_DIR}/test.sh", timeout_s, environment=env)
    if network is not None:
      self._network("disconnect", network)
    timed_out = exit_code == KILL_EXIT_CODE and seconds >= timeout_s
    if timed_out:
      return TestReport(False, 0, 1, True, output)
    texts = []
    for path in (harbor.REWARD_TXT, harbor.REWARD_JSON):
      code, text, _ = self._root_script(
        f"[ -f {path} ] && [ ! -L {path} ] || exit 3; exec /usr/bin/head -c "
        f"{harbor.MAX_REWARD_BYTES + 1} -- {path}", 10.0, environment=SHELL_ENV)
      texts.append(text if code == 0 else None)
    try:
      reward = harbor.parse_reward(*texts)
    except harbor.RewardError as err:
      return TestReport(False, 0, 1, False, f"{output}\n{err}\nreward: 0")
    passed = reward >= 1.0
    return TestReport(passed, int(passed), 1, False, f"{output}\nreward: {reward:g}")

  def _network(self, action: str, name: str) -> None:
    try:
      getattr(self._sandbox._client.networks.get(name), action)(self._container)
    except _DOCKER_ERRORS as err:
      self._fail(f"could not {action} the verifier's network {name}: {err}", err)

  def run_tests(self) -> TestReport:
    if self._task.verifier_files:
      return self._run_test_script()
    return self._verify(self._task.final_tests, "test_final_state.py",
                        self._task.limits.test_timeout_s)

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      _force_remove(self._container)
