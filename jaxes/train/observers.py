"""Observers: what watches the run beside training it (measurements, records, co-evolution).

The trainer tells every observer of the points of the loop, in the list's order; an observer
overrides the points it uses (``Observer``'s are no-ops):

* ``on_result(result)``: a finished training episode;
* ``before_update(update)`` / ``after_update(update) -> dict``: around each update (``Update``:
  its cohort, the parameters before it, then after it); what ``after_update`` returns joins the
  update's metrics line;
* ``at_evaluation(evaluation) -> dict``: extra measures of each held-out evaluation
  (``Evaluation``; more task sets evaluated alike, too), added to its record;
* ``after_initial_evaluation()``, ``after_line(info)``, ``at_summary(summary)``: after version
  0's evaluation line, each update's metrics line (``hooks.UpdateInfo``) and ``summary.json``
  (on the primary process) are written;
* ``close()``: at the end of the run, also an interrupted one.

``build`` makes a run's list from its config: the shifted mix's and the off-task families'
held-out tasks, the multiple-choice probe, drift, co-evolution, the transcript sample, the
tracker, the progress plot and the report page, each only where it is switched on (and, for
what writes files, on the primary process). What an observer keeps that a resume needs lives in
the run state (co-evolution's contexts) or the run directory (the KL transcripts, episodes.jsonl).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from jaxes.train import coevolution, drift, mc_probe, metrics, tracker
from jaxes.train.hooks import Hook, UpdateInfo
from jaxes.train.transcripts import TranscriptSampler


@dataclasses.dataclass(frozen=True)
class Update:
  """One update as observers see it."""
  version: int                # the version the update makes
  results: list               # its cohort, in the order the update consumed it
  keep: set[int]              # the versions that must stay decodable after it
  params_by_version: dict     # the run's live versions' parameters
  params: Any                 # before the update: the current version's; after it: the new one's


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """One held-out evaluation as observers see it."""
  version: int
  params: Any                 # the evaluated (current) parameters
  streams: dict               # held-out task index -> its seed-0 episode's EpisodeStream
  run: Callable[[list, str], dict]   # (tasks, name) -> their evaluation, as the held-out one's


class Observer:
  """Every point a no-op: a subclass overrides those it uses."""

  def on_result(self, result) -> None:
    pass

  def before_update(self, update: Update) -> None:
    pass

  def after_update(self, update: Update) -> dict:
    return {}

  def at_evaluation(self, evaluation: Evaluation) -> dict:
    return {}

  def after_initial_evaluation(self) -> None:
    pass

  def after_line(self, info: UpdateInfo) -> None:
    pass

  def at_summary(self, summary: dict) -> None:
    pass

  def close(self) -> None:
    pass


class Observers(Observer):
  """A list of observers, told in order; the dicts they return merge in that order."""

  def __init__(self, observers: list[Observer]):
    self.observers = list(observers)

  def on_result(self, result) -> None:
    for o in self.observers:
      o.on_result(result)

  def before_update(self, update: Update) -> None:
    for o in self.observers:
      o.before_update(update)

  def after_update(self, update: Update) -> dict:
    out = {}
    for o in self.observers:
      out |= o.after_update(update)
    return out

  def at_evaluation(self, evaluation: Evaluation) -> dict:
    out = {}
    for o in self.observers:
      out |= o.at_evaluation(evaluation)
    return out

  def after_initial_evaluation(self) -> None:
    for o in self.observers:
      o.after_initial_evaluation()

  def after_line(self, info: UpdateInfo) -> None:
    for o in self.observers:
      o.after_line(info)

  def at_summary(self, summary: dict) -> None:
    for o in self.observers:
      o.at_summary(summary)

  def close(self) -> None:
    for o in self.observers:
      o.close()


# -- the run's observers ---------------------------------------------------------------------------
class TaskSet(Observer):
  """More held-out tasks in every evaluation, under ``name``: the later mix's in a changing
  environment (``shifted``), families the run does not train on (``probe``); ``fields``: the
  keys of their evaluation kept (None: all)."""

  def __init__(self, name: str, tasks: list, fields: tuple[str, ...] | None = None):
    self.name, self.tasks, self.fields = name, tasks, fields

  def at_evaluation(self, evaluation: Evaluation) -> dict:
    result = evaluation.run(self.tasks, self.name)
    return {self.name: result if self.fields is None else {k: result[k] for k in self.fields}}


class MultipleChoiceProbe(Observer):
  """``eval.mc_probe_file``: the probe's scores at every evaluation (``mc_probe``), on every
  process."""

  def __init__(self, probe: mc_probe.Probe, log: Callable[[str], None]):
    self.probe, self.log = probe, log

  def at_evaluation(self, evaluation: Evaluation) -> dict:
    scores = self.probe(evaluation.params)
    self.log(f"mc probe at version {evaluation.version}: accuracy {scores['accuracy']:.3f} "
             f"of {scores['items']} items (chance {scores['chance']:.3f})")
    return {"mc_probe": scores}


class Drift(Observer):
  """``eval.drift``: ``update_cosine`` in every update's line and the last one at every
  evaluation, beside the drift measures (``drift.Meter``). ``donated``: the update donates the
  current parameters' buffers (the meter keeps a copy)."""

  def __init__(self, meter: drift.Meter, donated: bool, log: Callable[[str], None]):
    self.meter, self.donated, self.log = meter, donated, log
    self.last_cosine: float | None = None

  def before_update(self, update: Update) -> None:
    # θ_{v-1} where the run still has it (the update makes v + 1 from θ_v).
    self.meter.before_update(update.params, update.params_by_version.get(update.version - 2),
                             donated=self.donated)

  def after_update(self, update: Update) -> dict:
    self.last_cosine = self.meter.after_update(update.params)
    return {"update_cosine": self.last_cosine}

  def at_evaluation(self, evaluation: Evaluation) -> dict:
    # Version 0's held-out episodes become the KL transcripts where none are drawn yet.
    streams = evaluation.streams if evaluation.version == 0 else None
    out = self.meter.at_evaluation(evaluation.version, evaluation.params, streams)
    out["update_cosine"] = self.last_cosine
    kl = out["kl_to_initial"]
    self.log(f"drift at version {evaluation.version}: param_drift {out['param_drift']:.4g}, "
             f"kl_to_initial {'n/a' if kl is None else f'{kl:.4g}'} nats/token")
    return out


class ContextParents(Observer):
  """``coevolve.enabled``: after each update its cohort's best contexts become the new version's
  parents (``coevolution.after_update``; the state lives in the run state, which checkpoints
  it); the metrics line records them."""

  def __init__(self, run_state):
    self.run_state = run_state   # its ``contexts`` (a resume's replay may have replaced them)

  def after_update(self, update: Update) -> dict:
    return coevolution.after_update(self.run_state.contexts, update.version, update.results, update.keep)


class Transcripts(Observer):
  """``train.transcripts_per_update``: each update window's first episodes to episodes.jsonl
  (``TranscriptSampler``), handed on to later observers as ``info.episodes``."""

  def __init__(self, sampler: TranscriptSampler):
    self.sampler = sampler

  def on_result(self, result) -> None:
    self.sampler.offer(result)

  def after_line(self, info: UpdateInfo) -> None:
    info.episodes = self.sampler.write(info.version)


class Tracker(Observer):
  """``train.tracker``: each metrics line and its sampled episodes to the tracker."""

  def __init__(self, run: tracker.WandbTracker):
    self.run = run

  def after_line(self, info: UpdateInfo) -> None:
    self.run.log(info.record, info.episodes)

  def close(self) -> None:
    self.run.close()


class Plot(Observer):
  """``train.plot``: progress.png from the metrics lines, with the summary."""

  def __init__(self, workdir: str, title: str):
    self.workdir, self.title = workdir, title

  def at_summary(self, summary: dict) -> None:
    records = metrics.read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    if records:
      metrics.plot(records, os.path.join(self.workdir, "progress.png"), title=self.title)


class Report(Observer):
  """``train.report``: the run's page, written by the run tool's ``write(workdir)``: from the
  first evaluation on, again every ``eval_every`` updates and after the last (so it is live
  while the run trains), and with the summary."""

  def __init__(self, write: Callable[[str], object], workdir: str, every: int):
    self.write, self.workdir = write, workdir
    self.schedule = Hook(lambda info: self.write(workdir), every=every, at_final=True)

  def after_initial_evaluation(self) -> None:
    self.write(self.workdir)

  def after_line(self, info: UpdateInfo) -> None:
    if self.schedule.due(info):
      self.schedule.fn(info)

  def at_summary(self, summary: dict) -> None:
    self.write(self.workdir)


def build(config, workdir: str, parts, algorithm, *, run_state, primary: bool,
          initial_params: Callable[[], Any], im_end: int, write_report: Callable[[str], object] | None,
          log: Callable[[str], None]) -> Observers:
  """The run's observers, in the order they are told: the task sets, then the probe, then drift
  (an evaluation record's keys), drift before co-evolution (a metrics line's), the transcripts
  before the tracker (which logs them), the plot before the report page (which shows it).
  ``initial_params()``: θ₀ where the run keeps it; ``write_report``: the page's writer (None: no
  page)."""
  c, found = config, []
  if parts.shift is not None:
    found.append(TaskSet("shifted", parts.shift.heldout_tasks[:c.eval.num_tasks]))
  if parts.probe_tasks:   # off-task: families the run does not train on
    found.append(TaskSet("probe", parts.probe_tasks, fields=("success", "stderr", "reward", "reward_stderr",
                                                             "episodes", "per_task", "failures")))
  if (probe_file := mc_probe.resolve(c.eval.mc_probe_file)) is not None:
    found.append(MultipleChoiceProbe(mc_probe.Probe(parts.model.graphdef, probe_file, parts.tokenizer), log))
  if c.eval.drift:
    found.append(Drift(drift.Meter(parts.model.graphdef, workdir, initial=initial_params,
                                   kl_transcripts=c.eval.kl_transcripts, max_len=c.rollout.max_len,
                                   im_end=im_end, primary=primary), algorithm.donates_params, log))
  if run_state.contexts is not None:
    found.append(ContextParents(run_state))
  if primary and c.train.transcripts_per_update:
    found.append(Transcripts(TranscriptSampler(workdir, parts.tokenizer, c.train.transcripts_per_update,
                                               c.train.transcript_chars, resume_version=run_state.version)))
  if primary and (run := tracker.build(c.train.tracker, workdir, json.loads(c.to_json_best_effort()),
                                       log)) is not None:
    found.append(Tracker(run))
  if primary and c.train.plot:
    found.append(Plot(workdir, f"{algorithm.plot_label()} — held-out success and staleness"))
  if primary and c.train.report and write_report is not None:
    found.append(Report(write_report, workdir, c.train.eval_every))
  return Observers(found)
