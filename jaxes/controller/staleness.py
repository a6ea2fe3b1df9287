"""Exact bookkeeping of the staleness bound: admission, expiry and the stale-synchronous barrier.

Counts are in *members* (a member = one perturbation, E episodes). Each update consumes exactly
``population`` (N) members of the natural pipeline (held-back members of a controlled delay
schedule have already left it). With K = ``max_staleness``, a member of version w has the
*deadline* w + K: the last update that may consume it.

* Admission (AReaL's rule, per member): at version v a new member may be admitted while
  ``admitted - dropped < (v + K + 1) N``. Work beyond that could not be consumed within the
  bound even if every earlier member arrived first, so it is never issued. An issue depth
  D < K (the ``throttle`` policy) admits only while ``admitted - dropped < (v + D + 1) N``.
* Cohorts are filled earliest deadline first (oldest version, then completion order).
* Feasibility (overage "wait", stale-synchronous): update u may fire only if what it leaves
  behind can still meet every deadline: for each D in [u, u + K], the live members with
  deadline <= D number at most (D - u) N (updates u+1..D take N each). Because admission
  bounds the live members by (K + 1) N, this holds once every live member has resolved, so
  waiting always ends when stragglers finish (no deadlock). Merely waiting for members whose
  deadline is u is not enough: earlier updates may have taken newer members, leaving more than
  N old ones for one cohort.
* Expiry (overage "drop"): after update u the version is u + 1 and a live member whose deadline
  was u can no longer be consumed within the bound; it is dropped and counted.

K = 0 with either overage is synchronous ES: N members per version, one version in flight.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StalenessManager:
  population: int
  max_staleness: int
  issue_depth: int | None = None   # admission depth D <= K (None: K)
  version: int = 0
  admitted: int = 0    # members ever admitted
  dropped: int = 0     # members dropped for staleness
  # version -> admitted members of that version neither resolved (complete or excluded) nor
  # dropped. Keys with a zero count are removed.
  unresolved: dict[int, int] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.population < 1:
      raise ValueError(f"population must be >= 1, got {self.population}")
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

  def capacity(self) -> int:
    """Members that may still be admitted at the current version."""
    depth = self.max_staleness if self.issue_depth is None else min(self.issue_depth,
                                                                     self.max_staleness)
    bound = (self.version + depth + 1) * self.population
    return bound - (self.admitted - self.dropped)

  def admit(self, count: int) -> None:
    if count < 0 or count > self.capacity():
      raise ValueError(f"cannot admit {count} members: capacity is {self.capacity()} at version "
                       f"{self.version}")
    self.admitted += count
    if count:
      self.unresolved[self.version] = self.unresolved.get(self.version, 0) + count

  def _release(self, version: int) -> None:
    left = self.unresolved.get(version, 0) - 1
    if left < 0:
      raise ValueError(f"no unresolved member of version {version} to release")
    if left:
      self.unresolved[version] = left
    else:
      del self.unresolved[version]

  def resolve(self, version: int) -> None:
    """A member of ``version`` completed (or was excluded); it now waits in the ready queue."""
    self._release(version)

  def drop(self, version: int, *, resolved: bool) -> None:
    """A member of ``version`` will never be consumed; frees its admission slot."""
    if not resolved:
      self._release(version)
    self.dropped += 1

  def staleness(self, version: int) -> int:
    """Staleness of a result of ``version`` if the update now due consumed it."""
    return self.version - version

  def feasible_after(self, ready_left: list[int]) -> bool:
    """Whether an update consuming now, leaving ready members of versions ``ready_left`` (and
    every unresolved member) live, lets all of them still meet their deadlines."""
    u, k, n = self.version, self.max_staleness, self.population
    live = dict(self.unresolved)
    for v in ready_left:
      live[v] = live.get(v, 0) + 1
    for deadline in range(u, u + k + 1):
      if sum(c for v, c in live.items() if v + k <= deadline) > (deadline - u) * n:
        return False
    return True

  def advance(self) -> list[int]:
    """Apply one update; returns the versions whose unresolved members just became too stale."""
    self.version += 1
    return sorted(v for v in self.unresolved if self.expired(v))

  def expired(self, version: int) -> bool:
    """A member of ``version`` can no longer be consumed within the bound."""
    return version + self.max_staleness < self.version
