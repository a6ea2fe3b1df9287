"""The trainer: a short loop over the parts ``builders`` makes, the state ``state`` keeps and
the algorithm (``jaxes.train.algorithms``: ES, GRPO) ``train.algorithm`` names.

One loop on the host: hand free slots the controller's jobs, advance every episode by one engine
step (sandbox work runs on worker threads meanwhile), report finished episodes, and apply every
update the controller declares due (its cohort of ``(version, member, fitness)`` results, stale
ones included) through the algorithm, handing the engine's policy bank what the update gives the
decode side. After each update the hooks run: held-out evaluation every ``eval_every``, the
update-log record, the metrics line, the observers, a checkpoint every ``checkpoint_every``, the
progress bar, the caller's callback.

Measurements and records beside training (drift, the probes, other held-out task sets, sampled
transcripts, the tracker, the plot, the report page, co-evolution's parents) are observers
(``jaxes.train.observers``), told of each result, update and evaluation in one list.

Resume: rerun the same command with the same ``--workdir`` (``state.initial_state``). Token
sampling is keyed by job (by antithetic pair with common random numbers), and the controller
reissues its in-flight jobs, so a resumed run decodes exactly what the interrupted one would have.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Callable

from ml_collections import config_dict

from jaxes.envs.sandboxes.sandbox import Sandbox, SandboxError
from jaxes.envs.tasks import oracle
from jaxes.envs.tasks.task import unsafe_task_names
from jaxes.train import (algorithms, builders, checkpoint, coevolution, compile_cache, config_history,
                         evaluation, metrics, multihost, observers, precompile)
from jaxes.train.algorithms import ReplaysUpdates, UpdateContext
from jaxes.train.config import validate
from jaxes.train.hooks import Hook, UpdateInfo, run_hooks
from jaxes.train.state import (UPDATE_LOG, RunState, build_parts, initial_state, load_initial_params,
                               log_record, needs_transcripts, save)
from jaxes.train.update_log import UpdateLog

class Trainer:
  """``Trainer(config, workdir).run()`` trains with the algorithm ``train.algorithm`` names
  (``jaxes.train.algorithms``). ``sandbox`` overrides the configured backend (it is shut
  down at the end either way); ``on_update(record)`` is called after each update's metrics line;
  ``hooks`` run after the built-in ones."""

  def __init__(self, config: config_dict.ConfigDict, workdir: str, *, sandbox=None,
               on_update: Callable[[dict], None] | None = None, hooks: list[Hook] = (),
               log: Callable[[str], None] = print, allow_config_change: bool = False,
               write_report: Callable[[str], object] | None = None):
    self.spec = validate(config)   # the typed objects the config builds, built once
    self.config, self.workdir, self.log = config, os.path.abspath(workdir), log
    self.allow_config_change = allow_config_change
    self._sandbox = sandbox
    # The report page (``train.report``) is a run tool's (jaxes.run_tools.report, a layer above
    # the trainer): ``python -m jaxes.train`` hands its writer in; without one no page is written.
    self._report_writer = write_report
    self._extra_hooks = list(hooks) + ([Hook(lambda info: on_update(info.record))] if on_update else [])

  # -- set-up ---------------------------------------------------------------------------------
  def run(self) -> dict:
    c = self.config
    self.host = host = multihost.host(c)   # the mesh; in a multi-process run, this process's part
    if not host.primary:
      self.log = lambda message: None       # the primary's lines are every process's (same state)
    os.makedirs(self.workdir, exist_ok=True)
    # Read and check before writing anything: a refused rerun leaves the directory as it was.
    steps_dir = os.path.join(self.workdir, "checkpoints")
    resuming = os.path.isdir(steps_dir) and any(n.isdigit() for n in os.listdir(steps_dir))
    self._changes = changes = (config_history.check_rerun(self.workdir, c, self.allow_config_change)
                               if resuming else [])
    if host.primary and (not resuming or config_history.original(self.workdir) is None):
      config_history.write_original(self.workdir, c)
    # Before the first compile: a rerun (or another host of the pod) reads the programs back.
    self.log(f"compilation cache: {compile_cache.enable(self.workdir)}")
    with contextlib.ExitStack() as stack:
      sandbox = self._sandbox or builders.build_sandbox(c)
      stack.callback(sandbox.shutdown)
      ckpt = checkpoint.Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=c.train.keep_checkpoints)
      stack.callback(ckpt.close)
      transcripts = multihost.shared(host, lambda: self._transcripts(sandbox, resuming=bool(ckpt.steps())))
      self.parts = multihost.primary_first(host, "tokenizer",
                                           lambda: build_parts(c, self.workdir, transcripts, self.log))
      self.algorithm = algorithms.build(c, self.parts, host.mesh, self.spec.algorithm_settings)
      if isinstance(sandbox, Sandbox):   # refuses here, not one SANDBOX_ERROR per task later
        sandbox.check_verifier(self.parts.train_tasks + self.parts.heldout_tasks)
      update_log = UpdateLog(os.path.join(self.workdir, UPDATE_LOG))
      stack.callback(update_log.close)
      self.state = self._initial_state(ckpt, update_log, transcripts)
      self._set_aside_skipped(ckpt)
      self._contexts = coevolution.ContextEpisodes(c, builders.system_prompt(c))   # coevolve.enabled
      self._contexts.check(self.state.contexts, self.parts.tokenizer)
      if changes and host.primary:
        config_history.record(self.workdir, self.state.version, changes)
        self.log(f"config changed from version {self.state.version} on (recorded in "
                 f"{config_history.HISTORY}): " + "; ".join(map(str, changes)))
      self._in_force = config_history.changed_in_force(self.workdir, c)
      self.observers = observers.build(
          c, self.workdir, self.parts, self.algorithm, run_state=self.state, primary=host.primary,
          initial_params=lambda: self._initial_params(ckpt),
          im_end=builders.stop_ids(self.parts.tokenizer)[1], write_report=self._report_writer, log=self.log)
      stack.callback(self.observers.close)
      engine = self.algorithm.build_engine(self.state.algorithm_state, host.mesh)
      self._decoding = engine.policy   # where an update's version step goes
      precompile.warm_up(precompile.run_programs(engine, self.algorithm, self.state.algorithm_state),
                         c.train.compile_jobs, self.log, progress=c.train.progress_bar and host.primary)
      # Oracle transcripts above ran on the bare sandbox; training and evaluation pay the latency.
      self.runner = builders.build_runner(c, engine, self.parts.tokenizer,
                                          builders.with_latency(c, sandbox), owned=host.owned,
                                          exchange=host.exchange)
      stack.callback(self.runner.close)
      writer = (metrics.MetricsWriter(self.workdir, resume_version=self.state.version) if host.primary
                else multihost.NullWriter())
      stack.callback(writer.close)
      if host.primary:
        writer.backfill(self.state.replayed)   # lines a kill cut off after their update was logged
      self._progress = progress = self._progress_bar()
      stack.callback(progress.close)
      evaluates = bool(c.eval.num_tasks)
      hooks = [Hook(self._eval_hook, every=c.train.eval_every if evaluates else 0, at_final=evaluates),
               Hook(lambda info: self._log_update(update_log, info)),
               Hook(lambda info: writer.write(info.record)),
               Hook(self.observers.after_line),
               Hook(lambda info: self._save(ckpt), every=c.train.checkpoint_every, at_final=True),
               Hook(lambda info: progress.update(info.record)),
               *self._extra_hooks]
      return self._train(ckpt, writer, hooks)

  def _initial_state(self, ckpt, update_log: UpdateLog, transcripts) -> RunState:
    # Each logged update is replayed under the config in force when it was made (the original
    # plus the history up to it; this rerun's own change is recorded only after the restore).
    built = {}

    def algorithm_for(version: int):
      recorded = config_history.in_force(self.workdir, version)
      if recorded is None or not [c for c in config_history.differences(recorded, self.config)
                                  if c.key not in config_history.free_keys(recorded)]:
        return self.algorithm
      key = json.dumps(recorded, sort_keys=True)
      if key not in built:
        built[key] = algorithms.build(config_dict.ConfigDict(config_history.unflat(recorded)),
                                      self.parts, self.host.mesh)
      return built[key]

    return initial_state(self.config, self.workdir, self.parts, self.algorithm, ckpt, update_log,
                         transcripts, self.log, algorithm_for=algorithm_for)

  def _set_aside_skipped(self, ckpt) -> None:
    """After a resume that skipped corrupt newer checkpoints: they are moved to
    ``checkpoints_superseded/`` and the version the update log replayed to is written, so that
    ``load_policy``, ``export``, ``compare`` and ``summary.json`` all name the version the run holds
    (not the corrupt one, nor the older one a reader would fall back to)."""
    restored = self.state.restored_from
    skipped = [s for s in ckpt.steps() if restored is not None and s > restored]
    if not skipped:
      return
    ckpt.set_aside(skipped[0], "unreadable, so set aside:")
    if self.state.version > restored:
      self._save(ckpt)
    self.log(f"checkpoint step(s) {skipped} could not be read: moved to {ckpt.superseded_directory}"
             + (f"; version {self.state.version}, replayed from the update log, written again"
                if self.state.version > restored else ""))

  def _save(self, ckpt) -> None:
    save(ckpt, self.state, self.config, self.algorithm)

  def _current_params(self):
    return self.algorithm.params(self.state.algorithm_state)

  def _initial_params(self, ckpt):
    """θ₀ where it is at hand (held for an anchor, or version 0 still live), else from its
    checkpoint (read for this evaluation only)."""
    state = self.state
    if state.initial_params is not None:
      return state.initial_params
    if 0 in state.params_by_version:
      return state.params_by_version[0]
    return load_initial_params(ckpt, self.algorithm)

  def _log_update(self, update_log: UpdateLog, info: UpdateInfo) -> None:
    # Identical on every process: one writes it.
    if self.host.primary and isinstance(self.algorithm, ReplaysUpdates):
      update_log.append(log_record(self.state, info.results, info.record))

  def _transcripts(self, sandbox, resuming: bool) -> list[list[dict]]:
    c = self.config
    if not needs_transcripts(c, self.workdir, resuming):
      return []
    t = time.perf_counter()
    transcripts = builders.oracle_transcripts(c, sandbox)
    self.log(f"{len(transcripts)} oracle transcripts in {time.perf_counter() - t:.1f}s")
    return oracle.off_protocol(transcripts, c.warmstart.off_protocol_fraction, c.seed)

  def _progress_bar(self):
    return metrics.ProgressBar(self.config.train.num_updates, self.state.version,
                               enabled=self.config.train.progress_bar and self.host.primary,
                               desc=f"{self.algorithm.name} updates")

  # -- the loop -------------------------------------------------------------------------------
  def _train(self, ckpt, writer, hooks: list[Hook]) -> dict:
    c, state = self.config, self.state
    t0, start_version = time.perf_counter(), state.version
    if not state.evals and c.eval.num_tasks:
      writer.write({"version": 0, "eval": self.evaluate()})
      self.observers.after_initial_evaluation()
    if not ckpt.steps():
      self._save(ckpt)   # version 0: warm-started params, initial evaluation
    self._window = metrics.UpdateWindow(self.runner.stats())
    while state.controller.version < c.train.num_updates:
      self._issue_jobs()
      for r in self.runner.poll(state.params_by_version, block=True):
        self._report(r)
      while (state.controller.version < c.train.num_updates
             and (update := state.controller.pop_update()) is not None):
        if (why := state.controller.excluded_beyond(c.train.max_excluded_share)) is not None:
          raise SandboxError(why)   # issue 31: fitness must not silently lose its episodes
        record, results = self._apply(update)
        record["excluded_episodes"] = dict(state.controller.excluded_kinds)   # run so far, by kind
        if self._in_force:   # the values in force of keys changed since config.json
          record["config_in_force"] = self._in_force
        run_hooks(hooks, UpdateInfo(state.version, record, state.version == c.train.num_updates, results))
        self._window = metrics.UpdateWindow(self.runner.stats())
    train_s = time.perf_counter() - t0
    if c.eval.num_tasks and state.evals[-1]["version"] != state.version:
      # A finished run resumed with evaluation newly switched on: evaluate its last version.
      writer.write({"version": state.version, "eval": self.evaluate()})
      self._save(ckpt)
    ckpt.wait()
    self._progress.close()   # before the before/after table, which stays the last thing shown
    return self._summary(train_s, start_version)

  def _issue_jobs(self) -> None:
    free = self.runner.free_slots()
    if not free:
      return
    for job in self.state.controller.next_jobs(len(free)):
      self.runner.submit(self._contexts.spec(self.algorithm.spec(job), self.state.contexts))

  def _report(self, result) -> None:
    self.algorithm.on_result(self.state.algorithm_state, result)
    self.state.controller.report(result.spec.key.job.job_id, reward=result.reward,
                                 failure=result.failure, decoded_under=result.last_version)
    self._window.add(result)
    self.observers.on_result(result)

  def _apply(self, update) -> tuple[dict, list]:
    state, t = self.state, time.perf_counter()
    results = sorted(update.results)  # a deterministic order: float sums do not depend on arrival
    keep = set(state.controller.live_versions()) | self.runner.live_versions()
    context = UpdateContext(state.controller.version, state.controller.config,
                            state.params_by_version, keep, state.initial_params)
    seen = observers.Update(state.version, results, keep, state.params_by_version, self._current_params())
    self.observers.before_update(seen)
    updated = self.algorithm.apply_update(state.algorithm_state, results, context)
    if updated.version_step is not None:   # rows of the new version may join older ones' calls
      self._decoding.add_step(*updated.version_step)
    state.advance(updated.state, self.algorithm.params(updated.state), keep)
    measured = self.observers.after_update(dataclasses.replace(seen, params=self._current_params()))
    self._window.update_s += time.perf_counter() - t
    record = self.algorithm.record(self._window, update, results, updated.metrics, self.runner.stats())
    return {**record, **measured}, results

  # -- evaluation -----------------------------------------------------------------------------
  def evaluate(self) -> dict:
    """Held-out success of the unperturbed current policy (``evaluation.evaluate``), and what
    the observers add: other task sets (``shifted``, ``probe``) and measures (drift, the probe)."""
    c, state = self.config, self.state
    streams = {}   # the held-out episodes' token streams (drift draws its KL transcripts from them)

    def run(tasks, name):
      return evaluation.evaluate(
          self.runner, state.params_by_version, state.version, tasks, seeds=c.eval.seeds,
          temperature=c.eval.temperature, top_p=c.rollout.top_p, on_training_result=self._report,
          log=self.log, prepare=lambda spec: self._contexts.spec(spec, state.contexts), name=name,
          streams=streams if name == "held-out" else None, count_replies=count_replies)

    count_replies = evaluation.reply_counter(self.parts.tokenizer, builders.reply_parses(c))

    result = run(self.parts.heldout_tasks[:c.eval.num_tasks], "held-out")
    result |= self.observers.at_evaluation(
        observers.Evaluation(state.version, self._current_params(), streams, run))
    state.evals.append(result)
    return result

  def _eval_hook(self, info: UpdateInfo) -> None:
    info.record["eval"] = self.evaluate()

  def _summary(self, train_s: float, start_version: int) -> dict:
    c, state = self.config, self.state
    before, after = (state.evals[0], state.evals[-1]) if state.evals else (None, None)
    updates = state.version - start_version
    records = metrics.read_metrics(os.path.join(self.workdir, "metrics.jsonl")) if self.host.primary else []
    # Run totals from the metrics lines (one per version, kept across resumes): the sum of the
    # update windows (training, no evaluation), as the grid counts them. A rerun that trains
    # nothing changes neither.
    windows = [(r.get("time") or {}).get("wall_s") or 0.0 for r in records if "train" in r]
    run_s, mine = sum(windows), sum(windows[len(windows) - updates:]) if updates else 0.0
    summary = {"version": state.version, "algorithm": c.train.algorithm, "mode": c.controller.mode,
               "seed": c.seed,
               "before": before, "after": after, "change": evaluation.paired_change(before, after),
               "reward_change": evaluation.paired_change(before, after, evaluation.REWARD),
               **({"shifted_change": evaluation.paired_change(before["shifted"], after["shifted"])}
                  if before and after and "shifted" in before and "shifted" in after else {}),
               "train_s": run_s, "updates_per_hour": _per_hour(len(windows), run_s),
               "updates_this_run": updates,
               # Tasks kept by env.allow_unsafe_verdicts: their rewards the agent's code could decide.
               **({"unsafe_verdicts": unsafe_task_names(
                   self.parts.train_tasks + self.parts.heldout_tasks)}
                  if c.env.get("allow_unsafe_verdicts", False) else {}),
               "this_invocation": {"updates": updates, "train_s": mine, "wall_s": train_s,
                                   "updates_per_hour": _per_hour(updates, mine),
                                   "peak_rss_gib": metrics.peak_rss_gib()},
               **state.timings}
    if not self.host.primary:
      return {**summary, "params": self._current_params()}
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    self.observers.at_summary(summary)   # the plot; the report page again, with the paired change
    if before is not None and after is not None:
      self.log(evaluation.format_table(before, after, self.algorithm.name))
    return {**summary, "params": self._current_params()}


def _per_hour(updates: int, seconds: float) -> float | None:
  return 3600.0 * updates / seconds if updates and seconds > 0 else None
