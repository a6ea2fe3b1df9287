"""Stale-result policies through the real trainer, on the deterministic schedule: a run that
fails after its first update (a failure injected in process) and is resumed ends with the parameters, staleness and policy decisions of a run
never interrupted -- ``weight``, ``pace`` and ``throttle`` (``wait``'s barrier), each resumed
in process; the metrics lines carry generation/waiting staleness and the policy's weights.
``baseline_only`` is resumed in tests/train/test_coevolution.py. An in-flight version change
(``rollout.switch_versions``) moves episodes to newer weights and counts their generation
staleness from there, and repeats exactly on the deterministic schedule."""
import jax
import numpy as np
import pytest

from helpers_train import (build_tiny_tokenizer, fail_after_update, tiny_config,
                           train_records)
from jaxes.train.trainer import Trainer


def _params_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_weight_policy_failure_then_resume_equals_uninterrupted(warm_start, tmp_path):
  # Temperature sampling keyed by job (members differ), results taken 2 engine steps after
  # hand-out (a deterministic arrival order, so async runs repeat exactly).
  config = _policy_config(*warm_start, "weight", **{"controller.staleness_decay": 0.5})
  whole = Trainer(config, str(tmp_path / "a"), log=lambda s: None).run()
  lines = train_records(tmp_path / "a")
  for r in lines:
    assert sum(r["generation_staleness_hist"]) == sum(r["waiting_staleness_hist"]) == r["num_results"]
  # Not vacuous: some stale result was down-weighted in an update that moved θ.
  assert any(r["weight_sum"] < r["num_results"] and r["update_norm"] > 0 for r in lines), lines

  # Failed and resumed in process, as the other policies (a SIGKILLed command-line run and its
  # rerun is tests/train/test_trainer.py's, for every config alike).
  workdir = tmp_path / "b"
  fail_after_update(config, workdir)
  resumed = Trainer(config, str(workdir), log=lambda s: None).run()   # restores, replays, finishes
  assert resumed["version"] == 4 and resumed["updates_this_run"] >= 1
  _params_equal(resumed["params"], whole["params"])
  strip = lambda r: {k: r[k] for k in ("version", "staleness_hist", "generation_staleness_hist",
                                       "waiting_staleness_hist", "weight_sum", "update_norm")}
  assert [strip(r) for r in train_records(workdir)] == [strip(r) for r in lines]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
  """A tokenizer and a warm-started version 0 that every policy run here starts from
  (``warmstart.init_from``: one warm start for the module, also for the weight test's launched
  processes)."""
  root = tmp_path_factory.mktemp("warm")
  config = _policy_config(build_tiny_tokenizer(str(root / "tok")), "", "drop", **{
      "warmstart.steps": 60, "warmstart.learning_rate": 1e-2, "train.num_updates": 0})
  Trainer(config, str(root / "init"), log=lambda s: None).run()
  return config.tokenizer.path, str(root / "init")


def _policy_config(tokenizer_dir, init_from, overage, **overrides):
  # The weight test's schedule (4 slots, one cohort): every cohort finishes in one poll, so no job
  # is in flight at an update. A resume reissues in-flight jobs from their first token, which
  # equals the uninterrupted run only then (docs/controller.md, "Resume through the trainer"); on
  # this schedule wait never has to wait, so it takes drop's decisions here (PACE gets a schedule
  # whose pool outgrows N, PACE_REJECTS): its decisions are tests/controller/test_policies.py's
  # and tests/controller/test_controller.py's, exactly.
  return tiny_config(tokenizer_dir, **{
      "controller.mode": "async", "controller.max_staleness": 1, "controller.overage": overage,
      "controller.pace_pool_capacity": 0, "rollout.sandbox_steps": 2,
      "warmstart.init_from": init_from, "env.partial_credit": True, "eval.num_tasks": 0,
      "rollout.temperature": 0.4, "rollout.common_random_numbers": False, "train.num_updates": 4,
      "train.plot": False, "train.checkpoint_every": 2, **overrides})


# PACE with a pool that outgrows N: 8 slots for a cohort of 4 and one-turn episodes whose
# prompts prefill in one engine call and decode in one more, so members complete several in one
# poll and PACE's budget rejects the most stale of the excess (measured: 1 at each of the first
# two updates, none with the default prefill chunk).
PACE_REJECTS = {"env.max_turns": 1, "rollout.num_slots": 8, "rollout.decode_steps": 24,
                "rollout.prefill_chunk": 192}


# Throttle at K = 2 issuing one update ahead: on this schedule its admission is the limit of
# K = 1 (the 4 slots hold one cohort), so it runs wait's barrier (policies.Throttle is a Wait)
# under a wider bound. It is also the successor of this test's former ``wait`` case: on this
# schedule that run took drop's decisions and the throttle run takes the same ones, through the
# same barrier code and resume path.
THROTTLE = {"controller.max_staleness": 2, "controller.issue_depth": 1}


@pytest.mark.slow
@pytest.mark.parametrize("overage,overrides", [("pace", PACE_REJECTS), ("throttle", THROTTLE)])
def test_policy_failure_then_resume_equals_uninterrupted(overage, overrides, warm_start, tmp_path):
  config = _policy_config(*warm_start, overage, **overrides)
  whole = Trainer(config, str(tmp_path / "a"), log=lambda s: None).run()
  lines = train_records(tmp_path / "a")
  if overage == "pace":   # not vacuous: PACE rejected members after the failure point
    assert any(r["rejected"] > 0 for r in lines[1:]), lines
    assert all(r["dropped"] == r["rejected"] for r in lines), lines
  else:
    assert all(r["dropped"] == 0 for r in lines), lines
  assert any(r["update_norm"] > 0 for r in lines[1:]), lines   # θ moved after the failure point

  workdir = tmp_path / "b"
  fail_after_update(config, workdir)
  resumed = Trainer(config, str(workdir), log=lambda s: None).run()   # restores, replays, finishes
  assert resumed["version"] == 4
  _params_equal(resumed["params"], whole["params"])
  # PACE: the member rejected at update 2 is, after the resume, dropped at the same update as
  # too stale instead (the resume reissued the jobs in flight at the kill, one completed a poll
  # later than uninterrupted, after the update's pool was taken): the same members are consumed
  # and dropped, and the split between rejected and expired is not compared.
  keys = ("version", "staleness_hist", "generation_staleness_hist", "waiting_staleness_hist",
          "dropped", "update_norm") + (() if overage == "pace" else ("rejected",))
  strip = lambda r: {k: r[k] for k in keys}
  assert [strip(r) for r in train_records(workdir)] == [strip(r) for r in lines]


@pytest.mark.slow
def test_a_version_change_moves_episodes_and_repeats_exactly(warm_start, tmp_path):
  # 8 slots for a cohort of 4 under K = 1: two-turn episodes of the next version are in flight
  # at every update, so their second turns move to the newer weights.
  config = _policy_config(*warm_start, "drop", **{
      "rollout.switch_versions": True, "rollout.num_slots": 8, "train.num_updates": 3})
  runs = [Trainer(config, str(tmp_path / name), log=lambda s: None).run() for name in "ab"]
  lines = train_records(tmp_path / "a")
  assert sum(r["switched_results"] for r in lines) > 0, lines
  for r in lines:
    staleness = sum(s * n for s, n in enumerate(r["staleness_hist"]))
    generation = sum(s * n for s, n in enumerate(r["generation_staleness_hist"]))
    waiting = sum(s * n for s, n in enumerate(r["waiting_staleness_hist"]))
    assert generation + waiting <= staleness
    assert (generation + waiting < staleness) == (r["switched_results"] > 0 and staleness > 0)
  _params_equal(runs[0]["params"], runs[1]["params"])
  strip = lambda r: {k: r[k] for k in ("version", "staleness_hist", "generation_staleness_hist",
                                       "waiting_staleness_hist", "switched_results", "update_norm")}
  assert [strip(r) for r in train_records(tmp_path / "b")] == [strip(r) for r in lines]
