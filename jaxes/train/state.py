"""The run state, and the one function that creates it: fresh start, resume and ``init_from``.

``RunState`` is everything a run carries from one update to the next, whatever its algorithm
(``jaxes.train.algorithms``): the algorithm's state (ES: params, optimizer state, run key,
version; GRPO: the learner state and the kept episodes of unconsumed groups), the parameters of
every version still in use (jobs of older versions may be in flight), the controller, the
evaluation history and timings. A checkpoint stores exactly that:

  items  ``<item>``      the algorithm's state (``Algorithm.checkpoint_item``: ``es``, ``learner``)
         ``old/<v>``     parameters of each older version still live
  host   ``controller``, ``evals``, ``timings``, ``old_versions``, ``config`` (the run's config,
         so a rerun with a changed config is told which key differs) and what the algorithm
         keeps besides its item (the algorithm's ``checkpoint_host``)

Full checkpoints are written every ``train.checkpoint_every`` updates. For an algorithm whose
update is a function of the state before it and its cohort (``algorithms.ReplaysUpdates``: ES),
every update in between appends a few-KB record to the update log (``update_log.py``): the
cohort it consumed, the controller's state after it and its metrics line; a resume restores the
newest checkpoint and replays the logged updates after it, bit for bit.

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

from jaxes.controller import Controller
from jaxes.controller.coevolve import Coevolution
from jaxes.errors import RunStateError
from jaxes.train import builders, checkpoint, coevolution, warmstart
from jaxes.train.algorithms import ReplaysUpdates
from jaxes.train.policy import load_policy
from jaxes.train.update_log import UpdateLog


@dataclasses.dataclass
class RunState:
  algorithm_state: Any                # the algorithm's own state (``Algorithm.init``)
  params_by_version: dict[int, Any]   # every version still needed, the current one included
  controller: Controller
  evals: list[dict]
  timings: dict[str, float]
  restored_from: int | None = None    # the checkpoint step this run resumed from
  replayed: list[dict] = dataclasses.field(default_factory=list)  # metrics of updates replayed from the log
  contexts: Coevolution | None = None  # co-evolved contexts (``coevolve.enabled``), else None
  # θ₀ on the devices, where every update reads it (``Capabilities.needs_initial_params``), else None
  initial_params: Any = None

  @property
  def version(self) -> int:
    return self.controller.version

  def advance(self, new_state, params, keep: set[int]) -> None:
    """The state after an update: ``new_state`` (whose current parameters are ``params``)
    current, only the versions in ``keep`` retained besides it."""
    self.algorithm_state = new_state
    self.params_by_version[self.version] = params
    for v in [v for v in self.params_by_version if v not in keep | {self.version}]:
      del self.params_by_version[v]


@dataclasses.dataclass(frozen=True)
class Parts:
  """What a run is made of besides its state (built once per process by ``builders``)."""
  tokenizer: Any
  model: builders.Model
  train_tasks: list
  heldout_tasks: list
  shift: builders.TaskShift | None = None   # a changing environment (env.shift_families)
  probe_tasks: list = dataclasses.field(default_factory=list)   # eval.probe_families' held-out tasks

  def train_task(self, job):
    """The task of a training job: its index into the mix in force for the job's version."""
    if self.shift is not None and job.version >= self.shift.at_update:
      return self.shift.train_tasks[job.task]
    return self.train_tasks[job.task]


# -- checkpoints ----------------------------------------------------------------------------------
def save(ckpt: checkpoint.Checkpointer, state: RunState, config, algorithm) -> None:
  old = sorted(v for v in state.params_by_version if v != state.version)
  items = {algorithm.checkpoint_item: algorithm.item(state.algorithm_state),
           **{f"old/{v}": state.params_by_version[v] for v in old}}
  host = {"controller": state.controller.state_dict(), "evals": state.evals,
          "timings": state.timings, "old_versions": old, "config": config_values(config),
          **algorithm.checkpoint_host(state.algorithm_state)}
  if state.contexts is not None:
    host["contexts"] = state.contexts.state_dict()
  ckpt.save(state.version, items, host)


UPDATE_LOG = "update_log"


def log_record(state: RunState, results, metrics_record: dict) -> dict:
  """The update-log record of the update that produced ``state``'s version."""
  record = {"version": state.version, "results": [list(r) for r in results],
            "controller": state.controller.state_dict(), "metrics": metrics_record}
  if state.contexts is not None:
    record["contexts"] = state.contexts.state_dict()
  return record


def replay(state: RunState, records: list[dict], algorithm_for) -> list[dict]:
  """Applies logged updates to a restored state (the same jitted update on the same inputs as
  the run that logged them, ``algorithm_for(version)``'s); returns their metrics lines."""
  for record in records:
    algorithm = algorithm_for(record["version"])
    new_state = algorithm.replay(state.algorithm_state, [tuple(r) for r in record["results"]],
                                 record["version"], initial_params=state.initial_params)
    state.controller = Controller.from_state_dict(record["controller"])
    if state.contexts is not None:
      state.contexts = Coevolution.from_state_dict(state.contexts.library, record["contexts"])
    state.advance(new_state, algorithm.params(new_state), keep=set(state.controller.live_versions()))
    if "eval" in record["metrics"]:
      state.evals.append(record["metrics"]["eval"])
  return [r["metrics"] for r in records]


def config_values(config) -> dict:
  return json.loads(config.to_json_best_effort())


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


def _restore(ckpt: checkpoint.Checkpointer, algorithm, config) -> RunState:
  abstract = algorithm.abstract_state()
  step, item, params, host = restore_items(ckpt, algorithm.checkpoint_item, abstract,
                                           abstract.params, config)
  algorithm_state = algorithm.restored(item, host)
  controller = Controller.from_state_dict(host["controller"])
  params[controller.version] = algorithm.params(algorithm_state)
  return RunState(algorithm_state, params, controller, host["evals"], host.get("timings", {}),
                  restored_from=step, contexts=coevolution.restored(config, host.get("contexts")))


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
def initial_state(config, workdir: str, parts: Parts, algorithm, ckpt: checkpoint.Checkpointer,
                  update_log: UpdateLog, transcripts: list[list[dict]], log=print,
                  algorithm_for=None) -> RunState:
  """The newest checkpoint's state, or a fresh one: version-0 parameters from the warm start on
  ``transcripts``, from ``warmstart.init_from``'s version 0, from ``model.path`` or random, made
  into ``algorithm``'s state (placed where it lives, and restored into the same places).
  ``algorithm_for(version)``: the algorithm the logged update to ``version`` was made with (the
  config in force then; default: ``algorithm`` for every one)."""
  if ckpt.steps():
    state = _restore(ckpt, algorithm, config)
    if algorithm.needs_initial_params:
      state.initial_params = load_initial_params(ckpt, algorithm)
    if isinstance(algorithm, ReplaysUpdates):
      state.replayed = replay(state, update_log.replay_after(state.restored_from),
                              algorithm_for or (lambda version: algorithm))
    log(f"resumed from checkpoint at version {state.restored_from}"
        + (f" and {len(state.replayed)} logged updates" if state.replayed else ""))
    return state
  update_log.truncate_to(0)   # a fresh start: records of an earlier run are set aside
  params, timings = version_zero_params(config, parts, transcripts, log)
  algorithm_state = algorithm.init(params)
  controller = Controller(algorithm.controller_config_of(config), num_tasks=len(parts.train_tasks))
  return RunState(algorithm_state, {0: algorithm.params(algorithm_state)}, controller, [], timings,
                  contexts=coevolution.from_config(config),
                  initial_params=(algorithm.params(algorithm_state) if algorithm.needs_initial_params
                                  else None))


def load_initial_params(ckpt: checkpoint.Checkpointer, algorithm):
  """θ₀: the parameters of the version-0 checkpoint (kept for good), placed where the run keeps
  its parameters (the ``params`` of ``algorithm.abstract_state()``, which every algorithm's item
  has). A ``RunStateError`` (one line) when step 0 cannot be read."""
  ckpt.wait()   # a fresh run's step 0 may still be being written
  try:
    return ckpt.restore_item(0, algorithm.checkpoint_item, {"params": algorithm.abstract_state().params},
                             partial=True)["params"]
  except checkpoint.CheckpointError as e:
    raise RunStateError(f"θ₀ (version 0) is needed for es.anchor and the drift measures and cannot be "
                        f"read: {e}") from None


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
  m = parts.model.config
  source = (f"config.model.path={config.model.path}" if config.model.path else
            f"a random initialisation of preset {config.model.preset!r}")
  log(f"model: {source} ({m.architecture.removesuffix('ForCausalLM')}, {m.num_layers} layers, hidden {m.hidden_size}, intermediate "
      f"{m.intermediate_size}, heads {m.num_heads}/{m.num_kv_heads}, vocab {m.vocab_size}, {m.param_dtype})")
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
  return Parts(tokenizer, builders.build_model(config, len(tokenizer)), builders.training_tasks(config),
               builders.heldout_tasks(config), shift=builders.task_shift(config),
               probe_tasks=builders.probe_tasks(config))
