"""The CPU demo's GRPO baseline: the same tiny policy, warm start, tasks, engine and evaluation
as configs/demo.py, trained by GRPO instead of ES.

  python -m jaxes.train --config=configs/demo_grpo.py --workdir=runs/demo_grpo

(``python -m jaxes.train`` runs ``jaxes.train.algorithms.grpo`` for ``train.algorithm = "grpo"``;
configs/demo_grid.py's ``grpo`` variant is this at the grid's sizes.)

Choices, matched to the ES demo so the comparison is at equal episode budget:
  * 4 tasks x 8 episodes = 32 episodes per update, as ES's 8 members x 4 episodes.
  * training episodes sampled at temperature 1.0 (GRPO needs sampled, distinct episodes in a
    group; ES's demo decodes greedily); evaluation stays greedy (eval.temperature 0).
  * synchronous, on-policy: one learner step per batch, no staleness.
  * 4 micro-batches of 8 episode rows x 512 tokens (the KV-cache row length bounds an episode).
  * learning rate 1e-4, no KL (Dr.GRPO / DAPO drop it), token-level mean: not tuned yet.
"""
import os

from jaxes.rl.config import default_config
from jaxes.train.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py"))
  c.train.algorithm = "grpo"
  c.controller.mode = "sync"
  c.controller.max_staleness = 0
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0

  c.grpo = default_config()
  c.grpo.group_size = 8
  c.grpo.tasks_per_update = 4
  c.grpo.learning_rate = 1e-4
  c.grpo.micro_batches = 4
  c.grpo.max_grad_norm = 1.0
  c.grpo.clip_eps_low = 0.2
  c.grpo.clip_eps_high = 0.2
  c.grpo.kl_coef = 0.0
  c.grpo.advantage = "zscore"
  c.grpo.aggregation = "token"
  return c
