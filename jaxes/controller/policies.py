"""Stale-result policies: which ready results an update consumes, which it throws away, and how
much each consumed result weighs in the ES step.

A policy is an object the ``Controller`` takes (``ControllerConfig.overage`` names one; pass
``Controller(..., policy=...)`` for another). Policies are pure functions of what the controller
knows (versions, completion order, the version each episode completed at), never of the clock,
so a run stays exact and replayable. Every policy keeps the staleness bound K: a result older
than K is never consumed.

Staleness of a consumed result (version v, last episode completed when the controller was at
version r, consumed by update u), PACE's decomposition:

* generation staleness ``g = r - v``: updates applied while its episodes ran;
* waiting staleness ``w = u - r``: updates applied while it waited in the ready pool;
* total ``s = g + w = u - v``, the staleness the ES update sees. Every episode of a member decodes
  under θ_v, so the result was generated under one version and spanned ``g + 1`` of them.

Policies (docs/controller.md, "Stale-result policies"):

* ``drop``: earliest deadline first; members that can no longer be consumed within K are dropped.
* ``wait``: the same order; an update waits until what it leaves can still be consumed
  (stale-synchronous).
* ``weight``: ``drop``, and the ES step weighs a result's shaped fitness by ``decay ** s``.
* ``baseline_only``: ``drop``; every result is shaped together (z-score/rank normalisation), but
  only fresh results (s = 0) step the parameters (prime-rl's use of stale samples).
* ``pace``: PACE (Pool-Aware Control of Effective Staleness): the ready pool beyond
  ``pool_capacity`` becomes a rejection budget; results are ranked by effective staleness
  ``w + generation_weight * g_prefix`` (``g_prefix`` the mean over episodes of the updates applied
  before each episode completed); the cohort is the N lowest, the budget rejects the highest.
* ``throttle``: tinker's async RL: slow issuing instead of discarding. New work is admitted only
  while at most ``(issue_depth + 1) N`` members are admitted and unconsumed (``issue_depth`` D <=
  K), so typical staleness sits near D; a straggler is waited for as under ``wait`` up to K and
  nothing is dropped.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A resolved member in the ready pool, in completion order."""
  version: int
  member: int
  done: tuple[int, ...]   # controller version when each episode completed

  @property
  def resolved(self) -> int:
    return max(self.done)

  def waiting(self, now: int) -> int:
    return now - self.resolved

  @property
  def generation(self) -> int:
    return self.resolved - self.version

  @property
  def prefix_generation(self) -> float:
    return sum(d - self.version for d in self.done) / len(self.done)


@dataclasses.dataclass(frozen=True)
class Selection:
  """Positions in the pool: ``cohort`` (consumed now, at most N), ``rejected`` (thrown away now)."""
  cohort: list[int]
  rejected: list[int]


class Policy(Protocol):
  name: str
  waits: bool   # the update waits until what it leaves behind can meet its deadlines
  # Admission depth D: new members are admitted while at most (D + 1) N are unconsumed (None: K).
  issue_depth: int | None

  def select(self, pool: Sequence[Candidate], n: int, now: int) -> Selection: ...

  def weight(self, staleness: int) -> float: ...

  @property
  def result_weight(self) -> Callable[[int], float] | None:
    """``staleness -> weight`` for ``es.Strategy(staleness_weighting=...)``, None when every
    result weighs 1."""


def earliest_deadline_first(pool: Sequence[Candidate], n: int) -> list[int]:
  """Oldest version first, then completion order (the pool's order; sorted() is stable)."""
  return sorted(range(len(pool)), key=lambda i: pool[i].version)[:n]


@dataclasses.dataclass(frozen=True)
class Drop:
  name = "drop"
  waits = False
  issue_depth = None

  def select(self, pool, n, now):
    return Selection(earliest_deadline_first(pool, n), [])

  def weight(self, staleness):
    return 1.0

  @property
  def result_weight(self):
    return None


@dataclasses.dataclass(frozen=True)
class Wait(Drop):
  name = "wait"
  waits = True


@dataclasses.dataclass(frozen=True)
class Weight(Drop):
  """The step ``θ += (α/N) Σ_i decay^{s_i} z_i ε_i``: shaping (z_i) over the whole cohort, the
  1/N normalisation over every consumed result (not over Σ weights), so stale evidence shrinks
  the step instead of being rescaled back up."""
  decay: float = 0.5
  name = "weight"

  def __post_init__(self):
    if not 0.0 < self.decay <= 1.0:
      raise ValueError(f"weight policy: decay must be in (0, 1], got {self.decay!r}")

  def weight(self, staleness):
    return float(self.decay) ** staleness

  @property
  def result_weight(self):
    return self.weight


@dataclasses.dataclass(frozen=True)
class BaselineOnly(Drop):
  """Stale results enter the shaping baseline (mean/std or ranks) but get weight 0; 1/N counts
  every consumed result, as for ``Weight``."""
  name = "baseline_only"

  def weight(self, staleness):
    return 1.0 if staleness == 0 else 0.0

  @property
  def result_weight(self):
    return self.weight


@dataclasses.dataclass(frozen=True)
class Pace(Drop):
  """PACE. ``pool_capacity`` C >= N: after the cohort is chosen, ``max(0, |pool| - C)`` more
  results (the highest effective staleness left) are rejected and counted. Ties rank earliest
  deadline first."""
  pool_capacity: int = 0
  generation_weight: float = 1.0
  name = "pace"

  def __post_init__(self):
    if self.pool_capacity < 0:
      raise ValueError(f"pace policy: pool_capacity must be >= 0, got {self.pool_capacity!r}")
    if not self.generation_weight >= 0:
      raise ValueError(f"pace policy: generation_weight must be >= 0, got {self.generation_weight!r}")

  def effective_staleness(self, c: Candidate, now: int) -> float:
    return c.waiting(now) + self.generation_weight * c.prefix_generation

  def select(self, pool, n, now):
    rank = sorted(range(len(pool)),
                  key=lambda i: (self.effective_staleness(pool[i], now), pool[i].version))
    budget = max(0, len(pool) - max(self.pool_capacity, n))
    rest = rank[n:]
    return Selection(rank[:n], rest[len(rest) - budget:] if budget else [])


@dataclasses.dataclass(frozen=True)
class Throttle(Wait):
  """Slow issuing instead of discarding (tinker's async RL: a pipeline depth under a hard
  staleness bound). Admission stops at ``(issue_depth + 1) N`` unconsumed members, fewer than
  ``wait``'s ``(K + 1) N``; the barrier of ``wait`` keeps every deadline. ``issue_depth`` above
  K is read as K."""
  issue_depth: int = 1
  name = "throttle"

  def __post_init__(self):
    if not isinstance(self.issue_depth, int) or self.issue_depth < 0:
      raise ValueError(f"throttle policy: issue_depth must be an int >= 0, got {self.issue_depth!r}")


POLICIES = ("drop", "wait", "weight", "baseline_only", "pace", "throttle")


def from_config(config) -> Policy:
  """The policy a ``ControllerConfig`` names (its ``overage``), with its parameters."""
  name = config.overage
  if name == "weight":
    return Weight(decay=config.staleness_decay)
  if name == "baseline_only":
    return BaselineOnly()
  if name == "pace":
    return Pace(pool_capacity=config.pace_pool_capacity,
                generation_weight=config.pace_generation_weight)
  if name == "throttle":
    return Throttle(issue_depth=config.issue_depth)
  return Wait() if name == "wait" else Drop()
