"""Stale-result policies: generation/waiting staleness on a hand-made schedule, each policy's
decisions exactly, the weights the ES step sees, and every policy through the simulator."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes import es
from jaxes.controller import Controller, ControllerConfig
from jaxes.controller import durations, policies
from jaxes.controller.policies import Candidate
from jaxes.controller.simulate import Simulator


def cfg(**kw):
  base = dict(mode="async", population=2, episodes_per_member=2, max_staleness=2, max_retries=0)
  base.update(kw)
  return ControllerConfig(**base)


def _three_updates(overage, **kw):
  """N = 2, K = 2, E = 2: version 0 admits members 0..5. Members 2, 3, 4, 5 finish at version 0;
  member 0's second episode and member 1 finish at version 2."""
  ctl = Controller(cfg(overage=overage, **kw), num_tasks=50)
  jobs = {(j.member, j.episode): j for j in ctl.next_jobs(100)}
  assert sorted({m for m, _ in jobs}) == [0, 1, 2, 3, 4, 5]
  report = lambda *keys: [ctl.report(jobs[k].job_id, 0.1 * k[0] + 0.01 * k[1]) for k in keys]
  report((0, 0), *[(m, e) for m in (2, 3, 4, 5) for e in (0, 1)])
  updates = [ctl.pop_update(), ctl.pop_update()]
  assert ctl.pop_update() is None
  report((0, 1), (1, 0), (1, 1))
  updates.append(ctl.pop_update())
  return ctl, updates


def test_generation_and_waiting_staleness_on_a_hand_made_schedule():
  ctl, ups = _three_updates("drop")
  assert [[(v, m) for v, m, _ in u.results] for u in ups] == [[(0, 2), (0, 3)], [(0, 4), (0, 5)],
                                                              [(0, 0), (0, 1)]]
  assert [u.staleness for u in ups] == [[0, 0], [1, 1], [2, 2]]
  assert [u.generation for u in ups] == [[0, 0], [0, 0], [2, 2]]   # 0 and 1 ran while v moved on
  assert [u.waiting for u in ups] == [[0, 0], [1, 1], [0, 0]]      # 4 and 5 waited one update
  assert [u.weights for u in ups] == [[1.0, 1.0]] * 3
  assert ups[2].staleness_metrics() == {"generation_staleness_hist": [0, 0, 2],
                                        "waiting_staleness_hist": [2], "weight_sum": 2.0,
                                        "rejected": 0, "switched_results": 0}
  # A restored controller keeps the completion versions.
  ctl2 = Controller(cfg(), num_tasks=50)
  jobs = ctl2.next_jobs(100)
  for j in jobs[:1]:
    ctl2.report(j.job_id, 1.0)
  ctl3 = Controller.from_state_dict(ctl2.state_dict())
  assert ctl3._members[(0, jobs[0].member)].done == [0, None]


def test_a_version_change_counts_generation_staleness_from_the_last_turns_weights():
  """In-flight version change (``rollout.switch_versions``): a result's generation staleness
  counts the updates since the weights that decoded its episodes' last turns (the oldest of
  them); its staleness for the bound and the step stays u - v (its noise is of cohort v)."""
  ctl = Controller(cfg(), num_tasks=50)   # N = 2, K = 2, E = 2
  jobs = {(j.member, j.episode): j for j in ctl.next_jobs(100)}
  for m in (2, 3, 4, 5):
    for e in (0, 1):
      ctl.report(jobs[(m, e)].job_id, 0.1 * m)
  ctl.pop_update(), ctl.pop_update()   # version 2; members 0 and 1 of version 0 still running
  with pytest.raises(ValueError, match=r"decoded_under=3 is outside the job's version 0 \.\. "
                                       r"the controller's 2"):
    ctl.report(jobs[(0, 0)].job_id, 0.5, decoded_under=3)
  ctl.report(jobs[(0, 0)].job_id, 0.5, decoded_under=2)   # the refused report lost nothing
  ctl.report(jobs[(0, 1)].job_id, 0.5, decoded_under=1)
  restored = Controller.from_state_dict(ctl.state_dict())   # keeps the decoding versions
  assert sorted(j.job_id for j in restored.next_jobs(2)) == sorted(
      jobs[(1, e)].job_id for e in (0, 1))   # the jobs in flight, reissued
  for c in (ctl, restored):
    c.report(jobs[(1, 0)].job_id, 0.2)
    c.report(jobs[(1, 1)].job_id, 0.2)
    u = c.pop_update()
    assert [(v, m) for v, m, _ in u.results] == [(0, 0), (0, 1)]
    assert (u.staleness, u.generation, u.waiting, u.switched) == ([2, 2], [1, 2], [0, 0], 1)
  # A state written before the version change (no decoding versions) loads as unmoved.
  state = ctl.state_dict()
  state["members"] = [row[:5] for row in state["members"]]
  assert all(r.decoded == [r.version] * 2 for r in Controller.from_state_dict(state)._members.values())


@pytest.mark.parametrize("overage,weights", [
    ("weight", [[1.0, 1.0], [0.5, 0.5], [0.25, 0.25]]),
    ("baseline_only", [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]),
])
def test_weighting_policies_consume_as_drop_and_weigh_by_staleness(overage, weights):
  _, drop = _three_updates("drop")
  _, ups = _three_updates(overage, staleness_decay=0.5)
  assert [u.results for u in ups] == [u.results for u in drop]
  assert [u.weights for u in ups] == weights


def test_pace_ranks_by_effective_staleness_and_rejects_the_excess():
  pool = [Candidate(1, 0, (1, 1)),   # waiting 2, prefix generation 0
          Candidate(0, 2, (0, 2)),   # waiting 1, prefix generation 1 (one episode ran 2 updates)
          Candidate(2, 4, (3, 3)),   # waiting 0, prefix generation 1
          Candidate(3, 6, (3, 3)),   # fresh
          Candidate(2, 8, (2, 2))]   # waiting 1
  pick = policies.Pace(generation_weight=1.0).select(pool, 2, now=3)
  assert (pick.cohort, pick.rejected) == ([3, 2], [4, 1, 0])   # capacity N: the whole excess
  pick = policies.Pace(pool_capacity=4, generation_weight=1.0).select(pool, 2, now=3)
  assert (pick.cohort, pick.rejected) == ([3, 2], [0])
  # Without the generation term, member 4 is as fresh as 6 (ties: oldest version first) and the
  # long rollout 2 outranks 0, which only waited.
  pick = policies.Pace(pool_capacity=4, generation_weight=0.0).select(pool, 2, now=3)
  assert (pick.cohort, pick.rejected) == ([2, 3], [0])
  assert policies.Drop().select(pool, 2, now=3).cohort == [1, 0]   # earliest deadline first


def test_pace_rejections_are_counted_and_free_admission():
  admitted = {}
  for overage in ("drop", "pace"):
    ctl = Controller(cfg(overage=overage, max_staleness=1, episodes_per_member=1), num_tasks=50)
    for j in ctl.next_jobs(100):          # members 0..3 of version 0 all complete
      ctl.report(j.job_id, 1.0)
    upd = ctl.pop_update()
    assert [(v, m) for v, m, _ in upd.results] == [(0, 0), (0, 1)]
    admitted[overage] = [(j.version, j.member) for j in ctl.next_jobs(100)]
    if overage == "pace":
      assert (upd.rejected, upd.dropped, ctl.stats["members_rejected"]) == (2, 2, 2)
      assert ctl.pop_update() is None     # the rejected pair is gone
  assert admitted == {"drop": [(1, 0), (1, 1)], "pace": [(1, 0), (1, 1), (1, 2), (1, 3)]}


def test_throttle_issues_at_its_depth_and_waits_instead_of_dropping():
  """N = 2, K = 2, E = 1, issue depth 1: 4 members admitted per step of the pipeline (wait
  admits 6); member 0 of version 0 straggles past two updates and is waited for, not dropped."""
  ctl = Controller(cfg(overage="throttle", issue_depth=1, episodes_per_member=1), num_tasks=50)
  wait = Controller(cfg(overage="wait", episodes_per_member=1), num_tasks=50)
  assert len(wait.next_jobs(100)) == 6
  jobs = {(j.version, j.member): j for j in ctl.next_jobs(100)}
  assert sorted(jobs) == [(0, 0), (0, 1), (0, 2), (0, 3)]
  done = lambda *keys: [ctl.report(jobs[k].job_id, 0.1 * k[1]) for k in keys]
  done((0, 1), (0, 2), (0, 3))
  members = lambda u: [(v, m) for v, m, _ in u.results]
  assert members(ctl.pop_update()) == [(0, 1), (0, 2)]
  jobs.update({(j.version, j.member): j for j in ctl.next_jobs(100)})
  assert sorted(jobs)[-2:] == [(1, 0), (1, 1)] and len(jobs) == 6   # 2 more: one update ahead
  assert ctl.pop_update() is None
  done((1, 0), (1, 1))
  assert members(ctl.pop_update()) == [(0, 3), (1, 0)]
  jobs.update({(j.version, j.member): j for j in ctl.next_jobs(100)})
  done((2, 0), (2, 1))
  # Taking (1, 1), (2, 0) would leave member (0, 0) past its deadline (update 2): wait for it.
  assert ctl.pop_update() is None
  done((0, 0))
  upd = ctl.pop_update()
  assert (members(upd), upd.staleness, upd.dropped) == ([(0, 0), (1, 1)], [2, 1], 0)
  assert ctl.stats["members_dropped"] == 0
  with pytest.raises(ValueError, match=r"ControllerConfig\.issue_depth=3: must be <= max_staleness \(2\)"):
    cfg(overage="throttle", issue_depth=3)


def test_policy_weights_reach_the_es_step():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, mode="full",
                         staleness_weighting=policies.BaselineOnly().result_weight)
  state = strategy.init({"w": jnp.zeros(3)}, jax.random.key(0))
  state = dataclasses.replace(state, version=1)
  results = [(0, 0, 1.0), (0, 1, 0.0), (1, 0, 3.0), (1, 1, 2.0)]
  versions, members, weights, count = strategy.cohort(state, results)
  z = (np.array([1.0, 0.0, 3.0, 2.0]) - 1.5) / np.std([1.0, 0.0, 3.0, 2.0])  # shaped over all 4
  assert count == 4 and list(versions[:2]) == [0, 1]   # antithetic pairs merged
  np.testing.assert_allclose(weights[:2], [0.0, z[2] - z[3]], rtol=1e-6)
  assert policies.Drop().result_weight is None and policies.Weight(0.25).result_weight(2) == 0.0625


@pytest.mark.parametrize("policy", policies.POLICIES)
def test_every_policy_runs_in_the_simulator_within_the_bound(policy):
  # K = 2: no job starts while the trainer updates, so with K = 1 the admitted 2N members never
  # fill the pool past N and PACE has nothing to reject; with K = 2 (3N admitted) it does.
  runs = []
  for _ in range(2):
    ctl = Controller(ControllerConfig(mode="async", population=8, episodes_per_member=2,
                                      max_staleness=2, overage=policy), num_tasks=200)
    sim = Simulator(ctl, 24, durations.parse("pareto:1.5"), seed=3, update_seconds=120.0)
    runs.append(sim.run(30))
  s = runs[0]
  assert s == runs[1] and s["updates"] == 30 and s["max_staleness"] <= 2
  assert s["mean_generation_staleness"] + s["mean_waiting_staleness"] == pytest.approx(s["mean_staleness"])
  assert (s["rejected"] > 0) == (policy == "pace")
  assert (s["dropped"] == 0) if policy in ("wait", "throttle") else True


@pytest.mark.parametrize("kw,key", [
    (dict(staleness_decay=0.0), "staleness_decay"), (dict(pace_pool_capacity=-1), "pace_pool_capacity"),
    (dict(pace_generation_weight=-0.5), "pace_generation_weight"), (dict(overage="tinker"), "overage"),
    (dict(overage="throttle", issue_depth=-1), "issue_depth"),
])
def test_bad_policy_parameters_name_the_key(kw, key):
  with pytest.raises(ValueError, match=rf"ControllerConfig\.{key}="):
    cfg(**kw)


def test_simulator_cli_takes_the_policy_and_trainer_time(capsys):
  from jaxes.controller.simulate import main
  argv = ["--mode", "async", "--workers", "24", "--population", "8", "--episodes_per_member", "2",
          "--durations", "pareto:1.5", "--updates", "20", "--no_objective", "--json",
          "--overage", "pace", "--pace_pool_capacity", "10", "--update_seconds", "120"]
  assert main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["overage"] == "pace" and out["updates"] == 20 and "mean_waiting_staleness" in out
  assert main(argv[:-6] + ["--overage", "weight", "--staleness_decay", "0"]) == 2   # one-line error
