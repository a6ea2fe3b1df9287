"""Real multi-process JAX on CPU (gloo collectives, loopback coordinator): start-up through
launch/local.sh, the global mesh, host allgather, and bounded-time failure when a process dies."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxes import distributed
import helpers_repo

ROOT = helpers_repo.REPO
LOCAL_SH = ROOT / "launch" / "local.sh"
HEARTBEAT_S = 5

WORKER = r'''
import json, os, pathlib, sys, time
from jaxes import distributed
launch = distributed.initialize()
assert distributed.initialize() is launch            # idempotent
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

out_dir = pathlib.Path(sys.argv[1])
me = distributed.process_index()
mode = os.environ["WORKER_MODE"]
if mode == "check":
  result = {"source": launch.source, "count": distributed.process_count(),
            "primary": distributed.is_primary(), "layouts": {}}
  for shape in [(2, 4, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2)]:
    mesh = distributed.global_mesh(*shape)
    result["layouts"][str(shape)] = {
      "processes": [[d.process_index for d in row.flat] for row in mesh.devices],
      "owners": list(distributed.data_shard_owners(mesh)),
      "rows": list(distributed.owned_rows(mesh, 16))}
  mesh = distributed.global_mesh(8, 1, 1)
  local = np.arange(4, dtype=np.float32) + 4 * me + 1          # global array 1..8
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
  psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh,
                               in_specs=P("data"), out_specs=P()))
  result["psum"] = np.asarray(psum(x).addressable_data(0)).tolist()
  # Process 1's payload outgrows the exchange's initial room: the second-round path.
  result["gathered"] = distributed.allgather_host({"process": me, "text": "ab" * (200 * me)})
  again = distributed.allgather_host(("tick", me, [1.5] * me))
  result["gathered_again"] = again
  result["tuples_kept"] = [type(g).__name__ for g in again]
  distributed.barrier("done")
  (out_dir / f"check-{me}.json").write_text(json.dumps(result))
else:  # exchange a few numbers per tick, like the trainer's controller
  for tick in range(100000):
    distributed.allgather_host({"process": me, "tick": tick})
    if tick == 2:
      (out_dir / f"ready-{me}").touch()
      while mode.startswith("idle"):   # no more collectives: only heartbeats can notice a death
        time.sleep(0.05)
    if mode == "raise" and me == 1 and tick == 5:
      raise RuntimeError("sandbox exploded")
    time.sleep(0.05)
'''


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "SLURM_", "JAXES_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", **extra)
  return env


@pytest.fixture
def worker(tmp_path):
  path = tmp_path / "worker.py"
  path.write_text(WORKER)
  return path


@pytest.mark.end_to_end
def test_two_processes_build_one_mesh_psum_and_exchange(worker, tmp_path):
  proc = subprocess.run(["bash", str(LOCAL_SH), "--devices", "4", "2", "--", sys.executable,
                         str(worker), str(tmp_path)], env=_env(WORKER_MODE="check"),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "[p0] " in proc.stdout and "[p1] " in proc.stdout      # per-process prefixes
  results = [json.loads((tmp_path / f"check-{i}.json").read_text()) for i in range(2)]
  for me, r in enumerate(results):
    assert r["source"] == "env" and r["count"] == 2 and r["primary"] == (me == 0)
    assert r["psum"] == [36.0]                                 # 1 + ... + 8 across both processes
    assert r["gathered"] == [{"process": 0, "text": ""}, {"process": 1, "text": "ab" * 200}]
    assert r["gathered_again"] == [["tick", 0, []], ["tick", 1, [1.5]]]
    assert r["tuples_kept"] == ["tuple", "tuple"]                # pickled, not JSON-mangled
    layouts = r["layouts"]
    # Along data, process 0's devices first; each data index on one process when it fits.
    assert layouts["(2, 4, 1)"]["processes"] == [[0] * 4, [1] * 4]
    assert layouts["(8, 1, 1)"]["owners"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layouts["(2, 2, 2)"]["owners"] == [0, 1]
    assert layouts["(1, 8, 1)"]["processes"] == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert layouts["(1, 8, 1)"]["owners"] == [0]
  assert results[0]["layouts"]["(8, 1, 1)"]["rows"] == list(range(8))
  assert results[1]["layouts"]["(8, 1, 1)"]["rows"] == list(range(8, 16))
  assert results[0]["layouts"]["(1, 8, 1)"]["rows"] == list(range(16))
  assert results[1]["layouts"]["(1, 8, 1)"]["rows"] == []       # the shard's owner is process 0


def _start_pair(worker, tmp_path, mode):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  out = tmp_path / mode
  out.mkdir()
  procs = []
  for i in range(2):
    env = _env(WORKER_MODE=mode, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
               JAXES_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S), JAXES_SHUTDOWN_TIMEOUT_S="60",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    with open(out / f"log-{i}.txt", "w") as log:
      procs.append(subprocess.Popen([sys.executable, str(worker), str(out)], env=env,
                                    stdout=log, stderr=subprocess.STDOUT))
  return out, procs


def _wait_ready(out, procs):
  deadline = time.monotonic() + 120
  while not all((out / f"ready-{i}").exists() for i in range(2)):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      logs = "".join((out / f"log-{i}.txt").read_text()[-2000:] for i in range(2))
      pytest.fail(f"{out.name}: workers did not get going:\n{logs}")
    time.sleep(0.05)


# The bound: the heartbeat timeout plus generous slack for a loaded 2-core machine. A hang (what
# this guards against) would last until the 60 s shutdown timeout, or forever.
BOUND_S = HEARTBEAT_S + 25


@pytest.mark.end_to_end
def test_a_dead_or_failing_process_stops_the_other_in_bounded_time(worker, tmp_path):
  """Three scenarios, run side by side to keep the test short. 'idle' survivors run no
  collective, so only the coordination service can stop them: after missed heartbeats when
  process 1 is SIGKILLed, at once when the coordinator is. In 'raise', process 1 raises while
  process 0 exchanges results with it (the collective breaks; a SIGKILL there acts the same)."""
  scenarios = {"idle": 1, "idle-coordinator": 0, "raise": None}
  started = {name: _start_pair(worker, tmp_path, name) for name in scenarios}
  for out, procs in started.values():
    _wait_ready(out, procs)
  killed_at = {}
  for name, victim in scenarios.items():
    if victim is not None:
      started[name][1][victim].send_signal(signal.SIGKILL)
      killed_at[name] = time.monotonic()
  raiser = started["raise"][1][1]
  survivors = {name: procs[0 if victim is None else 1 - victim]
               for name, victim in scenarios.items() for procs in [started[name][1]]}
  report, late = {}, []
  deadline = time.monotonic() + 2 * BOUND_S
  while len(report) < len(survivors) and not late:
    now = time.monotonic()
    if "raise" not in killed_at and raiser.poll() is not None:
      killed_at["raise"] = now
    for name, survivor in survivors.items():
      if name not in report and name in killed_at and survivor.poll() is not None:
        report[name] = (survivor.returncode, round(now - killed_at[name], 1))
    late = [n for n in survivors if n not in report and now > killed_at.get(n, deadline) + BOUND_S]
    time.sleep(0.02)
  for _, procs in started.values():
    for p in procs:
      p.kill()
      p.wait()
  assert not late, f"{late}: the surviving process still ran {BOUND_S} s after its peer died"
  print(f"survivor (exit status, seconds after the peer died): {report}")
  assert all(rc != 0 for rc, _ in report.values()), report
  assert raiser.returncode == 1
  assert "process 1 failed: RuntimeError: sandbox exploded" in \
    (tmp_path / "raise" / "log-1.txt").read_text()


@pytest.mark.end_to_end
def test_local_sh_stops_the_rest_and_names_the_failed_process():
  start = time.monotonic()
  proc = subprocess.run(
    ["bash", str(LOCAL_SH), "3", "--", "bash", "-c",
     'echo "up $JAX_PROCESS_ID of $JAX_NUM_PROCESSES at $JAX_COORDINATOR_ADDRESS"; '
     'if [ "$JAX_PROCESS_ID" = 2 ]; then sleep 0.3; exit 7; fi; sleep 60'],
    env=_env(), capture_output=True, text=True, timeout=60)
  assert proc.returncode == 7
  assert "process 2 (pid" in proc.stderr and "exited with status 7" in proc.stderr
  assert time.monotonic() - start < 30                          # the sleepers were stopped
  for i in range(3):
    assert f"[p{i}] up {i} of 3 at 127.0.0.1:" in proc.stdout


@pytest.mark.end_to_end
def test_local_sh_names_a_killed_process_and_its_signal():
  proc = subprocess.run(
    ["bash", str(LOCAL_SH), "2", "--", "bash", "-c",
     'if [ "$JAX_PROCESS_ID" = 0 ]; then sleep 0.3; kill -KILL $$; fi; sleep 60'],
    env=_env(), capture_output=True, text=True, timeout=60)
  assert proc.returncode == 137
  assert "process 0 (pid" in proc.stderr and "was killed by SIGKILL (status 137)" in proc.stderr


@pytest.mark.end_to_end
def test_local_sh_rejects_bad_usage():
  for args, message in [(["--", "true"], "missing the process count"),
                        (["two", "--", "true"], "positive integer"),
                        (["2"], "missing the command"),
                        (["--devices", "0", "2", "--", "true"], "--devices")]:
    proc = subprocess.run(["bash", str(LOCAL_SH), *args], env=_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_single_process_initialize_is_a_noop(monkeypatch):
  for name in list(os.environ):
    if name.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                        "JAX_LOCAL_DEVICE_IDS", "SLURM_", "JAXES_", "TPU_")):
      monkeypatch.delenv(name)
  import jax
  launch = distributed.initialize()
  assert launch.source == "single" and not launch.multi_process
  assert distributed.initialize() is launch
  assert not jax.distributed.is_initialized()
  assert distributed.process_count() == 1 and distributed.is_primary()
  obj = {"a": [1, 2]}
  gathered = distributed.allgather_host(obj)
  assert gathered == [obj] and gathered[0] is not obj
  distributed.barrier("single")                                 # returns at once


@pytest.mark.parametrize("env, message", [
  ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_COORDINATOR_ADDRESS set but JAX_NUM_PROCESSES, "
                                       "JAX_PROCESS_ID not"),
  ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "but JAX_COORDINATOR_ADDRESS not"),
  ({"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
   "expected HOST:PORT"),
  ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
   "0 <= JAX_PROCESS_ID < JAX_NUM_PROCESSES"),
  ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
   "JAX_NUM_PROCESSES='two' is not an integer"),
  ({"JAX_LOCAL_DEVICE_IDS": "0,1"}, "nothing describes a multi-process run"),
  ({"JAX_LOCAL_DEVICE_IDS": "0;1", "JAXES_DISTRIBUTED": "auto"}, "comma-separated integers"),
  ({"JAXES_DISTRIBUTED": "yes"}, "expected 'auto', 'off' or unset"),
  ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, "start it with srun"),
])
def test_half_set_or_bad_variables_fail_with_one_line(env, message):
  with pytest.raises(distributed.LaunchError, match=None) as e:
    distributed.detect(env)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_detect_reads_each_launcher():
  assert distributed.detect({}) == distributed.Launch("single")
  assert distributed.detect({"JAXES_DISTRIBUTED": "off", "JAX_COORDINATOR_ADDRESS": "h:1"}).source \
    == "single"
  assert distributed.detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                             "JAX_PROCESS_ID": "3", "JAX_LOCAL_DEVICE_IDS": "0,1"}) == \
    distributed.Launch("env", "10.0.0.1:1234", 4, 3, (0, 1))
  slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_PROCID": "1"}
  assert distributed.detect(slurm).source == "slurm"
  assert distributed.detect({**slurm, "SLURM_NTASKS": "1"}).source == "single"
  assert distributed.detect({"TPU_WORKER_HOSTNAMES": "a,b"}).source == "tpu"
  assert distributed.detect({"JAXES_DISTRIBUTED": "auto"}).source == "auto"


def test_layout_rule():
  follows = distributed.follows_processes
  assert follows([(0,), (0,), (1,), (1,)])              # two shards per process
  assert follows([(0, 1), (2, 3)])                      # each shard spans two processes
  assert follows([(0,)])
  assert not follows([(1,), (0,)])                      # out of process order
  assert not follows([(0, 1), (0, 1)])                  # both shards straddle both processes
  assert not follows([(0, 1), (1, 2)])                  # process 1 holds parts of two shards


@pytest.mark.parametrize("env, args, message", [
  ({"JAXES_DISTRIBUTED": "auto", "JAXES_HEARTBEAT_TIMEOUT_S": "soon"}, "",
   "LaunchError: JAXES_HEARTBEAT_TIMEOUT_S='soon': expected a whole number"),
  ({"JAXES_DISTRIBUTED": "auto"}, "",
   "LaunchError: launch looked like 'auto' but JAX could not tell the coordinator"),
  ({}, "coordinator_address='h:1'",   # arguments are checked like the variables
   "LaunchError: JAX_COORDINATOR_ADDRESS set but JAX_NUM_PROCESSES, JAX_PROCESS_ID not"),
])
@pytest.mark.end_to_end
def test_launches_that_cannot_work_fail_with_one_line(env, args, message):
  code = f"from jaxes import distributed; distributed.initialize({args})"
  proc = subprocess.run([sys.executable, "-c", code], env=_env(**env), capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 1 and message in proc.stderr
