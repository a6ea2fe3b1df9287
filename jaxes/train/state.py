"""The run state, and the one function that creates it: fresh start, resume and ``init_from``.

``RunState`` is everything a run carries from one update to the next: the ES state, the
parameters of every version still in use (jobs of older versions may be in flight), the
controller, the evaluation history and timings. A checkpoint stores exactly that:

  items  ``es``          the ES state (params, optimizer state, run key, version)
         ``old/<v>``     parameters of each older version still live
  host   ``controller``, ``evals``, ``timings``, ``old_versions`` and ``config`` (the run's config,
         so a rerun with a changed config is told which key differs)

Full checkpoints are written every ``train.checkpoint_every`` updates; every update in between
appends a few-KB record to the update log (``update_log.py``): the cohort it consumed, the
controller's state after it and its metrics line. The ES state after an update is a function of
the state before it and its cohort, so a resume restores the newest checkpoint and replays the
logged updates after it, bit for bit.

``initial_state`` restores the newest checkpoint when the run directory has one. A checkpoint
that does not match the config stops the run before any compute, naming the leaf and the config
key that differs; one that is corrupt is skipped with a warning; if none can be restored the run
stops rather than start over (``--restart`` or a new workdir starts fresh).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax

from jaxes import distributed, es, sharding
from jaxes.controller import Controller
from jaxes.train import builders, checkpoint, multihost, warmstart
from jaxes.train.errors import RunStateError
from jaxes.train.policy import load_policy
from jaxes.train.update_log import UpdateLog


@dataclasses.dataclass
class RunState:
  es: es.ESState
  params_by_version: dict[int, Any]   # every version still needed, the current one included
  controller: Controller
  evals: list[dict]
  timings: dict[str, float]
  restored_from: int | None = None    # the checkpoint step this run resumed from
  replayed: list[dict] = dataclasses.field(default_factory=list)  # metrics of updates replayed from the log

  @property
  def version(self) -> int:
    return int(self.es.version)

  def advance(self, new_es: es.ESState, keep: set[int]) -> None:
    """The state after an update: ``new_es`` current, only the versions in ``keep`` retained."""
    self.es = new_es
    self.params_by_version[self.version] = new_es.params
    for v in [v for v in self.params_by_version if v not in keep | {self.version}]:
      del self.params_by_version[v]


@dataclasses.dataclass(frozen=True)
class Parts:
  """What a run is made of besides its state (built once per process by ``builders``)."""
  tokenizer: Any
  model: builders.Model
  strategy: es.Strategy
  train_tasks: list
  heldout_tasks: list


# -- checkpoints ----------------------------------------------------------------------------------
def save(ckpt: checkpoint.Checkpointer, state: RunState, config) -> None:
  old = sorted(v for v in state.params_by_version if v != state.version)
  items = {"es": state.es, **{f"old/{v}": state.params_by_version[v] for v in old}}
  host = {"controller": state.controller.state_dict(), "evals": state.evals,
          "timings": state.timings, "old_versions": old, "config": config_values(config)}
  ckpt.save(state.version, items, host)


UPDATE_LOG = "update_log"


def log_record(state: RunState, results, metrics_record: dict) -> dict:
  """The update-log record of the update that produced ``state``'s version."""
  return {"version": state.version, "results": [list(r) for r in results],
          "controller": state.controller.state_dict(), "metrics": metrics_record}


def replay(state: RunState, records: list[dict], strategy: es.Strategy) -> list[dict]:
  """Applies logged updates to a restored state (the same jitted update on the same inputs as
  the run that logged them); returns their metrics lines."""
  for record in records:
    new_es, _ = strategy.update(state.es, [tuple(r) for r in record["results"]])
    if int(new_es.version) != record["version"]:
      raise RunStateError(f"update log: replaying the update to version {record['version']} gave "
                          f"version {int(new_es.version)}")
    state.controller = Controller.from_state_dict(record["controller"])
    state.advance(new_es, keep=set(state.controller.live_versions()))
    if "eval" in record["metrics"]:
      state.evals.append(record["metrics"]["eval"])
  return [r["metrics"] for r in records]


def config_values(config) -> dict:
  return json.loads(config.to_json_best_effort())


def abstract_es_state(parts: Parts, shardings=None) -> es.ESState:
  """The ES state's shapes and dtypes (nothing allocated), each array leaf placed in its
  sharding if ``shardings`` (a matching pytree) is given: the target of a restore."""
  shapes = jax.eval_shape(lambda p: parts.strategy.init(p, jax.random.key(0)), parts.model.abstract_params)
  if shardings is None:
    return shapes
  return sharding.abstract(shapes, shardings)


def es_shardings(parts: Parts, mesh):
  """The ES state's shardings on ``mesh`` (``multihost.es_state_shardings``); None without one."""
  return None if mesh is None else multihost.es_state_shardings(abstract_es_state(parts), mesh, parts.model.config)


def restore_items(ckpt: checkpoint.Checkpointer, name: str, abstract, abstract_params, config
                  ) -> tuple[int, Any, dict[int, Any], dict]:
  """The newest restorable checkpoint of a run: its step, the item ``name`` (restored into
  ``abstract``'s shapes, dtypes and shardings), the parameters of each older version still live
  (items ``old/<v>``, into ``abstract_params``) by version, and the host state. Shared by every
  trainer. A checkpoint that does not match ``config`` or none that can be restored is a
  ``RunStateError`` (one line: the differing config keys, and what to do)."""
  def target(host):
    return {name: abstract, **{f"old/{v}": abstract_params for v in host["old_versions"]}}

  try:
    step, items, host = ckpt.restore(target)
  except checkpoint.CheckpointMismatch as e:
    stored = ckpt.restore_host(e.step).get("config", {})
    raise RunStateError(f"{e}; {config_difference(stored, config_values(config))}: revert it, or "
                        f"start fresh with --restart or a new --workdir") from None
  except checkpoint.NoRestorableCheckpoint as e:
    raise RunStateError(str(e)) from None
  old = {int(k.split("/", 1)[1]): v for k, v in items.items() if k.startswith("old/")}
  return step, items[name], old, host


def _restore(ckpt: checkpoint.Checkpointer, parts: Parts, config, shardings=None) -> RunState:
  abstract = abstract_es_state(parts, shardings)
  step, es_state, params, host = restore_items(ckpt, "es", abstract, abstract.params, config)
  es_state = dataclasses.replace(es_state, version=int(es_state.version))
  params[int(es_state.version)] = es_state.params
  return RunState(es_state, params, Controller.from_state_dict(host["controller"]), host["evals"],
                  host.get("timings", {}), restored_from=step)


def config_difference(stored: dict, current: dict) -> str:
  """``config.model.intermediate_size was 384 there, is 512 here`` for every key that differs."""
  def flat(d, prefix="config"):
    out = {}
    for k, v in d.items():
      out.update(flat(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v})
    return out
  a, b = flat(stored), flat(current)
  diffs = [f"{k} was {a.get(k)!r} there, is {b.get(k)!r} here" for k in sorted(set(a) | set(b))
           if a.get(k) != b.get(k)]
  return "; ".join(diffs) if diffs else "no config key differs (the checkpoint comes from other code)"


# -- the initial state ----------------------------------------------------------------------------
def initial_state(config, workdir: str, parts: Parts, ckpt: checkpoint.Checkpointer,
                  update_log: UpdateLog, transcripts: list[list[dict]], log=print,
                  place=None, replay_strategy: es.Strategy | None = None) -> RunState:
  """The newest checkpoint's state, or a fresh one: version-0 parameters from the warm start on
  ``transcripts``, from ``warmstart.init_from``'s version 0, from ``model.path`` or random.
  ``place``: the mesh the ES state lives on, in the rule table's shardings (``es_shardings``),
  restored into them too; None leaves arrays where they are made. ``replay_strategy``: the
  strategy the logged updates were made with, when the config changed since (default: this one)."""
  shardings = es_shardings(parts, place)
  if ckpt.steps():
    state = _restore(ckpt, parts, config, shardings)
    state.replayed = replay(state, update_log.replay_after(state.restored_from),
                            replay_strategy or parts.strategy)
    log(f"resumed from checkpoint at version {state.restored_from}"
        + (f" and {len(state.replayed)} logged updates" if state.replayed else ""))
    return state
  update_log.truncate_to(0)   # a fresh start: records of an earlier run are set aside
  params, timings = version_zero_params(config, parts, transcripts, log)
  es_state = parts.strategy.init(params, jax.random.key(config.seed))
  if shardings is not None:
    es_state = distributed.place(es_state, shardings)
  controller = Controller(builders.controller_config(config), num_tasks=len(parts.train_tasks))
  return RunState(es_state, {0: es_state.params}, controller, [], timings)


def version_zero_params(config, parts: Parts, transcripts: list[list[dict]], log=print
                        ) -> tuple[Any, dict[str, float]]:
  """A fresh run's version-0 parameters (``warmstart.init_from``'s version 0, or ``model.path``
  or a random initialisation, then the supervised warm start on ``transcripts`` if configured)
  and the time the warm start took. Shared by every trainer, so ES and GRPO start alike."""
  if config.warmstart.init_from:
    params = load_policy(config.warmstart.init_from, version=0).params
    log(f"initial parameters from {config.warmstart.init_from} (version 0)")
    return params, {}
  params, timings = builders.initial_params(config, parts.model), {}
  if config.warmstart.steps:
    t = time.perf_counter()
    w = config.warmstart
    tokens, weights = warmstart.encode(parts.tokenizer, transcripts, w.seq_len, w.observation_weight)
    params, _ = warmstart.train(parts.model.graphdef, params, tokens, weights, steps=w.steps,
                                batch_size=w.batch_size, learning_rate=w.learning_rate,
                                seed=config.seed, log=log)
    timings["warmstart_s"] = time.perf_counter() - t
  return params, timings


def needs_transcripts(config, workdir: str, resuming: bool) -> bool:
  """Oracle transcripts are made only for a warm start that will run or a tokenizer to build."""
  warm = bool(config.warmstart.steps) and not resuming and not config.warmstart.init_from
  return warm or builders.tokenizer_dir(config, workdir) is None


def build_parts(config, workdir: str, transcripts: list[list[dict]], log=print) -> Parts:
  path = builders.tokenizer_dir(config, workdir)
  tokenizer = (builders.load_tokenizer(path) if path is not None
               else builders.build_tokenizer(config, workdir, transcripts, log))
  return Parts(tokenizer, builders.build_model(config, len(tokenizer)), builders.build_strategy(config), builders.training_tasks(config),
               builders.heldout_tasks(config))
