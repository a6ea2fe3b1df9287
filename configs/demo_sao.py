"""The CPU demo's SAO run (jaxes/train/algorithms/sao.py): the same tiny policy, warm start,
tasks, engine and evaluation as configs/demo.py, trained by single-rollout asynchronous
optimisation with a value-head baseline and strict double-side clipping.

  python -m jaxes.train --config=configs/demo_sao.py --workdir=runs/demo_sao

(configs/demo_grid.py's ``sao`` variants are this at the grid's sizes.) Choices, not tuned:
  * one episode per task, 16 per update (the grid's ES and GRPO rows' 16), asynchronous with
    staleness <= 1 (Async-1's controller: SAO exists for the asynchronous setting).
  * training episodes sampled at temperature 1.0 (the ratio needs sampled tokens' log-probs);
    evaluation stays greedy.
  * the policy's learner settings are demo_grpo.py's (lr 1e-4, 4 micro-batches, token-level
    mean) with DAPO's asymmetric clip range 0.2 / 0.28, now strict on both sides.
  * the value head: Adam at 2e-2 (each step moves V by about that), the first 4 updates train
    it alone (a warm-up, so the first policy updates' baseline is not 0).
"""
import os

from jaxes.rl.config import sao_default_config
from jaxes.train.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py"))
  c.train.algorithm = "sao"
  c.controller.mode = "async"
  c.controller.max_staleness = 1
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0

  c.sao = sao_default_config()
  c.sao.tasks_per_update = 16
  c.sao.learning_rate = 1e-4
  c.sao.micro_batches = 4
  c.sao.max_grad_norm = 1.0
  c.sao.clip_eps_low = 0.2
  c.sao.clip_eps_high = 0.28
  c.sao.aggregation = "token"
  c.sao.value_learning_rate = 2e-2
  c.sao.value_warmup_updates = 4
  c.sao.turn_values = True
  return c
