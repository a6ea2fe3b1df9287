"""Launch scripts: the TPU and SLURM plans that --dry-run prints, the TPU worker helper's
start/status/stop on this machine, and shellcheck over every script in launch/."""
import os
import shlex
import subprocess
import sys
import time

import pytest
import helpers_repo

pytestmark = pytest.mark.end_to_end   # every test here launches processes

ROOT = helpers_repo.REPO
LAUNCH = ROOT / "launch"
TRAIN = ["python", "-m", "jaxes.train", "--config=configs/paper.py:async1",
         "--workdir=/mnt/jaxes/runs/async1",
         "--config.model.path=/mnt/jaxes/models/Qwen2.5-7B-Instruct"]


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "JAXES_"))}
  env.update(extra)
  return env


def _run(script, *args, env=None, cwd=ROOT):
  return subprocess.run(["bash", str(LAUNCH / script), *args], env=env or _env(), cwd=cwd,
                        capture_output=True, text=True, timeout=60)


def _plan(script, *args, **kw):
  proc = _run(script, *args, **kw)
  assert proc.returncode == 0, proc.stderr
  return [shlex.split(line) for line in proc.stdout.splitlines()]


def test_tpu_up_plan_for_async1_on_v5p_64():
  plan = _plan("tpu/run.sh", "--name", "jaxes-a1", "--zone", "us-east5-a", "--project", "proj",
               "--dry-run", "up", "--", *TRAIN, "--config.mesh.data=8")
  assert len(plan) == 5
  create, archive, scp, setup, start = plan
  where = ["--zone=us-east5-a", "--project=proj"]
  assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "jaxes-a1", *where,
                    "--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5"]
  assert archive[:2] == ["git", "-C"] and archive[-1] == "HEAD"
  tarball = archive[-2].removeprefix("--output=")
  assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", tarball, "jaxes-a1:jaxes.tar.gz",
                 *where, "--worker=all"]
  for ssh in (setup, start):
    assert ssh[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "jaxes-a1", *where,
                       "--worker=all"]
    assert ssh[9] == "--command" and len(ssh) == 11
  assert "tar -xzf jaxes.tar.gz -C jaxes" in setup[10]
  assert shlex.split(setup[10].split("&& ")[-1]) == [
    "bash", "jaxes/launch/tpu/worker.sh", "setup", "--jax", "jax[tpu]==0.10.2"]
  # The remote shell gets back exactly the run's words.
  assert shlex.split(start[10]) == ["bash", "jaxes/launch/tpu/worker.sh", "start", "--", *TRAIN,
                                    "--config.mesh.data=8"]


def test_tpu_other_subcommands_and_options():
  common = ["--name", "n", "--zone", "z", "--dry-run"]
  (create,) = _plan("tpu/run.sh", *common, "--accelerator", "v5p-8", "--version", "v", "--spot",
                    "create")
  assert create[-3:] == ["--accelerator-type=v5p-8", "--version=v", "--spot"]
  (delete,) = _plan("tpu/run.sh", *common, "delete")
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "n", "--zone=z", "--quiet"]
  (logs,) = _plan("tpu/run.sh", *common, "logs")
  assert logs[7] == "--worker=0" and "tail" in logs[-1] and "jaxes-run/run.log" in logs[-1]
  (stop,) = _plan("tpu/run.sh", *common, "stop")
  assert stop[7] == "--worker=all" and stop[-1] == "bash jaxes/launch/tpu/worker.sh stop"
  *_, setup = _plan("tpu/run.sh", *common, "--no-docker", "setup")
  assert setup[-1].endswith("--no-docker")
  (start,) = _plan("tpu/run.sh", *common, "--env", "JAXES_HEARTBEAT_TIMEOUT_S=30", "start", "--",
                   "echo", "it's a $HOME")
  assert shlex.split(start[-1]) == ["bash", "jaxes/launch/tpu/worker.sh", "start", "--env",
                                    "JAXES_HEARTBEAT_TIMEOUT_S=30", "--", "echo", "it's a $HOME"]


@pytest.mark.parametrize("args, message", [
  (["--zone", "z", "--dry-run", "create"], "--name is required"),
  (["--name", "n", "--dry-run", "create"], "--zone is required"),
  (["--name", "n", "--zone", "z", "--dry-run", "start"], "needs the run as -- COMMAND"),
  (["--name", "n", "--zone", "z", "--dry-run", "launch"], "unknown subcommand 'launch'"),
  (["--name", "n", "--zone", "z", "--dry-run", "delete", "--", "x"], "takes no COMMAND"),
  (["--name", "n", "--zone", "z", "--env", "oops", "--dry-run", "stop"], "KEY=VALUE"),
])
def test_tpu_bad_usage_is_one_line(args, message):
  proc = _run("tpu/run.sh", *args)
  assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_slurm_submission_plan_for_async1_on_two_h100_nodes():
  mkdir, sbatch = _plan("gpu/slurm.sh", "--nodes", "2", "--gpus-per-node", "8", "--partition",
                        "h100", "--time", "48:00:00", "--dry-run", "--", *TRAIN,
                        "--config.mesh.data=2")
  assert mkdir == ["mkdir", "-p", f"{ROOT}/slurm-logs"]
  script = sbatch.index(f"{ROOT}/launch/gpu/slurm.sh")
  assert sbatch[:script] == [
    "sbatch", "--job-name=jaxes", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8",
    "--exclusive", f"--chdir={ROOT}", "--output=slurm-logs/%x-%j.out", "--partition=h100",
    "--time=48:00:00"]
  assert sbatch[script + 1:] == ["--", *TRAIN, "--config.mesh.data=2"]


def test_slurm_job_step_takes_the_coordinator_from_the_first_node(tmp_path):
  # A stand-in for SLURM's scontrol (not the thing under test): expands this one node list.
  fake = tmp_path / "scontrol"
  fake.write_text('#!/bin/sh\n'
                  '[ "$*" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
  fake.chmod(0o755)
  job = _env(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu[07-08]",
             PATH=f"{tmp_path}:{os.environ['PATH']}")
  docker, step = _plan("gpu/slurm.sh", "--docker", "--dry-run", "--", *TRAIN, env=job,
                       cwd=tmp_path)
  assert docker == ["srun", "--nodes=2", "--ntasks-per-node=1", "bash", "launch/docker/setup.sh"]
  inner = step.index("bash")
  assert step[:inner] == [
    "env", "JAX_COORDINATOR_ADDRESS=gpu07:24242", "JAX_NUM_PROCESSES=2", "srun", "--nodes=2",
    "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
  assert step[inner + 1] == "-c" and step[inner + 3:] == ["jaxes-task", *TRAIN]
  # What each task runs: its process index from SLURM_PROCID, then exactly the command.
  task = subprocess.run(["bash", "-c", step[inner + 2], "jaxes-task", sys.executable, "-c",
                         "import os, sys; print(os.environ['JAX_PROCESS_ID'], sys.argv[1:])",
                         "a b"], env=_env(SLURM_PROCID="1"), capture_output=True, text=True)
  assert task.stdout.strip() == "1 ['a b']"
  single = _env(SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="gpu07")
  assert _plan("gpu/slurm.sh", "--dry-run", "--", *TRAIN, env=single) == [
    ["srun", "--nodes=1", "--ntasks=1", *TRAIN]]


def test_single_node_gpu_plan():
  plan = _plan("gpu/node.sh", "--gpus", "0,1,2,3", "--dry-run", "--", *TRAIN)
  assert plan == [["nvidia-smi", "-L"],
                  ["env", "-u", "JAX_COORDINATOR_ADDRESS", "-u", "JAX_NUM_PROCESSES", "-u",
                   "JAX_PROCESS_ID", "CUDA_VISIBLE_DEVICES=0,1,2,3", *TRAIN]]


def test_slurm_bad_usage_is_one_line():
  for args, message in [(["--dry-run"], "missing the run"),
                        (["--nodes", "0", "--dry-run", "--", "x"], "--nodes must be"),
                        (["--bogus", "--", "x"], "unknown argument --bogus")]:
    proc = _run("gpu/slurm.sh", *args)
    assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_tpu_worker_helper_starts_reports_and_stops_a_run(tmp_path):
  """worker.sh as a TPU worker runs it, with a stand-in home holding a venv and the tree."""
  home = tmp_path / "home"
  (home / "jaxes-venv" / "bin").mkdir(parents=True)
  (home / "jaxes").mkdir()
  (home / "jaxes-venv" / "bin" / "python").symlink_to(sys.executable)
  env = _env(HOME=str(home))
  worker = ["bash", str(LAUNCH / "tpu" / "worker.sh")]
  run = lambda *a: subprocess.run([*worker, *a], env=env, capture_output=True, text=True,
                                  timeout=60)
  started = run("start", "--env", "MARK=m1", "--", "bash", "-c",
                'echo "$JAXES_DISTRIBUTED $MARK $PWD"; sleep 60 & wait')
  assert started.returncode == 0, started.stderr
  log = home / "jaxes-run" / "run.log"
  deadline = time.monotonic() + 20
  while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert log.read_text().split() == ["auto", "m1", str(home / "jaxes")]
  assert "running (pid" in run("status").stdout
  again = run("start", "--", "true")
  assert again.returncode == 2 and "already going" in again.stderr
  pid = int((home / "jaxes-run" / "run.pid").read_text())
  assert "stopped pid" in run("stop").stdout
  assert "not running" in run("status").stdout
  # The whole process group went, including the background sleep.
  ps = subprocess.run(["ps", "-o", "pid=", "-g", str(pid)], capture_output=True, text=True)
  assert ps.stdout.strip() == ""


@pytest.mark.shellcheck
def test_every_launch_script_passes_shellcheck():
  scripts = sorted(str(p.relative_to(ROOT)) for p in LAUNCH.rglob("*.sh"))
  assert {"launch/local.sh", "launch/tpu/run.sh", "launch/gpu/slurm.sh"} <= set(scripts)
  proc = subprocess.run(["shellcheck", "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout
