"""Synthetic fitness for the simulator, optimised through ``jaxes.es``: learning curves under
staleness without an LLM.

theta in R^dim starts at 0; an optimum theta* ~ N(0, I) is fixed by the seed. Task t weighs the
coordinates by w_t (positive, mean 1, fixed by the seed), so tasks disagree as LLM tasks do:
``reward(x, t) = exp(-mean(w_t * (x - theta*)^2))`` in (0, 1]. The job of (version v, member m)
is scored with ``theta_v + sigma * eps(v, m)`` exactly as the ES library perturbs it, and each
update is ``Strategy.update`` on the (version, member, fitness) results the controller hands out,
weighted by the controller's stale-result policy.
A job whose later turns an in-flight version change moved (the simulator's ``switch_versions``)
scores the mean over its turns i of ``reward(theta_{v_i} + sigma * eps(v, m), t)``: each turn an
equal share of the episode, its member's noise re-applied to the parameters of the version that
decoded the turn (``Strategy.perturbed`` of the state of ``v_i`` at the member ``(v, m)``). A
stand-in: an LLM episode's reward is no sum over turns, but it moves with the weights they decoded
under. Those versions are no older than ``v`` and no newer than the current one, so the states kept
for ``live_versions`` cover them.
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
    self._perturbed: dict[tuple[int, int, int], np.ndarray] = {}

  def _point(self, version: int, member: int, base: int) -> np.ndarray:
    """theta_base + sigma * eps(version, member): the member's own noise on base's parameters."""
    key = (version, member, base)
    if key not in self._perturbed:
      params = self.strategy.perturbed(self.states[base], (version, member))
      self._perturbed[key] = np.asarray(params["theta"], np.float64)
    return self._perturbed[key]

  def score(self, theta: np.ndarray, task: int) -> float:
    return float(np.exp(-np.mean(self.task_weights[task] * (theta - self.optimum) ** 2)))

  def reward(self, job: Job, turn_versions: tuple[int, ...] | None = None) -> float:
    """The score of the job's point, or with ``turn_versions`` (the version that decoded each
    turn) the mean over its turns of the score with its noise on that version's parameters."""
    scores = [self.score(self._point(job.version, job.member, v), job.task)
              for v in turn_versions or (job.version,)]
    return sum(scores) / len(scores)

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
