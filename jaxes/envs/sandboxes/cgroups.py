"""Per-episode cgroups for the local sandbox: memory, processes and CPU of an episode as a whole.

rlimits bound each process; a cgroup bounds all of an episode's processes together (three
1.5 GB processes cannot take 4.5 GB of a 2 GB episode). We use cgroup v2 where our own cgroup
can hand the memory and pids controllers to children, else the cgroup v1 memory, pids, cpu and
freezer hierarchies; ``layout()`` is None where neither is writable (not root, a read-only cgroupfs),
and the caller warns. Every process of an episode is started by a root ``sh`` that writes
itself into the episode's ``cgroup.procs`` files and only then execs the sandbox as the
agent's uid, so nothing it forks is ever outside the cgroup. A kill is bounded by time and
escalates to freezing the episode between listing its processes and killing them.

Cgroups are named ``jaxes-<pid>-<hex>/ep-<hex>`` under our own cgroup; ``remove_orphans``
removes those of dead runs.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import re
import signal
import time
import uuid

log = logging.getLogger(__name__)

# memory and pids are required. The freezer comes first: removing a run's cgroups then thaws
# (and kills) what a crash left frozen before the other hierarchies wait for it to go.
V1_CONTROLLERS = ("freezer", "memory", "pids", "cpu")
_PREFIX = "jaxes-"
KILL_DEADLINE_S = 10.0   # how long a kill waits for an episode's processes to be gone
FREEZE_WAIT_S = 0.5      # how long one freeze waits for every process to stop

# Moves itself into every cgroup.procs named before "--", then execs the rest.
JOIN_SH = ('for f; do [ "$f" = -- ] && break; echo 0 > "$f" || exit 126; shift; done; '
           'shift; exec "$@"')


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where runs' cgroups go: one directory per hierarchy (v2: one for all controllers)."""
  version: int
  bases: tuple[str, ...]
  controllers: tuple[str, ...]


def _mount_points() -> dict[str, tuple[str, str]]:
  """controller ("" for v2) -> (mount point, mount root) of the cgroup filesystems."""
  found = {}
  with open("/proc/self/mountinfo") as f:
    for line in f:
      left, _, right = line.partition(" - ")
      fields, (fstype, _, options) = left.split(), right.split()[:3]
      root, point = fields[3], fields[4].replace("\\040", " ")
      if fstype == "cgroup2":
        found.setdefault("", (point, root))
      elif fstype == "cgroup":
        for name in options.split(","):
          if name in V1_CONTROLLERS:
            found.setdefault(name, (point, root))
  return found


def _own_paths() -> dict[str, str]:
  """controller ("" for v2) -> our cgroup's path in that hierarchy."""
  paths = {}
  with open("/proc/self/cgroup") as f:
    for line in f:
      _, names, path = line.rstrip("\n").split(":", 2)
      for name in names.split(",") if names else [""]:
        paths[name] = path
  return paths


def _own_dir(point: str, root: str, path: str) -> str:
  """The directory of cgroup ``path`` in a hierarchy mounted at ``point`` from ``root``."""
  rel = os.path.relpath(path, root) if root != "/" and path.startswith(root) else path.lstrip("/")
  return os.path.normpath(os.path.join(point, "" if rel == "." else rel))


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _try_v2(mounts, own) -> Layout | None:
  if "" not in mounts or "" not in own:
    return None
  base = _own_dir(*mounts[""], own[""])
  try:
    with open(os.path.join(base, "cgroup.controllers")) as f:
      available = f.read().split()
  except OSError:
    return None
  if not {"memory", "pids"} <= set(available):
    return None
  wanted = [c for c in ("memory", "pids", "cpu") if c in available]
  try:   # a non-root cgroup with processes in it cannot delegate (no internal processes)
    _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
    probe = os.path.join(base, f"{_PREFIX}probe-{uuid.uuid4().hex[:8]}")
    os.mkdir(probe)
    os.rmdir(probe)
  except OSError:
    return None
  return Layout(2, (base,), tuple(wanted))


def _try_v1(mounts, own) -> Layout | None:
  bases, names = [], []
  for name in V1_CONTROLLERS:
    if name not in mounts or name not in own:
      continue
    base = _own_dir(*mounts[name], own[name])
    probe = os.path.join(base, f"{_PREFIX}probe-{uuid.uuid4().hex[:8]}")
    try:
      os.mkdir(probe)
      os.rmdir(probe)
    except OSError:
      continue
    bases.append(base)
    names.append(name)
  if not {"memory", "pids"} <= set(names):
    return None
  return Layout(1, tuple(bases), tuple(names))


@functools.lru_cache(maxsize=None)
def layout() -> Layout | None:
  """How this machine lets us make cgroups, or None (checked once per process)."""
  try:
    mounts, own = _mount_points(), _own_paths()
  except OSError:
    return None
  return _try_v2(mounts, own) or _try_v1(mounts, own)


def _procs(directory: str) -> list[int]:
  try:
    with open(os.path.join(directory, "cgroup.procs")) as f:
      return [int(line) for line in f if line.strip()]
  except (FileNotFoundError, ProcessLookupError):
    return []
  except OSError as e:
    if e.errno == errno.ENODEV:   # removed while being read (another process removing an orphan)
      return []
    raise


class Freezer:
  """The freezer of one cgroup: v2's ``cgroup.freeze``, or a v1 freezer hierarchy's
  ``freezer.state``. A frozen cgroup's processes can no longer fork; SIGKILL reaches frozen v2
  processes at once, frozen v1 ones once thawed."""

  def __init__(self, directory: str, version: int):
    self.directory, self.version = directory, version

  @staticmethod
  def of(directory: str) -> "Freezer | None":
    """The freezer a cgroup directory carries itself (v2, or v1's freezer hierarchy), or None."""
    for name, version in (("cgroup.freeze", 2), ("freezer.state", 1)):
      if os.path.exists(os.path.join(directory, name)):
        return Freezer(directory, version)
    return None

  def _frozen(self) -> bool:
    if self.version == 2:
      with open(os.path.join(self.directory, "cgroup.events")) as f:
        return "frozen 1" in f.read().splitlines()
    with open(os.path.join(self.directory, "freezer.state")) as f:
      return f.read().strip() == "FROZEN"

  def freeze(self, wait_s: float) -> bool:
    """Freezes; True once every process is frozen (within ``wait_s``; a process stuck in the
    kernel may keep a freeze from completing)."""
    try:
      if self.version == 2:
        _write(os.path.join(self.directory, "cgroup.freeze"), "1")
      else:
        _write(os.path.join(self.directory, "freezer.state"), "FROZEN")
      deadline, pause = time.monotonic() + wait_s, 0.001
      while not self._frozen():
        if time.monotonic() > deadline:
          return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
      return True
    except OSError:   # removed meanwhile, or no freezer after all: kill without it
      return False

  def thaw(self) -> None:
    try:
      if self.version == 2:
        _write(os.path.join(self.directory, "cgroup.freeze"), "0")
      else:
        _write(os.path.join(self.directory, "freezer.state"), "THAWED")
    except OSError:
      pass


def _kill_all(directory: str, freezer: Freezer | None = None) -> bool:
  """SIGKILLs every process in ``directory``'s cgroup until it is empty or ``KILL_DEADLINE_S``
  has passed; True when it is empty. After two plain passes each pass escalates: freeze (a
  fork can then no longer land between reading the list and killing it), read the list, kill
  it, thaw (frozen v1 processes die only once thawed). Processes that are slow to die (a full
  disk, pages to free) get the time, with growing pauses, instead of a fixed number of quick
  rounds."""
  kill_file = os.path.join(directory, "cgroup.kill")   # v2, Linux 5.14+: one atomic pass
  if os.path.exists(kill_file):
    try:
      _write(kill_file, "1")
    except OSError:
      pass
  freezer = freezer or Freezer.of(directory)
  deadline = time.monotonic() + KILL_DEADLINE_S
  pause, passes = 0.002, 0
  while True:
    pids = _procs(directory)
    if not pids:
      return True
    if time.monotonic() > deadline:
      return False
    passes += 1
    escalate = passes >= 3 and freezer is not None
    try:
      if escalate and freezer.freeze(min(FREEZE_WAIT_S, max(deadline - time.monotonic(), 0))):
        pids = _procs(directory)   # complete now: nothing forks while frozen
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    finally:
      if escalate:
        freezer.thaw()
    time.sleep(pause)
    pause = min(pause * 2, 0.1)


def _rmdir(directory: str) -> None:
  try:
    children = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):   # gone, e.g. removed by another process
    return
  for child in children:
    path = os.path.join(directory, child)
    if os.path.isdir(path):
      _rmdir(path)
  _kill_all(directory)
  for _ in range(100):   # a killed process leaves its cgroup only once it is reaped
    try:
      os.rmdir(directory)
      return
    except FileNotFoundError:
      return
    except OSError:
      time.sleep(0.01)
  log.warning("could not remove cgroup %s", directory)


class EpisodeCgroup:
  """One episode's cgroup (one directory per v1 hierarchy)."""

  def __init__(self, lay: Layout, dirs: list[str]):
    self.layout = lay
    self.dirs = dirs

  @property
  def procs_files(self) -> list[str]:
    return [os.path.join(d, "cgroup.procs") for d in self.dirs]

  def _dir(self, controller: str) -> str | None:
    if self.layout.version == 2:
      return self.dirs[0]
    if controller in self.layout.controllers:
      return self.dirs[self.layout.controllers.index(controller)]
    return None

  def memory_peak(self) -> int | None:
    """The most memory the episode's processes held together, in bytes (kernel's count)."""
    name = "memory.peak" if self.layout.version == 2 else "memory.max_usage_in_bytes"
    try:
      with open(os.path.join(self._dir("memory"), name)) as f:
        return int(f.read())
    except (OSError, ValueError):
      return None

  def freezer(self) -> Freezer | None:
    """The episode's freezer (v2's own, v1's freezer hierarchy), or None where there is none."""
    directory = self._dir("freezer")
    return None if directory is None else Freezer(directory, self.layout.version)

  def kill(self) -> bool:
    """SIGKILLs every process of the episode (``_kill_all``); True once none is left."""
    freezer = self.freezer()
    return all([_kill_all(d, freezer) for d in self.dirs])

  def remove(self) -> None:
    for d in self.dirs:
      _rmdir(d)


class RunCgroups:
  """A sandbox's cgroups: ``jaxes-<pid>-<hex>`` in each hierarchy, one child per episode."""

  def __init__(self, lay: Layout):
    self.layout = lay
    name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    self.dirs = [os.path.join(base, name) for base in lay.bases]
    for d in self.dirs:
      os.mkdir(d)
    if lay.version == 2:
      _write(os.path.join(self.dirs[0], "cgroup.subtree_control"),
             " ".join("+" + c for c in lay.controllers))

  def episode(self, memory_bytes: int, pids: int, cpus: float | None) -> EpisodeCgroup:
    name = f"ep-{uuid.uuid4().hex[:12]}"
    cg = EpisodeCgroup(self.layout, [os.path.join(d, name) for d in self.dirs])
    try:
      for d in cg.dirs:
        os.mkdir(d)
      quota = None if cpus is None else max(int(cpus * 100_000), 1000)
      if self.layout.version == 2:
        d = cg.dirs[0]
        _write(os.path.join(d, "memory.max"), str(memory_bytes))
        if os.path.exists(os.path.join(d, "memory.swap.max")):
          _write(os.path.join(d, "memory.swap.max"), "0")
        _write(os.path.join(d, "pids.max"), str(pids))
        if quota and "cpu" in self.layout.controllers:
          _write(os.path.join(d, "cpu.max"), f"{quota} 100000")
      else:
        mem = cg._dir("memory")
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
          _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        _write(os.path.join(cg._dir("pids"), "pids.max"), str(pids))
        cpu = cg._dir("cpu")
        if quota and cpu:
          _write(os.path.join(cpu, "cpu.cfs_period_us"), "100000")
          _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(quota))
    except BaseException:
      cg.remove()
      raise
    return cg

  def live_episodes(self) -> int:
    """Episode cgroups that still exist (each is removed when its episode closes)."""
    return sum(name.startswith("ep-") for d in self.dirs if os.path.isdir(d)
               for name in os.listdir(d))

  def remove(self) -> None:
    for d in self.dirs:
      _rmdir(d)


def pid_alive(pid: int) -> bool:
  """Whether a process with this id exists (it may belong to another user)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_orphans(lay: Layout) -> int:
  """Removes the cgroups of runs whose process is dead; returns how many."""
  removed = 0
  for base in lay.bases:
    for name in os.listdir(base):
      m = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-\w+", name)
      if m and not pid_alive(int(m.group(1))):
        _rmdir(os.path.join(base, name))
        removed += 1
  return removed
