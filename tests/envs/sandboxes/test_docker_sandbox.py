"""Docker sandbox against a real engine (skipped, with the reason, when none answers or the base
image is missing: `bash launch/docker/setup.sh` provides both)."""
import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest
import helpers_repo

docker = pytest.importorskip("docker")

from jaxes.envs import protocol  # noqa: E402
from jaxes.envs.images.base_image import DEFAULT_TAG  # noqa: E402
from jaxes.envs.sandboxes import docker_sandbox
from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox  # noqa: E402
from jaxes.envs.sandboxes.sandbox import HostError, SandboxError  # noqa: E402
from jaxes.envs.tasks import loaders
from jaxes.envs.tasks.task import Limits, Task  # noqa: E402

pytestmark = pytest.mark.docker
REPO = str(helpers_repo.REPO)


def _engine_or_skip():
  try:
    client = docker.from_env()
    client.ping()
  except Exception as err:  # any failure to reach an engine means: skip
    reason = f"no docker engine answers ({err}); run `bash launch/docker/setup.sh`"
    print(reason, file=sys.stderr)
    pytest.skip(reason)
  try:
    client.images.get(DEFAULT_TAG)
  except docker.errors.ImageNotFound:
    reason = f"image {DEFAULT_TAG} missing; run `python -m jaxes.envs.images.base_image build`"
    print(reason, file=sys.stderr)
    pytest.skip(reason)
  return client


@pytest.fixture(scope="module")
def client():
  return _engine_or_skip()


@pytest.fixture(scope="module")
def sandbox(client):
  sb = DockerSandbox(run_label=f"test-{uuid.uuid4().hex[:8]}", exec_grace_s=3.0)
  yield sb
  sb.shutdown()
  assert sb.leftovers() == {"containers": 0, "volumes": 0}


COUNT_TESTS = textwrap.dedent("""\
  def test_count():
    assert open("/home/user/count.txt").read().strip() == "2"

  def test_untouched():
    assert open("/home/user/logs/app.log").read().count("ERROR") == 2
  """)


def count_task(**overrides):
  fields = dict(
    name="count-errors", instruction="Count ERROR lines of logs/app.log into count.txt.",
    files=(("/home/user/logs/app.log", b"ERROR a\nINFO b\nERROR c\n"),),
    setup="mkdir -p /home/user/out && echo made > /home/user/out/setup.txt",
    final_tests=COUNT_TESTS, solution="grep -c ERROR logs/app.log > count.txt",
    env=(("GREETING", "hi there"),))
  fields.update(overrides)
  return Task(**fields)


def test_episode_runs_as_user_with_state_carried_over(sandbox):
  with sandbox.start(count_task()) as handle:
    res = handle.exec("id -un; pwd; echo $GREETING; cat out/setup.txt; stat -c %U logs/app.log", 5)
    assert res.output == "user\n/home/user\nhi there\nmade\nuser\n" and res.exit_code == 0
    assert handle.exec("cd logs && export MARK=7", 5).exit_code == 0
    assert handle.exec("pwd; echo $MARK", 5).output == "/home/user/logs\n7\n"
    assert handle.exec("exit 3", 5).exit_code == 3
    res = handle.exec("no-such-command", 5)
    assert res.exit_code == 127 and "command not found" in res.output
    report = handle.run_tests()
    assert (report.passed, report.num_passed, report.num_tests) == (False, 1, 2)
    handle.exec("cd ~ && grep -c ERROR logs/app.log > count.txt", 5)
    report = handle.run_tests()
    assert (report.passed, report.num_passed, report.num_tests, report.timed_out) == (
      True, 2, 2, False)


def test_agent_cannot_touch_tests_or_root_files(sandbox):
  with sandbox.start(count_task()) as handle:
    res = handle.exec(f"ls {docker_sandbox.TESTS_DIR} ; touch /etc/x", 5)
    assert res.exit_code != 0 and "Permission denied" in res.output
    # A pytest.py or conftest.py planted by the agent must not change the verdict.
    for planted in ("pytest.py", "sitecustomize.py", "conftest.py"):
      handle.exec(f"echo 'import os; os._exit(0)' > {planted}", 5)
    assert not handle.run_tests().passed


def test_command_timeout_kills_everything_it_started(sandbox):
  with sandbox.start(count_task()) as handle:
    start = time.monotonic()
    res = handle.exec("setsid sleep 1000 & sleep 1000", 1)
    assert res.timed_out and res.exit_code == -1
    assert time.monotonic() - start < 1 + sandbox.exec_grace_s
    assert "sleep" not in handle.exec("ps -eo user,args | grep ^user", 5).output
    # Background jobs of a command that ends normally do not outlive it either.
    handle.exec("sleep 500 & disown; nohup sleep 600 >/dev/null 2>&1 &", 5)
    assert "sleep" not in handle.exec("ps -eo user,args | grep ^user", 5).output


@pytest.mark.parametrize("command, check", [
  (":(){ :|:& };:", None),                                            # fork bomb
  ("rm -rf --no-preserve-root / 2>/dev/null; ls /", None),           # rm -rf /
  ("yes", lambda r: r.exit_code == -1 and r.output_chars >= docker_sandbox.MAX_READ_BYTES
   and len(r.output) < 2 * 50_000 + 200 and "command was killed" in r.output),
  ("sleep 1000", lambda r: r.timed_out),
  ("head -c 5000 /dev/urandom; printf '\\xff\\xfe\\x00end'", lambda r: r.output.endswith("end")),
  ("python3 -c \"import socket; socket.create_connection(('172.17.0.1', 2375), 2)\"",
   lambda r: r.exit_code != 0 and "unreachable" in r.output),
  ("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 2375), 2)\"",
   lambda r: r.exit_code != 0 and "refused" in r.output),
  ("cat /sys/class/net/*/address; ls /sys/class/net", lambda r: r.output.split()[-1] == "lo"),
])
def test_hostile_commands_leave_the_sandbox_usable(sandbox, command, check):
  sentinel = tempfile.NamedTemporaryFile(prefix="jaxes-host-sentinel-")
  with sandbox.start(count_task()) as handle:
    res = handle.exec(command, 4)
    if check is not None:
      assert check(res), res
    assert handle.exec("echo alive", 5).output == "alive\n"
  assert os.path.exists(sentinel.name)  # the host is unharmed
  sentinel.close()


def _solved_episode(sandbox, task):
  handle = sandbox.start(task)
  episode = protocol.Episode(task, handle)
  assert not episode.step(f"<command>{task.solution}</command>")
  return handle, episode


def test_a_container_killed_from_outside_after_the_agent_solved_the_task_is_retried(sandbox,
                                                                                    client):
  # Killed by an operator or the engine: the host's failure, left out of fitness and retried,
  # never charged to the member (it had solved the task).
  task = count_task()
  handle, episode = _solved_episode(sandbox, task)
  client.containers.get(handle.container_id).kill()
  assert episode.step("<action>done</action>")
  outcome = episode.finish()
  assert outcome.failure == protocol.SANDBOX_ERROR and outcome.failure in protocol.EXCLUDED
  with pytest.raises(HostError, match="stopped from outside"):
    handle.exec("echo hi", 5)
  handle.close()
  handle.close()  # idempotent


def test_a_container_the_agent_ran_out_of_memory_is_the_agents_failure(sandbox, client):
  # The agent's command fills the container's memory limit (tmpfs pages count against it) and
  # the kernel's OOM killer stops the container (docker then reports State.OOMKilled): a failed
  # episode, reward 0 and counted, even though the task had been solved. Fault injection: the
  # container's init is made the OOM killer's first choice, so the container itself goes (left
  # to itself the killer takes the agent's largest process, and the episode simply goes on).
  task = dataclasses.replace(count_task(), limits=Limits(memory_mb=96))
  handle, episode = _solved_episode(sandbox, task)
  init = client.containers.get(handle.container_id).attrs["State"]["Pid"]
  with open(f"/proc/{init}/oom_score_adj", "w") as f:
    f.write("1000")
  episode.step("<command>head -c 200M /dev/zero > /tmp/fill</command>")
  if not episode.done:
    assert episode.step("<action>done</action>")
  outcome = episode.finish()
  assert client.containers.get(handle.container_id).attrs["State"]["OOMKilled"]
  assert (outcome.reward, outcome.failure) == (0.0, protocol.SANDBOX_BROKEN)
  assert outcome.failure not in protocol.EXCLUDED
  handle.close()


def freeze_timeout(client, handle):
  """Fault injection: SIGSTOPs the `timeout` wrapping the running command, so the exec can
  never end by itself (the engine-side picture of a wedged exec). Pausing the container would
  do, but a cgroup-v1 freeze that fails half-way wedges the whole engine."""
  client.containers.get(handle.container_id).exec_run(["pkill", "-STOP", "-x", "timeout"],
                                                      user="root")


def test_hung_exec_is_a_sandbox_error_and_the_container_is_removed(sandbox, client):
  handle = sandbox.start(count_task())
  threading.Timer(0.3, freeze_timeout, (client, handle)).start()
  start = time.monotonic()
  with pytest.raises(SandboxError, match="past its"):
    handle.exec("sleep 0.3; sleep 5", 1)
  assert time.monotonic() - start < 1 + sandbox.exec_grace_s + 6
  with pytest.raises(docker.errors.NotFound):
    client.containers.get(handle.container_id)
  handle.close()


class FlakyCreate(DockerSandbox):
  """Fault injection: the calling thread's next ``n`` creates fail as an overloaded engine's
  would (per thread, so concurrent episodes do not consume each other's faults)."""

  def __init__(self, **kwargs):
    self._faults = threading.local()
    super().__init__(**kwargs)

  def fail_next_creates(self, n):
    self._faults.remaining = n

  def _create_container(self, spec):
    if getattr(self._faults, "remaining", 0) > 0:
      self._faults.remaining -= 1
      raise docker.errors.APIError("injected create failure")
    return super()._create_container(spec)


def test_create_is_retried_with_backoff(client):
  sb = FlakyCreate(create_retries=2, retry_backoff_s=0.01)
  try:
    sb.fail_next_creates(2)
    with sb.start(count_task()) as handle:
      assert handle.exec("echo ok", 5).output == "ok\n"
    sb.fail_next_creates(3)
    with pytest.raises(SandboxError, match="injected create failure"):
      sb.start(count_task())
    # An engine-rejected configuration fails the same way, leaving nothing behind.
    with pytest.raises(SandboxError, match="could not start a container"):
      sb.start(count_task(limits=Limits(memory_mb=1)))
    assert sb.leftovers() == {"containers": 0, "volumes": 0}
  finally:
    sb.shutdown()


def test_setup_failure_is_a_sandbox_error_naming_the_task(sandbox):
  with pytest.raises(SandboxError, match="task broken: setup exited 3"):
    sandbox.start(count_task(name="broken", setup="echo about to fail; exit 3"))
  assert sandbox.leftovers() == {"containers": 0, "volumes": 0}


def test_warm_pool_serves_starts_and_refills(client):
  sb = DockerSandbox(pool_size=2)
  try:
    deadline = time.monotonic() + 60
    while sb.leftovers()["containers"] < 2 and time.monotonic() < deadline:
      time.sleep(0.1)
    pooled = {c.id for c in docker_sandbox.list_run_containers(client, sb.run_label)}
    assert len(pooled) == 2
    with sb.start(count_task()) as handle:
      assert handle.container_id in pooled
      assert handle.exec("cat logs/app.log | wc -l", 5).output == "3\n"
    # A task asking for tighter limits than the pool's gets its own container.
    with sb.start(count_task(limits=Limits(memory_mb=512))) as handle:
      assert handle.container_id not in pooled
  finally:
    sb.shutdown()
  assert sb.leftovers() == {"containers": 0, "volumes": 0}


OWNER_SCRIPT = """
import os, sys
from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox
from jaxes.envs.tasks.task import Task
sb = DockerSandbox(run_label=sys.argv[1])
sb.start(Task(name="t", instruction="x"))
print("started", flush=True)
if sys.argv[2] == "crash":
  os._exit(0)   # no atexit, no shutdown: like a SIGKILLed trainer
"""


def test_leftovers_of_exited_and_crashed_runs_are_removed(client):
  env = {**os.environ, "PYTHONPATH": REPO}
  labels = {}
  for mode in ("exit", "crash"):
    labels[mode] = f"test-{mode}-{uuid.uuid4().hex[:8]}"
    out = subprocess.run([sys.executable, "-c", OWNER_SCRIPT, labels[mode], mode], env=env,
                         capture_output=True, text=True, timeout=120)
    assert "started" in out.stdout, out.stderr
  assert docker_sandbox.list_run_containers(client, labels["exit"]) == []   # atexit cleaned up
  assert len(docker_sandbox.list_run_containers(client, labels["crash"])) == 1
  sb = DockerSandbox()   # a new run sweeps containers whose owner process is dead
  try:
    assert sb.orphans_removed >= 1
    assert docker_sandbox.list_run_containers(client, labels["crash"]) == []
  finally:
    sb.shutdown()


def test_loaded_endless_terminals_task_runs_with_its_oracle(sandbox, tmp_path):
  folder = tmp_path / "task_et"
  (folder / "data").mkdir(parents=True)
  (folder / "task.json").write_text('{"description": "Count ERROR lines", "truth": "2", '
                                    '"name": "et-count"}')
  (folder / "data" / "app.log").write_text("ERROR a\nINFO b\nERROR c\n")
  (folder / "test_initial_state.py").write_text(
    "def test_log():\n  assert open('/home/user/logs/app.log').read().count('ERROR') == 2\n")
  (folder / "test_final_state.py").write_text(COUNT_TESTS)
  (folder / "solution.sh").write_text("cd /home/user && grep -c ERROR logs/app.log > count.txt\n")
  (folder / "container.def").write_text(textwrap.dedent("""\
    Bootstrap: localimage
    From: ./ubuntu_22.04.sif

    %post
        apt update && apt install -y python3-pip git
        pip3 install pytest
        useradd -m -s /bin/bash user
        mkdir -p /home/user/logs
        chown -R user:user /home/user

    %files
        data/app.log /home/user/logs/app.log

    %environment
        export LANG=C.UTF-8
    """))
  task = loaders.load_task(str(folder))
  checked = DockerSandbox(run_label=f"test-et-{uuid.uuid4().hex[:8]}", check_initial_state=True)
  try:
    with checked.start(task) as handle:
      assert not handle.run_tests().passed
      handle.exec(task.solution, 10)
      assert handle.run_tests().passed
  finally:
    checked.shutdown()


def _child_processes():
  me = str(os.getpid())
  children = 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        children += f.read().rsplit(")", 1)[1].split()[1] == me
    except (FileNotFoundError, ProcessLookupError):
      pass
  return children


SOAK_KINDS = ("kill", "hang", "create", "timeout", "ok", "ok")


def test_soak_episodes_with_injected_faults_leaks_nothing(client, tmp_path, monkeypatch):
  """12 short episodes on 4 workers, each injected fault twice (a worker meets a fault kind again
  after it was hit once) and in flight beside others: a container killed mid-episode, an exec that
  hangs (its timeout frozen), a create that fails (both attempts), a command that times out; the
  rest are plain episodes. Every episode ends as its kind says; no container, child process or
  temporary file is left. (It ran 60 episodes, each fault 6 times: the same kinds and checks.)"""
  # This process's temporary files go to a folder of its own: the other test worker's files in
  # /tmp come and go meanwhile and are none of this test's business.
  private_tmp = tmp_path / "tmp"
  private_tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
  children_before = _child_processes()
  sb = FlakyCreate(run_label=f"soak-{uuid.uuid4().hex[:8]}", exec_grace_s=1.0,
                   create_retries=1, retry_backoff_s=0.01)

  def episode(i):
    kind = SOAK_KINDS[i % len(SOAK_KINDS)]
    sb.fail_next_creates(2 if kind == "create" else 0)   # both attempts of this start fail
    try:
      handle = sb.start(count_task(name=f"soak-{i}"))
    except SandboxError:
      return kind, "start-failed"
    try:
      if kind == "kill":
        client.containers.get(handle.container_id).kill()
      if kind == "hang":
        threading.Timer(0.3, freeze_timeout, (client, handle)).start()
      # Generous timeouts: the machine may be loaded; the hang is injected at 0.3 s.
      command, timeout_s = {"hang": ("sleep 60", 5), "timeout": ("sleep 60", 1)}.get(
        kind, ("grep -c ERROR logs/app.log > count.txt", 30))
      res = handle.exec(command, timeout_s)
      return kind, ("timeout" if res.timed_out else
                    "passed" if handle.run_tests().passed else "failed")
    except SandboxError:
      return kind, "sandbox-error"
    finally:
      handle.close()

  try:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      outcomes = list(pool.map(episode, range(2 * len(SOAK_KINDS))))
  finally:
    sb.shutdown()
  assert sorted(kind for kind, _ in outcomes) == sorted(2 * SOAK_KINDS)   # every fault kind, twice
  expected = {"ok": "passed", "kill": "sandbox-error", "hang": "sandbox-error",
              "create": "start-failed", "timeout": "timeout"}
  wrong = [(i, kind, got) for i, (kind, got) in enumerate(outcomes) if expected[kind] != got]
  assert wrong == []
  assert client.containers.list(all=True, filters={"label": f"jaxes.run={sb.run_label}"}) == []
  assert _child_processes() == children_before
  assert list(private_tmp.iterdir()) == []


def test_the_agents_writable_space_is_capped_per_episode_never_the_hosts_disk(sandbox, client):
  # Before: five 256 MiB files in /tmp grew the host's /var/lib/docker by 1,280 MiB, uncapped.
  task = Task(name="disk", instruction="x", files=(("/home/user/given.txt", b"given\n"),),
              limits=Limits(disk_mb=32, file_size_mb=64))
  with sandbox.start(task) as handle:
    for where in ("/tmp", "/var/tmp", "/home/user", "/run/jaxes"):
      res = handle.exec(f"for i in 1 2 3; do head -c 24M /dev/zero > {where}/fill$i || exit 7; done", 20)
      assert res.exit_code == 7 and "No space left on device" in res.output, (where, res.output)
    res = handle.exec("cd /tmp && rm -f fill* && for i in $(seq 20000); do : > f$i || exit 7; done", 20)
    assert res.exit_code == 7 and "No space left on device" in res.output   # the inode cap
    assert handle.exec("cat /home/user/given.txt; stat -c %a /tmp", 10).output.split() == ["given", "1777"]
    layer = client.api.containers(all=True, size=True, filters={"id": handle.container_id})[0]
    assert layer.get("SizeRw", 0) < 4 << 20, layer   # what the episode left on the host's disk
