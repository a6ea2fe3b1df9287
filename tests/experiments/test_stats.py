"""jaxes.experiments.stats: t-based verdicts at 2, 3 and 20 seeds (against closed forms, printed
tables and scipy's own t-test), 80%-power seed counts, and the lack-of-fit check of a slope."""
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from jaxes.experiments import stats


def test_two_seeds_is_a_cauchy_t_on_one_df():
  # d = (2.0, 2.6): mean 2.3, s.e. 0.3, t = 7.667 on 1 df (the Cauchy: p = 1 - 2/pi atan|t|).
  # The old 2-s.e. rule called it resolved; the 95% interval 2.3 ± 12.706 x 0.3 holds 0.
  p = stats.paired([2.0, 2.6])
  assert p["mean"] == pytest.approx(2.3) and p["stderr"] == pytest.approx(0.3) and p["df"] == 1
  assert p["t"] == pytest.approx(2.3 / 0.3)
  assert p["p"] == pytest.approx(1 - 2 / math.pi * math.atan(2.3 / 0.3))
  assert p["ci"] == pytest.approx([2.3 - 12.7062 * 0.3, 2.3 + 12.7062 * 0.3], abs=1e-4)
  assert not p["resolved"]


def test_three_seeds_async1_is_not_resolved():
  # Async-1 on the LLM toy, 12-06 (docs/log/grid-2026-12-06-toy-grid-3-seeds.md): +5.5, +0.8,
  # +2.3 points. t on 2 df has F(t) = 1/2 + t / (2 sqrt(2 + t^2)): p = 1 - |t| / sqrt(2 + t^2).
  d = [5.5, 0.8, 2.3]
  p = stats.paired(d)
  se = np.std(d, ddof=1) / math.sqrt(3)
  t = np.mean(d) / se
  assert p["t"] == pytest.approx(t) and t == pytest.approx(2.08, abs=0.02)
  assert p["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t)) and p["p"] == pytest.approx(0.17, abs=0.01)
  assert p["ci"] == pytest.approx([np.mean(d) - 4.3027 * se, np.mean(d) + 4.3027 * se], abs=1e-3)
  assert abs(p["mean"]) > 2 * p["stderr"] and not p["resolved"]   # the old rule's false call


def test_twenty_seeds_match_scipys_t_test():
  d = np.random.default_rng(0).normal(0.6, 1.0, 20)
  p = stats.paired(d)
  ref = scipy_stats.ttest_1samp(d, 0.0)
  assert p["t"] == pytest.approx(ref.statistic) and p["p"] == pytest.approx(ref.pvalue)
  lo, hi = ref.confidence_interval(0.95)
  assert p["ci"] == pytest.approx([lo, hi]) and p["df"] == 19
  assert p["ci"][1] - p["mean"] == pytest.approx(2.0930 * p["stderr"], abs=1e-4)
  assert p["resolved"] == (ref.pvalue < 0.05)


def test_one_seed_and_zero_spread():
  assert stats.paired([1.0]) == {"mean": 1.0, "stderr": None, "sd": None, "n": 1, "df": None,
                                 "t": None, "p": None, "ci": None, "resolved": False}
  assert stats.paired([None]) is None
  same = stats.paired([-25.0, -25.0, -25.0])   # no spread: the interval is the point
  assert same["ci"] == [-25.0, -25.0] and same["p"] == 0.0 and same["t"] is None and same["resolved"]
  assert stats.paired([0.0, 0.0])["p"] == 1.0 and not stats.paired([0.0, 0.0])["resolved"]


@pytest.mark.parametrize("n,old_rate", [(2, 0.29), (3, 0.18)])
def test_with_no_effect_resolved_fires_five_percent_of_the_time(n, old_rate):
  rng = np.random.default_rng(n)
  draws = rng.normal(0.0, 1.0, (4000, n))
  calls = [stats.paired(d) for d in draws]
  rate = np.mean([c["resolved"] for c in calls])
  old = np.mean([abs(c["mean"]) > 2 * c["stderr"] for c in calls])
  assert rate == pytest.approx(0.05, abs=0.015)
  assert old == pytest.approx(old_rate, abs=0.025)


@pytest.mark.parametrize("effect,n", [(1.0, 10), (0.8, 15), (0.5, 34)])
def test_seeds_for_power_are_the_textbook_paired_t_sizes(effect, n):
  # Cohen's d = effect / s.d.: 10, 15, 34 pairs for 80% power at a two-sided 5% level.
  assert stats.seeds_for_power(1.0, effect) == n
  assert stats.t_power(effect, 1.0, n) >= 0.8 > stats.t_power(effect, 1.0, n - 1)
  assert stats.seeds_for_power(2.0, -2 * effect) == n   # sign and scale free


def test_power_matches_a_simulated_t_test():
  # delay-8 on the LLM toy, 12-06: -2.1 ± 2.7 over 3 seeds (s.d. 4.68): 20 seeds detect it
  # about half the time; 80% takes about 40 (the simulation: 52%, ~39).
  sd = 2.7 * math.sqrt(3)
  n = stats.seeds_for_power(sd, -2.1)
  assert 38 <= n <= 42
  rng = np.random.default_rng(1)
  draws = rng.normal(-2.1, sd, (4000, 20))
  simulated = np.mean(scipy_stats.ttest_1samp(draws, 0.0, axis=1).pvalue < 0.05)
  assert stats.t_power(-2.1, sd, 20) == pytest.approx(simulated, abs=0.025)
  assert stats.seeds_for_power(None, 1.0) is None and stats.seeds_for_power(1.0, 0.0) is None


def test_lack_of_fit_by_hand():
  # 2 seeds x 3 cells at x = 0, 1, 2: SSE of seed + cell = 4/3 on 2 df, of seed + b x
  # (b = 0.5) = 13/3; F = 3 / (2/3) = 4.5 on (1, 2) df, p = P(|t_2| > sqrt 4.5).
  check = stats.lack_of_fit(np.array([[0.0, 1.0, 0.0], [0.0, 3.0, 2.0]]), np.array([0.0, 1.0, 2.0]))
  t = math.sqrt(4.5)
  assert check["F"] == pytest.approx(4.5) and check["df"] == [1, 2]
  assert check["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t)) and check["fits"]
  assert stats.lack_of_fit(np.zeros((3, 2)), np.array([0.0, 1.0])) is None   # 2 cells: no check


def test_a_kink_is_no_line_and_a_line_with_noise_is():
  rng = np.random.default_rng(2)
  x = np.array([0.0, 0.45, 1.4, 1.9])
  seeds = rng.normal(0, 5, (10, 1))
  line = seeds - 1.5 * x + rng.normal(0, 0.3, (10, 4))
  kink = seeds + np.array([0.0, -3.0, -6.0, -1.0]) + rng.normal(0, 0.3, (10, 4))
  assert stats.lack_of_fit(line, x)["fits"]
  bad = stats.lack_of_fit(kink, x)
  assert not bad["fits"] and bad["p"] < 1e-6


def test_surface_table_says_what_its_numbers_are():
  rows = {"sync": {"seeds": [0, 1, 2], "diff": [0.0] * 3, "mean_staleness": [0.0] * 3},
          "async1": {"seeds": [0, 1, 2], "diff": [-1.0, -2.0, -1.5], "mean_staleness": [0.45] * 3},
          "delay_updates=8": {"seeds": [0, 1, 2], "diff": [-9.0, -7.0, -8.0], "mean_staleness": [1.4] * 3},
          "delay_updates=16": {"seeds": [0, 1, 2], "diff": [-2.0, -2.5, -3.0], "mean_staleness": [1.9] * 3}}
  summary = stats.surface_summary(rows, seeds=[0, 1, 2])
  md = stats.surface_markdown(summary)
  assert "s.e. over seeds" in md and "held-out tasks differ per seed" in md and "95% t-interval" in md
  fit = summary["slopes"]["all"]
  assert fit["cells"] == ["sync", "async1", "delay_updates=8", "delay_updates=16"]
  assert not fit["lack_of_fit"]["fits"] and "(no line)" in md   # delay 8 costs more than 16
  d8 = next(r for r in summary["table"] if r["name"] == "delay_updates=8")
  assert d8["vs_sync"]["resolved"] and d8["seeds_for_power"] == 2
