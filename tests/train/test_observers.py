"""Observers: told in the list's order, their dicts merged in it; each point a no-op by default;
task sets evaluated as the held-out tasks; the transcripts handed to the tracker through
``UpdateInfo.episodes``; the report page on its schedule; ``build`` picks what the config
switches on. That the trainer's records stay what they were (drift, probes, transcripts,
co-evolution, the report) is tests/train/test_trainer.py's, test_coevolution.py's,
algorithms/test_sao.py's and tests/run_tools/test_report.py's."""
import json
import types

from jaxes.train import defaults
from jaxes.train.hooks import UpdateInfo
from jaxes.train.observers import (ContextParents, Evaluation, Observer, Observers, Report, TaskSet,
                                   Tracker, Transcripts, Update, build)


class Recorder(Observer):
  def __init__(self, name, calls, out):
    self.name, self.calls, self.out = name, calls, out

  def before_update(self, update):
    self.calls.append((self.name, "before", update.version))

  def after_update(self, update):
    self.calls.append((self.name, "after", update.params))
    return dict(self.out)

  def at_evaluation(self, evaluation):
    return {f"{self.name}_at": evaluation.version}

  def close(self):
    self.calls.append((self.name, "close"))


def _update(params="old"):
  return Update(version=3, results=[(2, 0, 1.0)], keep={2, 3}, params_by_version={}, params=params)


def test_observers_are_told_in_order_and_their_dicts_merge_in_it():
  calls = []
  both = Observers([Recorder("a", calls, {"x": 1, "y": 1}), Recorder("b", calls, {"y": 2, "z": 2})])
  both.before_update(_update())
  out = both.after_update(_update("new"))
  assert list(out.items()) == [("x", 1), ("y", 2), ("z", 2)]   # a later observer's key wins, in place
  assert both.at_evaluation(Evaluation(5, None, {}, None)) == {"a_at": 5, "b_at": 5}
  both.close()
  assert calls == [("a", "before", 3), ("b", "before", 3), ("a", "after", "new"), ("b", "after", "new"),
                   ("a", "close"), ("b", "close")]


def test_task_sets_are_evaluated_as_the_held_out_tasks_each_under_its_name():
  ran = []

  def run(tasks, name):
    ran.append((tasks, name))
    return {"success": 0.5, "per_task": [0.5], "seconds": 1.0}

  sets = Observers([TaskSet("shifted", ["s"]), TaskSet("probe", ["p"], fields=("success", "per_task"))])
  out = sets.at_evaluation(Evaluation(2, None, {}, run))
  assert ran == [(["s"], "shifted"), (["p"], "probe")]
  assert out == {"shifted": {"success": 0.5, "per_task": [0.5], "seconds": 1.0},
                 "probe": {"success": 0.5, "per_task": [0.5]}}


def test_every_point_of_the_base_is_a_no_op():
  o, info = Observer(), UpdateInfo(1, {"version": 1}, final=False)
  o.on_result(object())
  o.before_update(_update())
  assert o.after_update(_update()) == {} and o.at_evaluation(Evaluation(0, None, {}, None)) == {}
  o.after_initial_evaluation()
  o.after_line(info)
  o.at_summary({})
  o.close()
  assert info.record == {"version": 1} and info.episodes == []


class FakeSampler:
  def __init__(self):
    self.offered = []

  def offer(self, result):
    self.offered.append(result)

  def write(self, update):
    window, self.offered = self.offered, []
    return [{"update": update, "task": r} for r in window]


class FakeRun:
  def __init__(self):
    self.logged, self.closed = [], False

  def log(self, record, episodes):
    self.logged.append((record["version"], episodes))

  def close(self):
    self.closed = True


def test_the_tracker_logs_the_transcripts_written_before_it():
  run = FakeRun()
  both = Observers([Transcripts(FakeSampler()), Tracker(run)])
  both.on_result("t0")
  both.on_result("t1")
  both.after_line(UpdateInfo(1, {"version": 1}, final=False))
  both.after_line(UpdateInfo(2, {"version": 2}, final=False))
  both.close()
  assert run.logged == [(1, [{"update": 1, "task": "t0"}, {"update": 1, "task": "t1"}]), (2, [])]
  assert run.closed
  alone = FakeRun()   # without a sample the tracker logs no episodes
  Tracker(alone).after_line(UpdateInfo(1, {"version": 1}, final=False))
  assert alone.logged == [(1, [])]


def test_the_report_page_at_the_first_evaluation_every_eval_every_the_last_and_the_summary():
  pages = []
  report = Report(pages.append, "/run", every=2)
  report.after_initial_evaluation()
  for v in range(1, 6):
    report.after_line(UpdateInfo(v, {"version": v}, final=v == 5))
  report.at_summary({})
  assert pages == ["/run"] * 5   # initial, 2, 4, 5 (the last), the summary


def test_context_parents_read_the_run_states_contexts_at_each_update():
  class Contexts:
    def __init__(self):
      self.updates, self.forgotten = [], []

    def update(self, version, results):
      self.updates.append((version, results))
      return [(0, 1)]

    def forget(self, version):
      self.forgotten.append(version)

  class RunState:
    contexts = None

  state = RunState()
  parents = ContextParents(state)
  state.contexts = Contexts()   # replaced after the observer was built (a resume's replay)
  assert parents.after_update(_update()) == {"context_parents": [[0, 1]]}
  assert state.contexts.updates == [(2, [(2, 0, 1.0)])] and state.contexts.forgotten == [2]


def _config(**overrides):
  c = defaults.base_config()
  c.eval.drift, c.eval.mc_probe_file, c.coevolve.enabled = False, "", False
  c.train.transcripts_per_update, c.train.tracker, c.train.report, c.train.plot = 0, "", False, False
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


def test_build_makes_only_what_the_config_switches_on(tmp_path):
  class RunState:
    contexts, version = None, 0

  def kinds(config, primary=True, write_report=print):
    algorithm = types.SimpleNamespace(donates_params=False, plot_label=lambda: "ES (async)")
    made = build(config, str(tmp_path), types.SimpleNamespace(tokenizer=None, shift=None, probe_tasks=[]),
                 algorithm, run_state=RunState(), primary=primary, initial_params=lambda: None, im_end=0,
                 write_report=write_report, log=lambda s: None)
    return [type(o).__name__ for o in made.observers]

  assert kinds(_config()) == []
  assert kinds(_config(**{"train.report": True})) == ["Report"]
  assert kinds(_config(**{"train.report": True}), write_report=None) == []   # no writer, no page
  assert kinds(_config(**{"train.report": True, "train.plot": True})) == ["Plot", "Report"]
  assert kinds(_config(**{"train.report": True}), primary=False) == []   # the primary writes files
  assert kinds(_config(**{"train.transcripts_per_update": 2}), primary=False) == []
  (tmp_path / "episodes.jsonl").write_text(json.dumps({"update": 1}) + "\n")
  both = _config(**{"train.transcripts_per_update": 2, "train.report": True})
  assert kinds(both) == ["Transcripts", "Report"]
