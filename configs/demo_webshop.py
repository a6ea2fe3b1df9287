"""The CPU demo on WebShop: the terminal demo's tiny policy and ES, on generated WebShop goals.

  python -m jaxes.train --config=configs/demo_webshop.py --workdir=runs/demo_webshop

(draft: settings being measured)
"""
from jaxes.train.defaults import base_config


def get_config():
  c = base_config()
  c.model.preset = "tiny"
  c.model.vocab_size = 1024
  c.model.hidden_size = 128
  c.model.intermediate_size = 384
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.tokenizer.vocab_size = 1024
  c.mesh.data = 1

  c.es.mode = "lowrank"
  c.es.population = 8
  c.es.sigma = 0.015
  c.es.learning_rate = 0.02
  c.es.rank = 1
  c.es.shaping = "centered_rank"

  c.controller.mode = "async"
  c.controller.max_staleness = 1
  c.controller.episodes_per_member = 4

  c.env.kind = "webshop"
  c.env.num_train_tasks = 256
  c.env.num_heldout_tasks = 64
  c.env.sandbox_workers = 8
  c.webshop.max_steps = 8
  c.webshop.off_protocol_fraction = 0.0

  c.rollout.num_slots = 32
  c.rollout.max_len = 2048
  c.rollout.prefill_chunk = 128
  c.rollout.max_new_tokens = 48
  c.rollout.temperature = 0.0
  c.rollout.sandbox_steps = 3

  c.train.num_updates = 20
  c.train.eval_every = 10
  c.train.checkpoint_every = 5
  c.eval.num_tasks = 64
  c.eval.seeds = 1

  c.warmstart.steps = 300
  c.warmstart.num_tasks = 256
  c.warmstart.batch_size = 8
  c.warmstart.learning_rate = 3e-3
  c.warmstart.seq_len = 1024
  return c
