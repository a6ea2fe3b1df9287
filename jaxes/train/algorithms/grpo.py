"""GRPO as a training algorithm: a gradient learner (``jaxes.rl``) in place of the ES update, on
the same trainer, tasks, engine, controller, evaluation, metrics and checkpoints.

A controller *member* is a group: ``grpo.group_size`` episodes of one task
(``ControllerConfig.episodes_share_task``), ``grpo.tasks_per_update`` groups per update, so the
controller's staleness bound, delays and drops apply to GRPO exactly as to ES (``max_staleness``
0: on-policy and synchronous; K >= 1: stale groups, corrected by the importance ratio against the
log-probs the engine recorded when it sampled them). Every episode has its own sampling stream
(the job id), since a group needs distinct samples. The engine runs unperturbed rows.

A finished episode's tokens (``EpisodeResult.tokens``) are kept until the update that consumes
its group; the update pads the consumed groups into one fixed-shape ``Batch`` and runs
``grpo.updates_per_batch`` learner steps. A checkpoint holds the learner state (item
``learner``: params, float32 master, AdamW moments) and, in its host record, the kept episodes
of groups not yet consumed. There is no update log (no ``replay``): an update's input is
its batch (KBs per episode), not a few numbers, so updates after the newest checkpoint are
recomputed instead of replayed; under the deterministic schedule (``rollout.sandbox_steps`` > 0)
a resumed run repeats the interrupted one's updates exactly, since streams are keyed by job.

Multi-process runs: every process runs the same controller and knows every finished episode's
tokens (the runner exchanges them once per engine tick), so every process builds the same batch;
the learner state, params and batch live on the one global mesh (the batch split over ``data``),
so the learner step is one SPMD program.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxes import distributed
from jaxes.controller import ControllerConfig
from jaxes.errors import ConfigError
from jaxes.models import partition
from jaxes.rl import batch as rl_batch
from jaxes.rl import config as rl_config
from jaxes.rl.grpo import GRPOLearner, LearnerState
from jaxes.rollout.episodes import EpisodeStream
from jaxes.train import builders
from jaxes.train.algorithms.base import Capabilities, UpdateContext


@dataclasses.dataclass
class GRPOState:
  learner: LearnerState
  # (version, group, episode) -> (reward, EpisodeStream): finished episodes of groups not consumed yet
  episodes: dict[tuple[int, int, int], tuple[float, EpisodeStream]]


def _episode_rows(episodes: dict) -> list:
  return [[v, m, e, reward, list(s.prompt), [list(t) for t in s.turns],
           [list(x) for x in s.logprobs], [list(o) for o in s.observations]]
          for (v, m, e), (reward, s) in sorted(episodes.items())]


def _episodes_from_rows(rows: list) -> dict:
  return {(v, m, e): (reward, EpisodeStream(tuple(p), tuple(map(tuple, t)), tuple(map(tuple, lp)),
                                            tuple(map(tuple, o))))
          for v, m, e, reward, p, t, lp, o in rows}


class GRPO(Capabilities):
  """``train.algorithm = "grpo"``: the ``grpo.*`` config block (``jaxes.rl.config``). Beyond the
  core: its config rules, the kept episodes (``on_result``, a checkpoint's host record), a learner
  step that donates its state, and its compiled update; rows decode the current policy, one
  stream per episode, and the metrics line (the defaults). A variant with another learner (SAO)
  sets ``block`` and overrides ``learner_config``, ``make_learner``, ``learner_step``,
  ``group_size`` and ``learner_batch``."""

  name = "GRPO"
  checkpoint_item = "learner"
  block = "grpo"   # its config block (and its update program's name, "grpo_step")
  # The anchor (grpo.anchor) pulls toward the learner's own reference params, so the trainer holds
  # no θ₀ for it; the learner step donates its state, params included.
  donates_params = True
  # The learner's config from the run config: the block's rules are the learner's own, and its
  # messages name the key (config.grpo.*, config.rollout.*).
  learner_config = staticmethod(rl_config.from_run_config)

  def __init__(self, config, parts, mesh, settings=None):
    super().__init__(config, parts, mesh, settings)
    self.learner = self.make_learner()
    self._param_shardings = partition.param_shardings(parts.model.config, mesh)

  def make_learner(self):
    return GRPOLearner(self.parts.model.graphdef, self.settings)

  @classmethod
  def check_config(cls, config):
    """The learner's config, built (its messages name their key)."""
    try:
      return cls.learner_config(config)
    except ValueError as err:
      raise ConfigError(str(err)) from err

  @staticmethod
  def controller_config_of(config) -> ControllerConfig:
    """A member is a group of ``grpo.group_size`` episodes of one task (``grpo.tasks_per_update``
    per update); the controller's staleness bound and delays apply to groups as to ES members."""
    if config.controller.overage in ("weight", "baseline_only"):
      raise ConfigError(f"config.controller.overage={config.controller.overage!r} weighs ES results "
                        "by staleness; GRPO takes drop, wait or pace")
    g = config.grpo
    return ControllerConfig.from_config(config.controller, population=g.tasks_per_update,
                                        seed=config.seed, antithetic=False,
                                        episodes_per_member=g.group_size, episodes_share_task=True)

  def init(self, params) -> GRPOState:
    return GRPOState(self.learner.init(distributed.place(params, self._param_shardings)), {})

  def abstract_state(self) -> LearnerState:
    """The learner state's shapes, each leaf where a fresh start puts it
    (``GRPOLearner.abstract_state``)."""
    return self.learner.abstract_state(self.parts.model.abstract_params, self._param_shardings)

  def params(self, state: GRPOState):
    return state.learner.params

  def item(self, state: GRPOState) -> LearnerState:
    return state.learner

  def restored(self, item: LearnerState, host: dict) -> GRPOState:
    return GRPOState(item, _episodes_from_rows(host["episodes"]))

  def checkpoint_host(self, state: GRPOState) -> dict:
    return {"episodes": _episode_rows(state.episodes)}

  def on_result(self, state: GRPOState, result) -> None:
    job = result.spec.key.job
    if result.reward is not None:
      state.episodes[(job.version, job.member, job.episode)] = (result.reward, result.tokens)

  def learner_step(self, learner, batch, context: UpdateContext):
    """One learner step of ``update`` (a variant's learner may take the context into account)."""
    return self.learner.step(learner, batch)

  def update(self, state: GRPOState, results: list, context: UpdateContext) -> tuple[GRPOState, dict]:
    c, t = self.config, time.perf_counter()
    old = context.version - 1
    batch, batch_metrics = self.learner_batch(state, results)
    if old in context.keep:   # the step donates the learner state; stale rows still need θ_old
      context.params_by_version[old] = jax.tree.map(jnp.copy, self.params(state))
    learner, sums = state.learner, {}
    steps = c[self.block].updates_per_batch
    for _ in range(steps):
      learner, step_metrics = self.learner_step(learner, batch, context)
      for k, v in step_metrics.items():   # replicated scalars: this process's copy
        sums[k] = sums.get(k, 0.0) + float(np.asarray(v.addressable_data(0)))
    new_state = GRPOState(learner, state.episodes)
    _forget(new_state, context.controller, context.version)
    update_s = time.perf_counter() - t
    return new_state, {**{k: v / steps for k, v in sums.items() if k not in ("tokens", "episodes")},
                       "tokens": int(sums["tokens"] / steps), "episodes": int(sums["episodes"] / steps),
                       "learner_tokens_per_s": sums["tokens"] / update_s if update_s > 0 else 0.0,
                       **batch_metrics}

  def update_lowerings(self, state: GRPOState) -> dict:
    """The learner step ``update`` runs, lowered when called for ``state``'s learner state and a
    batch (``abstract_batch``) placed as ``learner_batch`` places it."""
    return {f"{self.block}_step": functools.partial(self.learner.lower, state.learner,
                                                    self.abstract_batch(self.mesh))}

  def group_size(self) -> int:
    """Episodes of one task per controller member."""
    return self.config.grpo.group_size

  def batch_rows(self) -> int:
    """Episode rows of a learner batch: every episode of an update's members."""
    return self.group_size() * self.config[self.block].tasks_per_update

  def seq_len(self) -> int:
    c = self.config
    return c[self.block].seq_len or c.rollout.max_len

  def abstract_batch(self, mesh) -> rl_batch.Batch:
    """A batch of ``group_size x tasks_per_update`` episode rows of ``seq_len`` tokens, abstract,
    in ``batch_sharding`` on ``mesh`` (where ``learner_batch`` puts a real one)."""
    rows, seq = self.batch_rows(), self.seq_len()
    where = batch_sharding(mesh, rows)

    def arg(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    return rl_batch.Batch(arg((rows, seq), jnp.int32), arg((rows, seq), jnp.bool_),
                          arg((rows, seq), jnp.bool_), arg((rows, seq), jnp.float32),
                          arg((rows,), jnp.float32), arg((rows,), jnp.int32))

  def abstract_update(self, params, mesh) -> tuple[dict, dict]:
    """``update_lowerings`` over the abstract learner state a run places
    (``GRPOLearner.abstract_state``: params as ``params`` are sharded; the float32 master and
    AdamW moments also over data with ``grpo.optimizer_over_data``); and the state it holds
    besides the parameters (the engine decodes with the learner's params)."""
    state = self.learner.abstract_state(params, jax.tree.map(lambda p: p.sharding, params))
    return (self.update_lowerings(GRPOState(state, {})),
            {"master_weights": state.master, "optimizer_state": state.opt_state,
             "reference_params": state.ref_params, "learner_batch": self.abstract_batch(mesh)})

  def learner_batch(self, state: GRPOState, results: list) -> tuple[rl_batch.Batch, dict]:
    """The consumed groups' episodes, padded to ``tasks_per_update * group_size`` rows, and
    ``batch_metrics``: ``group_reward_std``, the mean over groups of their rewards' std (0: every
    episode of a group scored alike, and the group teaches nothing)."""
    im_end = builders.stop_ids(self.parts.tokenizer)[1]
    episodes, rewards, groups = [], [], []
    for version, group, _ in results:
      for e in range(self.group_size()):
        kept = state.episodes.pop((version, group, e), None)
        if kept is None:   # failed for good after its retries: not part of the group
          continue
        reward, stream = kept
        if stream is None or not stream.turns:   # never decoded (its prompt overflowed the row)
          continue
        episodes.append(rl_batch.episode_from_stream(stream, im_end))
        rewards.append(reward)
        groups.append((version, group))
    batch = rl_batch.build_batch(episodes, rewards, groups, seq_len=self.seq_len(),
                                 num_rows=self.batch_rows())
    return (distributed.place(batch, batch_sharding(self.mesh, batch.num_rows)),
            self.batch_metrics(groups, rewards))

  def batch_metrics(self, groups: list, rewards: list) -> dict:
    """What the update's metrics say of its batch, from the host's lists (the placed batch may
    span other processes' devices): ``group_reward_std``."""
    by_group: dict = {}
    for g, r in zip(groups, rewards):
      by_group.setdefault(g, []).append(r)
    return {"group_reward_std": float(np.mean([np.std(r) for r in by_group.values()])) if by_group else 0.0}


def _forget(state: GRPOState, controller: ControllerConfig, version: int) -> None:
  """Drops kept episodes of groups that can no longer be consumed (older than the bound on the
  staleness of a consumed result: max_staleness plus the longest hold)."""
  horizon = controller.max_staleness + controller.hold_updates
  for key in [k for k in state.episodes if k[0] + horizon < version]:
    del state.episodes[key]


def batch_sharding(mesh, rows: int) -> NamedSharding:
  """Rows split over ``data`` in contiguous blocks (each data shard trains its own rows; the
  learner's micro-batches interleave them), or replicated when ``data`` does not divide them.
  The same placement on one process as on several, so both run the same step program."""
  split = rows % mesh.shape.get("data", 1) == 0
  return NamedSharding(mesh, PartitionSpec("data") if split else PartitionSpec())


