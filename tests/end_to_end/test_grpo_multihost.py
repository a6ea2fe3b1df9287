"""The GRPO trainer for real as 2 JAX processes x 2 CPU devices (`launch/local.sh`: gloo
collectives, loopback coordinator) against 1 process x 4 devices: `python -m jaxes.train` on the
same tiny async GRPO run (warm start, sampled groups with staleness, greedy held-out evaluation)
must write the same metrics lines (timings aside; the learner's loss, grad norm and ratio
exactly), end with the same parameters bit for bit and write its metrics and summary once. SAO,
which shares GRPO's plumbing but builds its own batch metrics and has a value head, likewise.

The 2-process run starts from the 1-process run's warm start (``warmstart.init_from``): the warm
start across process layouts is tests/end_to_end/test_multihost_train.py's, and here it would cost each of
the two processes its own compile and 60 steps.
"""
import json
import subprocess
import sys

import pytest

from helpers_train import ROOT, build_tiny_tokenizer, launch_env, tiny_config, write_config_file
from jaxes.run_tools import compare
from jaxes.train import metrics
from jaxes.train.policy import load_policy

UPDATES = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("grpo_multihost")
  tokenizer = build_tiny_tokenizer(str(tmp / "tok"))
  # data 2 x fsdp 2: each process owns the sandboxes of half the slots, the batch's 4 rows are
  # split over data, params and moments over fsdp (and the moments over data too).
  config = tiny_config(tokenizer, **{
      "train.algorithm": "grpo", "controller.mode": "async", "controller.max_staleness": 1,
      "rollout.temperature": 0.5, "rollout.sandbox_steps": 2, "rollout.num_slots": 8,
      "mesh.data": -1, "mesh.fsdp": 2, "warmstart.steps": 60, "warmstart.learning_rate": 1e-2,
      "env.partial_credit": True, "eval.num_tasks": 1, "grpo.group_size": 2,
      "grpo.tasks_per_update": 2, "grpo.micro_batches": 2, "grpo.learning_rate": 3e-3,
      "train.num_updates": UPDATES, "train.checkpoint_every": 1, "train.plot": False})
  config_file = write_config_file(config, tmp / "config.py")
  config.warmstart.init_from = str(tmp / "one")
  from_one_file = write_config_file(config, tmp / "from_one.py")

  one = _launch_one(tmp, config_file, tmp / "one")
  assert one.returncode == 0, one.stderr[-4000:]
  two = _launch_two(tmp, from_one_file, tmp / "two")
  assert two.returncode == 0, two.stderr[-3000:] + two.stdout[-5000:]
  return tmp, two


def _command(config_file, workdir):
  # --verbose: the summary printed as JSON, by process 0 only (test_metrics_summary_...).
  return [sys.executable, "-m", "jaxes.train", f"--config={config_file}", f"--workdir={workdir}", "--verbose"]


def _launch_one(tmp, config_file, workdir):
  return subprocess.run(_command(config_file, workdir), cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=launch_env(tmp, XLA_FLAGS="--xla_force_host_platform_device_count=4"))


def _launch_two(tmp, config_file, workdir):
  return subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--devices", "2", "2", "--",
                         *_command(config_file, workdir)], cwd=ROOT, env=launch_env(tmp),
                        capture_output=True, text=True, timeout=900)


def test_two_processes_train_like_one_process_of_four_devices(runs):
  tmp, _ = runs
  # Timings and rates differ between runs; everything else in a metrics line must not.
  lines = {name: compare.metrics_lines(str(tmp / name)) for name in ("two", "one")}
  assert lines["two"] == lines["one"]
  train = [r for r in lines["two"] if "train" in r]
  assert [r["version"] for r in train] == list(range(1, UPDATES + 1))
  assert all(r["grpo"]["episodes"] > 0 for r in train), train
  assert any(r["grpo"]["grad_norm"] > 0 for r in train), "no group taught anything: vacuous"
  assert any(sum(r["staleness_hist"][1:]) for r in train), "no stale group: the comparison is vacuous"
  # Bit for bit: the same compiled programs on the same mesh (data 2 x fsdp 2), whichever way
  # its devices are split into processes, and a warm start summed in a fixed order (docs/multihost.md).
  two, one = load_policy(str(tmp / "two")).params, load_policy(str(tmp / "one")).params
  assert compare.param_differences(two, one) == {}
  start = load_policy(str(tmp / "one"), version=0).params
  assert compare.param_differences(start, load_policy(str(tmp / "two"), version=0).params) == {}
  assert compare.param_differences(start, one), "the parameters never moved: the comparison is vacuous"


def test_metrics_summary_and_logs_are_written_once(runs):
  tmp, two = runs
  records = metrics.read_metrics(str(tmp / "two" / "metrics.jsonl"))
  assert [r["version"] for r in records if "train" in r] == list(range(1, UPDATES + 1))
  assert [r["version"] for r in records if "train" not in r] == [0]   # the initial evaluation
  summary = json.loads((tmp / "two" / "summary.json").read_text())
  assert summary["version"] == UPDATES and summary["algorithm"] == "grpo"
  out = two.stdout.splitlines()
  assert any(line.startswith("[p0] {") for line in out)
  assert not [line for line in out if line.startswith("[p1] {")], "\n".join(out[-80:])
  assert not any(line.startswith("[p1] held-out eval") for line in out)


def test_sao_in_two_processes_trains_like_one_process(runs):
  # Both start from the GRPO runs' warm start, and evaluate nothing (the GRPO runs do). Update 1
  # trains the value head alone, update 2 the policy too, on results up to one update stale. Its
  # batch metrics are read from the host's lists: the placed batch spans both processes' devices
  # (reading it failed before).
  tmp, _ = runs
  config = tiny_config(str(tmp / "tok"), **{
      "train.algorithm": "sao", "controller.mode": "async", "controller.max_staleness": 1,
      "rollout.temperature": 0.5, "rollout.sandbox_steps": 2, "rollout.num_slots": 8,
      "mesh.data": -1, "mesh.fsdp": 2, "warmstart.init_from": str(tmp / "one"),
      "env.partial_credit": True, "eval.num_tasks": 0, "sao.tasks_per_update": 4,
      "sao.micro_batches": 2, "sao.learning_rate": 3e-3, "sao.value_learning_rate": 0.05,
      "sao.value_warmup_updates": 1, "train.num_updates": UPDATES, "train.plot": False})
  config_file = write_config_file(config, tmp / "sao.py")
  one = _launch_one(tmp, config_file, tmp / "sao-one")
  assert one.returncode == 0, one.stderr[-4000:]
  two = _launch_two(tmp, config_file, tmp / "sao-two")
  assert two.returncode == 0, two.stderr[-3000:] + two.stdout[-5000:]
  lines = {name: compare.metrics_lines(str(tmp / name)) for name in ("sao-two", "sao-one")}
  assert lines["sao-two"] == lines["sao-one"]
  train = [r for r in lines["sao-two"] if "train" in r]
  assert [r["version"] for r in train] == list(range(1, UPDATES + 1))
  assert all(r["sao"]["episodes"] > 0 and r["sao"]["value_loss"] > 0 for r in train), train
  assert any(sum(r["staleness_hist"][1:]) for r in train), "no stale result: the comparison is vacuous"
  two_params, one_params = load_policy(str(tmp / "sao-two")).params, load_policy(str(tmp / "sao-one")).params
  assert compare.param_differences(two_params, one_params) == {}
  assert compare.param_differences(load_policy(str(tmp / "sao-one"), version=0).params, one_params), \
      "the policy never moved: the comparison is vacuous"
