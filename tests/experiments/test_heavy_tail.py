"""heavy_tail.predict: the simulator's updates/hour for sync and Async-1 under log-normal episode
durations of a given median. Without a tail it is the arithmetic of rounds; with one, the sync
barrier idles workers that Async-1 keeps busy, at staleness at most 1; the rate scales inversely
with the median. (``measure``/``main`` run the real trainer: the experiment's own run.)"""
import pytest

from jaxes.experiments.heavy_tail import predict

# workers = slots, as main() predicts; a cohort is population x episodes = 16 episodes
TINY = dict(workers=8, population=8, episodes=2, updates=12, num_tasks=16, seed=0)


def _predict(mode: str, sigma: float, median_s: float = 4.0) -> dict:
  return predict(mode, 0 if mode == "sync" else 1, sigma=sigma, median_s=median_s, **TINY)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_without_a_tail_the_rate_is_rounds_of_the_median(mode):
  out = _predict(mode, sigma=0.0)
  # 16 episodes on 8 workers: 2 rounds of 4 s per update
  assert out["updates"] == TINY["updates"]
  assert out["updates_per_hour"] == pytest.approx(3600 / (2 * 4.0))
  assert out["utilization"] == pytest.approx(1.0)
  assert out["mean_staleness"] == 0 and out["dropped"] == 0


def test_async1_outpaces_the_sync_barrier_on_a_heavy_tail():
  sync, async1 = _predict("sync", sigma=1.0), _predict("async", sigma=1.0)
  assert sync["mean_staleness"] == 0 and sync["utilization"] < 0.9   # idle at the barrier
  assert async1["utilization"] == pytest.approx(1.0)
  assert 0 < async1["mean_staleness"] <= 1 and async1["max_staleness"] == 1
  assert async1["updates_per_hour"] > 1.5 * sync["updates_per_hour"]
  assert _predict("async", sigma=1.0) == async1   # seeded: the same prediction again


def test_rate_scales_inversely_with_the_median():
  short, long = _predict("async", sigma=1.0, median_s=2.0), _predict("async", sigma=1.0, median_s=6.0)
  assert short["updates_per_hour"] == pytest.approx(3 * long["updates_per_hour"])
  assert short["utilization"] == pytest.approx(long["utilization"])
  assert short["mean_staleness"] == long["mean_staleness"]
