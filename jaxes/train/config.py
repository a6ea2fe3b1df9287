"""Up-front validation of a training config: every error names the offending key.

Runs before any model is built or sandbox started, so a typo costs milliseconds, not a run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

from ml_collections import config_dict

from jaxes import envs, errors
from jaxes.envs import environments, protocol
from jaxes.envs.tasks import generator
from jaxes.errors import ConfigError
from jaxes.models import qwen2, sources
from jaxes.rollout import engine
from jaxes.train import algorithms, builders, coevolution, defaults, mc_probe
from jaxes.train.tracker import TRACKERS


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


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What validating a config builds once for the run to use: ``algorithm_settings``, the
  ``train.algorithm``'s own block built (ES: the ``es.Strategy``; GRPO: the learner's
  ``GRPOConfig``; SAO: its policy and value-head configs).
  The controller's configuration and co-evolution's state are built here to check them; a run
  state makes its own at a fresh start and restores them on resume."""
  config: config_dict.ConfigDict
  algorithm_settings: Any


def validate(config: config_dict.ConfigDict) -> RunSpec:
  """The run's ``RunSpec``; raises ``ConfigError`` naming the first invalid key."""
  given, schema = _flatten(config), _flatten(_schema())
  for key in given:
    if key not in schema:
      raise ConfigError(f"{key}: unknown key{defaults.did_you_mean(key)} (known keys: python -m "
                        f"jaxes.train --config_help)")
  for key in schema:
    if key not in given:
      raise ConfigError(f"{key}: missing (start experiment configs from jaxes.train.defaults.base_config())")
  checks = _Checks(config, given)
  checks.model()
  checks.mesh()
  # The algorithm's, controller's, co-evolution's and model's settings are checked by the typed
  # objects they build, which own their rules; ``errors.keyed`` names the key an error rejects.
  algorithm_settings = checks.algorithm()   # only the algorithm's own block
  with errors.keyed(config, "controller"):
    algorithms.controller_config(config)   # what a member is depends on the algorithm
  with errors.keyed(config, "coevolve"):
    coevolution.from_config(config)
  if not config.model.path:
    tokenizer_size = config.tokenizer.vocab_size   # the tokenizer as the config builds it
    with errors.keyed(config, "model"):
      builders.model_config(config, builders.vocab_size(config, tokenizer_size))
  checks.env()
  checks.rollout(algorithm_settings)
  checks.schedule()
  checks.warmstart()
  return RunSpec(config, algorithm_settings)


class _Checks:
  """The rules no typed object owns (paths, counts, the rollout's and the schedule's bounds)."""

  def __init__(self, config, given: dict):
    self.c, self.given = config, given

  def check(self, key, ok, why):
    if not ok:
      raise ConfigError(f"config.{key}: {why}, got {self.given['config.' + key]!r}")

  def one_of(self, key, options):
    self.check(key, self.given["config." + key] in options, f"must be one of {options}")

  def at_least(self, key, lo):
    v = self.given["config." + key]
    self.check(key, isinstance(v, (int, float)) and not isinstance(v, bool) and v >= lo, f"must be >= {lo}")

  def positive(self, key):
    v = self.given["config." + key]
    self.check(key, isinstance(v, (int, float)) and v > 0, "must be > 0")

  def model(self):
    c = self.c
    self.at_least("seed", 0)
    self.one_of("model.preset", tuple(qwen2.PRESETS))
    if c.model.path:
      problem = sources.problem(c.model.path)
      self.check("model.path", problem is None, problem)
      self.checkpoint_shape()
    elif not c.model.preset.startswith("tiny"):
      self.check("model.path", False, f"must name a local checkpoint (directory, .gguf file or pip:PACKAGE) for preset {c.model.preset!r}")
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
      self.at_least(f"model.{k}", 0)
    if c.tokenizer.path:
      self.check("tokenizer.path", os.path.isdir(c.tokenizer.path), "must be an existing local directory")
    elif not c.model.path:
      self.at_least("tokenizer.vocab_size", 300)  # 256 byte symbols + ChatML specials + some merges
      if c.model.vocab_size:
        self.check("tokenizer.vocab_size", c.tokenizer.vocab_size <= c.model.vocab_size,
                   "must be <= config.model.vocab_size")

  # config.model.<key> -> the checkpoint's Qwen2Config field: what model.path decides.
  CHECKPOINT_DECIDES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                        "num_kv_heads")

  def checkpoint_shape(self):
    """The model's shape is the checkpoint's: a size also set in the config (not 0) must agree,
    or the run would train the checkpoint's model while config.json records the other."""
    try:
      stored = qwen2.Qwen2Config.from_hf_dict(sources.read_config(self.c.model.path))
    except (ValueError, TypeError, KeyError):   # CheckpointError too
      return   # not a readable Qwen2 config: loading it names what is wrong
    for key in self.CHECKPOINT_DECIDES:
      value = self.c.model[key]
      if value and value != getattr(stored, key):
        raise ConfigError(f"config.model.{key}: {value}, but the checkpoint config.model.path="
                          f"{self.c.model.path} has {key} {getattr(stored, key)}: the checkpoint "
                          f"decides the model's shape; set config.model.{key}=0 (or leave it out)")

  def mesh(self):
    m = self.c.mesh
    for k in ("data", "fsdp", "tensor"):
      self.check(f"mesh.{k}", isinstance(m[k], int) and (m[k] >= 1 or m[k] == -1),
                 "must be a positive int or -1 (all remaining devices)")
    self.check("mesh.data", [m.data, m.fsdp, m.tensor].count(-1) <= 1,
               "at most one of config.mesh.{data,fsdp,tensor} may be -1")

  def algorithm(self):
    self.one_of("train.algorithm", tuple(algorithms.ALGORITHMS))
    return algorithms.ALGORITHMS[self.c.train.algorithm].check_config(self.c)

  def env(self):
    c = self.c
    self.one_of("env.kind", tuple(environments.ENVIRONMENTS))
    self.one_of("env.sandbox", envs.BACKENDS)
    self.one_of("env.action_format", tuple(protocol.ACTION_FORMATS))
    if c.env.kind == "webshop":
      self.check("env.action_format", c.env.action_format == "tags",
                 "chooses how terminal agents write commands; WebShop has its own actions (set 'tags')")
      self.at_least("webshop.max_steps", 1)
      self.at_least("webshop.results_per_page", 1)
      self.at_least("webshop.num_products", 0)
      self.check("webshop.asin_length", 3 <= c.webshop.asin_length <= 10, "must be in [3, 10]")
      self.check("webshop.off_protocol_fraction", 0.0 <= c.webshop.off_protocol_fraction <= 1.0,
                 "must be in [0, 1]")
      self.check("warmstart.off_protocol_fraction", c.warmstart.off_protocol_fraction == 0.0,
                 "fences terminal commands and does nothing for WebShop; set "
                 "config.webshop.off_protocol_fraction instead")
      if c.webshop.data_path:
        self.check("webshop.data_path", os.path.isdir(c.webshop.data_path), "must be a directory")
    for key in ("env.families", "eval.probe_families", "warmstart.families"):
      value = self.given["config." + key]
      for fam in filter(None, (f.strip() for f in value.split(","))):
        self.check(key, fam in generator.FAMILIES,
                   f"{fam!r} is not a task family; known: {', '.join(generator.FAMILIES)}")
    if c.eval.probe_families.strip() or c.warmstart.families.strip():
      self.check("eval.probe_families", c.env.kind == "terminal",
                 "and config.warmstart.families name terminal task families (set them to '')")
    shifted = [f.strip() for f in c.env.shift_families.split(",") if f.strip()]
    for fam in shifted:
      self.check("env.shift_families", fam in generator.FAMILIES,
                 f"{fam!r} is not a task family; known: {', '.join(generator.FAMILIES)}")
    if shifted:
      self.check("env.shift_families", c.env.kind == "terminal",
                 "changes the generated terminal tasks' families, which only env.kind 'terminal' has")
      self.check("env.shift_at_update", isinstance(c.env.shift_at_update, int)
                 and 1 <= c.env.shift_at_update <= c.train.num_updates,
                 "must be an update of the run (1..config.train.num_updates) when "
                 "config.env.shift_families is set")
    else:
      self.check("env.shift_at_update", c.env.shift_at_update == 0,
                 "needs config.env.shift_families (the later mix); 0 = no shift")
    self.one_of("env.difficulty", (0, 1, 2, 3))
    for k in ("num_train_tasks", "num_heldout_tasks", "max_turns", "sandbox_workers"):
      self.at_least(f"env.{k}", 1)
    self.at_least("env.parse_error_penalty", 0.0)
    self.at_least("env.latency_median_s", 0.0)
    self.at_least("env.latency_sigma", 0.0)
    self.one_of("env.latency_per", ("episode", "command"))
    if c.env.latency_median_s:
      self.check("env.latency_median_s", c.env.kind == "terminal",
                 "adds sandbox latency, which only terminal tasks have (set it to 0 for WebShop)")

  def rollout(self, algorithm_settings):
    r = self.c.rollout
    for k in ("num_slots", "prefill_chunk", "max_new_tokens"):
      self.at_least(f"rollout.{k}", 1)
    for k in ("max_len", "page_size", "num_pages", "prefill_tokens", "prefill_hold", "decode_steps"):
      self.check(f"rollout.{k}", isinstance(r[k], int) and not isinstance(r[k], bool), "must be an int")
    self.at_least("rollout.page_size", 0)
    self.at_least("rollout.num_pages", 0)
    with errors.keyed(self.c, "rollout"):   # the engine's own rules
      engine.check_settings(**builders.engine_settings(self.c))
    self.at_least("rollout.temperature", 0.0)
    self.at_least("rollout.sandbox_steps", 0)
    self.check("rollout.top_p", 0.0 < r.top_p <= 1.0, "must be in (0, 1]")
    slices = algorithms.ALGORITHMS[self.c.train.algorithm].decodes_member_slices(algorithm_settings)
    self.check("rollout.switch_versions", not (r.switch_versions and slices),
               "needs per-row members: full-rank ES (es.mode = 'full') decodes in member slices")

  def schedule(self):
    c = self.c
    self.at_least("train.num_updates", 0)
    self.at_least("train.checkpoint_every", 1)
    self.at_least("train.keep_checkpoints", 1)
    self.at_least("train.eval_every", 0)
    self.at_least("train.transcripts_per_update", 0)
    self.at_least("train.transcript_chars", 100)
    self.one_of("train.tracker", TRACKERS)
    self.check("train.max_excluded_share", 0.0 <= c.train.max_excluded_share <= 1.0, "must be in [0, 1]")
    self.at_least("eval.num_tasks", 0)
    self.check("eval.num_tasks", c.eval.num_tasks <= c.env.num_heldout_tasks,
               "must be <= config.env.num_heldout_tasks")
    self.at_least("eval.seeds", 1)
    self.at_least("eval.temperature", 0.0)
    self.check("eval.drift", isinstance(c.eval.drift, bool), "must be a bool")
    self.at_least("eval.kl_transcripts", 0)
    self.at_least("eval.probe_tasks", 0)
    self.mc_probe()

  def mc_probe(self):
    c = self.c
    self.check("eval.mc_probe_file", isinstance(c.eval.mc_probe_file, str), "must be a string")
    path = mc_probe.resolve(c.eval.mc_probe_file)
    if path is None:
      return
    self.check("eval.mc_probe_file", c.eval.num_tasks >= 1,
               "is scored at each evaluation: it needs config.eval.num_tasks >= 1")
    self.check("eval.mc_probe_file", os.path.isfile(path),
               f"must be {mc_probe.BUNDLED!r} or a JSONL file of multiple-choice items")
    try:   # a few kB: read now, so a bad line costs milliseconds, not a run
      mc_probe.load_items(path)
    except ValueError as err:
      raise ConfigError(f"config.eval.mc_probe_file: {err}") from err

  def warmstart(self):
    c, w = self.c, self.c.warmstart
    self.check("warmstart.off_protocol_fraction", 0.0 <= w.off_protocol_fraction <= 1.0, "must be in [0, 1]")
    self.at_least("warmstart.steps", 0)
    if w.init_from:
      self.check("warmstart.init_from", os.path.isdir(os.path.join(w.init_from, "checkpoints", "0")),
                 "must be a run directory with a version-0 checkpoint")
    if w.steps > 0:
      self.at_least("warmstart.num_tasks", 1)
      self.at_least("warmstart.batch_size", 1)
      self.positive("warmstart.learning_rate")
      self.at_least("warmstart.seq_len", 16)
      self.check("warmstart.observation_weight", w.observation_weight >= 0.0, "must be >= 0")
      self.check("warmstart.steps", not c.model.path,
                 "supervised warm start is for randomly initialised models; unset config.model.path")
