"""SyntheticObjective: the simulator's ES fitness without an LLM. Scores peak at the seed's
optimum and differ per task; a job's reward is its member's noise on the parameters of the
versions that decoded its turns; ``apply`` is one ES step per controller update, refuses an
update of another version, keeps the states of live versions only, and climbs the objective."""
import numpy as np
import pytest

from jaxes.controller.config import ControllerConfig
from jaxes.controller.controller import Controller, Job, Update
from jaxes.controller.objective import SyntheticObjective

CONFIG = ControllerConfig(mode="sync", population=8, max_staleness=0, seed=0)


def _objective(**kw) -> SyntheticObjective:
  return SyntheticObjective(CONFIG, **{"num_tasks": 3, "dim": 8, **kw})


def _job(version: int, member: int, task: int = 0) -> Job:
  return Job(job_id=0, version=version, member=member, task=task, episode=0, attempt=0)


def _update(version: int, fitness: list[float]) -> Update:
  n = len(fitness)
  return Update(version=version, results=[(version, m, f) for m, f in enumerate(fitness)],
                staleness=[0] * n, dropped=0, excluded=0, delayed=[False] * n)


def _one_update(ctl: Controller, objective: SyntheticObjective) -> dict:
  """Every job of the current cohort scored by ``objective``, then its update applied."""
  for job in ctl.next_jobs(CONFIG.population):
    ctl.report(job.job_id, objective.reward(job))
  update = ctl.pop_update()
  assert update is not None and len(update.results) == CONFIG.population
  return objective.apply(update, ctl.live_versions())


def test_seeded_optimum_and_task_weights():
  a, b, other = _objective(), _objective(), _objective(seed=1)
  np.testing.assert_array_equal(a.optimum, b.optimum)
  assert not np.allclose(a.optimum, other.optimum)
  assert a.task_weights.shape == (3, 8) and (a.task_weights > 0).all()
  np.testing.assert_allclose(a.task_weights.mean(axis=1), 1.0)
  # theta starts at 0: the objective is exp(-mean(theta*^2))
  assert a.objective() == pytest.approx(np.exp(-np.mean(a.optimum ** 2)))


def test_score_peaks_at_the_optimum_and_tasks_disagree():
  objective = _objective()
  assert objective.score(objective.optimum, 0) == pytest.approx(1.0)
  away = objective.optimum + 0.5
  scores = [objective.score(away, t) for t in range(3)]
  assert all(0 < s < 1 for s in scores)
  # a uniform offset of 0.5 under weights of mean 1: exp(-0.25) on every task
  np.testing.assert_allclose(scores, np.exp(-0.25))
  x = objective.optimum.copy()
  x[0] += 1.0
  one_coordinate = [objective.score(x, t) for t in range(3)]
  assert one_coordinate == pytest.approx(np.exp(-objective.task_weights[:, 0] / 8))
  assert len(set(one_coordinate)) == 3


def test_reward_is_the_members_noise_on_each_turns_version():
  objective = _objective()
  base = np.asarray(objective.states[0].params["theta"], np.float64)
  job = _job(0, 3, task=1)
  noise = np.asarray(objective.strategy.perturbed(objective.states[0], (0, 3))["theta"],
                     np.float64) - base
  assert np.abs(noise).max() > 0
  assert objective.reward(job) == pytest.approx(objective.score(base + noise, 1), rel=1e-6)
  assert objective.reward(job, (0, 0)) == pytest.approx(objective.reward(job))

  objective.apply(_update(0, [float(m) for m in range(8)]), live_versions=[0])
  moved = np.asarray(objective.states[1].params["theta"], np.float64)
  assert not np.allclose(moved, base)
  want = (objective.score(base + noise, 1) + objective.score(moved + noise, 1)) / 2
  assert objective.reward(job, (0, 1)) == pytest.approx(want, rel=1e-5)


def test_apply_refuses_an_update_of_another_version():
  objective = _objective()
  update = _update(1, [])
  with pytest.raises(ValueError, match="update of version 1 but the objective is at 0"):
    objective.apply(update, [])
  assert objective.version == 0


def test_apply_keeps_only_the_states_of_live_versions():
  objective = _objective()
  metrics = objective.apply(_update(0, [float(m) for m in range(8)]), live_versions=[0])
  assert objective.version == 1 and sorted(objective.states) == [0, 1]
  assert metrics["update_norm"] > 0 and 0 < metrics["objective"] <= 1
  objective.apply(_update(1, [float(-m) for m in range(8)]), live_versions=[])
  assert sorted(objective.states) == [2]


def test_updates_climb_the_objective():
  objective = _objective(learning_rate=0.2)
  ctl = Controller(CONFIG, 3)
  start = objective.objective()
  curve = [_one_update(ctl, objective)["objective"] for _ in range(6)]
  assert objective.version == 6 and curve[-1] == objective.objective()
  assert curve[-1] > start + 0.02, (start, curve)
