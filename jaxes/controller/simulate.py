"""Discrete-event simulator: W workers on a virtual clock drive the real ``Controller``.

One tick: apply every update that is due, abort jobs the controller dropped, hand jobs to idle
workers, then advance the clock to the next completion and report every job finishing at that
instant (in job-id order). With ``update_seconds`` an update keeps the trainer busy that long
after its cohort is taken, and no job is handed out meanwhile (the version it would run is being
computed): a synchronous run waits out every update, an asynchronous one keeps the jobs in flight
running, and results finishing meanwhile wait in the ready pool (where waiting staleness and
PACE's pool occupancy come from). A job's duration and infrastructure failure are drawn from a
``random.Random`` seeded with the job's identity, so the run is a pure function of its arguments.

In-flight version change (``switch_versions``, the trainer's ``rollout.switch_versions``): an
episode of duration D has ``turns`` turns, turn t starting at start + t * D / turns. Turn 0
decodes under the job's version; with ``switch_versions`` each later turn decodes under the newest
version whose parameters exist at its start: version u + 1 exists once the trainer finished
computing it, at the update's pop time plus ``update_seconds``. The job keeps its member's noise;
the fitness scores it with its turns' versions (``Fitness.reward``) and the controller hears the
last turn's version (``decoded_under``), from which it counts generation staleness. Without
``switch_versions`` (or with one turn) the turn count changes nothing.

CLI (prints a summary table, then one JSON line)::

  python -m jaxes.controller.simulate --mode async --max_staleness 1 --workers 64 \
      --population 32 --episodes_per_member 2 --durations lognormal:1.0 --updates 100 \
      [--overage drop|wait|weight|baseline_only|pace|throttle] [--update_seconds 30] \
      [--turns 4 --switch_versions]
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from bisect import bisect_right
from collections import Counter
from typing import Any, Protocol

from jaxes.controller import durations as durations_lib
from jaxes.controller import policies
from jaxes.controller.config import ControllerConfig
from jaxes.controller.controller import Controller, Job, Update

SANDBOX_ERROR = "SANDBOX_ERROR"
CANCELLED = "CANCELLED"


class Fitness(Protocol):
  """Where rewards come from and what an update does with them. ``turn_versions`` (one version per
  turn) is passed only for an episode an in-flight version change moved; without
  ``switch_versions`` a fitness may take ``reward(job)`` alone."""

  def reward(self, job: Job, turn_versions: tuple[int, ...] | None = None) -> float: ...

  def apply(self, update: Update, live_versions: list[int]) -> dict[str, float]: ...


class HashFitness:
  """Pure scheduling runs: a reward in [0, 1) fixed by the job's identity (whatever versions
  decoded its turns); updates do nothing."""

  def __init__(self, seed: int = 0):
    self.seed = seed

  def reward(self, job: Job, turn_versions: tuple[int, ...] | None = None) -> float:
    return random.Random(f"jaxes.reward:{self.seed}:{job.version}:{job.member}:{job.task}:"
                         f"{job.episode}").random()

  def apply(self, update: Update, live_versions: list[int]) -> dict[str, float]:
    return {}


class Simulator:
  def __init__(self, controller: Controller, workers: int, durations: durations_lib.DurationModel,
               *, failure_rate: float = 0.0, seed: int = 0, fitness: Fitness | None = None,
               abort_doomed: bool = True, update_seconds: float = 0.0, turns: int = 1,
               switch_versions: bool = False):
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
      raise ValueError(f"turns must be an int >= 1, got {turns!r}")
    if not update_seconds >= 0:
      raise ValueError(f"update_seconds must be >= 0, got {update_seconds}")
    if not 0.0 <= failure_rate < 1.0:
      raise ValueError(f"failure_rate must be in [0, 1), got {failure_rate}")
    self.ctl = controller
    self.workers = workers
    self.durations = durations
    self.failure_rate = failure_rate
    self.seed = seed
    self.fitness = fitness or HashFitness(seed)
    # Abort jobs whose member was dropped (a rollout engine can free such a slot); without it
    # they run to the end and their results are ignored.
    self.abort_doomed = abort_doomed
    self.update_seconds = float(update_seconds)
    self.turns = turns
    self.switch_versions = bool(switch_versions)
    self.trainer_free = 0.0                      # when the trainer can take the next cohort
    self.clock = 0.0
    # (time its parameters exist, version) per version, in order: what a turn decodes under.
    self._usable: list[tuple[float, int]] = [(self.clock, controller.version)]
    self.switched = 0                            # results with an episode moved to newer weights
    self._idle = list(range(workers))            # heap of worker ids
    self._events: list[tuple[float, int]] = []   # heap of (finish time, job id)
    self._running: dict[int, list] = {}          # job id -> [job, worker, start, end, fails]
    self.busy_seconds = 0.0
    self.useful_seconds = 0.0
    self._member_seconds: dict[tuple[int, int], float] = {}  # successful episode time per member
    self.staleness_histogram: Counter[int] = Counter()
    self.generation_histogram: Counter[int] = Counter()
    self.waiting_histogram: Counter[int] = Counter()
    self.weighted_staleness = [0.0, 0.0]         # sum of weight * staleness, sum of weights
    self.rejected = 0
    self.dropped = 0
    self.excluded = 0
    self.aborted = 0
    self.updates: list[dict[str, Any]] = []   # per update: time, version, metrics
    objective = getattr(self.fitness, "objective", None)
    self.objective_initial = objective() if objective else None

  # ---- one job -------------------------------------------------------------------------------

  def _draw(self, job: Job) -> tuple[float, bool]:
    rng = random.Random(f"jaxes.sim:{self.seed}:{job.version}:{job.member}:{job.task}:"
                        f"{job.episode}:{job.attempt}")
    fails = rng.random() < self.failure_rate
    return self.durations.sample(rng, job.task), fails

  def _turn_versions(self, job: Job, start: float, end: float) -> tuple[int, ...]:
    """The version that decodes each turn: the job's own for turn 0, for each later one the newest
    whose parameters exist at its start (never older than the job's; never newer than the
    controller's, since a version is listed when its update is popped)."""
    versions = [job.version]
    for t in range(1, self.turns):
      i = bisect_right(self._usable, start + t * (end - start) / self.turns, key=lambda e: e[0])
      versions.append(max(job.version, self._usable[i - 1][1]) if i else job.version)
    return tuple(versions)

  def _start(self, job: Job, worker: int, start: float, end: float, fails: bool) -> None:
    self._running[job.job_id] = [job, worker, start, end, fails]
    heapq.heappush(self._events, (end, job.job_id))

  def _finish(self, job_id: int, now: float, aborted: bool) -> None:
    job, worker, start, end, fails = self._running.pop(job_id)
    heapq.heappush(self._idle, worker)
    self.busy_seconds += now - start
    if aborted:
      self.aborted += 1
      self.ctl.report(job_id, None, CANCELLED)
    elif fails:
      self.ctl.report(job_id, None, SANDBOX_ERROR)
    else:
      key = (job.version, job.member)
      self._member_seconds[key] = self._member_seconds.get(key, 0.0) + (end - start)
      turn_versions = self._turn_versions(job, start, end) if self.switch_versions else ()
      if turn_versions and turn_versions[-1] > job.version:   # versions only grow over turns
        self.ctl.report(job_id, self.fitness.reward(job, turn_versions),
                        decoded_under=turn_versions[-1])
      else:
        self.ctl.report(job_id, self.fitness.reward(job))

  # ---- the loop ------------------------------------------------------------------------------

  def _apply_updates(self, limit: int) -> None:
    while len(self.updates) < limit and self.clock >= self.trainer_free:
      update = self.ctl.pop_update()
      if update is None:
        return
      self.trainer_free = self.clock + self.update_seconds
      self._usable.append((self.trainer_free, self.ctl.version))
      self.switched += update.switched
      for (v, m, _), s, g, w, wt in zip(update.results, update.staleness, update.generation,
                                        update.waiting, update.weights):
        self.staleness_histogram[s] += 1
        self.generation_histogram[g] += 1
        self.waiting_histogram[w] += 1
        self.weighted_staleness[0] += wt * s
        self.weighted_staleness[1] += wt
        self.useful_seconds += self._member_seconds.pop((v, m), 0.0)
      self.rejected += update.rejected
      self.dropped += update.dropped
      self.excluded += update.excluded
      metrics = self.fitness.apply(update, self.ctl.live_versions())
      self.updates.append({"time": self.clock, "version": update.version,
                           "results": len(update.results), **metrics})

  def tick(self, limit: int) -> None:
    self._apply_updates(limit)
    if len(self.updates) >= limit:
      return
    for job in self.ctl.doomed_jobs() if self.abort_doomed else ():
      if job.job_id in self._running:
        self._finish(job.job_id, self.clock, aborted=True)
    busy_trainer = self.trainer_free > self.clock
    # No job starts while the trainer computes the next version: its parameters do not exist
    # yet (sync pays every update in full; async overlaps it with the episodes in flight).
    for job in () if busy_trainer else self.ctl.next_jobs(len(self._idle)):
      duration, fails = self._draw(job)
      self._start(job, heapq.heappop(self._idle), self.clock, self.clock + duration, fails)
    if not self._running and not busy_trainer:
      raise RuntimeError(f"simulator deadlock at version {self.ctl.version}: no job running, none "
                         f"issuable, no update due; controller stats {self.ctl.stats}")
    now = self._events[0][0] if self._events else self.trainer_free
    if busy_trainer and self.trainer_free < now:
      self.clock = self.trainer_free   # the trainer takes the next cohort before more finish
      return
    self.clock = now
    while self._events and self._events[0][0] == now:
      _, job_id = heapq.heappop(self._events)
      if job_id in self._running:        # aborted jobs leave stale heap entries
        self._finish(job_id, now, aborted=False)

  def run(self, updates: int) -> dict[str, Any]:
    while len(self.updates) < updates:
      self.tick(updates)
    return self.summary()

  def summary(self) -> dict[str, Any]:
    elapsed = self.clock
    in_flight = sum(self.clock - r[2] for r in self._running.values())
    capacity = self.workers * elapsed
    hist = dict(sorted(self.staleness_histogram.items()))
    mean = lambda h: sum(k * v for k, v in h.items()) / max(1, sum(h.values()))
    out = {
        "updates": len(self.updates),
        "virtual_hours": elapsed / 3600.0,
        "utilization": (self.busy_seconds + in_flight) / capacity if capacity else 0.0,
        "useful_utilization": self.useful_seconds / capacity if capacity else 0.0,
        "updates_per_hour": len(self.updates) / (elapsed / 3600.0) if elapsed else 0.0,
        "staleness_histogram": {str(k): v for k, v in hist.items()},
        "max_staleness": max(hist) if hist else 0,
        "mean_staleness": mean(hist),
        "mean_generation_staleness": mean(self.generation_histogram),
        "mean_waiting_staleness": mean(self.waiting_histogram),
        # The staleness the ES steps see: results weighted by the policy's weights.
        "mean_effective_staleness": (self.weighted_staleness[0] / self.weighted_staleness[1]
                                     if self.weighted_staleness[1] else 0.0),
        "rejected": self.rejected,
        "dropped": self.dropped,
        "excluded": self.excluded,
        "switched_results": self.switched,
        "aborted_jobs": self.aborted,
        "retries": self.ctl.stats["retries"],
        "failed_episodes": self.ctl.stats["failed_episodes"],
        "jobs_issued": self.ctl.stats["jobs_issued"],
    }
    if self.objective_initial is not None:
      out["objective_initial"] = self.objective_initial
      out["objective_final"] = self.updates[-1]["objective"] if self.updates else None
    return out

  # ---- checkpointing (scheduling fitness only) ------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """Controller state plus the virtual workers' jobs in flight; JSON-serialisable."""
    return {
        "controller": self.ctl.state_dict(),
        "clock": self.clock,
        "running": [[job.job_id, worker, start, end, fails]
                    for job, worker, start, end, fails in self._running.values()],
        "busy_seconds": self.busy_seconds, "useful_seconds": self.useful_seconds,
        "member_seconds": [[v, m, s] for (v, m), s in self._member_seconds.items()],
        "staleness_histogram": [[k, c] for k, c in self.staleness_histogram.items()],
        "generation_histogram": [[k, c] for k, c in self.generation_histogram.items()],
        "waiting_histogram": [[k, c] for k, c in self.waiting_histogram.items()],
        "weighted_staleness": list(self.weighted_staleness), "rejected": self.rejected,
        "trainer_free": self.trainer_free,
        "switched": self.switched,
        "dropped": self.dropped, "excluded": self.excluded, "aborted": self.aborted,
        "updates": self.updates, "objective_initial": self.objective_initial,
    }

  def load_state_dict(self, state: dict[str, Any], log: list | None = None) -> None:
    """Restores a checkpoint; the restored controller reissues the jobs that were in flight and
    they go back to the workers that held them, finishing when they would have."""
    self.ctl = Controller.from_state_dict(state["controller"], log=log)
    self.clock = state["clock"]
    self.busy_seconds, self.useful_seconds = state["busy_seconds"], state["useful_seconds"]
    self._member_seconds = {(v, m): s for v, m, s in state["member_seconds"]}
    self.staleness_histogram = Counter({k: c for k, c in state["staleness_histogram"]})
    self.generation_histogram = Counter({k: c for k, c in state["generation_histogram"]})
    self.waiting_histogram = Counter({k: c for k, c in state["waiting_histogram"]})
    self.weighted_staleness = list(state["weighted_staleness"])
    self.rejected, self.trainer_free = state["rejected"], state["trainer_free"]
    self.dropped, self.excluded = state["dropped"], state["excluded"]
    self.aborted = state["aborted"]
    self.updates = list(state["updates"])
    self.objective_initial = state["objective_initial"]
    self.switched = state.get("switched", 0)
    # When each version's parameters exist follows from the updates (taken at "time", computed
    # update_seconds later), as _apply_updates recorded it.
    first = self.updates[0]["version"] if self.updates else self.ctl.version
    self._usable = [(0.0, first)] + [(u["time"] + self.update_seconds, u["version"] + 1)
                                     for u in self.updates]
    running = {row[0]: row[1:] for row in state["running"]}
    reissued = self.ctl.next_jobs(len(running))
    if sorted(j.job_id for j in reissued) != sorted(running):
      raise RuntimeError("restored controller did not reissue exactly the jobs in flight")
    self._running, self._events = {}, []
    busy = set()
    for job in reissued:
      worker, start, end, fails = running[job.job_id]
      self._start(job, worker, start, end, fails)
      busy.add(worker)
    self._idle = [w for w in range(self.workers) if w not in busy]
    heapq.heapify(self._idle)


# ---- CLI ---------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxes.controller.simulate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mode", choices=("sync", "async"), required=True)
  p.add_argument("--max_staleness", type=int, default=None,
                 help="K (default 0 for sync, 1 for async)")
  p.add_argument("--overage", choices=policies.POLICIES, default="drop",
                 help="stale-result policy (docs/controller.md)")
  p.add_argument("--staleness_decay", type=float, default=0.5, help="'weight': decay per update")
  p.add_argument("--pace_pool_capacity", type=int, default=0,
                 help="'pace': ready results beyond max(this, population) are rejected")
  p.add_argument("--pace_generation_weight", type=float, default=1.0,
                 help="'pace': weight of prefix-aware generation staleness")
  p.add_argument("--update_seconds", type=float, default=0.0,
                 help="virtual seconds an update keeps the trainer busy")
  p.add_argument("--turns", type=int, default=1, help="turns per episode (equal shares of it)")
  p.add_argument("--switch_versions", action="store_true",
                 help="in-flight version change: later turns decode under the newest parameters")
  p.add_argument("--workers", type=int, required=True)
  p.add_argument("--population", type=int, required=True)
  p.add_argument("--episodes_per_member", type=int, default=1)
  p.add_argument("--durations", default="lognormal:1.0",
                 help="constant | lognormal:S | pareto:A | bimodal[:P[:R]] | per-task[:S]")
  p.add_argument("--duration_scale", type=float, default=60.0,
                 help="median (minimum for pareto) episode seconds")
  p.add_argument("--updates", type=int, required=True)
  p.add_argument("--delay_fraction", type=float, default=0.0)
  p.add_argument("--delay_updates", type=int, default=0)
  p.add_argument("--stress_all_stale", type=int, default=0)
  p.add_argument("--failure_rate", type=float, default=0.0,
                 help="probability that an attempt fails for an infrastructure reason")
  p.add_argument("--max_retries", type=int, default=3)
  p.add_argument("--num_tasks", type=int, default=1000)
  p.add_argument("--keep_doomed", action="store_true",
                 help="let jobs of dropped members run to the end instead of aborting them")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no_objective", action="store_true",
                 help="pure scheduling: hashed rewards instead of the synthetic ES objective")
  p.add_argument("--dim", type=int, default=64, help="synthetic objective: parameter count")
  p.add_argument("--sigma", type=float, default=0.1, help="synthetic objective: ES sigma")
  p.add_argument("--learning_rate", type=float, default=0.05,
                 help="synthetic objective: ES learning rate")
  p.add_argument("--json", action="store_true", help="print only the JSON line")
  return p


def simulate(args: argparse.Namespace) -> dict[str, Any]:
  k = args.max_staleness if args.max_staleness is not None else (0 if args.mode == "sync" else 1)
  config = ControllerConfig(
      mode=args.mode, population=args.population, episodes_per_member=args.episodes_per_member,
      max_staleness=k, overage=args.overage, staleness_decay=args.staleness_decay,
      pace_pool_capacity=args.pace_pool_capacity,
      pace_generation_weight=args.pace_generation_weight, delay_fraction=args.delay_fraction,
      delay_updates=args.delay_updates, stress_all_stale=args.stress_all_stale,
      max_retries=args.max_retries, seed=args.seed)
  model = durations_lib.parse(args.durations, args.duration_scale, args.seed)
  fitness = None
  if not args.no_objective:
    from jaxes.controller.objective import SyntheticObjective   # imports JAX
    fitness = SyntheticObjective(config, num_tasks=args.num_tasks, dim=args.dim, sigma=args.sigma,
                                 learning_rate=args.learning_rate, seed=args.seed)
  sim = Simulator(Controller(config, args.num_tasks), args.workers, model,
                  failure_rate=args.failure_rate, seed=args.seed, fitness=fitness,
                  abort_doomed=not args.keep_doomed, update_seconds=args.update_seconds,
                  turns=args.turns, switch_versions=args.switch_versions)
  summary = sim.run(args.updates)
  return {"mode": args.mode, "max_staleness_bound": k, "overage": args.overage,
          "workers": args.workers, "population": args.population,
          "episodes_per_member": args.episodes_per_member, "durations": args.durations,
          "turns": args.turns, "switch_versions": args.switch_versions, **summary}


def _table(summary: dict[str, Any]) -> str:
  rows = [(k, v) for k, v in summary.items() if k != "staleness_histogram"]
  rows.append(("staleness_histogram", " ".join(f"{s}:{c}" for s, c in
                                              summary["staleness_histogram"].items())))
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                   for k, v in rows)


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    summary = simulate(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not args.json:
    print(_table(summary))
  print(json.dumps(summary, sort_keys=True))
  return 0


if __name__ == "__main__":
  sys.exit(main())
