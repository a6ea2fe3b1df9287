"""Up-front validation of a training config: every error names the offending key.

Runs before any model is built or sandbox started, so a typo costs milliseconds, not a run.
"""
from __future__ import annotations

import importlib.util
import os
import re

from ml_collections import config_dict

from jaxes.train import defaults

MODEL_PRESETS = ("tiny", "tiny-gqa", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b")


class ConfigError(ValueError):
  """A config value is invalid; the message starts with the key, e.g. ``config.es.sigma``."""


def load_config_file(path, *args) -> config_dict.ConfigDict:
  """``get_config(*args)`` of a config file (``configs/*.py``), as ``--config=PATH`` loads it."""
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


def _schema() -> config_dict.ConfigDict:
  return defaults.base_config()


def _flatten(d, prefix="config"):
  out = {}
  for k, v in d.items():
    key = f"{prefix}.{k}"
    if isinstance(v, (config_dict.ConfigDict, dict)):
      out.update(_flatten(v, key))
    else:
      out[key] = v
  return out


def validate(config: config_dict.ConfigDict) -> None:
  """Raises ``ConfigError`` naming the first invalid key."""
  given, schema = _flatten(config), _flatten(_schema())
  for key in given:
    if key not in schema:
      raise ConfigError(f"{key}: unknown key (known keys are those of jaxes/train/defaults.py)")
  for key in schema:
    if key not in given:
      raise ConfigError(f"{key}: missing (start experiment configs from jaxes.train.defaults.base_config())")

  def check(key, ok, why):
    if not ok:
      raise ConfigError(f"config.{key}: {why}, got {given['config.' + key]!r}")

  def one_of(key, options):
    check(key, given["config." + key] in options, f"must be one of {options}")

  def at_least(key, lo):
    v = given["config." + key]
    check(key, isinstance(v, (int, float)) and not isinstance(v, bool) and v >= lo, f"must be >= {lo}")

  def positive(key):
    v = given["config." + key]
    check(key, isinstance(v, (int, float)) and v > 0, "must be > 0")

  c = config
  at_least("seed", 0)
  one_of("model.preset", MODEL_PRESETS)
  if c.model.path:
    check("model.path", os.path.isfile(os.path.join(c.model.path, "config.json")),
          "must be a local directory containing config.json")
  elif not c.model.preset.startswith("tiny"):
    check("model.path", False, f"must name a local checkpoint directory for preset {c.model.preset!r}")
  for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
    at_least(f"model.{k}", 0)
  if c.model.num_heads and c.model.num_kv_heads:
    check("model.num_kv_heads", c.model.num_heads % c.model.num_kv_heads == 0,
          "must divide config.model.num_heads")
  one_of("model.dtype", ("float32", "bfloat16"))
  one_of("model.param_dtype", ("float32", "bfloat16"))
  if c.tokenizer.path:
    check("tokenizer.path", os.path.isdir(c.tokenizer.path), "must be an existing local directory")
  elif not c.model.path:
    at_least("tokenizer.vocab_size", 300)  # 256 byte symbols + ChatML specials + some merges
    if c.model.vocab_size:
      check("tokenizer.vocab_size", c.tokenizer.vocab_size <= c.model.vocab_size,
            "must be <= config.model.vocab_size")
  for k in ("data", "fsdp", "tensor"):
    check(f"mesh.{k}", isinstance(c.mesh[k], int) and (c.mesh[k] >= 1 or c.mesh[k] == -1),
          "must be a positive int or -1 (all remaining devices)")
  check("mesh.data", [c.mesh.data, c.mesh.fsdp, c.mesh.tensor].count(-1) <= 1,
        "at most one of config.mesh.{data,fsdp,tensor} may be -1")

  one_of("es.mode", ("lowrank", "full"))
  at_least("es.population", 2)
  if c.es.antithetic:
    check("es.population", c.es.population % 2 == 0, "must be even when config.es.antithetic")
  positive("es.sigma")
  positive("es.learning_rate")
  at_least("es.rank", 1)
  one_of("es.shaping", ("zscore", "centered_rank"))
  one_of("es.sigma_schedule", ("constant", "cosine"))
  at_least("es.sigma_final", 0.0)
  one_of("es.optimizer", ("sgd", "adam"))
  at_least("es.weight_decay", 0.0)
  check("warmstart.off_protocol_fraction", 0.0 <= c.warmstart.off_protocol_fraction <= 1.0,
        "must be in [0, 1]")
  for pattern in c.es.frozen.split(","):
    try:
      re.compile(pattern.strip())
    except re.error as err:
      check("es.frozen", False, f"{pattern.strip()!r} is not a regular expression ({err})")

  one_of("controller.mode", ("sync", "async"))
  at_least("controller.episodes_per_member", 1)
  at_least("controller.max_staleness", 0)
  if c.controller.mode == "sync":
    check("controller.max_staleness", c.controller.max_staleness == 0,
          "must be 0 when config.controller.mode='sync'")
  one_of("controller.overage", ("drop", "wait"))
  v = c.controller.delay_fraction
  check("controller.delay_fraction", isinstance(v, (int, float)) and 0.0 <= v <= 1.0, "must be in [0, 1]")
  at_least("controller.delay_updates", 0)
  if c.controller.delay_fraction > 0:
    check("controller.delay_updates", c.controller.delay_updates >= 1,
          "must be >= 1 when config.controller.delay_fraction > 0")
  at_least("controller.stress_all_stale", 0)
  at_least("controller.max_retries", 0)

  one_of("env.sandbox", ("local", "docker"))
  if c.env.families:
    from jaxes.envs import generator
    for fam in c.env.families.split(","):
      check("env.families", fam.strip() in generator.FAMILIES,
            f"{fam.strip()!r} is not a task family; known: {', '.join(generator.FAMILIES)}")
  one_of("env.difficulty", (0, 1, 2, 3))
  at_least("env.num_train_tasks", 1)
  at_least("env.num_heldout_tasks", 1)
  at_least("env.max_turns", 1)
  at_least("env.parse_error_penalty", 0.0)
  at_least("env.sandbox_workers", 1)

  at_least("rollout.num_slots", 1)
  at_least("rollout.prefill_chunk", 1)
  at_least("rollout.max_new_tokens", 1)
  check("rollout.max_len", isinstance(c.rollout.max_len, int)
        and c.rollout.max_len > c.rollout.max_new_tokens, "must exceed config.rollout.max_new_tokens")
  at_least("rollout.temperature", 0.0)
  at_least("rollout.sandbox_steps", 0)
  check("rollout.top_p", 0.0 < c.rollout.top_p <= 1.0, "must be in (0, 1]")

  at_least("train.num_updates", 0)
  at_least("train.checkpoint_every", 1)
  at_least("train.keep_checkpoints", 1)
  at_least("train.eval_every", 0)
  at_least("eval.num_tasks", 0)
  check("eval.num_tasks", c.eval.num_tasks <= c.env.num_heldout_tasks,
        "must be <= config.env.num_heldout_tasks")
  at_least("eval.seeds", 1)
  at_least("eval.temperature", 0.0)

  at_least("warmstart.steps", 0)
  if c.warmstart.init_from:
    check("warmstart.init_from", os.path.isdir(os.path.join(c.warmstart.init_from, "checkpoints", "0")),
          "must be a run directory with a version-0 checkpoint")
  if c.warmstart.steps > 0:
    at_least("warmstart.num_tasks", 1)
    at_least("warmstart.batch_size", 1)
    positive("warmstart.learning_rate")
    at_least("warmstart.seq_len", 16)
    check("warmstart.steps", not c.model.path,
          "supervised warm start is for randomly initialised models; unset config.model.path")
