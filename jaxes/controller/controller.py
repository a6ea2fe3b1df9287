"""The host-side ES controller: hands out jobs, takes results, assembles update cohorts.

Pure Python, no JAX, no clock: every decision is a function of the config, the seed and the
order in which results are reported, so hosts that report the same results in the same order
take the same decisions (see docs/design.md, "Scaling out").

Life of a member (version v, member m): admitted in an antithetic pair at the current version
(only while the staleness budget allows, see ``staleness.py``); its E episode jobs are handed
out by ``next_jobs``; infrastructure failures are retried up to R times; once every episode is
done the member is *resolved* (fitness = mean reward of its successful episodes, or *excluded*
when all failed) and joins the ready queue in completion order. An update is due when N
resolved members are ready (and, with overage "wait", what it leaves behind can still be
consumed within the bound). The stale-result policy (``policies.py``) chooses the cohort: earliest
deadline first, oldest version then completion order (plain FIFO can strand more than N old
members for one cohort; see ``staleness.py``), or PACE's effective-staleness ranking. A controlled delay holds back a seeded choice of round-half-up(pN)
members of each cohort for d updates; they are consumed, with their own (version, member),
by the update d later. With ``pairs = "together"`` a resolved member waits for its antithetic
partner (``_pool``) until its last update within K.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from typing import Any

from jaxes.controller import policies
from jaxes.controller.config import ControllerConfig
from jaxes.controller.staleness import StalenessManager
from jaxes.controller.tasks import TaskSampler

FAILED = "failed"   # episode outcome after R infrastructure retries
STATE_FORMAT = 2   # 2: members carry the version each episode completed at


@dataclasses.dataclass(frozen=True)
class Job:
  job_id: int
  version: int
  member: int
  task: int
  episode: int
  attempt: int   # 0 for the first try, up to max_retries


@dataclasses.dataclass(frozen=True)
class Update:
  """An update that is due. ``results[i] = (version, member, fitness)`` with staleness
  ``staleness[i] = version_now - version`` and ``delayed[i]`` True for a held-back result.
  ``excluded``: consumed members whose episodes all failed (no fitness). ``dropped``: members
  this update made too stale to ever be consumed, and ``rejected`` of them thrown away by the
  policy (PACE's budget). ``results`` may be empty (every member excluded, or the warm-up of a
  stress test): the trainer then applies no step but still advances its version with the
  controller's. ``generation[i]`` / ``waiting[i]``: the result's generation and waiting
  staleness (they sum to ``staleness[i]``, less when an in-flight version change moved its
  last turns to newer weights); ``weights[i]``: the policy's weight of its shaped
  fitness in the step."""
  version: int
  results: list[tuple[int, int, float]]
  staleness: list[int]
  dropped: int
  excluded: int
  delayed: list[bool]
  generation: list[int] = dataclasses.field(default_factory=list)
  waiting: list[int] = dataclasses.field(default_factory=list)
  weights: list[float] = dataclasses.field(default_factory=list)
  rejected: int = 0
  switched: int = 0   # results with an episode whose last turn decoded under a newer version

  def staleness_metrics(self) -> dict[str, Any]:
    """Histograms of generation and waiting staleness (count per value 0..max) and the weights'
    sum, for a metrics line."""
    def hist(values):
      counts = [0] * (max(values, default=0) + 1)
      for x in values:
        counts[x] += 1
      return counts
    return {"generation_staleness_hist": hist(self.generation),
            "waiting_staleness_hist": hist(self.waiting),
            "weight_sum": float(sum(self.weights)), "rejected": self.rejected,
            "switched_results": self.switched}


@dataclasses.dataclass
class _Member:
  version: int
  member: int
  outcomes: list      # per episode: None (pending), float reward, or FAILED
  in_flight: int = 0
  dropped: bool = False
  done: list = dataclasses.field(default_factory=list)   # per episode: controller version at its outcome
  # Per episode: the version whose weights decoded its last turn (its own version unless an
  # in-flight version change moved it, ``rollout.switch_versions``).
  decoded: list = dataclasses.field(default_factory=list)

  @property
  def resolved(self) -> bool:
    return all(o is not None for o in self.outcomes)

  @property
  def fitness(self) -> float | None:
    rewards = [o for o in self.outcomes if o is not None and o != FAILED]
    return sum(rewards) / len(rewards) if rewards else None


def _job_row(job: Job) -> list[int]:
  return [job.job_id, job.version, job.member, job.task, job.episode, job.attempt]


class Controller:
  def __init__(self, config: ControllerConfig, num_tasks: int, log: list | None = None,
               policy: policies.Policy | None = None):
    self.config = config
    self.num_tasks = num_tasks
    self.log = log   # if a list, every decision is appended as a tuple (the event log)
    self.policy = policy if policy is not None else policies.from_config(config)
    self._tasks = TaskSampler(num_tasks, config.seed)
    self._budget = StalenessManager(config.population, config.max_staleness,
                                    issue_depth=self.policy.issue_depth)
    self._next_job_id = 0
    self._groups_at_version = 0     # pairs (or single members) admitted at the current version
    self._members: dict[tuple[int, int], _Member] = {}
    self._unresolved: dict[int, dict[int, None]] = {}   # version -> member ids (ordered set)
    self._pending: deque[Job] = deque()
    self._reissue: set[int] = set()
    self._in_flight: dict[int, Job] = {}
    self._ready: list[tuple[int, int]] = []
    self._held: dict[int, list[tuple[int, int]]] = {}   # release update -> members
    self.stats = dict(jobs_issued=0, jobs_reissued=0, reports=0, retries=0, failed_episodes=0,
                      members_admitted=0, members_dropped=0, members_excluded=0,
                      members_consumed=0, members_held=0, members_rejected=0,
                      ignored_reports=0, updates=0)
    self.scored_episodes = 0                 # episodes with a reward (in fitness)
    self.excluded_kinds: dict[str, int] = {}  # failure kind -> episodes left out of fitness

  @property
  def version(self) -> int:
    return self._budget.version

  def _event(self, *event) -> None:
    if self.log is not None:
      self.log.append(event)

  # ---- handing out work ----------------------------------------------------------------------

  def _admit_group(self) -> None:
    cfg = self.config
    size = 2 if cfg.antithetic else 1
    v, group = self.version, self._groups_at_version
    self._budget.admit(size)
    self._groups_at_version += 1
    members = [group * size + i for i in range(size)]
    order = self._unresolved.setdefault(v, {})
    for m in members:
      self._members[(v, m)] = _Member(v, m, [None] * cfg.episodes_per_member,
                                      done=[None] * cfg.episodes_per_member,
                                      decoded=[v] * cfg.episodes_per_member)
      order[m] = None
    self.stats["members_admitted"] += size
    self._event("admit", v, tuple(members))
    # Both members of a pair get the same task per episode index (common random numbers).
    for e in range(cfg.episodes_per_member):
      task = self._tasks.task(v, group if cfg.episodes_share_task else group * cfg.episodes_per_member + e)
      for m in members:
        self._pending.append(Job(self._next_job_id, v, m, task, e, 0))
        self._next_job_id += 1

  def next_jobs(self, max_jobs: int) -> list[Job]:
    """Up to ``max_jobs`` jobs, fewer (or none) when the staleness bound admits no more work."""
    group = 2 if self.config.antithetic else 1
    jobs = []
    while len(jobs) < max_jobs:
      if not self._pending:
        if self._budget.capacity() < group:
          break
        self._admit_group()
      job = self._pending.popleft()
      self._in_flight[job.job_id] = job
      self._members[(job.version, job.member)].in_flight += 1
      if job.job_id in self._reissue:
        self._reissue.discard(job.job_id)
        self.stats["jobs_reissued"] += 1
        self._event("reissue", *_job_row(job))
      else:
        self.stats["jobs_issued"] += 1
        self._event("issue", *_job_row(job))
      jobs.append(job)
    return jobs

  def live_versions(self) -> list[int]:
    """Versions whose parameters issued or pending jobs still need (keep those θ_v alive)."""
    live = set()
    for job in list(self._in_flight.values()) + list(self._pending):
      if not self._members[(job.version, job.member)].dropped:
        live.add(job.version)
    return sorted(live)

  def in_flight(self) -> list[Job]:
    return sorted(self._in_flight.values(), key=lambda j: j.job_id)

  def doomed_jobs(self) -> list[Job]:
    """Jobs in flight whose member was dropped: their results will be ignored, so a worker may
    abort them (report them with ``reward=None``, any failure) and take new work."""
    return [j for j in self.in_flight() if self._members[(j.version, j.member)].dropped]

  # ---- taking results ------------------------------------------------------------------------

  def report(self, job_id: int, reward: float | None = None, failure: str | None = None,
             decoded_under: int | None = None) -> None:
    """A job ended. ``reward=None`` with a ``failure`` is an infrastructure failure (retried up to
    max_retries times, then the episode counts as failed); otherwise the reward stands and
    ``failure`` (e.g. PARSE_ERROR, AGENT_TIMEOUT) is informational. ``decoded_under``: the
    version whose weights decoded the episode's last turn when an in-flight version change moved
    it past the job's own (None: the job's version); it sets the generation staleness."""
    if reward is None and failure is None:
      raise ValueError(f"report(job_id={job_id}): give a reward, or reward=None with a failure")
    if reward is not None:
      reward = float(reward)
      if not math.isfinite(reward):
        raise ValueError(f"report(job_id={job_id}): reward must be finite, got {reward}")
    job = self._in_flight.get(job_id)
    if job is None:
      raise KeyError(f"report(job_id={job_id}): not in flight (unknown, or already reported)")
    if decoded_under is not None and not job.version <= decoded_under <= self.version:
      raise ValueError(f"report(job_id={job_id}): decoded_under={decoded_under} is outside the "
                       f"job's version {job.version} .. the controller's {self.version}")
    del self._in_flight[job_id]
    key = (job.version, job.member)
    rec = self._members[key]
    rec.in_flight -= 1
    self.stats["reports"] += 1
    self._event("report", job_id, reward, failure)
    if rec.dropped:
      self.stats["ignored_reports"] += 1
      if rec.in_flight == 0:
        del self._members[key]
      return
    if reward is None:
      if job.attempt < self.config.max_retries:
        retry = dataclasses.replace(job, job_id=self._next_job_id, attempt=job.attempt + 1)
        self._next_job_id += 1
        self._pending.appendleft(retry)
        self.stats["retries"] += 1
        return
      rec.outcomes[job.episode] = FAILED
      self.stats["failed_episodes"] += 1
      self.excluded_kinds[failure] = self.excluded_kinds.get(failure, 0) + 1
    else:
      rec.outcomes[job.episode] = reward
      self.scored_episodes += 1
    rec.done[job.episode] = self.version
    if decoded_under is not None:
      rec.decoded[job.episode] = decoded_under
    if rec.resolved:
      self._budget.resolve(job.version)
      del self._unresolved[job.version][job.member]
      if not self._unresolved[job.version]:
        del self._unresolved[job.version]
      self._ready.append(key)
      self._event("resolve", job.version, job.member, rec.fitness)

  # ---- what fitness leaves out ---------------------------------------------------------------

  def excluded_share(self) -> float:
    """The share of this run's finished episodes left out of fitness (failed every retry)."""
    excluded = self.stats["failed_episodes"]
    return excluded / max(excluded + self.scored_episodes, 1)

  def excluded_beyond(self, limit: float) -> str | None:
    """One line saying why the run must stop when more than ``limit`` of its episodes were left
    out of fitness (judged from 1/limit finished episodes on), else None. Fitness averages only
    the other episodes, so a policy that can make its failures excluded would be rewarded."""
    excluded = self.stats["failed_episodes"]
    finished = excluded + self.scored_episodes
    if not excluded or finished * limit < 1 or self.excluded_share() <= limit:
      return None
    kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.excluded_kinds.items()))
    return (f"{excluded} of {finished} episodes ({self.excluded_share():.1%}) failed every retry "
            f"and were left out of fitness ({kinds}), more than train.max_excluded_share = "
            f"{limit:g}: fix the sandbox (or raise the limit)")

  # ---- updates -------------------------------------------------------------------------------

  def pop_update(self) -> Update | None:
    """The next update if one is due; popping it advances ``version`` by one."""
    cfg, budget = self.config, self._budget
    n, u = cfg.population, self.version
    at = self._pool()
    if len(at) < n:
      return None
    pool = [policies.Candidate(v, m, tuple(self._members[(v, m)].done))
            for v, m in (self._ready[i] for i in at)]
    pick = self.policy.select(pool, n, u)
    if len(pick.cohort) != n or set(pick.cohort) & set(pick.rejected):
      raise RuntimeError(f"policy {self.policy.name!r} chose {len(pick.cohort)} of {n} members, "
                         f"or rejected members it consumes")
    cohort = [self._ready[at[i]] for i in pick.cohort]
    taken = {at[i] for i in pick.cohort} | {at[i] for i in pick.rejected}
    left = [k for i, k in enumerate(self._ready) if i not in taken]
    if self.policy.waits and not budget.feasible_after([k[0] for k in left]):
      return None
    rejected = [self._ready[i] for i in sorted(at[i] for i in pick.rejected)]
    self._ready = left
    for key in rejected:
      del self._members[key]
      self._budget.drop(key[0], resolved=True)
    if rejected:
      self.stats["members_rejected"] += len(rejected)
      self.stats["members_dropped"] += len(rejected)
      self._event("reject", tuple(rejected))

    held_n = cfg.held_per_cohort
    held_pos = set(random.Random(f"jaxes.delay:{cfg.seed}:{u}").sample(range(n), held_n))
    if held_n:
      self._held[u + cfg.hold_updates] = [k for i, k in enumerate(cohort) if i in held_pos]
      self.stats["members_held"] += held_n
    released = self._held.pop(u, [])
    consumed = sorted([(k, False) for i, k in enumerate(cohort) if i not in held_pos]
                      + [(k, True) for k in released])

    results, staleness, delayed, excluded = [], [], [], 0
    generation, waiting, weights, switched = [], [], [], 0
    for key, was_held in consumed:
      rec = self._members.pop(key)
      fitness = rec.fitness
      if fitness is None:
        excluded += 1
        continue
      results.append((key[0], key[1], fitness))
      staleness.append(u - key[0])
      delayed.append(was_held)
      resolved = max(rec.done)
      # Updates applied since the weights that decoded its last turns (its own version unless
      # a version change moved them): g + w = u - v without one, less with one.
      generation.append(resolved - min(rec.decoded))
      switched += max(rec.decoded) > key[0]
      waiting.append(u - resolved)
      weights.append(self.policy.weight(u - key[0]))
    self.stats["members_consumed"] += len(consumed)
    self.stats["members_excluded"] += excluded
    self.stats["updates"] += 1

    dropped = self._expire(budget.advance()) + len(rejected)
    self._groups_at_version = 0
    self._event("update", u, tuple(results), tuple(staleness), tuple(delayed), excluded, dropped,
                tuple(generation), tuple(waiting), tuple(weights))
    return Update(u, results, staleness, dropped, excluded, delayed, generation, waiting, weights,
                  len(rejected), switched)

  def _pool(self) -> list[int]:
    """Positions in the ready queue the next cohort may take, in the order the policy sees them.
    Every one with pairs "free". With pairs "together" a member waits while its partner is still
    running and a later update may still consume it (its version + K > the current version);
    partners that are both ready sit side by side (the later one moved up to the earlier, so a
    stable earliest-deadline order keeps them adjacent). A function of the state alone: a
    resumed or replayed controller takes the same cohorts."""
    if self.config.pairs != "together":
      return list(range(len(self._ready)))
    u, k = self.version, self.config.max_staleness
    position = {key: i for i, key in enumerate(self._ready)}
    out, placed = [], set()
    for i, (v, m) in enumerate(self._ready):
      if i in placed:
        continue
      j = position.get((v, m ^ 1))
      if j is not None:
        out += [i, j]
        placed.add(j)
      elif not (m ^ 1 in self._unresolved.get(v, ()) and v + k > u):
        out.append(i)
    return out

  def _expire(self, versions: list[int]) -> int:
    """Drops the members of ``versions`` (unresolved) and the ready members that are now beyond
    the bound; returns the count."""
    stale_ready = [k for k in self._ready if self._budget.expired(k[0])]
    if (versions or stale_ready) and self.policy.waits:
      raise RuntimeError(f"controller invariant broken: members expired under overage 'wait' "
                         f"at version {self.version}")
    dropped = []
    for key in stale_ready:
      del self._members[key]
      self._budget.drop(key[0], resolved=True)
      dropped.append(key)
    self._ready = [k for k in self._ready if not self._budget.expired(k[0])]
    for v in versions:
      for m in self._unresolved.pop(v):
        rec = self._members[(v, m)]
        rec.dropped = True
        self._budget.drop(v, resolved=False)
        dropped.append((v, m))
        if rec.in_flight == 0:
          del self._members[(v, m)]
    if dropped:
      gone = set(dropped)
      self._pending = deque(j for j in self._pending if (j.version, j.member) not in gone)
      self.stats["members_dropped"] += len(dropped)
      self._event("drop", tuple(dropped))
    return len(dropped)

  # ---- checkpointing -------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state. Jobs in flight are saved to be reissued (same job_id, version,
    member, task, episode, attempt) by the restored controller."""
    b = self._budget
    return {
        "format": STATE_FORMAT,
        "config": dataclasses.asdict(self.config),
        "num_tasks": self.num_tasks,
        "budget": {"version": b.version, "admitted": b.admitted, "dropped": b.dropped,
                   "unresolved": sorted([v, c] for v, c in b.unresolved.items())},
        "next_job_id": self._next_job_id,
        "groups_at_version": self._groups_at_version,
        "members": [[r.version, r.member, list(r.outcomes), r.dropped, list(r.done),
                     list(r.decoded)] for r in self._members.values()],
        "unresolved": [[v, list(ms)] for v, ms in self._unresolved.items()],
        # Reissued first, in job order, then what was pending.
        "pending": [_job_row(j) for j in self.in_flight()] + [_job_row(j) for j in self._pending],
        "reissue": sorted(self._reissue | set(self._in_flight)),
        "ready": [list(k) for k in self._ready],
        "held": [[u, [list(k) for k in ks]] for u, ks in sorted(self._held.items())],
        "stats": dict(self.stats),
        "scored_episodes": self.scored_episodes, "excluded_kinds": dict(self.excluded_kinds),
    }

  @classmethod
  def from_state_dict(cls, state: dict[str, Any], log: list | None = None) -> "Controller":
    if state.get("format") not in (1, STATE_FORMAT):
      raise ValueError(f"controller state: format {state.get('format')!r}, expected {STATE_FORMAT}")
    ctl = cls(ControllerConfig(**state["config"]), state["num_tasks"], log=log)
    b = state["budget"]
    ctl._budget.version, ctl._budget.admitted, ctl._budget.dropped = (
        b["version"], b["admitted"], b["dropped"])
    ctl._budget.unresolved = {v: c for v, c in b["unresolved"]}
    ctl._next_job_id = state["next_job_id"]
    ctl._groups_at_version = state["groups_at_version"]
    for v, m, outcomes, dropped, *rest in state["members"]:
      # Format 1 kept no completion versions: its episodes count as completed at their version.
      # States written before the in-flight version change keep no decoding versions: their own.
      done = rest[0] if rest else [None if o is None else v for o in outcomes]
      decoded = rest[1] if len(rest) > 1 else [v] * len(outcomes)
      ctl._members[(v, m)] = _Member(v, m, list(outcomes), dropped=dropped, done=list(done),
                                     decoded=list(decoded))
    ctl._unresolved = {v: dict.fromkeys(ms) for v, ms in state["unresolved"]}
    ctl._pending = deque(Job(*row) for row in state["pending"])
    # Members of dropped jobs that were in flight now have nothing outstanding: forget them.
    ctl._pending = deque(j for j in ctl._pending if not ctl._members[(j.version, j.member)].dropped)
    ctl._members = {k: r for k, r in ctl._members.items() if not r.dropped}
    ctl._reissue = set(state["reissue"]) & {j.job_id for j in ctl._pending}
    ctl._ready = [tuple(k) for k in state["ready"]]
    ctl._held = {u: [tuple(k) for k in ks] for u, ks in state["held"]}
    ctl.stats = dict(state["stats"])
    ctl.scored_episodes = state.get("scored_episodes", 0)   # absent from states before issue 31
    ctl.excluded_kinds = dict(state.get("excluded_kinds", {}))
    return ctl
