"""The GRPO trainer: the ES trainer's loop, tasks, engine, controller, evaluation, metrics and
checkpoints, with a gradient learner (``jaxes.rl``) in place of the ES update.

A controller *member* is a group: ``grpo.group_size`` episodes of one task
(``ControllerConfig.episodes_share_task``), ``grpo.tasks_per_update`` groups per update, so the
controller's staleness bound, delays and drops apply to GRPO exactly as to ES (``max_staleness``
0: on-policy and synchronous; K >= 1: stale groups, corrected by the importance ratio against the
log-probs the engine recorded when it sampled them). Every episode has its own sampling stream
(the job id), since a group needs distinct samples. The engine runs unperturbed rows.

A finished episode's tokens (``EpisodeResult.tokens``) are kept until the update that consumes
its group; the update pads the consumed groups into one fixed-shape ``Batch`` and runs
``grpo.updates_per_batch`` learner steps. A checkpoint (every ``train.checkpoint_every`` updates)
holds the learner state (params, float32 master, AdamW moments), the params of older versions
still being decoded, the controller, and the kept episodes of groups not yet consumed. Resume
restores the newest one; the controller reissues the jobs that were in flight, which decode the
same tokens (streams are keyed by job), so under the deterministic schedule
(``rollout.sandbox_steps`` > 0) a resumed run repeats the interrupted one's updates exactly. There
is no update log: an update's input is its batch (KBs per episode), not a few numbers, so
updates after the newest checkpoint are recomputed instead of replayed.

Multi-process runs work as the ES trainer's (``multihost``): every process runs this same
controller; the runner exchanges the owned slots' sandbox results once per engine tick, so every
process knows every finished episode's tokens (``EpisodeStream``) and builds the same batch; the
learner state, params and batch live on the one global mesh (the batch split over ``data``), so
the learner step is one SPMD program; the primary alone writes the run's files, and orbax saves
each process's shards.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxes import distributed
from jaxes.controller import Controller, Job
from jaxes.models import partition
from jaxes.rl import batch as rl_batch
from jaxes.rl import config as rl_config
from jaxes.rl.grpo import GRPOLearner, LearnerState
from jaxes.rollout.episodes import EpisodeSpec, EpisodeStream
from jaxes.train import builders
from jaxes.train.state import config_values, restore_items, version_zero_params
from jaxes.train.trainer import TrainEpisode, Trainer


@dataclasses.dataclass
class GRPORunState:
  learner: LearnerState
  params_by_version: dict[int, Any]   # every version still decoded, the current one included
  controller: Controller
  evals: list[dict]
  timings: dict[str, float]
  # (version, group, episode) -> (reward, EpisodeStream): finished episodes of groups not consumed yet
  episodes: dict[tuple[int, int, int], tuple[float, EpisodeStream]]
  restored_from: int | None = None
  replayed: list[dict] = dataclasses.field(default_factory=list)   # (no update log: always empty)

  @property
  def version(self) -> int:
    return self.controller.version


def _episode_rows(episodes: dict) -> list:
  return [[v, m, e, reward, list(s.prompt), [list(t) for t in s.turns],
           [list(x) for x in s.logprobs], [list(o) for o in s.observations]]
          for (v, m, e), (reward, s) in sorted(episodes.items())]


def _episodes_from_rows(rows: list) -> dict:
  return {(v, m, e): (reward, EpisodeStream(tuple(p), tuple(map(tuple, t)), tuple(map(tuple, lp)),
                                            tuple(map(tuple, o))))
          for v, m, e, reward, p, t, lp, o in rows}


class GRPOTrainer(Trainer):
  """``GRPOTrainer(config, workdir).run()`` for a config with ``train.algorithm = "grpo"``; the
  same constructor arguments and run directory layout as ``Trainer``."""

  name = "GRPO"

  # -- state ------------------------------------------------------------------------------------
  def _initial_state(self, ckpt, update_log, transcripts) -> GRPORunState:
    c, host = self.config, self.host
    self.learner = GRPOLearner(self.parts.model.graphdef, rl_config.from_run_config(c))
    self._param_shardings = partition.param_shardings(self.parts.model.config, host.mesh)
    if ckpt.steps():
      state = self._restore(ckpt)
      self.log(f"resumed from checkpoint at version {state.restored_from}")
      return state
    update_log.truncate_to(0)   # not used by GRPO; a fresh start sets earlier records aside
    params, timings = version_zero_params(c, self.parts, transcripts, self.log)
    learner = self.learner.init(distributed.place(params, self._param_shardings))
    controller = Controller(builders.controller_config(c), num_tasks=len(self.parts.train_tasks))
    return GRPORunState(learner, {0: learner.params}, controller, [], timings, {})

  def _abstract_learner(self) -> LearnerState:
    """The learner state's shapes, each leaf where a fresh start puts it
    (``GRPOLearner.abstract_state``)."""
    return self.learner.abstract_state(self.parts.model.abstract_params, self._param_shardings)

  def _restore(self, ckpt) -> GRPORunState:
    abstract = self._abstract_learner()
    step, learner, params, host = restore_items(ckpt, "learner", abstract, abstract.params,
                                                self.config)
    controller = Controller.from_state_dict(host["controller"])
    params[controller.version] = learner.params
    return GRPORunState(learner, params, controller, host["evals"], host.get("timings", {}),
                        _episodes_from_rows(host["episodes"]), restored_from=step)

  def _save(self, ckpt) -> None:
    state = self.state
    old = sorted(v for v in state.params_by_version if v != state.version)
    items = {"learner": state.learner, **{f"old/{v}": state.params_by_version[v] for v in old}}
    host = {"controller": state.controller.state_dict(), "evals": state.evals,
            "timings": state.timings, "old_versions": old, "config": config_values(self.config),
            "episodes": _episode_rows(state.episodes)}
    ckpt.save(state.version, items, host)

  def _current_params(self):
    return self.state.learner.params

  def _log_update(self, update_log, info) -> None:
    """GRPO keeps no update log (see the module docstring)."""

  # -- the loop's pieces ------------------------------------------------------------------------
  def _build_engine(self):
    return builders.build_engine(self.config, self.parts.model, self.parts.tokenizer,
                                 mesh=self.host.mesh)

  def _spec(self, job: Job) -> EpisodeSpec:
    c = self.config   # one stream per episode: a group's samples must differ
    return EpisodeSpec(TrainEpisode(job), self.parts.train_tasks[job.task], job.version, -1,
                       job.job_id, c.rollout.temperature, c.rollout.top_p)

  def _report(self, result) -> None:
    job = result.spec.key.job
    if result.reward is not None:
      self.state.episodes[(job.version, job.member, job.episode)] = (result.reward, result.tokens)
    super()._report(result)

  def _apply(self, update) -> tuple[dict, list]:
    c, state, t = self.config, self.state, time.perf_counter()
    results = sorted(update.results)
    batch, group_std = self._batch(results)
    keep = set(state.controller.live_versions()) | self.runner.live_versions()
    if update.version in keep:   # the step donates the learner state; stale rows still need θ_v
      state.params_by_version[update.version] = jax.tree.map(jnp.copy, state.learner.params)
    sums: dict[str, float] = {}
    for _ in range(c.grpo.updates_per_batch):
      state.learner, step_metrics = self.learner.step(state.learner, batch)
      for k, v in step_metrics.items():   # replicated scalars: this process's copy
        sums[k] = sums.get(k, 0.0) + float(np.asarray(v.addressable_data(0)))
    state.params_by_version[state.version] = state.learner.params
    for v in [v for v in state.params_by_version if v not in keep | {state.version}]:
      del state.params_by_version[v]
    self._forget(update.version + 1)
    update_s = time.perf_counter() - t
    self._window.update_s += update_s
    record = self._window.common(state.version, update, results, self.runner.stats())
    steps = c.grpo.updates_per_batch
    record["grpo"] = {**{k: v / steps for k, v in sums.items() if k not in ("tokens", "episodes")},
                      "tokens": int(sums["tokens"] / steps), "episodes": int(sums["episodes"] / steps),
                      "learner_tokens_per_s": sums["tokens"] / update_s if update_s > 0 else 0.0,
                      "group_reward_std": group_std}
    return record, results

  def _batch(self, results: list) -> tuple[rl_batch.Batch, float]:
    """The consumed groups' episodes, padded to ``tasks_per_update * group_size`` rows, and the
    mean over groups of their rewards' std (0: every episode of a group scored alike, and the
    group teaches nothing)."""
    c, state = self.config, self.state
    im_end = builders.stop_ids(self.parts.tokenizer)[1]
    episodes, rewards, groups = [], [], []
    for version, group, _ in results:
      for e in range(c.grpo.group_size):
        kept = state.episodes.pop((version, group, e), None)
        if kept is None:   # failed for good after its retries: not part of the group
          continue
        reward, stream = kept
        if stream is None or not stream.turns:   # never decoded (its prompt overflowed the row)
          continue
        episodes.append(rl_batch.episode_from_stream(stream, im_end))
        rewards.append(reward)
        groups.append((version, group))
    by_group: dict = {}
    for g, r in zip(groups, rewards):
      by_group.setdefault(g, []).append(r)
    group_std = float(np.mean([np.std(r) for r in by_group.values()])) if by_group else 0.0
    batch = rl_batch.build_batch(episodes, rewards, groups, seq_len=c.grpo.seq_len or c.rollout.max_len,
                                 num_rows=c.grpo.tasks_per_update * c.grpo.group_size)
    return distributed.place(batch, self._batch_sharding(batch.num_rows)), group_std

  def _batch_sharding(self, rows: int) -> NamedSharding:
    """Rows split over ``data`` in contiguous blocks (each data shard trains its own rows; the
    learner's micro-batches interleave them), or replicated when ``data`` does not divide them.
    The same placement on one process as on several, so both run the same step program."""
    mesh = self.host.mesh
    split = rows % mesh.shape.get("data", 1) == 0
    return NamedSharding(mesh, PartitionSpec("data") if split else PartitionSpec())

  def _forget(self, version: int) -> None:
    """Drops kept episodes of groups that can no longer be consumed (older than the bound on
    the staleness of a consumed result: max_staleness plus the longest hold)."""
    cfg = self.state.controller.config
    horizon = cfg.max_staleness + cfg.hold_updates
    for key in [k for k in self.state.episodes if k[0] + horizon < version]:
      del self.state.episodes[key]

  def _plot_label(self) -> str:
    return f"GRPO ({self.config.controller.mode})"
