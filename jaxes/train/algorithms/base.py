"""The seam between the trainer and a training algorithm: ``Algorithm``, the small core every
algorithm writes, and ``Capabilities``, the optional rest, each with what it does when an
algorithm leaves it out.

The trainer owns the loop, the run state (``jaxes.train.state.RunState``: the algorithm's state,
the parameters of every live version, the controller, evaluations), checkpoints, the update log,
evaluation, metrics and hooks. An algorithm owns what differs: what a controller member is, its
state and where it lives, and how a cohort of finished results becomes the next state (the
core); and, where it differs from the defaults, what a checkpoint keeps of its state, which rows
the engine decodes (perturbed members or the current policy), each job's episode, its metrics
line, the programs its update compiles, and whether its updates replay from the update log.

Adding an algorithm is one module in this package (a class deriving from ``Capabilities`` that
writes the core and overrides only what it uses), its config block in ``defaults.py``, one entry
in ``ALGORITHMS`` and its tests; the trainer, the builders and the run state never name it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from jaxes.controller import ControllerConfig, Job
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeSpec
from jaxes.train import builders


@dataclasses.dataclass(frozen=True)
class TrainEpisode:
  """The key of a training episode: the controller's job."""
  job: Job


@dataclasses.dataclass(frozen=True)
class UpdateContext:
  """What an update may read besides its state and cohort."""
  version: int                    # the version the update makes (the controller's, after it)
  controller: ControllerConfig    # the run's controller's configuration
  params_by_version: dict         # every live version's parameters, the current one included
  keep: set[int]                  # the versions that must stay decodable after the update
  initial_params: Any = None      # θ₀ (version 0), held when ``needs_initial_params``


@dataclasses.dataclass(frozen=True)
class Updated:
  """What an update gives the run (``Capabilities.apply_update``): the next state, the update's
  metrics, and what the decode side needs of it. ``version_step``: ``PolicyBank.add_step``'s
  arguments ``(version, versions, members, weights, count)``, the new version as the old one plus
  a low-rank step (ES: its cohort, which an ``ESPolicyBank`` with ``version_steps`` registers);
  None: nothing."""
  state: Any
  metrics: dict
  version_step: tuple | None = None


class Algorithm(Protocol):
  """The required core: what no default can say. An algorithm is built once per process as
  ``cls(config, parts, mesh)`` (``jaxes.train.algorithms.build``; ``Capabilities.__init__``
  keeps the three)."""

  name: str              # in logs, the progress bar and the before/after table ("ES", "GRPO")
  checkpoint_item: str   # the checkpoint item holding its state (``load_policy`` reads its params)

  @staticmethod
  def controller_config_of(config) -> ControllerConfig:
    """What a controller member is (a perturbation, a group of one task's episodes); raises
    ``ConfigError`` naming the key for a controller setting the algorithm cannot take."""

  def init(self, params) -> Any:
    """The state of a fresh run from version-0 ``params``, placed where the run keeps it."""

  def abstract_state(self) -> Any:
    """``item(init(...))`` as ShapeDtypeStructs in their shardings: what a restore targets;
    its ``params`` are where the run keeps the parameters."""

  def params(self, state) -> Any:
    """The current version's parameters in ``state``."""

  def update(self, state, results: list, context: UpdateContext) -> tuple[Any, dict]:
    """The next state from a cohort of ``(version, member, fitness)`` results, in a
    deterministic order, and the update's metrics."""


@runtime_checkable
class ReplaysUpdates(Protocol):
  """The update-log capability. An algorithm whose update is a function of the state before it
  and its cohort (a few numbers per result: ES) has ``replay``; the trainer then logs every
  update and a resume replays the ones after the newest checkpoint, bit for bit. Without it
  (GRPO, SAO: an update's input is a batch of episodes) the updates after the checkpoint are
  recomputed."""

  def replay(self, state, results: list, version: int, initial_params=None) -> Any:
    """The next state, of ``version``, from a logged cohort; ``initial_params``: θ₀ where
    ``needs_initial_params``."""


class Capabilities:
  """The optional part of the seam, each member with its default: an algorithm derives from this
  class, writes ``Algorithm``'s core and overrides only what it uses."""

  # What the run does around an update.
  needs_initial_params = False   # True: every update reads θ₀ (an anchor toward version 0): the
                                 # run holds it on the devices and passes it (``UpdateContext``,
                                 # ``replay``)
  donates_params = False         # True: ``update`` donates the current params' buffers (the drift
                                 # observer copies them first: ``drift.update_cosine``)

  def __init__(self, config, parts, mesh, settings=None):
    """``settings``: the algorithm's config block as ``config.validate`` built it
    (``RunSpec.algorithm_settings``); None builds it here (``check_config``)."""
    self.config, self.parts, self.mesh = config, parts, mesh
    self.settings = self.check_config(config) if settings is None else settings

  @staticmethod
  def check_config(config) -> Any:
    """The algorithm's own config block, built (``RunSpec.algorithm_settings``); raises
    ``ConfigError`` naming the key for a config the block does not allow (called by
    ``config.validate``, which checks no other algorithm's block). Default: no block beyond what
    ``controller_config_of`` checks (None)."""

  @staticmethod
  def decodes_member_slices(settings) -> bool:
    """Whether the engine decodes one member per data shard at a time (full-rank ES), given the
    built block (``check_config``'s). Default: no, rows are independent."""
    return False

  # -- checkpoints: the state is the item, nothing kept besides it ---------------------------------
  def item(self, state) -> Any:
    """The arrays of ``state`` a checkpoint holds as its item ``checkpoint_item``."""
    return state

  def restored(self, item, host: dict) -> Any:
    """The state from a checkpoint's restored item and its host record (``checkpoint_host``)."""
    return item

  def checkpoint_host(self, state) -> dict:
    """What a checkpoint keeps of ``state`` besides its item, as JSON-able values."""
    return {}

  # -- decoding: every row runs the current, unperturbed policy ------------------------------------
  def build_engine(self, state, mesh, abstract: bool = False) -> Engine:
    """The rollout engine decoding this algorithm's rows (``state`` None with ``abstract``).
    Default: unperturbed rows, an engine without a noiser."""
    return builders.build_engine(self.config, self.parts.model, self.parts.tokenizer, mesh=mesh,
                                 abstract=abstract)

  def spec(self, job: Job) -> EpisodeSpec:
    """The episode of a controller job. Default: the unperturbed policy of the job's version
    (member -1), one sampling stream per episode (the job id: a group's samples must differ)."""
    c = self.config
    return EpisodeSpec(TrainEpisode(job), self.parts.train_task(job), job.version, -1,
                       job.job_id, c.rollout.temperature, c.rollout.top_p)

  def apply_update(self, state, results: list, context: UpdateContext) -> Updated:
    """``update``, with what the engine's policy bank needs of it (``Updated.version_step``),
    which the trainer hands on. Default: ``update``'s state and metrics, no step (the engine
    decodes every version from its own parameters)."""
    return Updated(*self.update(state, results, context))

  def on_result(self, state, result) -> None:
    """A finished training episode, before the controller is told of it. Default: nothing (the
    controller keeps the reward)."""

  # -- reporting -----------------------------------------------------------------------------------
  def record(self, window, update, results: list, metrics: dict, runner_stats: dict) -> dict:
    """The update's metrics line (``metrics.UpdateWindow`` has the shared part). Default: the
    shared part, and the update's metrics under the algorithm's name in lower case."""
    return {**window.common(update.version + 1, update, results, runner_stats),
            self.name.lower(): metrics}

  def plot_label(self) -> str:
    """The title of the run's progress plot."""
    return f"{self.name} ({self.config.controller.mode})"

  # -- compiling ahead: nothing to compile before the first update ---------------------------------
  def update_lowerings(self, state) -> dict:
    """``{name: lower}``, the programs an update runs, each lowered when ``lower()`` is called
    (as ``Engine.lowerings``) for ``state`` (this algorithm's, arrays or ShapeDtypeStructs) with
    the other arguments placed as the update places them: the start-up compile warms the cache
    entries the first update reads."""
    return {}

  def abstract_update(self, params, mesh) -> tuple[dict, dict]:
    """For the preflight: ``update_lowerings`` over ``params`` (ShapeDtypeStructs in their
    shardings on ``mesh``) and the rest of the state abstractly, where the run places it; and
    ``{name: tree}``, the state the algorithm holds on the devices besides the parameters
    (optimizer state, ...), to count per device."""
    return {}, {}
