"""The parts of a training run, one builder each, from the config alone (plus what a part needs).

Nothing here decides between a fresh start and a resume (that is ``jaxes.train.state``), and
nothing here loops (that is the trainer): a second loop (GRPO) or a multi-process loop reuses
these builders as they are.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import jax
from flax import nnx
from ml_collections import config_dict

from jaxes import sharding, tokenization
from jaxes.envs import protocol
from jaxes.envs import environments
from jaxes.envs.sandboxes.latency import LatencySandbox
from jaxes.errors import ConfigError
from jaxes.models import qwen2, sources
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeRunner
from jaxes.rollout.policy_bank import PolicyBank
from jaxes.train import coevolution

# -- tasks and episodes (each environment kind's own, from ``environments``) --------------------
def make_tasks(config, split: str, n: int, start: int = 0) -> list:
  """Tasks (terminal tasks, WebShop goals) ``start .. start + n - 1`` of a split."""
  return environments.environment(config).make_tasks(config, split, n, start)


def training_tasks(config) -> list:
  """The tasks a run trains on: the training split after the warm start's own tasks, so it
  learns on tasks the warm-started policy was never taught."""
  return make_tasks(config, "train", config.env.num_train_tasks, start=config.warmstart.num_tasks)


def heldout_tasks(config) -> list:
  return make_tasks(config, "heldout", config.env.num_heldout_tasks)


@dataclasses.dataclass(frozen=True)
class TaskShift:
  """A changing environment (``env.shift_families``): training episodes of versions >=
  ``at_update`` run ``train_tasks`` (the same count, of the later mix) in place of the first
  mix's; evaluation also runs ``heldout_tasks``, the later mix's held-out split."""
  at_update: int
  train_tasks: list
  heldout_tasks: list


def task_shift(config) -> TaskShift | None:
  """The later task mix: the config with ``env.families = env.shift_families`` (None: no shift)."""
  if not config.env.shift_families:
    return None
  later = config.copy_and_resolve_references()
  later.env.families = config.env.shift_families
  return TaskShift(config.env.shift_at_update, training_tasks(later), heldout_tasks(later))


def warmstart_tasks(config) -> list:
  return make_tasks(_with_families(config, config.warmstart.families), "train",
                    max(config.warmstart.num_tasks, 1))


def probe_tasks(config) -> list:
  """Held-out tasks of ``eval.probe_families`` (none when empty): off-task probes."""
  if not config.eval.probe_families.strip():
    return []
  return make_tasks(_with_families(config, config.eval.probe_families), "heldout",
                    config.eval.probe_tasks or config.eval.num_tasks)


def _with_families(config, families: str):
  """``config`` with ``env.families`` = ``families`` (as it is when ``families`` is empty)."""
  if not families.strip():
    return config
  config = config.copy_and_resolve_references()
  config.env.families = families
  return config


def system_prompt(config) -> str:
  return config.env.system_prompt or environments.environment(config).default_system_prompt(config)


def reply_parses(config) -> Callable[[str], bool]:
  """Whether a model reply names an action the environment's protocol accepts."""
  return environments.environment(config).parses(config)


def build_sandbox(config):
  """The episode backend: a sandbox for terminal tasks, the in-process WebShop backend."""
  return environments.environment(config).build_backend(config)


def with_latency(config, sandbox):
  """``sandbox`` with the configured heavy-tailed latency (``env.latency_*``), or as it is."""
  e = config.env
  if not e.latency_median_s:
    return sandbox
  return LatencySandbox(sandbox, e.latency_median_s, e.latency_sigma, per=e.latency_per, seed=config.seed)


def oracle_transcripts(config, sandbox) -> list[list[dict]]:
  """The warm start's oracle transcripts (only passing episodes)."""
  return environments.environment(config).oracle_transcripts(config, warmstart_tasks(config), sandbox,
                                                             episode_factory(config))


def episode_factory(config) -> Callable[[Any, Any], protocol.Episode]:
  """``make_episode(task, handle)``: the agent protocol with the config's reward settings."""
  return environments.environment(config).make_episode(config, system_prompt(config))


# -- tokenizer ------------------------------------------------------------------------------------
def tokenizer_dir(config, workdir: str) -> str | None:
  """The directory the run's tokenizer loads from, or None when it has to be built (a fresh run
  of a randomly initialised model without a tokenizer of its own)."""
  c = config
  if c.tokenizer.path or c.model.path:
    return c.tokenizer.path or c.model.path
  if c.warmstart.init_from:
    return os.path.join(c.warmstart.init_from, "tokenizer")
  own = os.path.join(workdir, "tokenizer")
  return own if os.path.isdir(own) and os.listdir(own) else None


def build_tokenizer(config, workdir: str, transcripts: list[list[dict]], log=print):
  """A small byte-level BPE tokenizer (saved to ``workdir/tokenizer``) from the system prompt,
  the protocol's fixed texts (and co-evolution's prompt pieces), the training instructions and
  the warm start's transcripts."""
  repeated = environments.environment(config).tokenizer_texts(config)
  texts = 64 * [system_prompt(config), *repeated, *coevolution.pieces(config)]
  texts += [t.instruction for t in training_tasks(config)]
  for messages in transcripts:
    texts += [m["content"] for m in messages[1:]]
  log(f"building a {config.tokenizer.vocab_size}-token BPE tokenizer from {len(texts)} texts")
  return tokenization.build_tokenizer(texts, config.tokenizer.vocab_size, os.path.join(workdir, "tokenizer"))


def load_tokenizer(path: str):
  """A tokenizer directory's, or a model source's (``jaxes.models.sources``: a .gguf file's)."""
  return sources.load_tokenizer(path)


def stop_ids(tokenizer) -> tuple[list[int], int]:
  """(ids that end a turn, the ``<|im_end|>`` id)."""
  im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
  stop = [i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
          if isinstance(i, int) and i >= 0]
  return stop, im_end


# -- model ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Model:
  """A model's configuration, graph and parameter shapes (nothing allocated)."""
  config: qwen2.Qwen2Config
  graphdef: nnx.GraphDef
  abstract_params: nnx.State


def model_config(config, vocab_size: int) -> qwen2.Qwen2Config:
  """The model's configuration: ``model.path``'s (``jaxes.models.sources``), or the Qwen2 preset
  with the config's size overrides (0 = the preset's) and ``vocab_size`` tokens."""
  c = config.model
  if c.path:
    stored = sources.read_config(c.path)
    return qwen2.Qwen2Config.from_hf_dict(stored, param_dtype=c.param_dtype, dtype=c.dtype)
  overrides = {k: c[k] for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                 "num_kv_heads") if c[k]}
  return qwen2.Qwen2Config.preset(
      c.preset, vocab_size=vocab_size, dtype=c.dtype, param_dtype=c.param_dtype,
      max_position_embeddings=max(config.rollout.max_len, config.warmstart.seq_len), **overrides)


def vocab_size(config, tokenizer_size: int | None = None) -> int:
  """The model's vocabulary, decided here alone: ``model.vocab_size`` where set, else the tokenizer's
  size; with no tokenizer at hand (the preflight, measure) the preset's, as its
  checkpoint's tokenizer has it (``model.path``: the checkpoint's config decides the model's)."""
  if config.model.vocab_size:
    return config.model.vocab_size
  if tokenizer_size is not None:
    return tokenizer_size
  return qwen2.PRESETS.get(config.model.preset, {}).get("vocab_size") or config.tokenizer.vocab_size


def build_model(config, tokenizer_size: int | None = None) -> Model:
  """The model's graph and abstract parameters for a tokenizer of ``tokenizer_size`` tokens
  (None: no tokenizer at hand, ``vocab_size``)."""
  vocab = vocab_size(config, tokenizer_size)
  if not config.model.path and tokenizer_size is not None and vocab < tokenizer_size:
    raise ConfigError(f"config.model.vocab_size: {vocab} < the tokenizer's {tokenizer_size} tokens")
  cfg = model_config(config, vocab)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
  return Model(cfg, graphdef, abstract)


def mesh_shape(config, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with a -1 axis filled from ``num_devices``."""
  sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f"config.mesh: {num_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) > num_devices:
    raise ConfigError(f"config.mesh: data x fsdp x tensor = {math.prod(sizes)} exceeds the "
                      f"{num_devices} available devices")
  return tuple(sizes)


def build_mesh(config):
  devices = jax.devices()
  shape = mesh_shape(config, len(devices))
  return sharding.make_mesh(*shape, devices=devices[:math.prod(shape)])


def initial_params(config, model: Model):
  """Weights before any training: ``model.path``'s checkpoint (placed in its shardings on the
  config's mesh), or a random initialisation from the seed."""
  if config.model.path:
    _, _, params = sources.load(config.model.path, mesh=build_mesh(config),
                           param_dtype=config.model.param_dtype, dtype=config.model.dtype)
    return params
  _, params = nnx.split(qwen2.Qwen2ForCausalLM(model.config, rngs=nnx.Rngs(config.seed)), nnx.Param)
  return params


# -- rollout --------------------------------------------------------------------------------------
def build_engine(config, model: Model, tokenizer, policy: PolicyBank | None = None, mesh=None,
                 abstract: bool = False) -> Engine:
  """The rollout engine; ``policy``: what its rows decode with, the algorithm's bank (None: every
  row runs its version's unperturbed policy, as GRPO's do; ``es_policy_bank``: ES's members).
  ``mesh``: where its arrays live (None: one device). ``abstract``: shapes and shardings only,
  for compiling its programs ahead of time (the preflight); ``tokenizer`` may then be None (no
  stop ids: the programs do not depend on them)."""
  stop, im_end = stop_ids(tokenizer) if tokenizer is not None else ([], 0)
  return Engine(model.graphdef, model.config, num_slots=config.rollout.num_slots, stop_ids=stop,
                im_end_id=im_end, policy=policy, seed=config.seed, mesh=mesh, abstract=abstract,
                **engine_settings(config))


def engine_settings(config) -> dict:
  """``Engine``'s settings from the ``rollout`` block, which ``engine.check_settings`` rules on
  (0 = unset: ``prefill_tokens`` a chunk; ``page_size`` and ``num_pages`` the dense cache)."""
  r = config.rollout
  return dict(max_len=r.max_len, max_new_tokens=r.max_new_tokens, prefill_chunk=r.prefill_chunk,
              prefill_tokens=int(r.prefill_tokens) or None, page_size=int(r.page_size) or None,
              num_pages=int(r.num_pages) or None, prefill_hold=int(r.prefill_hold),
              decode_steps=int(r.decode_steps))


def build_runner(config, engine: Engine, tokenizer, sandbox, owned=None, exchange=None) -> EpisodeRunner:
  """``owned``/``exchange``: a multi-process run's sandbox split (``EpisodeRunner``)."""
  return EpisodeRunner(engine, tokenizer, sandbox, make_episode=episode_factory(config),
                       workers=config.env.sandbox_workers, sandbox_steps=config.rollout.sandbox_steps,
                       owned=owned, exchange=exchange,
                       switch_versions=bool(config.rollout.switch_versions))


def config_dict_of(config: config_dict.ConfigDict) -> dict:
  """The config as plain JSON-able values (what checkpoints and run directories record)."""
  return config.to_dict()
