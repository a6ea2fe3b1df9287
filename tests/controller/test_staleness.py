"""StalenessManager: the admission formula, expiry, and the stale-synchronous feasibility rule."""
import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from jaxes.controller.staleness import StalenessManager


# ---- admission -------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1, 0), (2, 0), (4, 1), (8, 3), (32, 1), (32, 8)])
def test_initial_capacity_is_k_plus_one_cohorts(n, k):
  assert StalenessManager(n, k).capacity() == (k + 1) * n


@pytest.mark.parametrize("version,admitted,dropped,expected", [
    (0, 0, 0, 8), (0, 3, 0, 5), (0, 8, 0, 0), (1, 8, 0, 4), (1, 8, 2, 6), (5, 24, 0, 4),
    (5, 28, 0, 0), (5, 28, 3, 3),
])
def test_capacity_formula(version, admitted, dropped, expected):
  # (version + K + 1) * N - (admitted - dropped) with N = 4, K = 1.
  m = StalenessManager(4, 1, version=version, admitted=admitted, dropped=dropped)
  assert m.capacity() == expected


def test_capacity_grows_by_one_cohort_per_update():
  m = StalenessManager(4, 2)
  m.admit(12)
  assert m.capacity() == 0
  for v in range(1, 5):
    m.unresolved.clear()
    m.advance()
    assert m.capacity() == 4 * v


def test_dropping_frees_admission_slots():
  m = StalenessManager(4, 1)
  m.admit(8)
  assert m.capacity() == 0
  m.drop(0, resolved=False)
  assert m.capacity() == 1
  m.drop(0, resolved=False)
  assert m.capacity() == 2
  assert m.unresolved == {0: 6}


def test_admit_over_capacity_raises_and_changes_nothing():
  m = StalenessManager(2, 0)
  m.admit(2)
  with pytest.raises(ValueError, match="capacity is 0"):
    m.admit(1)
  assert m.admitted == 2 and m.unresolved == {0: 2}


def test_admit_negative_raises():
  with pytest.raises(ValueError):
    StalenessManager(2, 0).admit(-1)


def test_admit_zero_records_nothing():
  m = StalenessManager(2, 0)
  m.admit(0)
  assert m.admitted == 0 and m.unresolved == {}


def test_admit_tags_members_with_current_version():
  m = StalenessManager(2, 2)
  m.admit(2)
  m.version = 1
  m.admit(3)
  assert m.unresolved == {0: 2, 1: 3}


@pytest.mark.parametrize("bad", [dict(population=0, max_staleness=0),
                                 dict(population=2, max_staleness=-1)])
def test_bad_arguments(bad):
  with pytest.raises(ValueError):
    StalenessManager(**bad)


# ---- resolving and dropping ------------------------------------------------------------------

def test_resolve_removes_versions_that_reach_zero():
  m = StalenessManager(2, 1)
  m.admit(2)
  m.resolve(0)
  assert m.unresolved == {0: 1}
  m.resolve(0)
  assert m.unresolved == {}


def test_resolve_unknown_version_raises():
  m = StalenessManager(2, 1)
  m.admit(1)
  with pytest.raises(ValueError, match="version 3"):
    m.resolve(3)
  with pytest.raises(ValueError):
    m.resolve(0)
    m.resolve(0)


def test_drop_resolved_member_keeps_unresolved_counts():
  m = StalenessManager(2, 1)
  m.admit(2)
  m.resolve(0)
  m.drop(0, resolved=True)
  assert m.unresolved == {0: 1} and m.dropped == 1


# ---- staleness, expiry -----------------------------------------------------------------------

def test_staleness_is_counted_at_the_consuming_update():
  m = StalenessManager(2, 3, version=7)
  assert [m.staleness(v) for v in (7, 6, 4)] == [0, 1, 3]


@pytest.mark.parametrize("k", [0, 1, 4])
def test_expired_exactly_past_the_deadline(k):
  m = StalenessManager(2, k, version=10)
  assert not m.expired(10 - k)
  assert m.expired(10 - k - 1)


def test_advance_reports_versions_that_just_expired():
  m = StalenessManager(2, 1)
  m.admit(4)
  assert m.advance() == []        # version 1: version 0 may still be consumed
  m.admit(2)
  assert m.advance() == [0]       # version 2: version 0 is 2 stale
  assert m.version == 2


def test_sync_advance_expires_everything_unresolved():
  m = StalenessManager(2, 0)
  m.admit(2)
  assert m.advance() == [0]


# ---- feasibility (stale-synchronous "wait") ---------------------------------------------------

def test_sync_feasible_only_when_the_whole_version_is_in_the_cohort():
  m = StalenessManager(2, 0)
  m.admit(2)
  assert not m.feasible_after([])    # both unresolved: they would miss their only update
  m.resolve(0)
  assert not m.feasible_after([])
  m.resolve(0)
  assert m.feasible_after([])
  assert not m.feasible_after([0])   # a version-0 member left behind would be 1 stale


def test_member_with_deadline_now_must_be_in_the_cohort():
  m = StalenessManager(2, 1, version=1)
  m.unresolved = {0: 1}
  assert not m.feasible_after([])
  m.unresolved = {1: 2}
  assert m.feasible_after([])


def test_more_old_members_than_one_cohort_is_infeasible_even_if_none_is_due_now():
  # K = 2, N = 2, version 5: three members of version 4 (deadline 6) must fit in update 6.
  m = StalenessManager(2, 2, version=5)
  m.unresolved = {4: 3}
  assert not m.feasible_after([])
  m.unresolved = {4: 2}
  assert m.feasible_after([])
  assert not m.feasible_after([4])
  assert m.feasible_after([5, 5])


def _brute_force_feasible(m: StalenessManager, live: list[int]) -> bool:
  """Is there an assignment of every live member to one future update (u+1, ...) that respects
  its deadline, with at most N members per update? Exhaustive."""
  u, k, n = m.version, m.max_staleness, m.population
  choices = [range(u + 1, v + k + 1) for v in live]
  for assignment in itertools.product(*choices):
    counts = {}
    for upd in assignment:
      counts[upd] = counts.get(upd, 0) + 1
    if all(c <= n for c in counts.values()):
      return True
  return not live


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 3), k=st.integers(0, 3), version=st.integers(0, 6),
       live=st.lists(st.integers(0, 6), max_size=6), split=st.integers(0, 6))
def test_feasibility_matches_exhaustive_search(n, k, version, live, split):
  live = [v for v in live if v <= version]
  m = StalenessManager(n, k, version=version)
  for v in live[:split]:
    m.unresolved[v] = m.unresolved.get(v, 0) + 1
  assert m.feasible_after(live[split:]) == _brute_force_feasible(m, live)


# ---- the pipeline as a whole -----------------------------------------------------------------

def _run_pipeline(n, k, seed, overage, steps=300):
  """Members admitted whenever allowed, resolved in random order, cohorts earliest deadline
  first; returns the staleness of every consumed member and the number dropped."""
  rnd = random.Random(seed)
  m = StalenessManager(n, k)
  unresolved, ready, consumed, dropped = [], [], [], 0
  for _ in range(steps):
    take = rnd.randint(0, m.capacity())
    m.admit(take)
    unresolved += [m.version] * take
    rnd.shuffle(unresolved)
    for _ in range(rnd.randint(0, len(unresolved))):
      v = unresolved.pop()
      m.resolve(v)
      ready.append(v)
    if len(ready) >= n:
      order = sorted(range(len(ready)), key=lambda i: ready[i])
      cohort = [ready[i] for i in order[:n]]
      left = [ready[i] for i in sorted(order[n:])]
      if overage == "wait" and not m.feasible_after(left):
        assert unresolved, "infeasible although everything has resolved: deadlock"
        continue
      consumed += [m.staleness(v) for v in cohort]
      ready = left
      expired = m.advance()
      for v in expired:
        assert overage == "drop"
        for _ in range(unresolved.count(v)):
          unresolved.remove(v)
          m.drop(v, resolved=False)
          dropped += 1
      for v in [v for v in ready if m.expired(v)]:
        assert overage == "drop"
        ready.remove(v)
        m.drop(v, resolved=True)
        dropped += 1
    # Admission keeps the live pipeline within K + 1 cohorts.
    assert len(unresolved) + len(ready) <= (k + 1) * n
  return consumed, dropped, m


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 4), k=st.integers(0, 4), seed=st.integers(0, 10**6),
       overage=st.sampled_from(["drop", "wait"]))
def test_pipeline_never_exceeds_the_bound(n, k, seed, overage):
  consumed, dropped, m = _run_pipeline(n, k, seed, overage)
  assert all(0 <= s <= k for s in consumed)
  assert len(consumed) == m.version * n
  if overage == "wait" or k == 0:
    assert dropped == 0
  assert m.dropped == dropped


def test_pipeline_makes_progress():
  consumed, _, m = _run_pipeline(4, 1, 0, "wait")
  assert m.version > 20 and max(consumed) == 1
