"""Evolution strategies as a training algorithm: the controller's members are perturbations
``θ_v + σ·ε(v, m)``, the engine decodes each row with its member's noise, and an update is
``es.Strategy.update`` over the cohort's ``(version, member, fitness)`` results, stale ones
included. An update is a function of the state before it and its cohort, so the update log
replays updates after a checkpoint bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import jax

from jaxes import distributed, errors, es, sharding
from jaxes.controller import ControllerConfig, Job, policies
from jaxes.errors import RunStateError
from jaxes.es import keys
from jaxes.rollout.episodes import EpisodeSpec
from jaxes.rollout.policy_bank import ESPolicyBank, VersionSteps
from jaxes.train import builders, multihost
from jaxes.train.algorithms.base import Capabilities, TrainEpisode, UpdateContext, Updated

PAIR_STREAM_BASE = 1 << 31     # sampling streams shared by antithetic partners


def training_stream(job: Job, antithetic: bool, common_random_numbers: bool) -> int:
  """The sampling stream of a training episode. With common random numbers both members of an
  antithetic pair (which the controller gives the same task) decode with the same stream, so at
  temperature > 0 their rewards differ through the perturbation, not through sampling luck. The
  stream depends only on (version, pair, episode), so a reissued job decodes the same tokens."""
  if not (common_random_numbers and antithetic):
    return job.job_id
  pair = keys.pair_id(job.member, antithetic)
  return PAIR_STREAM_BASE + zlib.crc32(f"{job.version}/{pair}/{job.episode}".encode()) % (1 << 30)


def build_strategy(config) -> es.Strategy:
  """The ``es.Strategy`` of the config's ``es`` block (its own checks name their key; a run
  builds it once, in ``config.validate``: ``RunSpec.algorithm_settings``)."""
  e = config.es
  scheduled = e.sigma_schedule != "constant"
  return es.Strategy(population=e.population, sigma=e.sigma, learning_rate=e.learning_rate,
                     mode=e.mode, rank=e.rank, antithetic=e.antithetic, shaping=e.shaping,
                     sigma_schedule=e.sigma_schedule,
                     sigma_final=e.sigma_final if scheduled else None,
                     schedule_steps=config.train.num_updates if scheduled else None,
                     optimizer=e.optimizer, weight_decay=e.weight_decay,
                     perturb_vectors=e.perturb_vectors,
                     frozen=[p.strip() for p in e.frozen.split(",") if p.strip()],
                     anchor=e.anchor, anchor_decay=e.anchor_decay,
                     # The controller's stale-result policy weighs each result's shaped fitness.
                     staleness_weighting=policies.from_config(controller_config(config)).result_weight)


def controller_config(config) -> ControllerConfig:
  """ES's controller: a member is a perturbation, its episodes run different tasks."""
  return ControllerConfig.from_config(config.controller, population=config.es.population,
                                      seed=config.seed, antithetic=config.es.antithetic)


def abstract_es_state(strategy: es.Strategy, model: builders.Model, shardings=None) -> es.ESState:
  """The ES state's shapes and dtypes (nothing allocated), each array leaf placed in its
  sharding if ``shardings`` (a matching pytree) is given: the target of a restore."""
  shapes = jax.eval_shape(lambda p: strategy.init(p, jax.random.key(0)), model.abstract_params)
  return shapes if shardings is None else sharding.abstract(shapes, shardings)


def es_shardings(strategy: es.Strategy, model: builders.Model, mesh):
  """The ES state's shardings on ``mesh`` (``multihost.es_state_shardings``); None without one."""
  if mesh is None:
    return None
  return multihost.es_state_shardings(abstract_es_state(strategy, model), mesh, model.config)


# -- ES's policy bank: what the engine's rows decode with ---------------------------------------
def es_policy_bank(config, model: builders.Model, strategy: es.Strategy, run_key: jax.Array) -> ESPolicyBank:
  """ES's policy bank: each slot's policy is its member's perturbation under ``run_key``."""
  return ESPolicyBank(strategy.engine_noiser(run_key),
                      version_steps=version_steps(config, model, strategy, run_key),
                      member_slices=member_slices(strategy))


def member_slices(strategy: es.Strategy | None) -> bool:
  """Full-rank ES decodes in member slices (``ESPolicyBank(member_slices=True)``): each data
  shard runs one member at a time, so the engine holds one perturbed weight copy per shard, not
  per slot."""
  return strategy is not None and strategy.mode == "full"


def version_steps(config, model: builders.Model, strategy: es.Strategy | None, run_key) -> VersionSteps | None:
  """An async ES run whose updates are low-rank steps (``Strategy.steps_are_lowrank``: low-rank
  mode, plain SGD) runs the rows of all its live versions in one engine call, up to
  ``max_staleness`` steps from the oldest (the update registers each step,
  ``ESPolicyBank.add_step``); None otherwise (a call per version)."""
  c = config.controller
  if strategy is None or c.mode != "async" or c.max_staleness < 1:
    return None
  make = strategy.version_step(model.abstract_params, run_key)
  return None if make is None else VersionSteps(make, strategy.population, int(c.max_staleness))


class EvolutionStrategies(Capabilities):
  """``train.algorithm = "es"``: the ``es.*`` config block (checked by the ``es.Strategy`` it
  builds, ``config.validate``). Beyond the core: perturbed rows (``build_engine``, ``spec``), the
  update log (``replay``), θ₀ held for an anchor, its metrics line and compiled update."""

  name = "ES"
  checkpoint_item = "es"

  def __init__(self, config, parts, mesh, settings: es.Strategy | None = None):
    super().__init__(config, parts, mesh, settings)
    self.strategy = self.settings
    # es.anchor: every update pulls toward θ₀, which the run then holds on the devices.
    self.needs_initial_params = self.strategy.anchored
    # One device: arrays stay where they are made; a mesh of several: the rule table's shardings.
    self._shardings = es_shardings(self.strategy, parts.model, mesh if mesh.size > 1 else None)

  @staticmethod
  def check_config(config) -> es.Strategy:
    """The ``es`` block, built. The strategy weighs results by the controller's stale-result
    policy, so it builds the controller's configuration too: an option either block has is
    named in it (``es.population`` in both: the es key)."""
    with errors.keyed(config, "es", "controller"):
      return build_strategy(config)

  @staticmethod
  def controller_config_of(config) -> ControllerConfig:
    return controller_config(config)

  @staticmethod
  def decodes_member_slices(settings: es.Strategy) -> bool:
    return member_slices(settings)

  def init(self, params) -> es.ESState:
    state = self.strategy.init(params, jax.random.key(self.config.seed))
    return state if self._shardings is None else distributed.place(state, self._shardings)

  def abstract_state(self) -> es.ESState:
    return abstract_es_state(self.strategy, self.parts.model, self._shardings)

  def params(self, state: es.ESState):
    return state.params

  def restored(self, item: es.ESState, host: dict) -> es.ESState:
    return dataclasses.replace(item, version=int(item.version))

  def build_engine(self, state: es.ESState | None, mesh, abstract: bool = False):
    # Abstractly (the preflight) the run key is the fresh run's, which has the same shape.
    run_key = jax.random.key(self.config.seed) if state is None else state.run_key
    policy = es_policy_bank(self.config, self.parts.model, self.strategy, run_key)
    return builders.build_engine(self.config, self.parts.model, self.parts.tokenizer, policy,
                                 mesh=mesh, abstract=abstract)

  def spec(self, job: Job) -> EpisodeSpec:
    c = self.config
    stream = training_stream(job, c.es.antithetic, c.rollout.common_random_numbers)
    return EpisodeSpec(TrainEpisode(job), self.parts.train_task(job), job.version,
                       job.member, stream, c.rollout.temperature, c.rollout.top_p)

  def update(self, state: es.ESState, results: list, context: UpdateContext
             ) -> tuple[es.ESState, dict]:
    updated = self.apply_update(state, results, context)
    return updated.state, updated.metrics

  def apply_update(self, state: es.ESState, results: list, context: UpdateContext) -> Updated:
    """The update, and its cohort as the step to the new version: with ``version_steps`` the
    engine's bank registers it, so rows of the new version may join calls of older ones."""
    new_state, metrics, cohort = self.strategy.update_with_cohort(state, results, context.initial_params)
    if int(new_state.version) != context.version:
      raise RuntimeError(f"ES version {int(new_state.version)} != controller version {context.version}")
    return Updated(new_state, metrics, (int(new_state.version), *cohort))

  def replay(self, state: es.ESState, results: list, version: int, initial_params=None
             ) -> es.ESState:
    new_state = self.strategy.update(state, results, initial_params)[0]
    if int(new_state.version) != version:
      raise RunStateError(f"update log: replaying the update to version {version} gave "
                          f"version {int(new_state.version)}")
    return new_state

  def record(self, window, update, results: list, metrics: dict, runner_stats: dict) -> dict:
    return window.record(update, results, metrics, runner_stats, self.config.es.antithetic)

  def plot_label(self) -> str:
    return f"ES ({self.config.controller.mode}, {self.config.es.mode})"

  def update_lowerings(self, state: es.ESState) -> dict:
    """The update's program (``Strategy.update``'s own), lowered for ``state`` when called."""
    initial = state.params if self.needs_initial_params else None   # θ₀ is laid out as they are
    return {"es_update": functools.partial(self.strategy.lower_update, state, initial)}

  def abstract_update(self, params, mesh) -> tuple[dict, dict]:
    """``update_lowerings`` over ``params`` (ShapeDtypeStructs in their shardings) and the rest
    of the ES state where a run on ``mesh`` places it (``es_shardings``); and its optimizer
    state, and θ₀ when an anchor holds it on the devices (``es.anchor``)."""
    state = abstract_es_state(self.strategy, self.parts.model, es_shardings(self.strategy, self.parts.model, mesh))
    state = dataclasses.replace(state, params=params)
    held = {"optimizer_state": state.opt_state}
    if self.needs_initial_params:
      held["initial_params"] = params
    return self.update_lowerings(state), held

