"""SAO as a training algorithm (Single-rollout Asynchronous Optimization, arXiv 2607.07508): the
``sao`` config block, ``jaxes.rl.sao``'s learner, GRPO's plumbing.

A controller *member* is one episode of one task (``sao.tasks_per_update`` per update): no
group, so no group barrier; each finished episode waits only for its update's cohort, under the
same staleness bound, stale-result policies and delay schedules as ES and GRPO members. The
baseline is the learned value of the state before each turn (``jaxes.rl.sao``), the clip strict
on both sides, the importance ratio against the log-probs the engine recorded when it sampled
the tokens. Everything else -- episodes kept until consumed, the checkpointed learner state
(item ``learner``: the policy's params, master and moments, and the value head: ``load_policy``
and the export read its ``params`` as a GRPO run's), no update log,
multi-process batches -- is GRPO's (``algorithms.grpo``), whose docstring says why.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxes.controller import ControllerConfig
from jaxes.errors import ConfigError
from jaxes.rl import config as rl_config
from jaxes.rl.sao import SAOLearner, SAOLearnerState
from jaxes.train.algorithms.base import UpdateContext
from jaxes.train.algorithms.grpo import GRPO, GRPOState


class SAO(GRPO):
  """``train.algorithm = "sao"``: the ``sao`` config block (``jaxes.rl.config.SAO_KEYS``)."""

  name = "SAO"
  block = "sao"
  # The policy learner's and the value head's configs (errors name config.sao.*, config.rollout.*).
  learner_config = staticmethod(rl_config.sao_from_run_config)

  def make_learner(self):
    policy, value = self.settings   # check_config: learner_config's pair
    return SAOLearner(self.parts.model.graphdef, policy, value, self.parts.model.config.hidden_size)

  @staticmethod
  def controller_config_of(config) -> ControllerConfig:
    """A member is one episode of one task; the controller's staleness bound and delays apply
    to it as to an ES member."""
    if config.controller.overage in ("weight", "baseline_only"):
      raise ConfigError(f"config.controller.overage={config.controller.overage!r} weighs ES results "
                        "by staleness; SAO takes drop, wait or pace")
    return ControllerConfig.from_config(config.controller, population=config.sao.tasks_per_update,
                                        seed=config.seed, antithetic=False, episodes_per_member=1,
                                        episodes_share_task=True)

  def group_size(self) -> int:
    return 1

  def learner_step(self, learner: SAOLearnerState, batch, context: UpdateContext):
    """The first ``sao.value_warmup_updates`` updates train the value head alone."""
    train_policy = context.version > self.config.sao.value_warmup_updates
    return self.learner.step(learner, batch, train_policy=train_policy)

  def batch_metrics(self, groups: list, rewards: list) -> dict:
    """One episode per group: no group reward std; the batch's mean reward."""
    return {"reward_mean": float(np.mean(rewards)) if rewards else 0.0}

  def abstract_update(self, params, mesh) -> tuple[dict, dict]:
    """``update_lowerings`` over the abstract learner state a run places; and what it holds
    besides the parameters: the policy's float32 master and AdamW moments, the value head and
    its Adam state, the batch."""
    state = self.learner.abstract_state(params, jax.tree.map(lambda p: p.sharding, params))
    return (self.update_lowerings(GRPOState(state, {})),
            {"master_weights": state.master, "optimizer_state": state.opt_state,
             "value_head": (state.value, state.value_opt),
             "learner_batch": self.abstract_batch(mesh)})
