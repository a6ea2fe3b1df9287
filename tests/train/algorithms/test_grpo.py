"""The GRPO trainer end to end at tiny sizes: async groups through the real engine, sandboxes and
controller; a resumed run equals an uninterrupted one; its policy loads like an ES run's."""
import jax
import numpy as np
import pytest

from helpers_train import build_tiny_tokenizer, tiny_config
from jaxes.train import checkpoint, metrics
from jaxes.train.trainer import Trainer
from jaxes.train.policy import load_policy

# Async (staleness <= 1), so stale groups are consumed and kept episodes cross checkpoints; a
# short warm start (made once: warm_start) and partial credit at temperature 0.5 make a group's
# rewards differ; the deterministic schedule (sandbox_steps) makes the run a function of its inputs.
BASE = {"train.algorithm": "grpo", "controller.mode": "async", "controller.max_staleness": 1,
        "rollout.temperature": 0.5, "rollout.sandbox_steps": 2, "warmstart.steps": 60,
        "warmstart.learning_rate": 1e-2, "env.partial_credit": True, "eval.num_tasks": 0,
        "grpo.group_size": 2, "grpo.tasks_per_update": 2, "grpo.micro_batches": 2,
        "grpo.learning_rate": 3e-3, "train.checkpoint_every": 1,
        "rollout.num_slots": 8}   # all of both live versions' episodes at once


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def warm_start(tokenizer_dir, tmp_path_factory):
  """BASE's warm start, made once (a run of no updates: its version 0): every run below starts
  from it (warmstart.init_from), as each used to make the same warm start itself."""
  workdir = tmp_path_factory.mktemp("warm") / "init"
  _run(tokenizer_dir, workdir, 0)
  return str(workdir)


def _params_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _run(tokenizer_dir, workdir, updates, init_from="", **overrides):
  config = tiny_config(tokenizer_dir, **{**BASE, **overrides, "train.num_updates": updates,
                                         "warmstart.init_from": init_from})
  return Trainer(config, str(workdir), log=lambda s: None).run()


def _train_lines(workdir):
  return [r for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]


def test_grpo_async_consumes_stale_groups_keeps_episodes_across_checkpoints_and_loads(tokenizer_dir, warm_start,
                                                                                      tmp_path):
  run = tmp_path / "async"
  # One decode step per engine call, four updates: the token-bucket engine prefills about a chunk
  # per shard per call and decodes 8 tokens per call by default, so a group's episodes end nearly
  # together; one step per call spreads them over the schedule, so the first checkpoint holds
  # finished episodes of unconsumed groups and a later update consumes a stale group.
  first = _run(tokenizer_dir, run, 1, warm_start, **{"rollout.decode_steps": 1})
  assert first["version"] == 1 and first["algorithm"] == "grpo"
  ckpt = checkpoint.Checkpointer(str(run / "checkpoints"))
  try:
    kept = [len(ckpt.restore_host(s)["episodes"]) for s in ckpt.steps()]
  finally:
    ckpt.close()
  assert kept[-1], f"no finished episode of an unconsumed group in the checkpoint ({kept}): resume path untested"
  resumed = _run(tokenizer_dir, run, 4, warm_start, **{"rollout.decode_steps": 1})   # restores them, and the jobs in flight are reissued
  assert resumed["updates_this_run"] == 3
  lines = _train_lines(run)
  assert [r["version"] for r in lines] == [1, 2, 3, 4]
  for r in lines:
    g = r["grpo"]
    assert sum(r["staleness_hist"]) == r["num_results"] <= 2
    assert 0 < g["episodes"] <= 4 and g["tokens"] > 0 and 0 <= g["clip_fraction"] <= 1
  assert any(len(r["staleness_hist"]) > 1 for r in lines), "no stale group was consumed"
  _params_equal(load_policy(str(run)).params, resumed["params"])


def test_grpo_resume_equals_uninterrupted(tokenizer_dir, warm_start, tmp_path):
  # Synchronous: at a checkpoint nothing is in flight, so the resumed run replays exactly what
  # the uninterrupted one did (async resumes reissue in-flight jobs from their start).
  # The async test's shapes (groups of 2, one decode step per engine call: its compiled
  # programs) at a gentler learning rate, with which both updates have reward differences within
  # a group: the resume starts from moved parameters, and the update after it moves them again
  # (a zero step would make the comparison vacuous; it used groups of 4 for that, and compiled
  # their programs).
  sync = {"controller.mode": "sync", "controller.max_staleness": 0, "rollout.decode_steps": 1,
          "grpo.learning_rate": 1e-3}
  whole = _run(tokenizer_dir, tmp_path / "a", 2, warm_start, **sync)
  lines = _train_lines(tmp_path / "a")
  assert lines[0]["grpo"]["grad_norm"] > 0, f"update 1 did not move θ: vacuous ({lines})"
  assert lines[1]["grpo"]["grad_norm"] > 0, f"update 2 did not move θ: vacuous ({lines})"
  _run(tokenizer_dir, tmp_path / "b", 1, warm_start, **sync)
  resumed = _run(tokenizer_dir, tmp_path / "b", 2, warm_start, **sync)
  assert resumed["updates_this_run"] == 1
  def learner_metrics(rows):   # everything but the tokens/s (a timing)
    return [{k: v for k, v in r["grpo"].items() if k != "learner_tokens_per_s"} for r in rows]
  assert learner_metrics(_train_lines(tmp_path / "b")) == learner_metrics(lines)
  _params_equal(resumed["params"], whole["params"])
  assert [r["version"] for r in _train_lines(tmp_path / "b")] == [1, 2]
