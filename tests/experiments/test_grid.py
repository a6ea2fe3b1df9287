"""The experiment grid: the aggregator on synthetic run directories (known numbers -> known
table, missing/failed/unfinished runs and an unavailable variant reported as such), variant
resolution and launch lines, and a 2-variant x 1-seed x 2-update grid end to end on the tiny
config, SIGKILLed mid-run and completed by a rerun that skips the finished run."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers_train import ROOT, build_tiny_tokenizer, tiny_config
from jaxes.experiments import aggregate, grid, plots, rundirs, variants
from jaxes.train import evaluation

ENV = {"families": "permissions", "num_heldout_tasks": 4}


# -- synthetic run directories ------------------------------------------------------------------
def _write_run(path, seed, *, summary=None, train=(), evals=(), attempts=None, log="", num_updates=2):
  os.makedirs(path)
  json.dump({"seed": seed, "env": ENV, "eval": {"num_tasks": 4}, "train": {"num_updates": num_updates}},
            open(os.path.join(path, "config.json"), "w"))
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for r in list(train) + list(evals):
      f.write(json.dumps(r) + "\n")
  if summary is not None:
    json.dump(summary, open(os.path.join(path, "summary.json"), "w"))
  if attempts is not None:
    json.dump({"attempts": attempts}, open(os.path.join(path, rundirs.GRID_RUN), "w"))
  if log:
    open(os.path.join(path, rundirs.GRID_LOG), "w").write(log)


def _ev(version, per_task):
  return {"version": version, "success": float(np.mean(per_task)), "stderr": 0.1, "per_task": per_task}


def _finished(path, seed, before, after, hist_per_update, wall_s, dropped=0, delayed=0):
  train = [{"version": v + 1, "staleness_hist": h, "dropped": dropped, "delayed": delayed, "excluded": 0,
            "time": {"wall_s": wall_s}, "train": {"success": 0.0}} for v, h in enumerate(hist_per_update)]
  b, a = _ev(0, before), _ev(len(train), after)
  change = {"success": a["success"] - b["success"], "stderr": 0.05, "tasks": len(after)}
  _write_run(path, seed, summary={"version": len(train), "before": b, "after": a, "change": change},
             train=train, evals=[{"version": 0, "eval": b}, {"version": len(train), "eval": a}],
             attempts=[{"command": ["x"], "returncode": 0, "wall_s": 10.0, "cpu_s": 15.0}],
             num_updates=len(train))


def test_aggregate_synthetic_runs_known_table(tmp_path):
  w = str(tmp_path)
  before = [0.0, 0.0, 0.0, 0.0]
  _finished(f"{w}/sync-s0", 0, before, [1, 0, 1, 1], [[4], [4]], wall_s=30.0)
  _finished(f"{w}/sync-s1", 1, before, [1, 0, 0, 0], [[4], [4]], wall_s=60.0)
  _finished(f"{w}/async1-s0", 0, before, [1, 1, 1, 0], [[3, 1], [2, 2]], wall_s=15.0, dropped=1)
  _write_run(f"{w}/async1-s1", 1, train=[{"version": 1, "staleness_hist": [4], "time": {"wall_s": 5.0}}],
             attempts=[{"command": ["x"], "returncode": 1, "wall_s": 3.0, "cpu_s": 2.0}],
             log="loading\nerror: invalid config: config.es.sigma: must be > 0\n")
  _write_run(f"{w}/delay8-s1", 1, train=[{"version": 1, "staleness_hist": [4], "time": {"wall_s": 5.0}}])
  vs = [variants.Variant("sync", "c.py:sync", {}), variants.Variant("async1", "c.py:async1", {}),
        variants.Variant("delay8", "c.py:delay8", {}),
        variants.Variant("grpo", "", {}, unavailable="no GRPO trainer entry point")]
  result = aggregate.aggregate(vs, [0, 1], w)
  by = {v["variant"]: v for v in result["variants"]}
  runs = {(r["variant"], r["seed"]): r for r in result["runs"]}

  # sync: after 0.75 and 0.25 -> mean 0.5, s.e. = std([.75, .25], ddof=1) / sqrt(2) = 0.25
  assert by["sync"]["status"] == "finished"
  assert by["sync"]["after"]["mean"] == pytest.approx(0.5) and by["sync"]["after"]["stderr"] == pytest.approx(0.25)
  # updates/hour: 2 updates in 60 s -> 120/h; in 120 s -> 60/h
  assert by["sync"]["updates_per_hour"]["mean"] == pytest.approx(90.0)
  assert by["sync"]["staleness"]["mean"] == 0 and by["sync"]["staleness"]["share_stale"] == 0

  # async1: only seed 0 finished; paired vs sync s0: diffs [0, 1, 0, -1] -> 0 ± sqrt(2/3)/2
  assert by["async1"]["status"] == "1/2 finished"
  vs_s0 = runs["async1", 0]["vs_sync"]
  assert vs_s0["success"] == pytest.approx(0.0) and vs_s0["stderr"] == pytest.approx(math.sqrt(2 / 3) / 2)
  assert by["async1"]["vs_sync"]["mean"] == pytest.approx(0.0) and by["async1"]["vs_sync_seeds"] == 1
  # staleness pooled [5, 3]: mean 3/8, share stale 3/8, max 1; 1 dropped per update, 2 updates
  st = by["async1"]["staleness"]
  assert st["hist"] == [5, 3] and st["mean"] == pytest.approx(3 / 8) and st["max"] == 1
  assert by["async1"]["dropped"]["mean"] == 2
  assert runs["async1", 1]["status"] == "failed" and "exit status 1" in runs["async1", 1]["reason"]
  assert "must be > 0" in runs["async1", 1]["reason"]

  # delay8: s0 missing, s1 unfinished -> no means, both reported
  assert by["delay8"]["status"] == "0/2 finished" and by["delay8"]["after"] is None
  assert runs["delay8", 0]["status"] == "missing" and runs["delay8", 1]["status"] == "unfinished"
  assert by["grpo"]["status"] == "not available"

  md = aggregate.to_markdown(result)
  assert "| sync | finished | 0.000 ± 0.000 | 0.500 ± 0.250 |" in md
  assert "| async1 | 1/2 finished |" in md and "+0.000 ± 0.000" in md
  assert "| grpo | not available |" in md and "no GRPO trainer entry point" in md
  assert "delay8-s0 | missing" in md and "delay8-s1 | unfinished" in md and "async1-s1 | failed" in md
  assert result["measure"] == "success"
  curves = plots.measure_curves(result)
  assert curves["sync"]["versions"] == [0, 2] and curves["sync"]["mean"][1] == pytest.approx(0.5)
  assert "delay8" not in curves
  plots.write(result, w)
  assert os.path.getsize(f"{w}/success.png") > 0 and os.path.getsize(f"{w}/staleness.png") > 0
  page = open(plots.write_grid_report(result, w)).read()
  assert page.count('id="curve') >= 2 and "<script" not in page   # sync's and async1's curves
  assert "<td>sync</td><td>finished</td><td>0.500 ± 0.250</td><td>0.254</td>" in page


def test_webshop_runs_are_compared_by_mean_reward(tmp_path):
  # WebShop's score is the mean reward; its runs rarely succeed (r = 1), so the table, the paired
  # changes and the plot use the reward there. Success is 0 everywhere below.
  w = str(tmp_path)

  def ev(version, rewards):
    return {"version": version, "success": 0.0, "stderr": 0.0, "per_task": [0.0] * len(rewards),
            "reward": float(np.mean(rewards)), "reward_stderr": 0.1, "per_task_reward": rewards}

  for name, after in (("sync", [0.5, 0.25, 0.5, 0.25]), ("async1", [0.5, 0.5, 0.5, 0.0])):
    b, a = ev(0, [0.25] * 4), ev(2, after)
    summary = {"version": 2, "before": b, "after": a, "change": {"success": 0.0, "stderr": 0.0},
               "reward_change": evaluation.paired_change(b, a, evaluation.REWARD)}
    train = [{"version": v, "staleness_hist": [4], "time": {"wall_s": 1.0}} for v in (1, 2)]
    _write_run(f"{w}/{name}-s0", 0, summary=summary, train=train,
               evals=[{"version": 0, "eval": b}, {"version": 2, "eval": a}])
    config = json.load(open(f"{w}/{name}-s0/config.json"))
    json.dump({**config, "env": {**ENV, "kind": "webshop"}}, open(f"{w}/{name}-s0/config.json", "w"))
  result = aggregate.aggregate([variants.Variant("sync", "c", {}), variants.Variant("async1", "c", {})], [0], w)
  assert result["measure"] == "reward"
  sync, async1 = ({r["variant"]: r for r in result["runs"]}[v] for v in ("sync", "async1"))
  assert (sync["before"], sync["after"], sync["change"]) == (0.25, 0.375, 0.125)
  # paired against sync: diffs [0, 0.25, 0, -0.25] -> 0 ± sqrt(1/24) / 2
  assert async1["vs_sync"]["reward"] == 0.0
  assert async1["vs_sync"]["stderr"] == pytest.approx(math.sqrt(0.125 / 3) / 2)
  assert plots.measure_curves(result)["async1"]["mean"] == [0.25, 0.375]
  md = aggregate.to_markdown(result)
  assert md.startswith("Held-out mean reward (WebShop's score)") and "| sync | finished | 0.250 ± 0.000 | 0.375 ± 0.000 |" in md
  assert plots.write(result, w)[0] == f"{w}/reward.png" and os.path.getsize(f"{w}/reward.png") > 0


def test_paired_vs_sync_needs_the_same_tasks(tmp_path):
  w = str(tmp_path)
  _finished(f"{w}/sync-s0", 0, [0, 0], [1, 0], [[2]], wall_s=1.0)
  _finished(f"{w}/async1-s0", 0, [0, 0], [1, 1], [[2]], wall_s=1.0)
  config = json.load(open(f"{w}/async1-s0/config.json"))
  config["env"] = {**ENV, "families": "log_count"}   # other held-out tasks
  json.dump(config, open(f"{w}/async1-s0/config.json", "w"))
  vs = [variants.Variant("sync", "c", {}), variants.Variant("async1", "c", {})]
  result = aggregate.aggregate(vs, [0], w)
  assert result["runs"][1]["vs_sync"] is None and result["variants"][1]["vs_sync"] is None


# -- variants and launch lines --------------------------------------------------------------------
def test_variants_resolve_for_configs_with_and_without_variants():
  paper = variants.resolve(str(ROOT / "configs/paper.py"), "delay8")
  assert paper.config_spec.endswith("configs/paper.py:delay8") and paper.overrides == {}
  target = variants.resolve(str(ROOT / "configs/paper.py") + ":{variant},v5p-64", "sync")
  assert target.config_spec.endswith(":sync,v5p-64")
  demo = variants.resolve(str(ROOT / "configs/demo.py"), "delay4")
  assert demo.overrides["controller.delay_updates"] == 4 and demo.overrides["controller.delay_fraction"] == 0.1
  grpo = variants.resolve(str(ROOT / "configs/demo.py"), "grpo")
  assert not grpo.available and "train.algorithm='grpo'" in grpo.unavailable
  grpo = variants.resolve(str(ROOT / "configs/demo_grid.py"), "grpo")
  assert grpo.available and grpo.entry == "jaxes.train" and grpo.config_spec.endswith("demo_grid.py:grpo")
  assert not variants.resolve(str(ROOT / "configs/demo.py"), "async7").available


def test_print_launch_shared_warm_start_and_launchers(capsys):
  argv = ["--config=configs/demo_grid.py", "--variants=sync,delay8,grpo", "--seeds=0,1",
          "--workdir=runs/g", "--print-launch", "--config.es.sigma=0.02"]
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    assert grid.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert grid.main(argv + ["--launcher=slurm", "--launcher_args=--nodes 1"]) == 0
    slurm = capsys.readouterr().out.splitlines()
    assert grid.main(argv + ["--config.es.sigmaa=1"]) == 2
    assert capsys.readouterr().err.strip() == "error: config.es.sigmaa: unknown key (did you mean 'sigma'?)"
  finally:
    os.chdir(cwd)
  commands = [l for l in out if l.startswith("python")]
  assert len(commands) == 2 + 6   # a warm start per seed, then 3 variants x 2 seeds
  assert any("--config=configs/demo_grid.py:grpo --workdir=runs/g/grpo-s0" in c for c in commands)
  assert "--workdir=runs/g/init-s1" in commands[1] and "--config.train.num_updates=0" in commands[1]
  assert ("--config=configs/demo_grid.py:delay8 --workdir=runs/g/delay8-s1 --config.es.sigma=0.02 "
          "--config.seed=1 --config.warmstart.init_from=runs/g/init-s1") in commands[6]
  assert [l for l in slurm if "delay8-s0" in l][0].startswith(
      "launch/gpu/slurm.sh --job-name jaxes-delay8-s0 --nodes 1 -- python -m jaxes.train")


def test_shared_warm_start_of_a_changing_environment_has_no_shift(capsys):
  """The init run has no updates, so a task shift (which must fall within a run's updates) is
  dropped from it; the variants keep theirs."""
  argv = ["--config=configs/demo_grid.py", "--variants=async1", "--seeds=0", "--workdir=runs/g",
          "--print-launch", "--config.env.shift_families=archive", "--config.env.shift_at_update=24"]
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    assert grid.main(argv) == 0
  finally:
    os.chdir(cwd)
  init, run = [l for l in capsys.readouterr().out.splitlines() if l.startswith("python")]
  assert init.endswith("--config.env.shift_families= --config.env.shift_at_update=0")
  assert "--config.env.shift_at_update=24" in run and "shift_at_update=0" not in run


# -- end to end on the tiny config ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_grid_config(tmp_path_factory):
  d = tmp_path_factory.mktemp("grid")
  config = tiny_config(build_tiny_tokenizer(str(d / "tok")))
  path = d / "tiny_grid.py"
  path.write_text(
      "import json\nfrom ml_collections import config_dict\n\nVARIANTS = ('sync', 'async1')\n"
      f"BASE = {config.to_json()!r}\n\n\n"
      "def get_config(variant='async1'):\n"
      "  c = config_dict.ConfigDict(json.loads(BASE))\n"
      "  c.controller.mode, c.controller.max_staleness = ('sync', 0) if variant == 'sync' else ('async', 1)\n"
      "  return c\n")
  return str(path)


def _grid_cmd(config, workdir, parallel):
  return [sys.executable, "-m", "jaxes.experiments.grid", f"--config={config}",
          "--variants=sync,async1,grpo", "--seeds=0", f"--workdir={workdir}", f"--parallel={parallel}"]


@pytest.fixture(scope="module")
def grid_run(tiny_grid_config, tmp_path_factory):
  """The tiny grid's workdir as a killed grid's rerun leaves it, and what was seen on the way.
  The grid runs one at a time: it finishes sync-s0, goes on to async1-s0 and is SIGKILLed in it
  (the run process must die with it); the rerun, 2 at a time, skips sync-s0, completes async1-s0
  and writes the table. Both tests read this one grid (it once ran twice: a whole grid 2 at a
  time, and a killed grid started from a copy of its finished sync run, whose rerun trained
  async1-s0 a second time)."""
  w = tmp_path_factory.mktemp("grid_run") / "grid"
  log = open(w.parent / "grid.err", "w+")
  proc = subprocess.Popen(_grid_cmd(tiny_grid_config, w, 1), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=log)
  deadline = time.monotonic() + 600
  while not (w / "async1-s0" / "config.json").exists() and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.1)
  log.seek(0)
  assert proc.poll() is None, f"the grid ended before it could be killed:\n{log.read()[-3000:]}"
  seen = {"sync_finished_at_kill": rundirs.is_finished(str(w / "sync-s0"))}
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  log.seek(0)
  child = int(re.search(r"started async1-s0 \(pid (\d+)\)", log.read()).group(1))
  for _ in range(100):   # the run dies with the grid (PR_SET_PDEATHSIG)
    if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
      seen["child_died"] = True
      break
    time.sleep(0.1)
  else:
    seen["child_died"] = f"run process {child} outlived the SIGKILLed grid"
  seen["async1_finished_after_kill"] = rundirs.is_finished(str(w / "async1-s0"))
  seen["sync_summary"] = (w / "sync-s0" / "summary.json").read_bytes()
  done = subprocess.run(_grid_cmd(tiny_grid_config, w, 2), cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  seen["rerun_stderr"] = done.stderr
  return w, seen


def _grid_in_process(argv, capsys) -> tuple[int, str]:
  """``python -m jaxes.experiments.grid ARGV`` in this process (``main`` is what the command runs;
  a launch would import JAX again, ~4 CPU-s each): its exit status and what it wrote on stderr."""
  capsys.readouterr()
  code = grid.main(argv)
  return code, capsys.readouterr().err


@pytest.mark.end_to_end
def test_grid_end_to_end_tiny(grid_run, tiny_grid_config, capsys):
  w, _ = grid_run
  table = json.load(open(w / "table.json"))
  by = {v["variant"]: v for v in table["variants"]}
  assert by["sync"]["status"] == by["async1"]["status"] == "finished"
  assert by["grpo"]["status"] == "not available"
  sync, async1 = table["runs"]
  assert sync["version"] == async1["version"] == 2 and sync["staleness"]["max"] == 0
  assert async1["vs_sync"]["tasks"] == 2 and sync["vs_sync"] is None
  assert async1["updates_per_hour"] > 0 and async1["cpu_s"] > 0 and sync["cpu_s"] > 0
  assert [e["version"] for e in async1["evals"]] == [0, 2]
  md = (w / "table.md").read_text()
  assert "| async1 | finished |" in md and "| grpo | not available |" in md
  assert (w / "success.png").stat().st_size > 0 and (w / "staleness.png").stat().st_size > 0
  assert 'id="curve' in (w / "report.html").read_text()
  # --aggregate-only of a variant with no runs (a typo, or grpo, which this config lacks) is one
  # line and exit 2, and writes nothing; of the variants that ran, it rereads the same rows.
  written = {f: (w / f).read_bytes() for f in ("table.md", "table.json", "grid.json", "report.html")}
  args = _grid_cmd(tiny_grid_config, w, 2)[3:]   # the command's arguments
  for names in ("asink1", "sync,async1,grpo"):
    code, err = _grid_in_process(args[:-1] + [f"--variants={names}", "--aggregate-only"], capsys)
    said = err.strip().splitlines()
    assert code == 2 and len(said) == 1, err
    assert said[0].startswith(f"error: --aggregate-only: no runs of variant(s) {names.split(',')[-1]} "
                              f"for seeds [0] in {w} (run directories there: async1-s0, ") and (
        said[0].endswith("sync-s0); nothing was written")), said
  assert {f: (w / f).read_bytes() for f in written} == written
  code, _ = _grid_in_process(args[:-1] + ["--variants=sync,async1", "--aggregate-only"], capsys)
  assert code == 0 and json.load(open(w / "table.json"))["runs"] == table["runs"]
  assert (w / "grid.json").read_bytes() == written["grid.json"]
  # Another grid's command in this directory is refused before anything is written.
  code, err = _grid_in_process(args + ["--config.es.sigma=0.5"], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "holds another grid (overrides [] in its grid.json" in err and "--overwrite" in err
  assert (w / "grid.json").read_bytes() == written["grid.json"]


@pytest.mark.end_to_end
def test_killed_grid_rerun_skips_finished_runs(grid_run):
  # The grid was killed in async1-s0 after finishing sync-s0 (grid_run); its rerun must have
  # skipped sync-s0 and completed async1-s0.
  w, seen = grid_run
  assert seen["sync_finished_at_kill"] and seen["child_died"] is True, seen["child_died"]
  assert not seen["async1_finished_after_kill"]
  assert "sync-s0 already finished (version 2), skipped" in seen["rerun_stderr"]
  assert "started sync-s0" not in seen["rerun_stderr"]
  assert (w / "sync-s0" / "summary.json").read_bytes() == seen["sync_summary"]
  assert len(rundirs.attempts(str(w / "sync-s0"))) == 1
  tries = rundirs.attempts(str(w / "async1-s0"))
  assert [t["returncode"] for t in tries] == [None, 0]   # the killed attempt, then the finished one
  table = json.load(open(w / "table.json"))
  assert [r["status"] for r in table["runs"]] == ["finished", "finished"]


# -- heavy-tailed latency -------------------------------------------------------------------------
class _Recorder:
  """A stand-in backend that records what reaches it (the wrapper is under test)."""

  def __init__(self):
    self.calls = []

  def start(self, task):
    self.calls.append(("start", task.name))
    outer = self

    class Handle:
      def exec(self, command, timeout_s):
        outer.calls.append(("exec", command))
        return command

      def run_tests(self):
        outer.calls.append(("tests",))
        return "report"

      def close(self):
        outer.calls.append(("close",))
    return Handle()

  def shutdown(self):
    self.calls.append(("shutdown",))

  def leftovers(self):
    return {}


def test_latency_sandbox_draws_lognormal_deterministically_and_passes_work_through():
  from types import SimpleNamespace
  from jaxes.envs.sandboxes.latency import LatencyModel, LatencySandbox
  a, b = LatencyModel(2.0, 1.0, seed=3), LatencyModel(2.0, 1.0, seed=3)
  draws = [a.draw(f"t{i % 50}") for i in range(4000)]
  assert draws == [b.draw(f"t{i % 50}") for i in range(4000)]     # seeded by (task, count)
  assert np.median(draws) == pytest.approx(2.0, rel=0.1)
  assert np.std(np.log(draws)) == pytest.approx(1.0, rel=0.1)
  assert LatencyModel(2.0, 1.0, seed=4).draw("t0") != draws[0]
  inner = _Recorder()
  box = LatencySandbox(inner, median_s=1e-4, sigma=0.5, per="command")
  with box.start(SimpleNamespace(name="task")) as h:
    assert h.exec("ls", 5) == "ls" and h.run_tests() == "report"
  box.shutdown()
  assert inner.calls == [("start", "task"), ("exec", "ls"), ("tests",), ("close",), ("shutdown",)]
  assert box.model.draws == 2    # one per command and one for the tests
  episode = LatencySandbox(_Recorder(), median_s=1e-4, sigma=0.5, per="episode")
  episode.start(SimpleNamespace(name="task")).exec("ls", 5)
  assert episode.model.draws == 1
  with pytest.raises(ValueError, match="per must be one of"):
    LatencySandbox(_Recorder(), 1.0, 1.0, per="turn")


def _fake_trainer(workdir, num_updates, exit_code=0, pause=0.3):
  """A real process standing in for a trainer: writes what a finished run leaves (the runner is
  under test), records when it ran."""
  code = (f"import json, os, time\nw = {str(workdir)!r}\nt0 = time.time()\ntime.sleep({pause})\n"
          f"json.dump({{'train': {{'num_updates': {num_updates}}}}}, open(os.path.join(w, 'config.json'), 'w'))\n"
          f"if {exit_code}:\n  print('error: boom'); raise SystemExit({exit_code})\n"
          f"json.dump({{'version': {num_updates}}}, open(os.path.join(w, 'summary.json'), 'w'))\n"
          "json.dump([t0, time.time()], open(os.path.join(w, 'when.json'), 'w'))\n")
  return ["python", "-c", code]


def test_runner_starts_runs_after_their_warm_start_and_reports_a_failed_one(tmp_path):
  def runs(init_exit):
    init = grid.Run("init-s0", str(tmp_path / f"{init_exit}" / "init-s0"), None, 0, "init", 0)
    init.command = _fake_trainer(init.workdir, 0, init_exit)
    out = [init]
    for name in ("sync", "async1"):
      r = grid.Run(f"{name}-s0", str(tmp_path / f"{init_exit}" / f"{name}-s0"), None, 2, name, 0, needs="init-s0")
      r.command = _fake_trainer(r.workdir, 2)
      out.append(r)
    return out

  ok = runs(0)
  grid.LocalRunner(parallel=3, log=lambda s: None).run_all(ok)
  init_end = json.load(open(os.path.join(ok[0].workdir, "when.json")))[1]
  for r in ok[1:]:
    assert rundirs.is_finished(r.workdir) and json.load(open(os.path.join(r.workdir, "when.json")))[0] >= init_end
  bad = runs(3)
  grid.LocalRunner(parallel=3, log=lambda s: None).run_all(bad)
  init = rundirs.read_run(bad[0].workdir, "init", 0)
  assert init.status == "failed" and "exit status 3: error: boom" in init.reason
  for r in bad[1:]:
    rec = rundirs.read_run(r.workdir, r.variant, 0, 2)
    assert rec.status == "failed" and "not started: init-s0 failed" in rec.reason
