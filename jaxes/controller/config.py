"""Controller configuration: a frozen dataclass, validated up front with errors naming the key."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxes.controller.policies import POLICIES
from jaxes.errors import OptionError

MODES = ("sync", "async")
PAIRS = ("free", "together")


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  """How work is handed out and when results are consumed.

  mode:              "sync" (a barrier, max_staleness must be 0) or "async".
  population:        N, members consumed per update; even (antithetic pairs 2j, 2j+1).
  episodes_per_member: E; a member's fitness is the mean reward of its episodes.
  max_staleness:     K, bound on (version consumed at) - (version generated with).
  overage:           the stale-result policy (``policies.py``): "drop" results that can no
                     longer be consumed within K (counted), "wait" for them (stale-synchronous),
                     "weight" (drop, and weigh results by staleness_decay ** staleness),
                     "baseline_only" (drop; stale results only shape the others) or "pace"
                     (drop; PACE's pool rejection budget and effective-staleness ranking).
  staleness_decay:   "weight": the decay in (0, 1].
  pace_pool_capacity: "pace": ready results beyond max(this, population) are rejected (0 = N).
  pace_generation_weight: "pace": weight of prefix-aware generation staleness in the ranking.
  issue_depth:       "throttle": new work is admitted while at most (issue_depth + 1) N members
                     are unconsumed (0 <= issue_depth <= max_staleness).
  delay_fraction:    p; round-half-up(p N) members of each cohort are held back ...
  delay_updates:     ... d updates on top of natural asynchrony (staleness in [d, d + K]).
  stress_all_stale:  d > 0 holds back *every* member of each cohort d updates.
  max_retries:       R; an infrastructure failure is retried up to R times, then counted.
  seed:              task sampling and the choice of delayed members.
  antithetic:        members 2j and 2j+1 get the same tasks (common random numbers).
  episodes_share_task: all E episodes of a member run one task (GRPO: a member is a group of
                     E episodes of one task, whose advantages are relative to each other).
  pairs:             "free": a resolved member is consumed whenever the policy picks it;
                     "together": with antithetic pairs, a resolved member whose partner is still
                     running is held out of the cohort until the partner resolves, unless this
                     update is its last within K (then it goes alone, as "free" would take it).
                     A partner is merged only when both land in one update (``es.update``); an
                     unpaired member keeps neither the base fitness nor the task cancelled.
  """
  mode: str = "async"
  population: int = 32
  episodes_per_member: int = 1
  max_staleness: int = 0
  overage: str = "drop"
  staleness_decay: float = 0.5
  pace_pool_capacity: int = 0
  pace_generation_weight: float = 1.0
  issue_depth: int = 1
  delay_fraction: float = 0.0
  delay_updates: int = 0
  stress_all_stale: int = 0
  max_retries: int = 3
  seed: int = 0
  antithetic: bool = True
  episodes_share_task: bool = False
  pairs: str = "free"

  def __post_init__(self):
    def bad(key, why):
      raise OptionError(key, why, f"ControllerConfig.{key}={getattr(self, key)!r}: {why}")

    if self.mode not in MODES:
      bad("mode", f"must be one of {MODES}")
    if self.pairs not in PAIRS:
      bad("pairs", f"must be one of {PAIRS}")
    if self.pairs == "together" and not self.antithetic:
      bad("pairs", "'together' needs antithetic pairs (es.antithetic = True)")
    if self.overage not in POLICIES:
      bad("overage", f"must be one of {POLICIES}")
    if not 0.0 < float(self.staleness_decay) <= 1.0:
      bad("staleness_decay", "must be in (0, 1]")
    if not isinstance(self.pace_pool_capacity, int) or self.pace_pool_capacity < 0:
      bad("pace_pool_capacity", "must be an int >= 0 (0 = population)")
    if not float(self.pace_generation_weight) >= 0:
      bad("pace_generation_weight", "must be >= 0")
    for key in ("population", "episodes_per_member"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
        bad(key, "must be an int >= 1")
    if self.antithetic and self.population % 2:
      bad("population", "must be even with antithetic pairs")
    for key in ("max_staleness", "delay_updates", "stress_all_stale", "max_retries", "issue_depth"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
        bad(key, "must be an int >= 0")
    if self.mode == "sync" and self.max_staleness != 0:
      bad("max_staleness", "must be 0 when mode='sync' (use mode='async' for a bound K > 0)")
    if self.overage == "throttle" and self.issue_depth > self.max_staleness:
      bad("issue_depth", f"must be <= max_staleness ({self.max_staleness}) with overage 'throttle'")
    if not 0.0 <= float(self.delay_fraction) <= 1.0:
      bad("delay_fraction", "must be in [0, 1]")
    if self.delay_fraction > 0 and self.delay_updates < 1:
      bad("delay_updates", "must be >= 1 when delay_fraction > 0")
    if self.stress_all_stale and self.delay_fraction > 0:
      bad("stress_all_stale", "cannot be combined with delay_fraction > 0")

  @property
  def held_per_cohort(self) -> int:
    """Members of each cohort held back (exact)."""
    if self.stress_all_stale:
      return self.population
    return int(math.floor(self.delay_fraction * self.population + 0.5)) if self.delay_updates else 0

  @property
  def hold_updates(self) -> int:
    return self.stress_all_stale or (self.delay_updates if self.held_per_cohort else 0)

  @property
  def member_bound(self) -> int:
    """Member ids of any version lie in [0, member_bound): at most (K + 1) N members are admitted
    at one version (async issues fresh perturbations of the newest version while older ones are
    still in flight). ``jaxes.es.Strategy`` accepts any id >= 0."""
    return (self.max_staleness + 1) * self.population

  @classmethod
  def from_config(cls, controller: Mapping[str, Any], *, population: int, seed: int,
                  antithetic: bool = True, **overrides) -> "ControllerConfig":
    """From an ml-collections ``config.controller`` block (plus ``es.population`` and the seed);
    ``overrides`` replace the block's keys (the GRPO trainer sets a member's episodes)."""
    given = {"population", "seed", "antithetic", "episodes_share_task"}
    known = {f.name for f in dataclasses.fields(cls)} - given
    values = dict(controller)
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"config.controller: unknown key(s) {unknown}; known: {sorted(known)}")
    return cls(population=population, seed=seed, antithetic=antithetic, **{**values, **overrides})
