"""A stale-result policy through the real trainer: async ES under the ``weight`` policy on the
deterministic schedule, SIGKILLed mid-run and rerun, ends with the parameters of a run never
interrupted; its metrics lines carry generation/waiting staleness and the policy's weights."""
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers_train import ROOT, build_tiny_tokenizer, tiny_config, write_config_file
from jaxes.train import metrics
from jaxes.train.trainer import Trainer


def _train_records(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  return [r for r in metrics.read_metrics(path) if "train" in r] if os.path.exists(path) else []


@pytest.mark.slow
def test_weight_policy_sigkill_then_rerun_equals_uninterrupted(tmp_path):
  # Temperature sampling keyed by job (members differ), results taken 2 engine steps after
  # hand-out (a deterministic arrival order, so async runs repeat exactly).
  config = tiny_config(build_tiny_tokenizer(str(tmp_path / "tok")), **{
      "controller.mode": "async", "controller.max_staleness": 1, "controller.overage": "weight",
      "controller.staleness_decay": 0.5, "rollout.sandbox_steps": 2,
      "warmstart.steps": 60, "warmstart.learning_rate": 1e-2, "env.partial_credit": True,
      "eval.num_tasks": 0, "rollout.temperature": 0.4, "rollout.common_random_numbers": False,
      "train.num_updates": 4, "train.plot": False, "train.checkpoint_every": 2})
  whole = Trainer(config, str(tmp_path / "a"), log=lambda s: None).run()
  lines = _train_records(tmp_path / "a")
  for r in lines:
    assert sum(r["generation_staleness_hist"]) == sum(r["waiting_staleness_hist"]) == r["num_results"]
  # Not vacuous: some stale result was down-weighted in an update that moved θ.
  assert any(r["weight_sum"] < r["num_results"] and r["update_norm"] > 0 for r in lines), lines

  workdir = tmp_path / "b"
  cmd = [sys.executable, "-m", "jaxes.train", f"--config={write_config_file(config, tmp_path / 'c.py')}",
         f"--workdir={workdir}"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 300
  while not _train_records(workdir) and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
  assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stderr.read().decode()[-2000:]}"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  proc.stderr.close()
  assert 1 <= len(_train_records(workdir)) < 4
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  resumed = Trainer(config, str(workdir), log=lambda s: None).run()   # finished: restores
  assert resumed["version"] == 4
  for x, y in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(whole["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  strip = lambda r: {k: r[k] for k in ("version", "staleness_hist", "generation_staleness_hist",
                                       "waiting_staleness_hist", "weight_sum", "update_norm")}
  assert [strip(r) for r in _train_records(workdir)] == [strip(r) for r in lines]
