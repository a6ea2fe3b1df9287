"""The fast lane's direct tests of issue 63: forced splits in sync, Async-1 with pairs together."""
import numpy as np

from jaxes.es import shaping
from jaxes.experiments import fastlane


def _lane(**overrides):
  base = {"train.num_updates": 30, "objective.num_train_tasks": 16, "objective.num_heldout_tasks": 8,
          "objective.dim_in": 8, "objective.dim_out": 4, "es.population": 8, "sim.workers": 16}
  return fastlane.apply_overrides(fastlane.default_config(), {**base, **overrides})


def test_forced_splits_unpair_sync_at_no_staleness():
  whole = fastlane.schedule(_lane(**fastlane.REFERENCES["sync"]), 1)
  assert whole.unpaired_share == 0.0
  split = _lane(**fastlane.REFERENCES["sync"], **{"sim.split_fraction": 1.0})
  s = fastlane.schedule(split, 1)
  bound = fastlane.controller_config(split, 1).member_bound
  assert s.unpaired_share == s.orphaned_share == 1.0 and whole.orphaned_share == 0.0
  assert s.staleness_hist == whole.staleness_hist == [30 * 8]
  assert np.array_equal(s.versions, whole.versions) and np.array_equal(s.valid, whole.valid)
  odd = whole.members % 2 == 1
  # every odd member is now a fresh one (a noise key nobody was admitted with), its tasks redrawn
  assert np.array_equal(s.members[odd], whole.members[odd] + bound)
  assert np.array_equal(s.members[~odd], whole.members[~odd])
  assert not np.array_equal(s.tasks[odd], whole.tasks[odd])
  half = fastlane.schedule(_lane(**fastlane.REFERENCES["sync"], **{"sim.split_fraction": 0.5}), 1)
  assert 0.3 < half.unpaired_share < 0.7
  again = fastlane.schedule(_lane(**fastlane.REFERENCES["sync"], **{"sim.split_fraction": 0.5}), 1)
  assert np.array_equal(half.members, again.members) and np.array_equal(half.tasks, again.tasks)


def test_pairs_together_unpair_fewer_results_within_the_bound():
  free = [fastlane.schedule(_lane(**fastlane.REFERENCES["async1"]), seed) for seed in range(3)]
  together = [fastlane.schedule(_lane(**fastlane.REFERENCES["async1"], **{"controller.pairs": "together"}), seed)
              for seed in range(3)]
  assert np.mean([s.unpaired_share for s in together]) < 0.5 * np.mean([s.unpaired_share for s in free])
  # holding the early member costs staleness, never past K = 1
  assert np.mean([s.mean_staleness for s in together]) > np.mean([s.mean_staleness for s in free])
  assert max(s.max_staleness for s in together) == 1


def test_shaping_in_graph_is_the_librarys_over_the_cohort_or_each_version():
  rng = np.random.default_rng(0)
  f = np.round(rng.normal(size=12), 1).astype(np.float32)   # rounded: ties
  versions = np.array([3, 4, 4, 3, 4, 2, 4, 3, 4, 4, 0, 0], np.int32)
  valid = np.array([True] * 10 + [False] * 2)
  for method in ("centered_rank", "zscore"):
    cohort = fastlane._shape(f, valid, method, np.zeros(12, np.int32))
    np.testing.assert_allclose(cohort[:10], shaping.shape(f[:10], method), atol=1e-5)
    by_version = np.asarray(fastlane._shape(f, valid, method, versions))
    for v in (2, 3, 4):
      at = (versions == v) & valid
      np.testing.assert_allclose(by_version[at], shaping.shape(f[at], method), atol=1e-5)
    assert by_version[5] == 0.0 and not by_version[10:].any()   # a version alone, padding


def test_task_baseline_by_hand():
  tasks = np.array([[0, 1], [0, 2], [3, 3]])
  valid = np.array([True, True, False])   # the padding row neither shifts nor updates anything
  baseline = (np.zeros(4, np.float32), np.zeros(4, bool))
  less, baseline = fastlane._less_task_baseline(np.array([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]),
                                                tasks, valid, baseline, 0.5)
  # no task seen yet: the update's mean, 2.5; afterwards each task's mean of this update
  np.testing.assert_allclose(less[:2], [[-1.5, -0.5], [0.5, 1.5]])
  np.testing.assert_allclose(baseline[0], [2.0, 2.0, 4.0, 0.0])
  assert baseline[1].tolist() == [True, True, True, False]
  less, baseline = fastlane._less_task_baseline(np.full((3, 2), 3.0), tasks, valid, baseline, 0.5)
  np.testing.assert_allclose(less[:2], [[1.0, 1.0], [1.0, -1.0]])
  np.testing.assert_allclose(baseline[0], [2.5, 2.5, 3.5, 0.0])
