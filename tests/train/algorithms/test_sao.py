"""SAO through the real trainer at tiny sizes: `python -m jaxes.train` SIGKILLed after its first
update, then resumed, ends with the parameters and learner metrics of a run never interrupted;
its policy loads like any run's; a changing environment's two mixes are both evaluated."""
import os

import jax
import numpy as np
import pytest

from helpers_train import build_tiny_tokenizer, sigkill_after_first_update, tiny_config, train_records
from jaxes.run_tools import report
from jaxes.train import metrics
from jaxes.train.policy import load_policy
from jaxes.train.trainer import Trainer

pytestmark = pytest.mark.end_to_end   # every test here launches processes

# Synchronous under the deterministic schedule (sandbox_steps), so a resume repeats the
# interrupted run's updates exactly. No warm start: the format penalty gives the random policy's
# replies a negative reward, so the advantage (return minus a zero-initialised value) is not 0
# and every policy update moves θ; the first update trains the value head alone.
SAO = {"train.algorithm": "sao", "controller.mode": "sync", "controller.max_staleness": 0,
       "rollout.temperature": 1.0, "rollout.sandbox_steps": 2, "env.parse_error_penalty": 1.0,
       "train.num_updates": 2, "train.checkpoint_every": 1, "train.plot": False,
       "sao.tasks_per_update": 2, "sao.micro_batches": 1,
       "sao.learning_rate": 3e-3, "sao.value_learning_rate": 0.05, "sao.value_warmup_updates": 1,
       # A changing environment: update 2's episodes run the other family; both mixes evaluated.
       "env.families": "permissions", "env.shift_families": "log_count", "env.shift_at_update": 2,
       "eval.num_tasks": 1, "eval.seeds": 1, "eval.temperature": 0.0}


def _learner(rows):   # everything but the tokens/s (a timing)
  return [{k: v for k, v in r["sao"].items() if k != "learner_tokens_per_s"} for r in rows]


def test_sao_sigkilled_then_rerun_equals_uninterrupted(tmp_path):
  config = tiny_config(build_tiny_tokenizer(str(tmp_path / "tok")), **SAO)
  whole = Trainer(config, str(tmp_path / "a"), log=lambda s: None, write_report=report.write).run()
  lines = train_records(tmp_path / "a")
  assert whole["algorithm"] == "sao" and [r["version"] for r in lines] == [1, 2]
  learner = _learner(lines)
  assert learner[0]["grad_norm"] > 0 and learner[0]["value_loss"] > 0
  assert learner[0]["value"] == 0.0 and learner[1]["value"] < 0, learner   # the head learned
  assert all(0 <= g["clip_fraction"] <= 1 and g["episodes"] == 2 for g in learner)
  evals = [r["eval"] for r in metrics.read_metrics(str(tmp_path / "a" / "metrics.jsonl")) if "eval" in r]
  assert [e["version"] for e in evals] == [0, 2] and all(e["shifted"]["version"] == e["version"] for e in evals)
  assert whole["shifted_change"]["tasks"] == 1 and os.path.getsize(tmp_path / "a" / "report.html") > 0
  first, last = load_policy(str(tmp_path / "a"), version=1).params, whole["params"]
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(last))), \
      "the policy updates after the value warm-up did not move θ: vacuous comparison"

  workdir = tmp_path / "b"
  sigkill_after_first_update(config, workdir, tmp_path / "sao_config.py")
  # The resume in this process (the command line's rerun is test_train's): the same Trainer code
  # resumes, and the programs the uninterrupted run compiled serve it (a launch: ~8 CPU-s more).
  said = []
  Trainer(config, str(workdir), log=said.append).run()
  assert any(line.startswith("resumed from checkpoint") for line in said), said
  assert [r["version"] for r in train_records(workdir)] == [1, 2]
  assert _learner(train_records(workdir)) == learner
  for a, b in zip(jax.tree.leaves(load_policy(str(workdir)).params), jax.tree.leaves(last), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
