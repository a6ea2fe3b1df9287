"""The discrete-event simulator, duration models and the CLI."""
import json
import os
import random
import subprocess
import sys

import pytest

from jaxes.controller import Controller, ControllerConfig
from jaxes.controller import durations
from jaxes.controller.simulate import Simulator, main


def make_sim(log=None, workers=16, durations_spec="lognormal:1.0", failure_rate=0.0, **kw):
  base = dict(mode="async", population=8, episodes_per_member=2, max_staleness=1)
  base.update(kw)
  ctl = Controller(ControllerConfig(**base), num_tasks=200, log=log)
  return Simulator(ctl, workers, durations.parse(durations_spec), failure_rate=failure_rate, seed=3)


# ---- durations -----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,kind,params", [
    ("constant", "constant", ()), ("lognormal:1.0", "lognormal", (1.0,)),
    ("pareto:1.5", "pareto", (1.5,)), ("bimodal", "bimodal", (0.2, 10.0)),
    ("bimodal:0.5", "bimodal", (0.5, 10.0)), ("bimodal:0.1:4", "bimodal", (0.1, 4.0)),
    ("per-task", "per-task", (0.25,)), ("per-task:0", "per-task", (0.0,)),
])
def test_parse_duration_models(spec, kind, params):
  model = durations.parse(spec)
  assert (model.kind, model.params) == (kind, params)


@pytest.mark.parametrize("spec,match", [
    ("gamma:2", "unknown model"), ("lognormal", "needs one parameter"),
    ("lognormal:x", "numbers"), ("pareto:0", "alpha"), ("constant:3", "at most 0"),
    ("bimodal:2", "0 <= P <= 1"), ("lognormal:-1", "sigma"),
])
def test_bad_duration_specs_name_the_spec(spec, match):
  with pytest.raises(ValueError, match=match) as e:
    durations.parse(spec)
  assert repr(spec) in str(e.value)


def test_duration_shapes():
  draw = lambda spec, task=0, n=4000: [durations.parse(spec, scale=10.0).sample(
      random.Random(i), task) for i in range(n)]
  assert set(draw("constant", n=10)) == {10.0}
  assert min(draw("pareto:2")) >= 10.0
  assert set(draw("bimodal:0.3:5")) == {10.0, 50.0}
  logn = sorted(draw("lognormal:1.0"))
  assert 9.0 < logn[len(logn) // 2] < 11.0      # median = scale
  model = durations.parse("per-task:0", scale=10.0, seed=1)
  per_task = {t: model.sample(random.Random(0), t) for t in range(50)}
  assert set(per_task.values()) <= {10.0, 20.0, 30.0, 40.0}
  assert len(set(per_task.values())) == 4
  assert all(per_task[t] == 10.0 * model.difficulty(t) for t in range(50))


# ---- the simulation ----------------------------------------------------------------------------

def test_same_arguments_same_run_and_event_log():
  logs, summaries = [], []
  for _ in range(2):
    log = []
    summaries.append(make_sim(log, failure_rate=0.1).run(30))
    logs.append(log)
  assert summaries[0] == summaries[1] and logs[0] == logs[1]
  other = make_sim(workers=15).run(30)
  assert other != summaries[0]


def test_sync_run_has_staleness_zero_and_all_work_useful():
  s = make_sim(mode="sync", max_staleness=0).run(20)
  assert s["staleness_histogram"] == {"0": 20 * 8} and s["dropped"] == 0
  assert s["utilization"] == pytest.approx(s["useful_utilization"])
  assert 0 < s["utilization"] < 1


@pytest.mark.parametrize("k,overage", [(1, "drop"), (2, "drop"), (1, "wait"), (3, "wait")])
def test_async_staleness_within_bound(k, overage):
  s = make_sim(max_staleness=k, overage=overage).run(40)
  assert s["max_staleness"] <= k
  assert sum(s["staleness_histogram"].values()) == 40 * 8
  if overage == "wait":
    assert s["dropped"] == 0 and s["aborted_jobs"] == 0
  assert s["useful_utilization"] <= s["utilization"] <= 1.0 + 1e-9


def test_controlled_delay_in_simulation():
  s = make_sim(max_staleness=1, delay_fraction=0.25, delay_updates=4).run(40)
  hist = {int(k): v for k, v in s["staleness_histogram"].items()}
  delayed = sum(v for k, v in hist.items() if k >= 4)
  assert set(hist) <= {0, 1, 4, 5}
  assert delayed == (40 - 4) * 2     # 2 of 8 held per cohort, released from update 4 on


def test_infrastructure_failures_are_retried_and_counted():
  s = make_sim(failure_rate=0.3, max_retries=1).run(30)
  assert s["retries"] > 0 and s["failed_episodes"] > 0


def test_async_beats_sync_on_updates_per_hour_under_lognormal_durations():
  sync = make_sim(mode="sync", max_staleness=0, workers=16).run(60)
  async1 = make_sim(max_staleness=1, workers=16).run(60)
  assert async1["updates_per_hour"] > 2 * sync["updates_per_hour"]
  assert async1["utilization"] > sync["utilization"]


def test_sync_waits_out_every_update_and_async_overlaps_it():
  # Constant 60 s episodes, one round of 16 per update: a sync update n lands at
  # n * 60 + (n - 1) * U, since no job of the next version starts while the trainer computes it.
  def run(mode, k, update_seconds, spec="constant"):
    ctl = Controller(ControllerConfig(mode=mode, population=8, episodes_per_member=2,
                                      max_staleness=k), num_tasks=200)
    return Simulator(ctl, 16, durations.parse(spec), seed=3, update_seconds=update_seconds).run(10)
  for u in (0.0, 30.0):
    s = run("sync", 0, u)
    assert s["virtual_hours"] * 3600 == pytest.approx(10 * 60 + 9 * u)
  # Under heavy tails too (durations are drawn by job identity): sync loses exactly U per
  # update; async keeps its episodes in flight through an update and loses less.
  sync = [run("sync", 0, u, "lognormal:1.0")["virtual_hours"] * 3600 for u in (0.0, 60.0)]
  async1 = [run("async", 1, u, "lognormal:1.0")["virtual_hours"] * 3600 for u in (0.0, 60.0)]
  assert sync[1] - sync[0] == pytest.approx(9 * 60.0)
  assert 0 < async1[1] - async1[0] < 9 * 60.0



def _switching_sim(log=None, switch=True, turns=4):
  ctl = Controller(ControllerConfig(mode="async", population=8, episodes_per_member=2,
                                    max_staleness=1), num_tasks=200, log=log)
  return Simulator(ctl, 16, durations.parse("lognormal:1.0"), seed=3, update_seconds=20.0,
                   turns=turns, switch_versions=switch)


def test_in_flight_version_change_moves_later_turns_and_counts_generation_from_there():
  """Episodes whose later turns start after a newer version exists decode them under it: the
  controller hears the last turn's version, so their generation staleness drops below their
  staleness; without the switch the turn count changes nothing; a resumed run is the same run."""
  plain = _switching_sim(switch=False).run(30)
  assert plain == _switching_sim(switch=False, turns=1).run(30) and plain["switched_results"] == 0
  s = _switching_sim().run(30)
  assert s["switched_results"] > 0 and s["max_staleness"] <= 1
  # Staleness u - v is unchanged by a move (same schedule: a version change moves no job in
  # time); generation staleness is counted from the last turn.
  assert s["staleness_histogram"] == plain["staleness_histogram"]
  assert s["mean_generation_staleness"] < plain["mean_generation_staleness"]
  assert s["mean_generation_staleness"] + s["mean_waiting_staleness"] <= s["mean_staleness"] + 1e-9
  # Same arguments, same run; a resume mid-run ends where the uninterrupted run ends.
  full_log, log = [], []
  expected = _switching_sim(full_log).run(30)
  part = _switching_sim(log)
  while len(part.updates) < 11:
    part.tick(30)
  resumed = _switching_sim()
  resumed.load_state_dict(json.loads(json.dumps(part.state_dict())), log=log)
  assert resumed.run(30) == expected
  assert [e for e in log if e[0] != "reissue"] == full_log


@pytest.mark.parametrize("pairs", ["free", "together"])
@pytest.mark.parametrize("cut", [1, 7, 23])
def test_checkpoint_and_resume_gives_the_uninterrupted_run(cut, pairs):
  full_log = []
  full = make_sim(full_log, failure_rate=0.1, max_staleness=2, pairs=pairs)
  expected = full.run(30)

  log = []
  sim = make_sim(log, failure_rate=0.1, max_staleness=2, pairs=pairs)
  while len(sim.updates) < cut:
    sim.tick(30)
  state = json.loads(json.dumps(sim.state_dict()))
  resumed = make_sim(failure_rate=0.1, max_staleness=2, pairs=pairs)
  resumed.load_state_dict(state, log=log)
  assert resumed.run(30) == expected
  assert [e for e in log if e[0] != "reissue"] == full_log


def test_deadlock_is_reported_not_hung():
  sim = make_sim()
  sim.ctl.next_jobs = lambda n: []   # a broken controller that never hands out work
  with pytest.raises(RuntimeError, match="deadlock"):
    sim.run(1)


# ---- CLI ---------------------------------------------------------------------------------------

REQUIRED = {"utilization", "useful_utilization", "updates_per_hour", "staleness_histogram",
            "max_staleness", "dropped"}


def test_cli_prints_a_table_then_one_json_line(capsys):
  assert main(["--mode", "async", "--max_staleness", "2", "--workers", "8", "--population", "4",
               "--episodes_per_member", "2", "--durations", "pareto:1.5", "--updates", "10",
               "--no_objective"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  summary = json.loads(lines[-1])
  assert REQUIRED <= set(summary) and summary["updates"] == 10
  assert any(line.startswith("utilization") for line in lines[:-1])


def test_cli_rejects_bad_arguments(capsys):
  assert main(["--mode", "sync", "--max_staleness", "1", "--workers", "2", "--population", "2",
               "--updates", "1", "--no_objective"]) == 2
  assert "max_staleness" in capsys.readouterr().err
  assert main(["--mode", "sync", "--workers", "2", "--population", "2", "--updates", "1",
               "--durations", "weibull:2", "--no_objective"]) == 2


@pytest.mark.end_to_end
def test_cli_module_with_synthetic_es_objective():
  # The default fitness: a synthetic objective optimised through jaxes.es.
  cmd = [sys.executable, "-m", "jaxes.controller.simulate", "--mode", "async", "--workers", "8",
         "--population", "8", "--updates", "25", "--dim", "8", "--learning_rate", "0.2",
         "--durations", "bimodal", "--json"]
  out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  lines = out.strip().splitlines()
  assert len(lines) == 1
  summary = json.loads(lines[0])
  assert REQUIRED <= set(summary)
  assert summary["objective_final"] > summary["objective_initial"] + 0.05
