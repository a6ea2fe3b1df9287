"""Synthetic fitness for the simulator, optimised through ``jaxes.es``: learning curves under
staleness without an LLM.

theta in R^dim starts at 0; an optimum theta* ~ N(0, I) is fixed by the seed. Task t weighs the
coordinates by w_t (positive, mean 1, fixed by the seed), so tasks disagree as LLM tasks do:
``reward(x, t) = exp(-mean(w_t * (x - theta*)^2))`` in (0, 1]. The job of (version v, member m)
is scored with ``theta_v + sigma * eps(v, m)`` exactly as the ES library perturbs it, and each
update is ``Strategy.update`` on the (version, member, fitness) results the controller hands out,
weighted by the controller's stale-result policy.
The reported ``objective`` is ``exp(-mean((theta - theta*)^2))`` of the unperturbed parameters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxes import es
from jaxes.controller import policies
from jaxes.controller.config import ControllerConfig
from jaxes.controller.controller import Job, Update


class SyntheticObjective:
  def __init__(self, config: ControllerConfig, *, num_tasks: int, dim: int = 64,
               sigma: float = 0.1, learning_rate: float = 0.05, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.optimum = rng.standard_normal(dim)
    weights = rng.gamma(2.0, 0.5, size=(num_tasks, dim))
    self.task_weights = weights / weights.mean(axis=1, keepdims=True)
    self.strategy = es.Strategy(population=config.population, sigma=sigma,
                                learning_rate=learning_rate, mode="full",
                                antithetic=config.antithetic, shaping="zscore",
                                staleness_weighting=policies.from_config(config).result_weight)
    state = self.strategy.init({"theta": jnp.zeros(dim, jnp.float32)}, jax.random.key(seed))
    self.states = {0: state}           # versions still needed by jobs in flight
    self.version = 0
    self._perturbed: dict[tuple[int, int], np.ndarray] = {}

  def _point(self, version: int, member: int) -> np.ndarray:
    key = (version, member)
    if key not in self._perturbed:
      params = self.strategy.perturbed(self.states[version], key)
      self._perturbed[key] = np.asarray(params["theta"], np.float64)
    return self._perturbed[key]

  def score(self, theta: np.ndarray, task: int) -> float:
    return float(np.exp(-np.mean(self.task_weights[task] * (theta - self.optimum) ** 2)))

  def reward(self, job: Job) -> float:
    return self.score(self._point(job.version, job.member), job.task)

  def objective(self) -> float:
    theta = np.asarray(self.states[self.version].params["theta"], np.float64)
    return float(np.exp(-np.mean((theta - self.optimum) ** 2)))

  def apply(self, update: Update, live_versions: list[int]) -> dict[str, float]:
    if update.version != self.version:
      raise ValueError(f"update of version {update.version} but the objective is at {self.version}")
    state, metrics = self.strategy.update(self.states[self.version], update.results)
    self.version += 1
    self.states[self.version] = state
    oldest = min(live_versions + [self.version])
    self.states = {v: s for v, s in self.states.items() if v >= oldest}
    self._perturbed = {k: x for k, x in self._perturbed.items() if k[0] >= oldest}
    return {"objective": self.objective(), "update_norm": metrics["update_norm"]}
