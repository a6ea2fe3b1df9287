r"""The fast lane: how the ES update tolerates staleness, without an LLM, 20 seeds in seconds.

  python -m jaxes.experiments.fastlane --surface="delay_fraction=0.1,0.25,0.5,1.0 delay_updates=1,2,4,8,16" \
      --seeds=20 --workdir=runs/fastlane [--objective=regression|bandit] [--config.KEY=VALUE ...]

Two stages per (cell, seed), both the project's own pieces:

1. *The schedule.* The real ``Controller`` (staleness bound, delay schedules, stale-result
   policy) driven by the discrete-event ``Simulator`` on a virtual clock (W workers, seeded
   log-normal episode durations): which (version, member) results each update consumes, their
   staleness tags and the policy's weights, and the tasks of each member's episodes. Nothing in
   it depends on the rewards (the controller orders results by completion and staleness only),
   so it is recorded once with placeholder rewards.
2. *The training.* The recorded stream replayed through the ES library's jitted pieces
   (``jaxes.es.update.perturb`` for each member's point on the parameters *of its own version*,
   ``jaxes.es.update.apply`` for the step, low-rank or full-rank noise), all updates in one
   ``lax.scan``, all seeds in one ``vmap``: a stale result is scored where it was generated and
   steps the current parameters, as in the trainer.

Black-box objectives with a known optimum (parameters a ``[d_in, d_out]`` matrix, so low-rank
noise applies): ``regression`` -- a task is a batch of noisy linear observations
``y = x W* + noise``, fitness minus the batch's squared error, held-out score the explained
variance ``1 - mse / E y^2`` (at most ``1 / (1 + noise^2)``); ``bandit`` -- a task is a batch of
contexts, the policy ``softmax(x W / temperature)`` over ``d_out`` arms, fitness and held-out
score the probability of the best arm ``argmax x W*`` (a success rate, as the LLM toy's). Scores
are reported in points (x 100); every cell is paired with ``sync`` on the same seeds (same
optimum, initial parameters, held-out tasks and noise keys).

A config is ``default_config()`` (sections controller, es, objective, sim, train); any key may
be a surface axis (``jaxes.experiments.surface``). The cells are the ``async1`` reference plus
the axis values, beside ``sync`` and ``async1``. Writes ``table.md``, ``table.json`` and
``surface.png`` (heat map with the paper's two points) to ``--workdir``. A surface takes CPU
seconds to minutes, so a rerun recomputes it (deterministically: the same numbers) instead of
resuming.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

from jaxes import cli

if __name__ == "__main__":   # a command: JAX starts quietly (cli.start_jax) before an import below loads it
  cli.start_jax(init_backends=False)

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from jaxes import es
from jaxes.controller import Controller, ControllerConfig, durations
from jaxes.controller.simulate import Simulator
from jaxes.es import update as es_update
from jaxes.experiments import aggregate, stats, surface
from jaxes.experiments.variants import GridError

OBJECTIVES = ("regression", "bandit")
REFERENCES = {"sync": {"controller.mode": "sync", "controller.max_staleness": 0},
              "async1": {"controller.mode": "async", "controller.max_staleness": 1}}


def default_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.controller = config_dict.ConfigDict(dict(
      mode="async", max_staleness=1, overage="drop", staleness_decay=0.5, pace_pool_capacity=0,
      pace_generation_weight=1.0, issue_depth=1, delay_fraction=0.0, delay_updates=0,
      stress_all_stale=0, episodes_per_member=2, pairs="free"))
  # population 20: a 10% delay holds back exactly 2 members of each cohort
  # Issue 63's cheap alternatives to waiting for partners (the fast lane only): shape_within
  # "cohort" (as the trainer) or "version" (each version's results shaped apart); task_baseline
  # r > 0: each episode's fitness less a running mean (rate r) of the fitness seen on its task.
  c.es = config_dict.ConfigDict(dict(mode="lowrank", population=20, rank=1, sigma=0.05,
                                     learning_rate=0.2, shaping="centered_rank", antithetic=True,
                                     shape_within="cohort", task_baseline=0.0))
  c.objective = config_dict.ConfigDict(dict(kind="regression", dim_in=32, dim_out=8, batch=16,
                                            noise=0.5, temperature=0.25, num_train_tasks=256,
                                            num_heldout_tasks=256))
  # 2N workers, log-normal(1) durations: Async-1's natural staleness ~0.4, as the LLM toy's 0.44
  # split_fraction: forced splits (issue 63) -- each pair consumed whole has its odd member, with
  # this probability, replaced by an independent one (fresh noise and tasks, same version): the
  # pair's cancellation lost at no staleness.
  c.sim = config_dict.ConfigDict(dict(workers=40, durations="lognormal:1.0", update_seconds=0.0,
                                      split_fraction=0.0))
  c.train = config_dict.ConfigDict(dict(num_updates=100))
  return c


# -- objectives: (params {"w": [d_in, d_out]}, task data) -> fitness; jittable -----------------------
def make_data(key: jax.Array, o) -> dict:
  """The seed's optimum and every task's batch (train tasks, then held-out ones)."""
  k_opt, k_x, k_noise = jax.random.split(key, 3)
  tasks = o.num_train_tasks + o.num_heldout_tasks
  optimum = jax.random.normal(k_opt, (o.dim_in, o.dim_out)) / np.sqrt(o.dim_in)
  x = jax.random.normal(k_x, (tasks, o.batch, o.dim_in))
  y = x @ optimum + o.noise * jax.random.normal(k_noise, (tasks, o.batch, o.dim_out))
  return {"optimum": optimum, "x": x, "y": y}


def fitness(kind: str, temperature: float, w: jax.Array, x: jax.Array, y: jax.Array,
            optimum: jax.Array) -> jax.Array:
  """One task's fitness of parameters ``w`` (higher is better)."""
  if kind == "regression":
    return -jnp.mean(jnp.square(x @ w - y))
  best = jnp.argmax(x @ optimum, axis=-1)
  p = jax.nn.softmax(x @ w / temperature, axis=-1)
  return jnp.mean(jnp.take_along_axis(p, best[:, None], axis=-1))


def heldout_score(kind: str, temperature: float, w: jax.Array, data: dict, first: int) -> jax.Array:
  """Held-out score in [0, 1]-ish: explained variance (regression) or best-arm probability."""
  x, y = data["x"][first:], data["y"][first:]
  if kind == "regression":
    return 1.0 - jnp.mean(jnp.square(x @ w - y)) / jnp.mean(jnp.square(y))
  return jax.vmap(lambda xb, yb: fitness(kind, temperature, w, xb, yb, data["optimum"]))(x, y).mean()


# -- stage 1: the schedule ---------------------------------------------------------------------------
class _Recorder:
  """A simulator fitness that records each consumed result: (version, member, tasks, weight,
  staleness), in the trainer's order (sorted by version, member)."""

  def __init__(self):
    self.tasks: dict[tuple[int, int], list[int]] = {}
    self.updates: list[list[tuple]] = []
    self.dropped = 0

  def reward(self, job, turn_versions=None) -> float:
    self.tasks.setdefault((job.version, job.member), []).append(job.task)
    return 0.0

  def apply(self, update, live_versions) -> dict:
    rows = sorted(zip(update.results, update.weights, update.staleness), key=lambda r: r[0][:2])
    self.updates.append([(v, m, tuple(self.tasks.pop((v, m))), w, s) for (v, m, _), w, s in rows])
    self.dropped += update.dropped
    return {}


@dataclasses.dataclass
class Schedule:
  """One seed's recorded stream, as arrays of ``[updates, results]`` (padded, ``valid``)."""
  versions: np.ndarray
  members: np.ndarray
  tasks: np.ndarray      # [U, R, E]
  weights: np.ndarray    # the policy's weight of each result's shaped fitness
  valid: np.ndarray
  staleness_hist: list[int]
  dropped: int

  @property
  def mean_staleness(self) -> float:
    h = np.asarray(self.staleness_hist, float)
    return float((h * np.arange(len(h))).sum() / max(h.sum(), 1))

  @property
  def unpaired_share(self) -> float:
    """The share of consumed results whose antithetic partner is not in the same update at the
    same version (the update then cannot cancel the pair's shared base fitness and tasks)."""
    alone = total = 0
    for versions, members, valid in zip(self.versions, self.members, self.valid):
      keys = {(int(v), int(m)) for v, m in zip(versions[valid], members[valid])}
      total += len(keys)
      alone += sum((v, m ^ 1) not in keys for v, m in keys)
    return alone / max(total, 1)

  @property
  def orphaned_share(self) -> float:
    """The share of consumed results whose partner no update consumes (dropped, or replaced by a
    forced split): nothing ever cancels such a result's base fitness and tasks."""
    keys = {(int(v), int(m)) for versions, members, valid in zip(self.versions, self.members, self.valid)
            for v, m in zip(versions[valid], members[valid])}
    return sum((v, m ^ 1) not in keys for v, m in keys) / max(len(keys), 1)

  @property
  def max_staleness(self) -> int:
    return max((s for s, n in enumerate(self.staleness_hist) if n), default=0)


def controller_config(c, seed: int) -> ControllerConfig:
  return ControllerConfig.from_config(dict(c.controller), population=int(c.es.population), seed=seed,
                                      antithetic=bool(c.es.antithetic))


def schedule(c, seed: int) -> Schedule:
  """The controller's stream for one seed (virtual clock, seeded durations: deterministic)."""
  cfg = controller_config(c, seed)
  recorder = _Recorder()
  sim = Simulator(Controller(cfg, int(c.objective.num_train_tasks)), int(c.sim.workers),
                  durations.parse(c.sim.durations, 1.0, seed), seed=seed, fitness=recorder,
                  update_seconds=float(c.sim.update_seconds))
  sim.run(int(c.train.num_updates))
  width = max([len(u) for u in recorder.updates] + [1])
  shape = (len(recorder.updates), width)
  s = Schedule(np.zeros(shape, np.int32), np.zeros(shape, np.int32),
               np.zeros(shape + (cfg.episodes_per_member,), np.int32), np.zeros(shape, np.float32),
               np.zeros(shape, bool), [], recorder.dropped)
  hist: list[int] = []
  for u, rows in enumerate(recorder.updates):
    for i, (v, m, tasks, w, st) in enumerate(rows):
      s.versions[u, i], s.members[u, i], s.weights[u, i], s.valid[u, i] = v, m, w, True
      s.tasks[u, i] = tasks
      hist.extend([0] * (st + 1 - len(hist)))
      hist[st] += 1
  s.staleness_hist = hist
  if c.sim.split_fraction:
    split_pairs(s, float(c.sim.split_fraction), seed, cfg.member_bound, int(c.objective.num_train_tasks))
  return s


def split_pairs(s: Schedule, fraction: float, seed: int, member_bound: int, num_tasks: int) -> None:
  """Forced splits, in place: each pair consumed whole is split with probability ``fraction`` --
  its odd member becomes member ``member_bound + m`` (a noise key no admitted member has) on
  fresh tasks, so both halves enter as unpaired members of the same version. Seeded: the same
  splits for every cell of a seed."""
  rng = np.random.default_rng([seed, 63])
  for u in range(s.versions.shape[0]):
    at = {(int(v), int(m)): i for i, (v, m, ok) in enumerate(zip(s.versions[u], s.members[u], s.valid[u])) if ok}
    for (v, m), i in sorted(at.items()):
      if m % 2 and (v, m - 1) in at and rng.random() < fraction:
        s.members[u, i] = member_bound + m
        s.tasks[u, i] = rng.integers(0, num_tasks, s.tasks.shape[2])


def _pad(schedules: list[Schedule], width: int) -> dict[str, np.ndarray]:
  """Stacked ``[seeds, U, width(, E)]`` arrays; padding entries are invalid with weight 0."""
  out = {}
  for name in ("versions", "members", "tasks", "weights", "valid"):
    arrays = []
    for s in schedules:
      a = getattr(s, name)
      pad = [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
      arrays.append(np.pad(a, pad))
    out[name] = np.stack(arrays)
  return out


# -- stage 2: the training ----------------------------------------------------------------------------
def _shape(f: jax.Array, valid: jax.Array, method: str, group: jax.Array) -> jax.Array:
  """``jaxes.es.shaping`` in-graph over the valid entries of each entry's ``group`` (0 elsewhere,
  and in a group of one): one group is the trainer's shaping over the cohort."""
  same = valid[None, :] & valid[:, None] & (group[None, :] == group[:, None])   # [i, j]: j shapes i
  n = jnp.sum(same, axis=1)
  if method == "zscore":
    mean = jnp.sum(jnp.where(same, f[None, :], 0.0), axis=1) / jnp.maximum(n, 1)
    var = jnp.sum(jnp.where(same, jnp.square(f[None, :] - mean[:, None]), 0.0), axis=1) / jnp.maximum(n, 1)
    z = (f - mean) / (jnp.sqrt(var) + 1e-8)
  elif method == "centered_rank":
    below = jnp.sum(same & (f[None, :] < f[:, None]), axis=1)
    ties = jnp.sum(same & (f[None, :] == f[:, None]), axis=1)
    rank = below + (ties - 1) / 2.0
    z = rank / jnp.maximum(n - 1, 1) - 0.5
  else:
    raise ValueError(f"es.shaping={method!r}: one of zscore, centered_rank")
  return jnp.where(valid & (n > 1), z, 0.0)


def _es_settings(c) -> tuple:
  return (c.es.mode, int(c.es.rank), int(c.es.population), float(c.es.sigma),
          float(c.es.learning_rate), c.es.shaping, bool(c.es.antithetic))


def strategy_of(c) -> es.Strategy:
  mode, rank, population, sigma, learning_rate, shaping, antithetic = _es_settings(c)
  return es.Strategy(population=population, sigma=sigma, learning_rate=learning_rate, mode=mode,
                     rank=rank, shaping=shaping, antithetic=antithetic)


SHAPE_WITHIN = ("cohort", "version")


def _less_task_baseline(per_task, tasks, valid, baseline, rate):
  """Each episode's fitness less its task's baseline (a running mean of the fitness seen on that
  task, updated at ``rate`` after this update; a task never seen takes this update's mean), so a
  member whose partner is not in the cohort no longer carries its tasks' difficulty into the
  ranks (a pair's two members share their tasks: their difference is unchanged)."""
  value, seen = baseline
  weight = jnp.broadcast_to(valid[:, None], per_task.shape).astype(jnp.float32)
  fallback = jnp.sum(per_task * weight) / jnp.maximum(jnp.sum(weight), 1.0)
  less = per_task - jnp.where(seen[tasks], value[tasks], fallback)
  sums = jnp.zeros_like(value).at[tasks].add(per_task * weight)
  counts = jnp.zeros_like(value).at[tasks].add(weight)
  here = sums / jnp.maximum(counts, 1.0)
  value = jnp.where(counts > 0, jnp.where(seen, (1 - rate) * value + rate * here, here), value)
  return less, (value, seen | (counts > 0))


@functools.lru_cache(maxsize=8)
def _trainer(kind: str, temperature: float, settings: tuple, ring: int, first_heldout: int,
             by_version: bool = False, task_baseline: float = 0.0, num_tasks: int = 1):
  """The jitted replay of every seed's stream (one compile per objective, ES settings and
  padded shape: a surface's cells share it)."""
  mode, rank, population, sigma, learning_rate, shaping, antithetic = settings
  strategy = es.Strategy(population=population, sigma=sigma, learning_rate=learning_rate,
                         mode=mode, rank=rank, shaping=shaping, antithetic=antithetic)
  cfg, tx = strategy.noise_config, strategy.tx
  score = functools.partial(fitness, kind, temperature)

  def one_seed(seed_key, data, versions, members, tasks, weights, valid):
    params = {"w": jnp.zeros(data["optimum"].shape, jnp.float32)}
    state = strategy.init(params, seed_key)
    run_key = state.run_key
    history = jax.tree.map(lambda p: jnp.broadcast_to(p, (ring,) + p.shape), params)
    baseline = (jnp.zeros(num_tasks, jnp.float32), jnp.zeros(num_tasks, bool))   # per task: value, seen

    def step(carry, xs):
      history, opt_state, u, baseline = carry
      v, m, t, w, ok = xs
      bases = jax.tree.map(lambda h: h[v % ring], history)      # each result's own version
      points = jax.vmap(lambda b, vi, mi: es_update.perturb(b, run_key, vi, mi, jnp.float32(sigma), cfg))(
          bases, v, m)
      per_task = jax.vmap(lambda p, tt: jax.vmap(lambda ti: score(p["w"], data["x"][ti], data["y"][ti],
                                                                  data["optimum"]))(tt))(points, t)
      if task_baseline:
        per_task, baseline = _less_task_baseline(per_task, t, ok, baseline, task_baseline)
      f = per_task.mean(axis=1)
      shaped = _shape(f, ok, shaping, v if by_version else jnp.zeros_like(v)) * w
      current = jax.tree.map(lambda h: h[u % ring], history)
      new, opt_state, _ = es_update.apply(current, opt_state, run_key, v, m, shaped.astype(jnp.float32),
                                          jnp.sum(ok).astype(jnp.int32), cfg, tx)
      history = jax.tree.map(lambda h, p: h.at[(u + 1) % ring].set(p), history, new)
      out = heldout_score(kind, temperature, new["w"], data, first_heldout)
      return (history, opt_state, u + 1, baseline), (out, new["w"])

    _, (curve, ws) = jax.lax.scan(step, (history, state.opt_state, jnp.int32(0), baseline),
                                  (versions, members, tasks, weights, valid))
    start = heldout_score(kind, temperature, params["w"], data, first_heldout)
    return start, curve, ws[-1]

  return jax.jit(jax.vmap(one_seed))


def train(c, seeds: list[int], schedules: list[Schedule], ring: int, width: int) -> dict:
  """Replays ``schedules`` (one per seed) through the jitted ES pieces; ``ring`` >= max
  staleness + 1 and ``width`` >= results per update, fixed across cells (one compile)."""
  o = c.objective
  data = jax.vmap(lambda k: make_data(k, o))(jnp.stack([jax.random.key(1000 + s) for s in seeds]))
  fn = _trainer(o.kind, float(o.temperature), _es_settings(c), ring, int(o.num_train_tasks),
                c.es.shape_within == "version", float(c.es.task_baseline), int(o.num_train_tasks))
  arrays = _pad(schedules, width)
  start, curve, final_w = fn(jnp.stack([jax.random.key(s) for s in seeds]), data,
                             arrays["versions"], arrays["members"], arrays["tasks"],
                             arrays["weights"], arrays["valid"])
  return {"start": np.asarray(start), "curve": np.asarray(curve), "final_w": np.asarray(final_w)}


# -- a surface ----------------------------------------------------------------------------------------
def apply_overrides(c, overrides: dict) -> config_dict.ConfigDict:
  c = config_dict.ConfigDict(c.to_dict())
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    node = c[section] if section else c
    old = node[field]
    node[field] = type(old)(value) if not isinstance(old, bool) else str(value).lower() in ("1", "true")
  return c


def cells_of(spec: str, base) -> dict[str, dict]:
  """name -> overrides: sync, async1, then the surface's cells on async1."""
  out = dict(REFERENCES)
  if spec:
    for values in surface.cells_of(spec, base):
      out[surface.cell_name(values)] = {**REFERENCES["async1"], **values}
  return out


def run_surface(base, cells: dict[str, dict], seeds: list[int], log=print) -> dict:
  """Every cell's per-seed held-out scores (points), staleness and paired differences vs sync."""
  t0 = time.time()
  configs = {name: apply_overrides(base, o) for name, o in cells.items()}
  for name, c in configs.items():
    controller_config(c, 0)   # validate every cell before running any
    if c.objective.kind not in OBJECTIVES:
      raise GridError(f"objective.kind={c.objective.kind!r}: one of {OBJECTIVES}")
    if c.es.shape_within not in SHAPE_WITHIN:
      raise GridError(f"es.shape_within={c.es.shape_within!r}: one of {SHAPE_WITHIN}")
    if not 0.0 <= c.es.task_baseline <= 1.0:
      raise GridError(f"es.task_baseline={c.es.task_baseline!r}: a rate in [0, 1] (0: off)")
  scheds = {name: [schedule(c, s) for s in seeds] for name, c in configs.items()}
  t_sched = time.time() - t0
  ring = 1 + max(s.max_staleness for ss in scheds.values() for s in ss)
  width = max(s.versions.shape[1] for ss in scheds.values() for s in ss)
  rows = {}
  for name, c in configs.items():
    out = train(c, seeds, scheds[name], ring, width)
    rows[name] = {
        "overrides": cells[name], "seeds": list(seeds),
        "score": (100 * out["curve"][:, -1]).tolist(), "start": (100 * out["start"]).tolist(),
        "curve_mean": (100 * out["curve"].mean(0)).tolist(),
        "mean_staleness": [s.mean_staleness for s in scheds[name]],
        "staleness_hist": aggregate.pool_histograms([s.staleness_hist for s in scheds[name]]),
        "dropped": [s.dropped for s in scheds[name]],
        "unpaired_share": [s.unpaired_share for s in scheds[name]],
        "orphaned_share": [s.orphaned_share for s in scheds[name]],
        "final_w": out["final_w"]}
  ref = rows["sync"]["score"]
  for name, r in rows.items():
    r["diff"] = np.subtract(r["score"], ref).tolist()
  log(f"fastlane: {len(cells)} cells x {len(seeds)} seeds: schedules {t_sched:.1f} s, "
      f"training {time.time() - t0 - t_sched:.1f} s")
  return rows


# -- the command line ---------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxes.experiments.fastlane", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--surface", default="delay_fraction=0.1,0.25,0.5,1.0 delay_updates=1,2,4,8,16",
                 help="axes 'KEY=V1,V2 KEY2=...' of default_config() keys")
  p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 per cell")
  p.add_argument("--objective", choices=OBJECTIVES, default=None, help="= --config.objective.kind")
  p.add_argument("--mode", choices=es.strategy.MODES, default=None, help="= --config.es.mode")
  p.add_argument("--workdir", required=True)
  p.add_argument("--aggregate-only", "--aggregate_only", action="store_true", dest="aggregate_only",
                 help="only redo the summary, table and heat map from WORKDIR/table.json")
  return p


def write(workdir: str, result: dict) -> str:
  """table.json (every per-seed number), table.md and surface.png; returns the markdown."""
  cfg = result["config"]
  summary = stats.surface_summary(result["cells"], seeds=result["seeds"])
  result = {**result, "summary": summary}
  with open(os.path.join(workdir, "table.json"), "w") as f:
    json.dump(result, f, indent=1)
  kind = cfg["objective"]["kind"]
  md = stats.surface_markdown(summary, unit="points of held-out " + (
      "explained variance" if kind == "regression" else "best-arm probability"))
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(md)
  stats.plot_heatmap(summary, os.path.join(workdir, "surface.png"),
                     title=f"fast lane: {kind}, {cfg['es']['mode']} ES, {result['seeds']} seeds")
  return md


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  own = [a for a in argv if not a.startswith("--config.")]
  overrides = {}
  try:
    for a in argv:
      if a.startswith("--config."):
        key, eq, value = a[len("--config."):].partition("=")
        if not eq:
          raise GridError(f"{a}: write overrides as --config.KEY=VALUE")
        overrides[key] = value
    args = _parser().parse_args(own)
    if args.aggregate_only:
      with open(os.path.join(args.workdir, "table.json")) as f:
        md = write(args.workdir, json.load(f))
      print(md)
      return 0
    if args.objective:
      overrides["objective.kind"] = args.objective
    if args.mode:
      overrides["es.mode"] = args.mode
    if args.seeds < 2:
      raise GridError(f"--seeds={args.seeds}: needs >= 2 for a standard error")
    base = default_config()
    for key in overrides:
      try:
        if "." not in key:
          raise GridError("write the dotted key (section.field)")
        surface.resolve_key(key, base)
      except GridError as e:
        raise GridError(f"--config.{key}: {str(e).rpartition(': ')[2]}") from None
    base = apply_overrides(base, overrides)
    cells = cells_of(args.surface, base)
    rows = run_surface(base, cells, list(range(args.seeds)), log=lambda s: print(s, file=sys.stderr))
  except (GridError, ValueError, OSError) as e:   # a bad key, value or cell: one line, nothing written
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(args.workdir, exist_ok=True)
  md = write(args.workdir, {"config": base.to_dict(), "surface": args.surface, "seeds": args.seeds,
                            "cells": {n: {k: v for k, v in r.items() if k != "final_w"} for n, r in rows.items()}})
  print(md)
  print(f"fastlane: {args.workdir}/table.md, table.json, surface.png", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
