"""Limits that hold for an episode as a whole: its processes' combined memory, and the disk it
may fill (local backend: a per-episode cgroup and a size-capped tmpfs; docker: the container's
memory limit). Where the machine cannot give a guarantee the test skips, saying why."""
import os
import shutil
import tempfile

import pytest

from helpers_sandboxes import sandbox  # noqa: F401  (the fixture: both backends)
from jaxes.envs import make_sandbox
from jaxes.envs.check import descendant_processes
from jaxes.envs.tasks.task import Limits, Task
import helpers_repo

MEMORY_MB = 300
# Three processes of 200 MB each, alive together for a second: 600 MB > 300 MB.
# bash reports a killed background job on its stderr whenever it notices, even after `echo end`;
# the group's stderr goes to /dev/null so the output's order is the command's own.
THREE_HOGS = ("{ for i in 1 2 3; do python3 -c 'import time; b = b\"x\" * (200 << 20); "
              "time.sleep(1.5); print(\"done\", flush=True)' & done; wait; } 2>/dev/null; echo end")




def test_combined_memory_of_an_episode_stays_under_its_limit(sandbox):
  if getattr(sandbox, "cgroups", True) is None:
    pytest.skip("no per-episode cgroup on this machine (needs root and cgroup v2 with memory "
                "and pids delegated, or cgroup v1): memory is limited per process only")
  task = Task(name="hogs", instruction="x",
              limits=Limits(memory_mb=MEMORY_MB, command_timeout_s=30))
  with sandbox.start(task) as handle:
    res = handle.exec(THREE_HOGS, 30)
    assert res.output.strip().endswith("end"), res
    # Not all three ever held their 200 MB at once: the cgroup's OOM killer stopped the others.
    assert res.output.splitlines().count("done") <= 1, res.output
    cgroup = getattr(handle, "cgroup", None)
    if cgroup is not None:   # the kernel's own peak of the episode's processes together
      assert 0 < cgroup.memory_peak() <= MEMORY_MB << 20
    assert handle.exec("echo alive", 10).output == "alive\n"
  assert descendant_processes() == 0


def _free_bytes() -> dict[str, int]:
  return {path: shutil.disk_usage(path).free for path in {"/dev/shm", tempfile.gettempdir(), "/"}
          if os.path.isdir(path)}


def test_disk_filling_fails_inside_the_episode_and_the_host_keeps_its_space(sandbox):
  if not getattr(sandbox, "mounts", False):
    pytest.skip("episode directories are not size-capped here (local backend as non-root, or "
                "docker: no per-container disk quota on overlay2 without xfs project quotas)")
  task = Task(name="fill", instruction="x",
              limits=Limits(disk_mb=64, file_size_mb=4096, command_timeout_s=30))
  before = _free_bytes()
  with sandbox.start(task) as handle:
    res = handle.exec("for i in 1 2 3 4; do head -c 50M /dev/zero > /home/user/f$i || break; "
                      "done; du -sm /home/user | cut -f1", 30)
    assert "No space left on device" in res.output, res
    assert int(res.output.split()[-1]) <= 64
    res = handle.exec("head -c 2G /dev/zero > /tmp/big; echo $?; du -sm /tmp | cut -f1", 30)
    assert "No space left on device" in res.output and int(res.output.split()[-1]) <= 64, res
    res = handle.exec("for i in $(seq 1 40000); do : > /home/user/e$i || break; done; echo $i", 60)
    assert "No space left on device" in res.output, res   # inodes are capped too
    assert handle.exec("rm -f /home/user/f* /home/user/e*; echo ok > /home/user/ok; cat ok",
                       10).output == "ok\n"   # the episode goes on
  after = _free_bytes()
  for path, free in before.items():   # other processes share the disk: allow 32 MB of drift
    assert abs(after[path] - free) < 32 << 20, (path, free, after[path])


CRASHING_RUN = """
import os, sys
sys.path.insert(0, sys.argv[1])
from jaxes.envs import make_sandbox
from jaxes.envs.tasks.task import Task
sb = make_sandbox("local")
h = sb.start(Task(name="t", instruction="x"))
h.exec("echo data > /home/user/f", 10)
print(sb.root_dir, h.ep_dir, " ".join(h.cgroup.dirs if h.cgroup else []), flush=True)
os._exit(0)   # no close, no shutdown: like a SIGKILLed trainer
"""


@pytest.mark.end_to_end
def test_mounts_and_cgroups_of_a_killed_run_are_removed_by_the_next():
  import subprocess
  import sys
  probe = make_sandbox("local")
  probe.shutdown()
  if not (probe.mounts or probe.cgroups):
    pytest.skip("no episode mounts or cgroups on this machine (not root)")
  repo = str(helpers_repo.REPO)
  out = subprocess.run([sys.executable, "-c", CRASHING_RUN, repo], capture_output=True,
                       text=True, timeout=120, check=True).stdout.split()
  root, ep_dir, cgroup_dirs = out[0], out[1], out[2:]
  with open("/proc/self/mountinfo") as f:
    assert (ep_dir in f.read()) == probe.mounts
  assert all(os.path.isdir(d) for d in cgroup_dirs)
  sb = make_sandbox("local")   # sweeps what dead runs left
  sb.shutdown()
  with open("/proc/self/mountinfo") as f:
    assert ep_dir not in f.read()
  assert not os.path.exists(root)
  assert not any(os.path.exists(d) for d in cgroup_dirs)


def test_an_orphan_cgroup_another_process_is_removing_is_skipped(tmp_path, monkeypatch):
  # Two processes of a multi-process run start their sandboxes together and sweep the same
  # orphans; reading a cgroup the other one has just removed fails with ENODEV (seen here: a
  # 2-process launch died of it). That may not stop the run.
  import errno
  import subprocess
  from jaxes.envs.sandboxes import cgroups
  dead = subprocess.Popen(["true"])
  dead.wait()
  orphan = tmp_path / f"jaxes-{dead.pid}-abc123"
  (orphan / "ep-1").mkdir(parents=True)

  def removed_meanwhile(path, *args, **kwargs):
    raise OSError(errno.ENODEV, "No such device", path)
  monkeypatch.setattr(cgroups, "open", removed_meanwhile, raising=False)
  layout = cgroups.Layout(version=2, bases=(str(tmp_path),), controllers=("memory", "pids"))
  assert cgroups.remove_orphans(layout) == 1 and not orphan.exists()


WALKER = ("import os\nwhile True:\n  try:\n    if os.fork():\n      os._exit(0)\n"
          "  except OSError:\n    pass\n")   # keeps spawning: its pid changes all the time


def _members(directory):
  with open(os.path.join(directory, "cgroup.procs")) as f:
    return f.read().split()


def _set_state(directory, state):
  with open(os.path.join(directory, "freezer.state"), "w") as f:
    f.write(state)


def _start_in(procs_files):
  import subprocess
  from jaxes.envs.sandboxes import cgroups
  return subprocess.Popen(["sh", "-c", cgroups.JOIN_SH, "join", *procs_files, "--", "setpriv",
                           "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                           "--", "/usr/bin/python3", "-c", WALKER], start_new_session=True)


def _v1_freezer_cgroup():
  """A new cgroup of our own in the v1 freezer hierarchy, or None where there is none."""
  import uuid
  with open("/proc/self/mounts") as f:
    points = [line.split()[1] for line in f
              if line.split()[2] == "cgroup" and "freezer" in line.split()[3].split(",")]
  with open("/proc/self/cgroup") as f:
    own = [line.rstrip("\n").split(":", 2)[2] for line in f if ":freezer:" in line]
  if not (points and own):
    return None
  path = os.path.join(points[0], own[0].lstrip("/"), f"jaxes-test-held-{uuid.uuid4().hex[:8]}")
  try:
    os.mkdir(path)
  except OSError:
    return None
  return path


def _slow_to_die(cgroup, held):
  """Fault injection: a process of the episode that a SIGKILL takes seconds to end (as after a
  disk or inode fill, with pages to free), and one that keeps spawning. The first is held in
  ``held``, a frozen v1 freezer cgroup of the test's own: its SIGKILL waits until the test
  thaws it."""
  import time
  pids = cgroup.dirs[cgroup.layout.controllers.index("pids")]
  own = [f for f in cgroup.procs_files if "freezer" not in f]
  procs = [_start_in(own + [os.path.join(held, "cgroup.procs")]), _start_in(cgroup.procs_files)]
  while not _members(held) or len(_members(pids)) < 2:
    time.sleep(0.01)
  _set_state(held, "FROZEN")
  return procs


def test_the_kill_before_the_tests_waits_for_slow_deaths_freezes_spawners_and_is_bounded(
    monkeypatch):
  # Replay: after a fill, the agent's processes took more than the ~1 s the kill loop used to
  # wait, and the episode was SANDBOX_BROKEN. The kill now waits up to KILL_DEADLINE_S, freezing
  # the episode between reading its processes and killing them, and thaws it again (the
  # verifier then runs in the same cgroup); past the deadline it gives up.
  import threading
  from jaxes.envs.sandboxes import cgroups
  from jaxes.envs.sandboxes.sandbox import SandboxError
  sb, held = make_sandbox("local"), _v1_freezer_cgroup()
  try:
    if sb.cgroups is None or held is None:
      pytest.skip("needs per-episode cgroups and the cgroup v1 freezer (root): the injected slow "
                  "death holds a process in a frozen v1 cgroup")
    task = Task(name="slow", instruction="x", final_tests="def test_x():\n  pass\n")
    with sb.start(task) as handle:
      procs = _slow_to_die(handle.cgroup, held)
      thaw = threading.Timer(4.0, _set_state, (held, "THAWED"))   # well past the old ~1 s
      thaw.start()
      report = handle.run_tests()
      thaw.join()
      assert report.passed, report.report
      assert all(_members(d) == [] for d in handle.cgroup.dirs)
      for p in procs:
        p.wait()
    with sb.start(task) as handle:
      procs = _slow_to_die(handle.cgroup, held)
      with monkeypatch.context() as patch, pytest.raises(SandboxError, match="could not kill"):
        patch.setattr(cgroups, "KILL_DEADLINE_S", 0.5)
        handle.run_tests()
      _set_state(held, "THAWED")
      dirs = handle.cgroup.dirs
    for p in procs:
      p.wait()
    assert not any(os.path.exists(d) for d in dirs)   # close killed and removed it all
  finally:
    if held is not None:
      _set_state(held, "THAWED")
      os.rmdir(held)
    sb.shutdown()
  assert descendant_processes() == 0
