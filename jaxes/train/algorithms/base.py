"""What the trainer needs from a training algorithm (``Algorithm``), and the episode key it uses.

The trainer owns the loop, the run state (``jaxes.train.state.RunState``: the algorithm's state,
the parameters of every live version, the controller, evaluations), checkpoints, the update log,
evaluation, metrics and hooks. An algorithm owns what differs: its state and where it lives, what
of it a checkpoint holds, which rows the engine decodes (perturbed members or the current policy),
each job's episode, and how a cohort of finished results becomes the next state.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from jaxes.controller import ControllerConfig, Job
from jaxes.rollout.engine import Engine
from jaxes.rollout.policy_bank import PolicyBank
from jaxes.rollout.episodes import EpisodeSpec


@dataclasses.dataclass(frozen=True)
class TrainEpisode:
  """The key of a training episode: the controller's job."""
  job: Job


@dataclasses.dataclass(frozen=True)
class UpdateContext:
  """What an update may read besides its state and cohort."""
  version: int                    # the version the update makes (the controller's, after it)
  controller: ControllerConfig    # the run's controller's configuration
  policy: PolicyBank              # the engine's policy bank (an async low-rank ES run registers
                                  # each step: ``ESPolicyBank.add_step``)
  params_by_version: dict         # every live version's parameters, the current one included
  keep: set[int]                  # the versions that must stay decodable after the update
  initial_params: Any = None      # θ₀ (version 0), held when ``needs_initial_params``


class Algorithm(Protocol):
  """One algorithm of a run, built once per process from the config, the run's parts and mesh
  (``jaxes.train.algorithms.build``)."""

  name: str              # in logs, the progress bar and the before/after table ("ES", "GRPO")
  checkpoint_item: str   # the checkpoint item holding its state (``load_policy`` reads its params)
  logs_updates: bool     # True: an update is a function of the state and its cohort, so updates
                         # after a checkpoint are replayed from the update log (``replay``)
  needs_initial_params: bool  # True: every update reads θ₀ (an anchor toward version 0): the run
                              # holds it on the devices and passes it (``UpdateContext``, ``replay``)
  donates_params: bool   # True: ``update`` donates the current params' buffers (the trainer copies
                         # them first where it needs them after the update: ``drift.update_cosine``)

  @staticmethod
  def check_config(config) -> None:
    """Raises ``ConfigError`` naming the key for a config its block does not allow."""

  @staticmethod
  def controller_config_of(config) -> ControllerConfig:
    """What a controller member is (a perturbation, a group of one task's episodes)."""

  def controller_config(self) -> ControllerConfig:
    """``controller_config_of`` this run's config."""

  def init(self, params) -> Any:
    """The state of a fresh run from version-0 ``params``, placed where the run keeps it."""

  def abstract_state(self) -> Any:
    """``init``'s result as ShapeDtypeStructs in their shardings: what a restore targets."""

  def item(self, state) -> Any:
    """The arrays of ``state`` a checkpoint holds as its item ``checkpoint_item``."""

  def params(self, state) -> Any:
    """The current version's parameters in ``state``."""

  def restored(self, item, host: dict) -> Any:
    """The state from a checkpoint's restored item and its host record (``checkpoint_host``)."""

  def checkpoint_host(self, state) -> dict:
    """What a checkpoint keeps of ``state`` besides its item, as JSON-able values."""

  def build_engine(self, state, mesh, abstract: bool = False) -> Engine:
    """The rollout engine decoding this algorithm's rows (``state`` None with ``abstract``)."""

  def spec(self, job: Job) -> EpisodeSpec:
    """The episode of a controller job."""

  def on_result(self, state, result) -> None:
    """A finished training episode, before the controller is told of it."""

  def update(self, state, results: list, context: UpdateContext) -> tuple[Any, dict]:
    """The next state from a cohort of ``(version, member, fitness)`` results, in a
    deterministic order, and the update's metrics."""

  def replay(self, state, results: list, version: int, initial_params=None) -> Any:
    """The next state, of ``version``, from a logged cohort (``logs_updates`` only);
    ``initial_params``: θ₀ where ``needs_initial_params``."""

  def record(self, window, update, results: list, metrics: dict, runner_stats: dict) -> dict:
    """The update's metrics line (``metrics.UpdateWindow`` has the shared part)."""

  def plot_label(self) -> str:
    """The title of the run's progress plot."""

  def update_lowerings(self, state) -> dict:
    """``{name: lower}``, the programs an update runs, each lowered when ``lower()`` is called
    (as ``Engine.lowerings``) for ``state`` (this algorithm's, arrays or ShapeDtypeStructs) with
    the other arguments placed as the update places them: the start-up compile warms the cache
    entries the first update reads."""

  def abstract_update(self, params, mesh) -> tuple[dict, dict]:
    """For the preflight: ``update_lowerings`` over ``params`` (ShapeDtypeStructs in their
    shardings on ``mesh``) and the rest of the state abstractly, where the run places it; and
    ``{name: tree}``, the state the algorithm holds on the devices besides the parameters
    (optimizer state, ...), to count per device."""
