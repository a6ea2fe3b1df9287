"""Controller behaviour on hand-made schedules: modes, accounting, delays, errors, state."""
import ast
import json
import pathlib
import subprocess
import sys

import ml_collections
import pytest

import jaxes.controller
from jaxes.controller import Controller, ControllerConfig
from jaxes.controller.tasks import TaskSampler


def cfg(**kw):
  base = dict(mode="async", population=2, episodes_per_member=1, max_staleness=0, max_retries=1)
  base.update(kw)
  return ControllerConfig(**base)


def report_all(ctl, jobs, reward=lambda j: float(j.member)):
  for job in jobs:
    ctl.report(job.job_id, reward(job))


# ---- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,key", [
    (dict(mode="fast"), "mode"),
    (dict(overage="skip"), "overage"),
    (dict(population=3), "population"),
    (dict(population=0), "population"),
    (dict(episodes_per_member=0), "episodes_per_member"),
    (dict(max_staleness=-1), "max_staleness"),
    (dict(mode="sync", max_staleness=1), "max_staleness"),
    (dict(delay_fraction=1.5, delay_updates=1), "delay_fraction"),
    (dict(delay_fraction=0.1), "delay_updates"),
    (dict(stress_all_stale=2, delay_fraction=0.1, delay_updates=1), "stress_all_stale"),
    (dict(max_retries=-1), "max_retries"),
    (dict(pairs="kept"), "pairs"),
    (dict(pairs="together", antithetic=False), "pairs"),
])
def test_bad_config_names_the_key(kw, key):
  with pytest.raises(ValueError, match=rf"ControllerConfig\.{key}="):
    cfg(**kw)


def test_from_ml_collections_block():
  block = ml_collections.ConfigDict(dict(
      mode="async", episodes_per_member=4, max_staleness=1, overage="drop", delay_fraction=0.1,
      delay_updates=4, stress_all_stale=0, max_retries=3))
  c = ControllerConfig.from_config(block, population=32, seed=7)
  assert (c.population, c.seed, c.max_staleness, c.held_per_cohort, c.hold_updates) == (
      32, 7, 1, 3, 4)
  block.typo = 1
  with pytest.raises(ValueError, match="typo"):
    ControllerConfig.from_config(block, population=32, seed=7)


@pytest.mark.parametrize("p,n,held", [(0.1, 32, 3), (0.1, 10, 1), (0.25, 2, 1), (0.5, 4, 2),
                                      (1.0, 6, 6), (0.01, 8, 0)])
def test_held_per_cohort_rounds_half_up(p, n, held):
  assert cfg(population=n, delay_fraction=p, delay_updates=2).held_per_cohort == held


@pytest.mark.end_to_end
def test_controller_imports_no_jax_and_reads_no_clock():
  # Decisions must not depend on wall-clock time (multi-host determinism); only the simulator's
  # optional synthetic objective may import JAX.
  package = pathlib.Path(jaxes.controller.__file__).parent
  for path in sorted(package.glob("*.py")):
    if path.name == "objective.py":
      continue
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        imported |= {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        imported.add(node.module.split(".")[0])
    assert not imported & {"jax", "time", "datetime", "numpy"}, (path.name, imported)
  code = "import sys, jaxes.controller.simulate; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


# ---- sync --------------------------------------------------------------------------------------

def test_sync_is_a_barrier_with_one_version_in_flight():
  ctl = Controller(cfg(mode="sync", population=4, episodes_per_member=2), num_tasks=100)
  jobs = ctl.next_jobs(100)
  assert len(jobs) == 8 and {j.version for j in jobs} == {0}
  assert sorted({j.member for j in jobs}) == [0, 1, 2, 3]
  report_all(ctl, jobs[:-1])
  assert ctl.next_jobs(100) == [] and ctl.pop_update() is None
  report_all(ctl, jobs[-1:])
  assert ctl.next_jobs(100) == []   # the update has not been applied yet
  upd = ctl.pop_update()
  assert upd.version == 0 and ctl.version == 1
  assert [(v, m) for v, m, _ in upd.results] == [(0, 0), (0, 1), (0, 2), (0, 3)]
  assert upd.staleness == [0, 0, 0, 0] and upd.dropped == 0 and upd.excluded == 0
  assert ctl.pop_update() is None
  assert {j.version for j in ctl.next_jobs(100)} == {1}


def test_fitness_is_the_mean_over_episodes():
  ctl = Controller(cfg(mode="sync", episodes_per_member=3), num_tasks=100)
  jobs = ctl.next_jobs(100)
  report_all(ctl, jobs, reward=lambda j: float(j.episode + 10 * j.member))
  upd = ctl.pop_update()
  assert upd.results == [(0, 0, 1.0), (0, 1, 11.0)]


# ---- tasks -------------------------------------------------------------------------------------

def test_antithetic_pairs_share_tasks_and_a_version_never_repeats_one():
  ctl = Controller(cfg(population=8, episodes_per_member=3), num_tasks=1000)
  jobs = ctl.next_jobs(100)
  by = {(j.member, j.episode): j.task for j in jobs}
  for m in range(0, 8, 2):
    for e in range(3):
      assert by[(m, e)] == by[(m + 1, e)]
  distinct = {by[(m, e)] for m in range(0, 8, 2) for e in range(3)}
  assert len(distinct) == 12


def test_without_antithetic_every_member_gets_its_own_tasks():
  ctl = Controller(cfg(population=3, antithetic=False, episodes_per_member=2), num_tasks=1000)
  jobs = ctl.next_jobs(100)
  assert len({j.task for j in jobs}) == 6


def test_task_sampler_uses_every_task_before_repeating_and_is_seeded():
  s = TaskSampler(7, seed=3)
  first = [s.task(5, i) for i in range(7)]
  assert sorted(first) == list(range(7))
  assert sorted(s.task(5, i) for i in range(7, 14)) == list(range(7))
  assert first == [TaskSampler(7, seed=3).task(5, i) for i in range(7)]
  assert first != [TaskSampler(7, seed=4).task(5, i) for i in range(7)]
  assert first != [s.task(6, i) for i in range(7)]
  with pytest.raises(ValueError):
    TaskSampler(0, seed=0)


# ---- failures ----------------------------------------------------------------------------------

def test_infrastructure_failure_is_retried_with_the_same_identity():
  ctl = Controller(cfg(mode="sync", max_retries=2), num_tasks=10)
  jobs = ctl.next_jobs(10)
  ctl.report(jobs[0].job_id, None, "SANDBOX_ERROR")
  retry = ctl.next_jobs(10)
  assert len(retry) == 1
  r = retry[0]
  assert (r.version, r.member, r.task, r.episode, r.attempt) == (
      jobs[0].version, jobs[0].member, jobs[0].task, jobs[0].episode, 1)
  assert r.job_id != jobs[0].job_id
  ctl.report(r.job_id, 0.5)
  ctl.report(jobs[1].job_id, 0.25)
  assert ctl.pop_update().results == [(0, 0, 0.5), (0, 1, 0.25)]
  assert ctl.stats["retries"] == 1 and ctl.stats["failed_episodes"] == 0


def test_agent_failures_keep_their_reward_and_are_not_retried():
  ctl = Controller(cfg(mode="sync"), num_tasks=10)
  jobs = ctl.next_jobs(10)
  ctl.report(jobs[0].job_id, 0.0, "PARSE_ERROR")
  ctl.report(jobs[1].job_id, 0.0, "AGENT_TIMEOUT")
  assert ctl.next_jobs(10) == []
  assert ctl.pop_update().results == [(0, 0, 0.0), (0, 1, 0.0)]


def test_episode_fails_after_r_retries_and_member_uses_the_rest():
  ctl = Controller(cfg(mode="sync", episodes_per_member=2, max_retries=1), num_tasks=10)
  jobs = {(j.member, j.episode): j for j in ctl.next_jobs(10)}
  ctl.report(jobs[(0, 0)].job_id, None, "SANDBOX_ERROR")
  (retry,) = ctl.next_jobs(10)
  ctl.report(retry.job_id, None, "SANDBOX_ERROR")
  assert ctl.next_jobs(10) == []          # R = 1 retry used up: the episode counts as failed
  for key in [(0, 1), (1, 0), (1, 1)]:
    ctl.report(jobs[key].job_id, 0.75)
  upd = ctl.pop_update()
  assert upd.results == [(0, 0, 0.75), (0, 1, 0.75)] and upd.excluded == 0
  assert ctl.stats["failed_episodes"] == 1 and ctl.stats["retries"] == 1


def test_member_whose_episodes_all_failed_is_excluded_not_scored_zero():
  ctl = Controller(cfg(mode="sync", max_retries=0), num_tasks=10)
  jobs = ctl.next_jobs(10)
  ctl.report(jobs[0].job_id, None, "SANDBOX_ERROR")
  ctl.report(jobs[1].job_id, 0.5)
  upd = ctl.pop_update()
  assert upd.results == [(0, 1, 0.5)] and upd.excluded == 1
  assert ctl.stats["members_excluded"] == 1


def test_every_member_excluded_gives_an_empty_update_not_a_hang():
  ctl = Controller(cfg(mode="sync", max_retries=0), num_tasks=10)
  for job in ctl.next_jobs(10):
    ctl.report(job.job_id, None, "SANDBOX_ERROR")
  upd = ctl.pop_update()
  assert upd.results == [] and upd.excluded == 2 and ctl.version == 1


@pytest.mark.parametrize("args,err,match", [
    (dict(reward=None, failure=None), ValueError, "give a reward"),
    (dict(reward=float("nan")), ValueError, "finite"),
    (dict(reward=float("inf")), ValueError, "finite"),
])
def test_bad_reports(args, err, match):
  ctl = Controller(cfg(), num_tasks=10)
  job = ctl.next_jobs(1)[0]
  with pytest.raises(err, match=match):
    ctl.report(job.job_id, **args)
  ctl.report(job.job_id, 1.0)   # the bad report changed nothing


def test_unknown_or_repeated_report_raises():
  ctl = Controller(cfg(), num_tasks=10)
  job = ctl.next_jobs(1)[0]
  with pytest.raises(KeyError, match="job_id=99"):
    ctl.report(99, 1.0)
  ctl.report(job.job_id, 1.0)
  with pytest.raises(KeyError, match="already reported"):
    ctl.report(job.job_id, 1.0)


# ---- async, drop and wait ----------------------------------------------------------------------

def test_async_admits_k_plus_one_cohorts_and_member_ids_stay_below_the_bound():
  c = cfg(population=4, episodes_per_member=2, max_staleness=2)
  ctl = Controller(c, num_tasks=100)
  jobs = ctl.next_jobs(1000)
  assert len(jobs) == 3 * 4 * 2
  assert {j.version for j in jobs} == {0}
  assert max(j.member for j in jobs) == c.member_bound - 1


def _k1_scenario(overage):
  """N = 2, K = 1, E = 1: version 0 admits members 0..3; 2 and 3 finish first."""
  ctl = Controller(cfg(max_staleness=1, overage=overage), num_tasks=100)
  jobs = {j.member: j for j in ctl.next_jobs(100)}
  assert sorted(jobs) == [0, 1, 2, 3]
  report_all(ctl, [jobs[3], jobs[2]])
  upd0 = ctl.pop_update()
  assert [(v, m) for v, m, _ in upd0.results] == [(0, 2), (0, 3)]
  new = ctl.next_jobs(100)
  assert [(j.version, j.member) for j in new] == [(1, 0), (1, 1)]
  report_all(ctl, new)
  return ctl, jobs, new


def test_drop_mode_drops_results_that_would_exceed_the_bound():
  ctl, old, new = _k1_scenario("drop")
  upd1 = ctl.pop_update()          # (0, 0) and (0, 1) still running: update 1 goes ahead
  assert [(v, m) for v, m, _ in upd1.results] == [(1, 0), (1, 1)]
  assert upd1.staleness == [0, 0] and upd1.dropped == 2
  assert ctl.stats["members_dropped"] == 2
  assert [(j.version, j.member) for j in ctl.doomed_jobs()] == [(0, 0), (0, 1)]
  assert ctl.live_versions() == []   # nothing pending needs θ_0 any more
  report_all(ctl, [old[0], old[1]])  # late results are accepted and ignored
  assert ctl.stats["ignored_reports"] == 2 and ctl.doomed_jobs() == []
  assert ctl.pop_update() is None


def test_wait_mode_waits_for_results_that_must_make_the_update():
  ctl, old, new = _k1_scenario("wait")
  assert ctl.pop_update() is None   # (0, 0), (0, 1) would be 2 stale at update 2
  assert ctl.live_versions() == [0]
  report_all(ctl, [old[1]])
  assert ctl.pop_update() is None
  report_all(ctl, [old[0]])
  upd1 = ctl.pop_update()
  assert [(v, m) for v, m, _ in upd1.results] == [(0, 0), (0, 1)]   # oldest first
  assert upd1.staleness == [1, 1] and upd1.dropped == 0
  report_all(ctl, ctl.next_jobs(100))
  upd2 = ctl.pop_update()
  assert [(v, m) for v, m, _ in upd2.results] == [(1, 0), (1, 1)]
  assert upd2.staleness == [1, 1]


def test_pairs_together_holds_a_member_for_its_partner_until_its_last_update():
  # N = 2, K = 1, E = 1: version 0 admits pairs (0, 1) and (2, 3); 0 and 3 finish first.
  def start(pairs):
    ctl = Controller(cfg(max_staleness=1, pairs=pairs), num_tasks=100)
    jobs = {j.member: j for j in ctl.next_jobs(100)}
    report_all(ctl, [jobs[0], jobs[3]])
    return ctl, jobs

  ctl, _ = start("free")
  assert [(v, m) for v, m, _ in ctl.pop_update().results] == [(0, 0), (0, 3)]   # two pairs split
  ctl, jobs = start("together")
  assert ctl.pop_update() is None            # each waits: update 1 may still consume it
  report_all(ctl, [jobs[1]])
  upd0 = ctl.pop_update()
  assert [(v, m) for v, m, _ in upd0.results] == [(0, 0), (0, 1)]
  assert ctl.pop_update() is None            # (0, 3) still waits for (0, 2)
  new = ctl.next_jobs(100)
  report_all(ctl, new)
  # Update 1 is (0, 3)'s last within K = 1: it goes without its partner, which is dropped.
  upd1 = ctl.pop_update()
  assert [(v, m) for v, m, _ in upd1.results] == [(0, 3), (1, 0)] and upd1.staleness == [1, 0]
  assert upd1.dropped == 1 and [(j.version, j.member) for j in ctl.doomed_jobs()] == [(0, 2)]
  # Sync has nothing to wait for: the option changes no cohort there.
  logs = []
  for pairs in ("free", "together"):
    logs.append([])
    ctl = Controller(cfg(mode="sync", population=4, pairs=pairs), num_tasks=100, log=logs[-1])
    for _ in range(3):
      report_all(ctl, reversed(ctl.next_jobs(100)))
      assert ctl.pop_update() is not None
  assert logs[0] == logs[1]


# ---- controlled delay and stress -------------------------------------------------------------

def _run_sync(c, updates):
  ctl = Controller(c, num_tasks=1000)
  out = []
  while len(out) < updates:
    report_all(ctl, ctl.next_jobs(1000), reward=lambda j: 1.0 + j.member)
    while (upd := ctl.pop_update()) is not None:
      out.append(upd)
  return out


def test_controlled_delay_holds_back_exactly_round_pn_members_for_d_updates():
  c = cfg(mode="sync", population=10, delay_fraction=0.2, delay_updates=3, seed=1)
  updates = _run_sync(c, 12)
  for upd in updates:
    delayed = [s for s, d in zip(upd.staleness, upd.delayed) if d]
    fresh = [s for s, d in zip(upd.staleness, upd.delayed) if not d]
    assert fresh == [0] * 8
    assert delayed == ([3, 3] if upd.version >= 3 else [])
  # The held members of update u are exactly the delayed results of update u + 3.
  held_by_update = {u.version: {(v, m) for (v, m, _), d in zip(u.results, u.delayed) if d}
                    for u in updates}
  for u in range(3, 12):
    assert {v for v, _ in held_by_update[u]} == {u - 3}
  # The choice is by seed: another seed holds back other members.
  other = _run_sync(cfg(mode="sync", population=10, delay_fraction=0.2, delay_updates=3, seed=2),
                    12)
  assert [u.results for u in other] != [u.results for u in updates]


def test_stress_all_stale_makes_every_result_stale():
  updates = _run_sync(cfg(mode="sync", population=4, stress_all_stale=2), 8)
  assert [len(u.results) for u in updates[:2]] == [0, 0]   # warm-up: nothing held back yet
  for upd in updates[2:]:
    assert upd.staleness == [2] * 4 and all(upd.delayed)


# ---- state -------------------------------------------------------------------------------------

def test_state_dict_round_trips_through_json_and_reissues_jobs_in_flight():
  ctl = Controller(cfg(population=4, episodes_per_member=2, max_staleness=1), num_tasks=50)
  jobs = ctl.next_jobs(5)
  report_all(ctl, jobs[:2])
  state = json.loads(json.dumps(ctl.state_dict()))
  restored = Controller.from_state_dict(state)
  assert restored.version == ctl.version and restored.stats == ctl.stats
  again = restored.next_jobs(3)
  assert again == jobs[2:5]
  assert restored.stats["jobs_reissued"] == 3
  assert restored.next_jobs(1)[0] == ctl.next_jobs(1)[0]   # then carries on identically


def test_state_with_wrong_format_is_refused():
  state = Controller(cfg(), num_tasks=5).state_dict()
  state["format"] = 99
  with pytest.raises(ValueError, match="format"):
    Controller.from_state_dict(state)
