"""The CPU demo: tiny Qwen2-architecture policy, small BPE tokenizer, generated tasks in local
sandboxes, asynchronous low-rank ES. Runs in <= 15 minutes on 2 CPU cores.

  python -m jaxes.train --config=configs/demo.py --workdir=runs/demo [--config.controller.mode=sync]

Choices (measured; see benchmarks/RESULTS_demo.md):
  * warm start: supervised training on oracle transcripts of training-split tasks stands in for
    an Instruct checkpoint; it is stopped early on purpose so held-out success stays well below
    100% and ES has room to improve.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # so `configs` imports from any cwd
from configs import common  # noqa: E402


def get_config():
  c = common.base_config()
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
  c.es.population = 16
  c.es.sigma = 0.008
  c.es.learning_rate = 0.05
  c.es.rank = 1
  c.es.shaping = "centered_rank"

  c.controller.mode = "async"
  c.controller.max_staleness = 1
  c.controller.episodes_per_member = 2

  c.env.sandbox = "local"
  # Endless Terminals' protocol with a compact wording of its rules: the full system prompt costs
  # ~180 tokens per episode and transcript, which dominates a tiny model's compute on CPU.
  c.env.system_prompt = ("You are in a Linux terminal; solve the user's task in /home/user. End each "
                         "reply with exactly one <command>ONE_SHELL_COMMAND</command>, or "
                         "<action>done</action> when the task is complete.")
  c.env.families = ""
  c.env.num_train_tasks = 256
  c.env.num_heldout_tasks = 64
  c.env.partial_credit = True
  c.env.max_turns = 4
  c.env.sandbox_workers = 8

  c.rollout.num_slots = 32
  c.rollout.max_len = 512
  c.rollout.prefill_chunk = 64
  c.rollout.max_new_tokens = 128
  c.rollout.temperature = 0.0

  c.train.num_updates = 20
  c.train.eval_every = 5
  c.train.checkpoint_every = 5
  c.eval.num_tasks = 64
  c.eval.seeds = 1

  c.warmstart.steps = 200
  c.warmstart.num_tasks = 256
  c.warmstart.batch_size = 8
  c.warmstart.learning_rate = 3e-3
  c.warmstart.seq_len = 256
  return c
