"""Multi-host training for real: `python -m jaxes.train` as 2 JAX processes x 4 CPU devices
(launch/local.sh: gloo collectives, loopback coordinator) against 1 process x 8 devices.

The same tiny run (warm start, async ES with staleness, sampled training episodes, greedy
held-out evaluation) must take the same decisions, decode the same tokens and end with the same
parameters either way, write its metrics once, stop when one process is SIGKILLed, and resume
from the same launch command to the parameters of the uninterrupted run.
"""
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers_train import ROOT, build_tiny_tokenizer, launch_env, tiny_config, write_config_file
from jaxes.run_tools import compare
from jaxes.train import metrics
from jaxes.train.policy import load_policy

LOCAL_SH = ROOT / "launch" / "local.sh"
# The killed launch's heartbeat timeout: short, so the survivor notices the kill quickly. The other
# launches keep the default (60 s): a process starved of CPU for 10 s on a loaded machine would
# otherwise be declared dead.
HEARTBEAT_S = 10
UPDATES = 2   # update 2 already consumes stale results (staleness 1), update 3 added none
# The kill-and-resume run: killed after update 1, resumed through the update log to update 2.
SYNC_UPDATES = 2
# Records the engine's finished turns (slot, token ids) of every step, per process: the tokens
# each process decoded, to compare across launches. Observes the engine; changes nothing.
DRIVER = r'''
import json, os
from absl import app
from jaxes.rollout import engine
from jaxes.train import __main__ as cli

from jax.experimental import multihost_utils
from jaxes import distributed

turns, exchanges, stepping = [], [], []
def counted(fn):
  def call(*args, **kwargs):
    if stepping:   # a host-side cross-process exchange inside an engine step
      exchanges.append(fn.__name__)
    return fn(*args, **kwargs)
  return call
multihost_utils.process_allgather = counted(multihost_utils.process_allgather)
distributed.allgather_host = counted(distributed.allgather_host)
step = engine.Engine.step
def logged_step(self, params_by_version):
  stepping.append(True)
  try:
    out = step(self, params_by_version)
  finally:
    stepping.clear()
  # Each process reads its own rows' tokens only (the others' turns come without ids).
  turns.extend([t.slot, [int(x) for x in t.tokens]] for t in out if t.tokens is not None)
  return out
engine.Engine.step = logged_step

def main(argv):
  cli.main(argv)
  import jax
  with open(os.path.join(os.environ["TURNS_DIR"], f"turns-{jax.process_index()}.json"), "w") as f:
    json.dump(turns, f)
  with open(os.path.join(os.environ["TURNS_DIR"], f"exchanges-{jax.process_index()}.json"), "w") as f:
    json.dump(exchanges, f)

app.run(main)
'''


def _failure(proc) -> str:
  """A failed launch's story: its stderr, then each process's last lines (the tail of the mixed
  stdout is mostly the survivor's stack once one process has died)."""
  lines = proc.stdout.splitlines()
  per_process = ["\n".join([line for line in lines if line.startswith(f"[p{i}]")][-40:]) for i in range(2)]
  return proc.stderr[-3000:] + "\n" + "\n...\n".join(per_process)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  tokenizer = build_tiny_tokenizer(str(tmp / "tok"))
  config = tiny_config(tokenizer, **{
      "rollout.num_slots": 8, "mesh.data": -1, "mesh.fsdp": 2, "rollout.sandbox_steps": 2,
      "controller.mode": "async", "controller.max_staleness": 1,
      "controller.pairs": "together",   # held partners: the same cohorts in every process layout
      "warmstart.steps": 60, "warmstart.learning_rate": 1e-2, "env.partial_credit": True,
      "rollout.temperature": 0.4, "rollout.common_random_numbers": False,
      "train.num_updates": UPDATES, "train.plot": False})
  (tmp / "driver.py").write_text(DRIVER)
  return tmp, write_config_file(config, tmp / "config.py")


@pytest.fixture(scope="module")
def sync_setup(runs):
  """The same run in sync mode, without evaluation, a full checkpoint every 2 updates (a kill
  after update 1 resumes through the update log): the config whose resume must equal an
  uninterrupted run. In async mode it cannot: which results make the next cohort depends on how
  far each in-flight episode had got, and a resume restarts them all from their first token.
  It starts from the 1-process run's warm start (``warmstart.init_from``; the same warm-start
  settings): the warm start across process layouts is test_two_processes_match_...'s, and each
  of the three launches here would otherwise spend ~14 s making it again."""
  tmp, _, _ = runs
  config = tiny_config(str(tmp / "tok"), **{
      "rollout.num_slots": 8, "mesh.data": -1, "mesh.fsdp": 2, "rollout.sandbox_steps": 2,
      "controller.mode": "sync", "controller.max_staleness": 0, "eval.num_tasks": 0,
      "warmstart.init_from": str(tmp / "one"), "env.partial_credit": True,
      "rollout.temperature": 0.4, "rollout.common_random_numbers": False,
      "train.num_updates": SYNC_UPDATES, "train.checkpoint_every": 2, "train.plot": False})
  return tmp, write_config_file(config, tmp / "sync_config.py")


def _command(tmp, config_file, workdir):
  # --verbose: the run's summary printed as JSON at the end, by process 0 only (checked below).
  return [sys.executable, str(tmp / "driver.py"), f"--config={config_file}", f"--workdir={workdir}",
          "--verbose"]


def _launch_two(tmp, config_file, workdir, timeout=1500):
  turns = workdir.parent / f"{workdir.name}-turns"
  turns.mkdir(exist_ok=True)
  return subprocess.run(["bash", str(LOCAL_SH), "2", "--", *_command(tmp, config_file, workdir)],
                        cwd=ROOT, env=launch_env(tmp, TURNS_DIR=str(turns)), capture_output=True,
                        text=True, timeout=timeout)


def _launch_one(tmp, config_file, workdir, timeout=1500):
  """The same command as one process of 8 devices."""
  turns = workdir.parent / f"{workdir.name}-turns"
  turns.mkdir(exist_ok=True)
  return subprocess.run(_command(tmp, config_file, workdir), cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout,
                        env=launch_env(tmp, TURNS_DIR=str(turns),
                                       XLA_FLAGS="--xla_force_host_platform_device_count=8"))


@pytest.fixture(scope="module")
def runs(setup):
  tmp, config_file = setup
  two = _launch_two(tmp, config_file, tmp / "two")
  assert two.returncode == 0, _failure(two)
  one = _launch_one(tmp, config_file, tmp / "one")
  assert one.returncode == 0, one.stderr[-4000:]
  return tmp, two, one


def _params(workdir):
  return load_policy(str(workdir)).params


def test_two_processes_match_one_process_of_eight_devices(runs):
  tmp, _, _ = runs
  two, one = tmp / "two", tmp / "one"
  # The same decisions (every metrics line: cohort sizes, staleness tags, fitness, pair ties,
  # drops, evaluation outcomes; update norms, a sum over the fsdp shards, to 1e-6 relative), the
  # same controller state and the same parameters, bit for bit: `python -m jaxes.run_tools.compare`,
  # the check a user runs after a rehearsal. The ES state lives in the rule table's shardings
  # (fsdp = 2 splits the embedding dimension), and the warm start sums its gradients in a fixed
  # order (warmstart.loss_and_grads), so nothing depends on how the 8 devices are split into
  # processes.
  report = []
  assert compare.compare(str(two), str(one), log=report.append), "\n".join(report)
  train = [r for r in compare.metrics_lines(str(two)) if "train" in r]
  print("\n".join(report), "\nupdate norms", [r["update_norm"] for r in train])
  assert len(train) == UPDATES and max(r["update_norm"] for r in train) > 0, train
  assert any(sum(r["staleness_hist"][1:]) for r in train), \
      "no stale result was used: the staleness comparison is vacuous"
  # The same tokens, decoded by both processes of the 2-process run and by the 1-process run.
  turns = [json.loads((tmp / d / f).read_text())
           for d, f in [("two-turns", "turns-0.json"), ("two-turns", "turns-1.json"),
                        ("one-turns", "turns-0.json")]]
  # Each process read the turns of its own slots (its 4 of 8: data 4 over 2 processes).
  assert turns[0] and turns[1]
  assert turns[0] == [t for t in turns[2] if t[0] < 4] and turns[1] == [t for t in turns[2] if t[0] >= 4]
  exchanges = [json.loads((tmp / "two-turns" / f"exchanges-{i}.json").read_text()) for i in range(2)]
  assert exchanges == [[], []]   # no host-side exchange inside any engine step


def test_metrics_and_run_files_are_written_once(runs):
  tmp, two, _ = runs
  records = metrics.read_metrics(str(tmp / "two" / "metrics.jsonl"))
  assert [r["version"] for r in records if "train" in r] == list(range(1, UPDATES + 1))
  assert [r["version"] for r in records if "train" not in r] == [0]      # the initial evaluation
  summary = json.loads((tmp / "two" / "summary.json").read_text())
  assert summary["version"] == UPDATES
  # Only process 0 printed the run's summary and the evaluation lines.
  out = two.stdout.splitlines()
  assert any(line.startswith("[p0] {") for line in out)
  assert not [line for line in out if line.startswith("[p1] {")], "\n".join(out[-80:])
  assert not any(line.startswith("[p1] held-out eval") for line in out)
  assert sum(line.startswith("[p0] held-out eval") for line in out) == 2


def _train_lines(workdir) -> int:
  return sum("train" in r for r in metrics.read_metrics(str(workdir / "metrics.jsonl")))


def test_sigkill_one_process_stops_the_other_then_rerun_resumes(sync_setup):
  tmp, config_file = sync_setup
  # The uninterrupted run, as one process of 8 devices: two processes decide and compute what one
  # does (test_two_processes_match_...), so the resumed 2-process run must end on its parameters,
  # and one process costs half the CPU of two.
  whole = _launch_one(tmp, config_file, tmp / "sync")
  assert whole.returncode == 0, whole.stderr[-4000:]
  workdir = tmp / "killed"
  # Started as local.sh starts them, but by hand: local.sh would stop the survivor itself; here
  # the survivor must notice on its own (the coordination service's heartbeat).
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  (tmp / "killed-turns").mkdir()
  logs = [open(tmp / f"killed-{i}.log", "w") for i in range(2)]   # files: a full pipe would block
  procs = [subprocess.Popen(_command(tmp, config_file, workdir), cwd=ROOT, stdout=logs[i],
                            stderr=subprocess.STDOUT,
                            env=launch_env(tmp, TURNS_DIR=str(tmp / "killed-turns"),
                                     JAXES_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S),
                                     JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                     JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                                     XLA_FLAGS="--xla_force_host_platform_device_count=4"))
           for i in range(2)]
  try:
    deadline = time.monotonic() + 1200
    while _train_lines(workdir) < 1 and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert all(p.poll() is None for p in procs), "a process ended before the kill:\n" + \
        "".join((tmp / f"killed-{i}.log").read_text()[-2000:] for i in range(2))
    assert _train_lines(workdir) < SYNC_UPDATES
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    procs[0].wait(timeout=HEARTBEAT_S * 6)
    survivor_s = time.monotonic() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
    for f in logs:
      f.close()
  assert procs[0].returncode != 0
  assert survivor_s < HEARTBEAT_S * 6
  assert not (workdir / "summary.json").exists()   # it was stopped mid-run
  # The same launch command again: resumes and ends where the uninterrupted run ended.
  again = _launch_two(tmp, config_file, workdir)
  assert again.returncode == 0, _failure(again)
  assert "resumed from checkpoint" in again.stdout
  assert compare.param_differences(_params(workdir), _params(tmp / "sync")) == {}
  versions = [r["version"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert versions == list(range(1, SYNC_UPDATES + 1))


def test_runner_split_needs_an_exchange_and_the_deterministic_schedule():
  from jaxes.rollout.episodes import EpisodeRunner
  kwargs = dict(make_episode=None, workers=1)
  with pytest.raises(ValueError, match="owned and exchange go together"):
    EpisodeRunner(None, None, None, sandbox_steps=2, owned=range(4), **kwargs)
  with pytest.raises(ValueError, match="sandbox_steps > 0"):
    EpisodeRunner(None, None, None, sandbox_steps=0, owned=range(4), exchange=lambda x: [x], **kwargs)
