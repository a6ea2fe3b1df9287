"""Property-based tests of the controller under randomised schedules (hypothesis).

A random driver asks for random numbers of jobs, reports random subsets of the jobs in flight in
random order, with random infrastructure failures, and pops every update that is due. Rewards
are a fixed function of (version, member, task, episode), so runs can be compared.
"""
import json
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from jaxes.controller import Controller, ControllerConfig
from jaxes.controller.config import PAIRS
from jaxes.controller.policies import POLICIES


def reward_of(job):
  return random.Random(f"r:{job.version}:{job.member}:{job.task}:{job.episode}").random()


@st.composite
def configs(draw):
  mode = draw(st.sampled_from(["sync", "async"]))
  k = 0 if mode == "sync" else draw(st.integers(0, 3))
  n = draw(st.sampled_from([2, 4, 6, 8]))
  delay = draw(st.sampled_from(["none", "delay", "stress"]))
  kw = {}
  if delay == "delay":
    kw = dict(delay_fraction=draw(st.sampled_from([0.1, 0.25, 0.5, 1.0])),
              delay_updates=draw(st.integers(1, 3)))
  elif delay == "stress":
    kw = dict(stress_all_stale=draw(st.integers(1, 3)))
  policy = draw(st.sampled_from(POLICIES))
  if policy == "pace":
    kw.update(pace_pool_capacity=draw(st.sampled_from([0, n + 1])),
              pace_generation_weight=draw(st.sampled_from([0.0, 0.5, 1.0])))
  if policy == "throttle":
    kw.update(issue_depth=draw(st.integers(0, k)))
  return ControllerConfig(mode=mode, population=n, episodes_per_member=draw(st.integers(1, 3)),
                          max_staleness=k, overage=policy, pairs=draw(st.sampled_from(PAIRS)),
                          max_retries=draw(st.integers(0, 2)), seed=draw(st.integers(0, 5)), **kw)


class Driver:
  """Random schedule over one controller; checks invariants as it goes."""

  def __init__(self, cfg, num_tasks, seed, fail_p, log=None, abort_doomed=False):
    self.cfg, self.fail_p, self.abort_doomed = cfg, fail_p, abort_doomed
    self.ctl = Controller(cfg, num_tasks, log=log)
    self.rnd = random.Random(seed)
    self.in_flight = []
    self.updates = []
    self.issued = {}     # job_id -> Job, every job ever handed out

  def take(self, jobs):
    for job in jobs:
      assert job.job_id not in self.issued or self.issued[job.job_id] == job
      self.issued[job.job_id] = job
      assert 0 <= job.member < self.cfg.member_bound
      assert 0 <= job.attempt <= self.cfg.max_retries
    self.in_flight.extend(jobs)

  def pop_updates(self):
    while (upd := self.ctl.pop_update()) is not None:
      assert upd.version == len(self.updates)
      self.updates.append(upd)
      self.check_live_versions()
    if self.abort_doomed:   # as the simulator does; otherwise doomed jobs report late
      doomed = {j.job_id for j in self.ctl.doomed_jobs()}
      for job_id in sorted(doomed):
        self.ctl.report(job_id, None, "CANCELLED")
      self.in_flight = [j for j in self.in_flight if j.job_id not in doomed]

  def check_live_versions(self):
    # Work that can still be consumed is never older than the bound allows.
    doomed = {j.job_id for j in self.ctl.doomed_jobs()}
    for job in self.ctl.in_flight():
      if job.job_id not in doomed:
        assert self.ctl.version - job.version <= self.cfg.max_staleness

  def step(self):
    self.pop_updates()
    self.take(self.ctl.next_jobs(self.rnd.randint(0, 6)))
    if not self.in_flight:
      self.take(self.ctl.next_jobs(1000))
      assert self.in_flight, "deadlock: nothing in flight, nothing issuable, no update due"
    self.rnd.shuffle(self.in_flight)
    k = self.rnd.randint(1, len(self.in_flight))
    done, self.in_flight = self.in_flight[:k], self.in_flight[k:]
    for job in done:
      if self.rnd.random() < self.fail_p:
        self.ctl.report(job.job_id, None, "SANDBOX_ERROR")
      else:
        self.ctl.report(job.job_id, reward_of(job), None)


def check_updates(cfg, updates):
  n, k = cfg.population, cfg.max_staleness
  held, hold = cfg.held_per_cohort, cfg.hold_updates
  seen = set()
  for upd in updates:
    u = upd.version
    assert len(upd.results) == len(upd.staleness) == len(upd.delayed)
    consumed = len(upd.results) + upd.excluded
    assert consumed == (n if u >= hold else n - held)
    assert len(upd.generation) == len(upd.waiting) == len(upd.weights) == len(upd.results)
    for (v, m, f), s, d, g, w, wt in zip(upd.results, upd.staleness, upd.delayed, upd.generation,
                                         upd.waiting, upd.weights):
      assert (v, m) not in seen
      seen.add((v, m))
      assert s == u - v and g >= 0 and w >= 0 and g + w == s
      assert wt == {"weight": cfg.staleness_decay ** s, "baseline_only": float(s == 0)}.get(
          cfg.overage, 1.0)
      if d:
        assert hold <= s <= hold + k
      else:
        assert 0 <= s <= k
      if cfg.mode == "sync" and not hold:
        assert s == 0
      assert 0.0 <= f < 1.0
    if upd.excluded == 0:
      assert sum(upd.delayed) == (held if u >= hold else 0)


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 10**6), fail_p=st.sampled_from([0.0, 0.0, 0.3]),
       num_tasks=st.sampled_from([1, 7, 1000]), abort=st.booleans())
def test_invariants_under_random_schedules(cfg, seed, fail_p, num_tasks, abort):
  drv = Driver(cfg, num_tasks, seed, fail_p, abort_doomed=abort)
  for _ in range(150):
    drv.step()
  check_updates(cfg, drv.updates)
  ctl, stats = drv.ctl, drv.ctl.stats
  # Every job handed out was reported or is still in flight; retries are new jobs.
  assert stats["jobs_issued"] == len(drv.issued)
  assert stats["reports"] == len(drv.issued) - len(drv.in_flight)
  assert sorted(j.job_id for j in ctl.in_flight()) == sorted(j.job_id for j in drv.in_flight)
  # Every admitted member is consumed, dropped, held, or still on its way.
  consumed = sum(len(u.results) + u.excluded for u in drv.updates)
  assert stats["members_consumed"] == consumed
  assert stats["members_dropped"] == sum(u.dropped for u in drv.updates)
  live = stats["members_admitted"] - consumed - stats["members_dropped"]
  assert live >= 0
  budget = ctl._budget
  assert budget.admitted == stats["members_admitted"]
  assert budget.dropped == stats["members_dropped"]
  # Each update took exactly N members out of the natural pipeline (held ones included); what
  # remains there is ready or unresolved.
  assert budget.admitted - budget.dropped - len(drv.updates) * cfg.population == (
      len(ctl._ready) + sum(budget.unresolved.values()))
  if cfg.overage in ("wait", "throttle") or cfg.max_staleness == 0:
    assert stats["members_dropped"] == 0
  if cfg.overage == "throttle":   # slow issuing: at most (D + 1) N admitted and unconsumed
    assert budget.admitted - budget.dropped - len(drv.updates) * cfg.population <= (
        (cfg.issue_depth + 1) * cfg.population)
  if fail_p == 0.0:
    assert stats["retries"] == 0 and stats["members_excluded"] == 0


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(cfg=configs(), seed=st.integers(0, 10**6), fail_p=st.sampled_from([0.0, 0.3]))
def test_same_seed_same_event_log(cfg, seed, fail_p):
  logs = []
  for _ in range(2):
    log = []
    drv = Driver(cfg, 50, seed, fail_p, log=log)
    for _ in range(80):
      drv.step()
    logs.append(log)
  assert logs[0] == logs[1]
  assert any(e[0] == "update" for e in logs[0])


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(cfg=configs(), seed=st.integers(0, 10**6), fail_p=st.sampled_from([0.0, 0.3]),
       cut=st.integers(1, 79))
def test_resume_mid_run_gives_the_same_log(cfg, seed, fail_p, cut):
  # Checkpoints are taken between ticks, after doomed jobs were aborted (as the simulator does):
  # a restored controller does not redo work of dropped members.
  full_log = []
  drv = Driver(cfg, 50, seed, fail_p, log=full_log, abort_doomed=True)
  for _ in range(80):
    drv.step()

  log = []
  drv = Driver(cfg, 50, seed, fail_p, log=log, abort_doomed=True)
  for _ in range(cut):
    drv.step()
  state = json.loads(json.dumps(drv.ctl.state_dict()))
  drv.ctl = Controller.from_state_dict(state, log=log)
  # The restored controller hands out exactly the jobs that were in flight, unchanged.
  reissued = drv.ctl.next_jobs(len(drv.in_flight))
  assert sorted(reissued, key=lambda j: j.job_id) == sorted(drv.in_flight, key=lambda j: j.job_id)
  for _ in range(80 - cut):
    drv.step()
  assert [e for e in log if e[0] != "reissue"] == full_log


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(cfg=configs(), seed=st.integers(0, 10**6), cut=st.integers(1, 60))
def test_crash_resume_loses_nothing_and_counts_nothing_twice(cfg, seed, cut):
  drv = Driver(cfg, 50, seed, 0.0)
  for _ in range(cut):
    drv.step()
  lost = {j.job_id: j for j in drv.in_flight}
  doomed_before = {j.job_id for j in drv.ctl.doomed_jobs()}
  state = json.loads(json.dumps(drv.ctl.state_dict()))
  before = list(drv.updates)
  # The trainer died: results of the jobs in flight never arrive.
  drv.ctl = Controller.from_state_dict(state)
  drv.in_flight = []
  first = drv.ctl.next_jobs(10**6)
  doomed = {j.job_id for j in drv.ctl.doomed_jobs()}
  assert not doomed
  again = {j.job_id: j for j in first if j.job_id in lost}
  # Lost jobs of members that can still be consumed come back identical; lost jobs of dropped
  # members are not redone.
  assert set(again) == set(lost) - doomed_before
  for job_id, job in again.items():
    assert job == lost[job_id]
  drv.take(first)
  for _ in range(60):
    drv.step()
  assert drv.updates[:len(before)] == before
  check_updates(cfg, drv.updates)
