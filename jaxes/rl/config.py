"""The GRPO learner's configuration (no JAX here: config validation imports it cheaply).

``GRPOConfig`` is what ``GRPOLearner`` takes. A run config's ``grpo`` block (``default_config``)
holds those fields plus the trainer's own (``TRAINER_KEYS``); ``from_run_config`` checks the
block, the rollout settings GRPO depends on, and builds the learner's config, every error naming
its key.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

ADVANTAGES = ("zscore", "centered")
AGGREGATIONS = ("token", "sequence")

# The trainer's keys of the ``grpo`` block, beside GRPOConfig's fields, with their defaults.
TRAINER_KEYS = dict(
  group_size=8,          # episodes per task (G); a group's advantages are relative to each other
  tasks_per_update=4,    # groups per learner batch: group_size * tasks_per_update episode rows
  seq_len=0,             # token rows of a batch; 0 = rollout.max_len (which bounds every episode)
  updates_per_batch=1,   # learner steps per batch; later ones are off-policy (the ratio corrects)
)
# GRPOConfig fields that come from the rollout block, not the grpo block.
FROM_ROLLOUT = ("temperature", "top_p")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  learning_rate: float = 1e-6
  warmup_steps: int = 0            # linear warm-up from 0, then constant
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8
  max_grad_norm: float = 1.0       # 0 = no clipping
  clip_eps_low: float = 0.2        # ratio clipped to [1 - low, 1 + high] (DAPO: high 0.28)
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0             # > 0: k3 KL to the reference params given to init
  # Anchored weight decay toward the reference params (θ₀), after each AdamW step
  # (jaxes.es.anchor: "l2" / "l1", step learning_rate * anchor_decay; "none" or 0: off).
  anchor: str = "none"
  anchor_decay: float = 0.0
  advantage: str = "zscore"        # "zscore" (GRPO) or "centered" (Dr.GRPO: no std division)
  advantage_eps: float = 1e-6
  aggregation: str = "token"       # "token" or "sequence" mean over the sampled tokens
  micro_batches: int = 1           # the batch's rows are split into this many, grads summed
  master_weights: bool = True      # float32 master copy (and moments) when params are not f32
  remat: bool = True               # each layer's activations recomputed in the backward
  logprob_chunk: int = 1024        # LM head + log-softmax this many positions at a time; 0 = all
  optimizer_over_data: bool = True  # master, moments, gradient sums also split over mesh.data
  temperature: float = 1.0         # of the sampling distribution the log-probs are under
  top_p: float = 1.0

  @property
  def anchored(self) -> bool:
    return self.anchor != "none" and self.anchor_decay > 0

  def __post_init__(self):
    def fail(key, why):
      raise ValueError(f"GRPOConfig.{key}: {why}, got {getattr(self, key)!r}")

    def number(key):
      v = getattr(self, key)
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(key, "must be a number")
      return v

    if not number("learning_rate") > 0:
      fail("learning_rate", "must be > 0")
    for key in ("weight_decay", "max_grad_norm", "kl_coef", "adam_eps"):
      if number(key) < 0:
        fail(key, "must be >= 0")
    for key in ("adam_b1", "adam_b2"):
      if not 0 <= number(key) < 1:
        fail(key, "must be in [0, 1)")
    if not 0 < number("clip_eps_low") < 1:
      fail("clip_eps_low", "must be in (0, 1)")
    if not number("clip_eps_high") > 0:
      fail("clip_eps_high", "must be > 0")
    if not number("advantage_eps") > 0:
      fail("advantage_eps", "must be > 0")
    if not number("temperature") > 0:
      fail("temperature", "must be > 0 (GRPO needs sampled episodes; greedy has no log-probs)")
    if not 0 < number("top_p") <= 1:
      fail("top_p", "must be in (0, 1]")
    for key in ("warmup_steps", "micro_batches", "logprob_chunk"):
      v = getattr(self, key)
      if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "micro_batches" else 0):
        fail(key, f"must be an int >= {1 if key == 'micro_batches' else 0}")
    if self.advantage not in ADVANTAGES:
      fail("advantage", f"must be one of {ADVANTAGES}")
    if self.aggregation not in AGGREGATIONS:
      fail("aggregation", f"must be one of {AGGREGATIONS}")
    if self.anchor not in ("none", "l2", "l1"):
      fail("anchor", "must be one of ('none', 'l2', 'l1')")
    if number("anchor_decay") < 0:
      fail("anchor_decay", "must be >= 0")
    for key in ("master_weights", "remat", "optimizer_over_data"):
      if not isinstance(getattr(self, key), bool):
        fail(key, "must be a bool")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "GRPOConfig":
    """From a config block (a ``ConfigDict`` or dict); an unknown key is an error naming it."""
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in d:
      if key not in known:
        raise ValueError(f"GRPOConfig.{key}: unknown key; known: {', '.join(sorted(known))}")
    return cls(**d)


def default_config():
  """The ``grpo`` block of a run config with every key at its default."""
  from ml_collections import config_dict
  learner = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name not in FROM_ROLLOUT}
  return config_dict.ConfigDict({**learner, **TRAINER_KEYS})


def from_run_config(c) -> GRPOConfig:
  """The learner's config from a run config (``c.grpo``, ``c.rollout``), after checking the
  trainer's keys; errors name the run config's key (``config.grpo.group_size: ...``)."""
  block = {**TRAINER_KEYS, **dict(c.grpo)}   # a trainer key left out is at its default
  for key, lo in (("group_size", 2), ("tasks_per_update", 1), ("seq_len", 0), ("updates_per_batch", 1)):
    v = block[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"config.grpo.{key}: must be an int >= {lo}, got {v!r}")
  if block["seq_len"] > c.rollout.max_len:
    raise ValueError(f"config.grpo.seq_len: must be <= config.rollout.max_len={c.rollout.max_len} "
                     f"(0 = equal to it), got {block['seq_len']!r}")
  rows = block["group_size"] * block["tasks_per_update"]
  learner = {k: v for k, v in block.items() if k not in TRAINER_KEYS}
  for key in FROM_ROLLOUT:
    if key in learner:
      raise ValueError(f"config.grpo.{key}: set config.rollout.{key} instead (episodes are sampled "
                       "at it, and the learner's log-probs must be under the same distribution)")
  try:
    config = GRPOConfig.from_dict({**learner, **{k: c.rollout[k] for k in FROM_ROLLOUT}})
  except ValueError as err:
    key = str(err).split(":")[0].removeprefix("GRPOConfig.")
    block_name = "rollout" if key in FROM_ROLLOUT else "grpo"
    raise ValueError(f"config.{block_name}.{str(err).removeprefix('GRPOConfig.')}") from None
  if rows % config.micro_batches:
    raise ValueError(f"config.grpo.micro_batches: must divide group_size * tasks_per_update = {rows}, "
                     f"got {config.micro_batches}")
  return config


# -- SAO (jaxes.rl.sao): one episode per task, a value head for the baseline, strict clipping ------
# GRPOConfig fields SAO does not use: no group (so no group advantage) and no KL term.
SAO_UNUSED = ("kl_coef", "advantage", "advantage_eps")
# The trainer's and the value head's keys of the ``sao`` block, beside the learner's.
SAO_KEYS = dict(
  tasks_per_update=16,       # episodes per update, one per task (no group)
  seq_len=0,                 # token rows of a batch; 0 = rollout.max_len
  updates_per_batch=1,       # learner steps per batch
  value_learning_rate=1e-3,  # Adam on the value head (its own optimizer, not the policy's)
  value_warmup_updates=0,    # the first N updates train the value head only (the policy stays)
  turn_values=True,          # a value per assistant turn (the state before it); False: per episode
)


@dataclasses.dataclass(frozen=True)
class SAOValueConfig:
  """What ``SAOLearner`` takes beside the policy's ``GRPOConfig`` (defaults: ``SAO_KEYS``)."""
  learning_rate: float
  turn_values: bool


def sao_default_config():
  """The ``sao`` block of a run config with every key at its default (clipping as DAPO's
  asymmetric 0.2 / 0.28, token-level mean)."""
  from ml_collections import config_dict
  learner = {f.name: f.default for f in dataclasses.fields(GRPOConfig)
             if f.name not in FROM_ROLLOUT + SAO_UNUSED}
  learner["clip_eps_high"] = 0.28
  return config_dict.ConfigDict({**learner, **SAO_KEYS})


def sao_from_run_config(c) -> tuple[GRPOConfig, SAOValueConfig]:
  """The policy learner's and the value head's configs from a run config (``c.sao``,
  ``c.rollout``); errors name the run config's key (``config.sao.tasks_per_update: ...``)."""
  block = {**SAO_KEYS, **dict(c.sao)}   # a trainer or value-head key left out is at its default
  for key, lo in (("tasks_per_update", 1), ("seq_len", 0), ("updates_per_batch", 1),
                  ("value_warmup_updates", 0)):
    v = block[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"config.sao.{key}: must be an int >= {lo}, got {v!r}")
  lr = block["value_learning_rate"]
  if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
    raise ValueError(f"config.sao.value_learning_rate: must be a number > 0, got {lr!r}")
  if not isinstance(block["turn_values"], bool):
    raise ValueError(f"config.sao.turn_values: must be a bool, got {block['turn_values']!r}")
  if block["seq_len"] > c.rollout.max_len:
    raise ValueError(f"config.sao.seq_len: must be <= config.rollout.max_len={c.rollout.max_len} "
                     f"(0 = equal to it), got {block['seq_len']!r}")
  for key in SAO_UNUSED + FROM_ROLLOUT:
    if key in block:
      raise ValueError(f"config.sao.{key}: not an SAO key" + (
          f" (set config.rollout.{key}: episodes are sampled at it)" if key in FROM_ROLLOUT else
          " (SAO has no group advantage and no KL term)"))
  learner = {k: v for k, v in block.items() if k not in SAO_KEYS}
  try:
    config = GRPOConfig.from_dict({**learner, **{k: c.rollout[k] for k in FROM_ROLLOUT}})
  except ValueError as err:
    key = str(err).split(":")[0].removeprefix("GRPOConfig.")
    block_name = "rollout" if key in FROM_ROLLOUT else "sao"
    raise ValueError(f"config.{block_name}.{str(err).removeprefix('GRPOConfig.')}") from None
  rows = block["tasks_per_update"]
  if rows % config.micro_batches:
    raise ValueError(f"config.sao.micro_batches: must divide tasks_per_update = {rows}, "
                     f"got {config.micro_batches}")
  return config, SAOValueConfig(float(lr), block["turn_values"])
