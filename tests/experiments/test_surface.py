"""The staleness surface: the ``--surface`` spec (cells as named variants of the grid), the paired
statistics and heat map on synthetic run directories (known numbers -> known table), and the fast
lane (controller schedule replayed through the jitted ES update): staleness 0 is sync bit for
bit, and the replay is the library's ``Strategy.update`` on the same stream."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_train import ROOT
from jaxes.experiments import fastlane, grid, stats, surface
from jaxes.experiments.variants import GridError


def test_surface_spec_resolves_keys_and_names_cells():
  config = grid.resolve_config(str(ROOT / "configs/demo_grid.py") + ":async1", [])
  axes = surface.axes_of("delay_fraction=0.1,0.5 es.sigma=0.01,0.02,0.03", config)
  assert [(a.key, a.values) for a in axes] == [("controller.delay_fraction", ("0.1", "0.5")),
                                               ("es.sigma", ("0.01", "0.02", "0.03"))]
  cells = surface.cells(axes)
  assert len(cells) == 6 and cells[1] == {"controller.delay_fraction": "0.1", "es.sigma": "0.02"}
  name = surface.cell_name(cells[1])
  assert name == "delay_fraction=0.1+sigma=0.02"
  assert surface.cell_values(name) == {"delay_fraction": "0.1", "sigma": "0.02"}
  assert surface.cell_values("delay8") == {}
  subset = surface.cells_of("delay_fraction=0.1 delay_updates=4,16; delay_fraction=1.0 delay_updates=4", config)
  assert [surface.cell_name(c) for c in subset] == [
      "delay_fraction=0.1+delay_updates=4", "delay_fraction=0.1+delay_updates=16", "delay_fraction=1.0+delay_updates=4"]
  with pytest.raises(GridError, match="named twice"):
    surface.cells_of("delay_updates=4,8; delay_updates=8", config)
  for spec, why in [("delay_fractio=0.1", "unknown key"), ("es.sigmaa=1", "unknown key"),
                    ("mode=sync", "ambiguous"), ("delay_fraction", "KEY=V1,V2"),
                    ("delay_fraction=0.1,0.1", "repeat"), ("delay_updates=1 delay_updates=2", "twice"), ("", "empty"),
                    ("delay_updates=4;", "empty")]:
    with pytest.raises(GridError, match=why):
      surface.cells_of(spec, config)


def _finished(path, seed, after, hist, num_updates):
  """A finished run directory of configs/demo_grid.py (the aggregator's view of one)."""
  os.makedirs(path)
  cfg = {"seed": seed, "env": {"kind": "terminal"}, "eval": {"num_tasks": len(after)},
         "train": {"num_updates": num_updates}}
  json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
  ev = lambda v, per: {"version": v, "success": float(np.mean(per)), "stderr": 0.0, "per_task": per}
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for v in range(num_updates):
      f.write(json.dumps({"version": v + 1, "staleness_hist": hist, "time": {"wall_s": 1.0}, "train": {}}) + "\n")
  before, final = ev(0, [0.0] * len(after)), ev(num_updates, after)
  json.dump({"version": num_updates, "before": before, "after": final,
             "change": {"success": final["success"], "stderr": 0.0}},
            open(os.path.join(path, "summary.json"), "w"))


def test_grid_surface_plans_cells_and_reports_paired_statistics(tmp_path, capsys):
  w = str(tmp_path / "g")
  argv = ["--config=configs/demo_grid.py", "--variants=sync", "--surface=delay_fraction=0.1,0.5 delay_updates=4,8",
          "--seeds=0,1,2", f"--workdir={w}", "--target_se=2"]
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    assert grid.main(argv + ["--print-launch"]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert grid.main(argv[:2] + ["--surface=delay_fractio=0.1", "--seeds=0", f"--workdir={w}", "--print-launch"]) == 2
    assert capsys.readouterr().err.strip() == "error: --surface: delay_fractio: unknown key"
    # Every run of the plan, finished (the runner skips them: the table, paired statistics, heat
    # map and report of a surface at no training cost). 4 tasks; per seed, sync solves 3 and
    # each cell's result is set by its delay: 4 -> one task fewer on seeds 0, 1 (d = -25, -25, 0
    # points), 8 -> one fewer on every seed (d = -25 exactly, s.e. 0: resolved).
    for seed in (0, 1, 2):
      os.makedirs(f"{w}/init-s{seed}")
      json.dump({"version": 0}, open(f"{w}/init-s{seed}/summary.json", "w"))
      json.dump({"train": {"num_updates": 0}}, open(f"{w}/init-s{seed}/config.json", "w"))
      _finished(f"{w}/sync-s{seed}", seed, [1, 1, 1, 0], [8], 48)
      for fraction, stale in (("0.1", 1), ("0.5", 4)):
        _finished(f"{w}/delay_fraction={fraction}+delay_updates=4-s{seed}", seed,
                  [1, 1, 0, 0] if seed < 2 else [1, 1, 1, 0], [8 - stale, 0, 0, 0, stale], 48)
        _finished(f"{w}/delay_fraction={fraction}+delay_updates=8-s{seed}", seed, [1, 1, 0, 0],
                  [8 - stale] + [0] * 7 + [stale], 48)
    assert grid.main(argv) == 0
  finally:
    os.chdir(cwd)
  commands = [l for l in plan if l.startswith("python")]
  assert len(commands) == 3 + 3 * 5
  assert (f"--config=configs/demo_grid.py:async1 --workdir={w}/delay_fraction=0.5+delay_updates=8-s2 "
          "--config.controller.delay_fraction=0.5 --config.controller.delay_updates=8 --config.seed=2") in commands[-1]
  table = json.load(open(f"{w}/table.json"))
  assert json.load(open(f"{w}/grid.json"))["surface"] == "delay_fraction=0.1,0.5 delay_updates=4,8"
  rows = {r["name"]: r for r in table["paired"]["table"]}
  d4 = rows["delay_fraction=0.1+delay_updates=4"]
  # d = (-25, -25, 0): mean -16.67, s.d. 14.43, s.e. 8.33 -> not resolved (t-interval on 2 df);
  # s.e. 2 takes 53 seeds, an 80%-power t-test of -16.67 at s.d. 14.43 takes 9
  assert d4["vs_sync"]["mean"] == pytest.approx(-50 / 3) and d4["vs_sync"]["stderr"] == pytest.approx(25 / 3)
  assert not d4["vs_sync"]["resolved"] and d4["seeds_for_target"] == 53 and d4["seeds_for_power"] == 9
  assert d4["mean_staleness"] == pytest.approx(4 / 8)
  assert rows["delay_fraction=0.5+delay_updates=8"]["vs_sync"]["mean"] == pytest.approx(-25)
  # slopes by delay fraction: per seed, least squares over sync (0, 0) and the two cells
  # fraction 0.1, seed 2: points (0, 0), (0.5, 0), (1, -25) -> slope -25; seeds 0, 1: (0, 0),
  # (0.5, -25), (1, -25) -> slope -25 as well
  assert table["paired"]["slopes"]["0.1"]["mean"] == pytest.approx(-25)
  heat = table["paired"]["heat"]
  assert heat["rows"] == ["0.1", "0.5"] and heat["cols"] == ["4", "8"]
  assert {(p["row"], p["col"], p["points"]) for p in heat["paper"]} == {(0, 0, -1.6), (0, 1, -3.1)}
  assert os.path.getsize(f"{w}/surface.png") > 0
  report = open(f"{w}/report.html").read()
  assert "<h2>Surface</h2>" in report and "paper -3.1" in report
  assert "Paired statistics:" in open(f"{w}/table.md").read()


def _lane(**overrides):
  base = {"train.num_updates": 6, "objective.num_train_tasks": 16, "objective.num_heldout_tasks": 8,
          "objective.dim_in": 8, "objective.dim_out": 4, "es.population": 8, "sim.workers": 16}
  return fastlane.apply_overrides(fastlane.default_config(), {**base, **overrides})


def test_fastlane_staleness_zero_is_sync_bit_for_bit_and_replays_the_strategy_update():
  base = _lane()
  cells = {"sync": fastlane.REFERENCES["sync"],
           "k0": {"controller.mode": "async", "controller.max_staleness": 0},
           # Async-1 whose workers never get ahead: every result has staleness 0
           "fresh": {**fastlane.REFERENCES["async1"], "sim.workers": 8, "sim.durations": "constant"},
           "delay": {**fastlane.REFERENCES["async1"], "controller.delay_fraction": 0.5, "controller.delay_updates": 2}}
  rows = fastlane.run_surface(base, cells, [0, 3], log=lambda s: None)
  assert rows["fresh"]["staleness_hist"] == rows["sync"]["staleness_hist"] == [2 * 6 * 8]
  for name in ("k0", "fresh"):
    assert np.array_equal(rows[name]["final_w"], rows["sync"]["final_w"]) and rows[name]["diff"] == [0.0, 0.0]
  assert rows["delay"]["mean_staleness"][1] > 1.0
  assert not np.array_equal(rows["delay"]["final_w"], rows["sync"]["final_w"])

  # The stale stream of seed 3 through es.Strategy's host path: each result scored with its
  # noise on its own version's parameters, Strategy.update on the cohort -- the same parameters.
  c = fastlane.apply_overrides(base, cells["delay"])
  sched = fastlane.schedule(c, 3)
  strategy = fastlane.strategy_of(c)
  data = fastlane.make_data(jax.random.key(1003), c.objective)
  states = [strategy.init({"w": jnp.zeros((8, 4), jnp.float32)}, jax.random.key(3))]
  for u in range(sched.versions.shape[0]):
    results = []
    ok = sched.valid[u]
    for v, m, tasks in zip(sched.versions[u][ok], sched.members[u][ok], sched.tasks[u][ok]):
      p = strategy.perturbed(states[v], (int(v), int(m)))["w"]
      f = np.mean([float(fastlane.fitness("regression", 0.25, p, data["x"][t], data["y"][t], data["optimum"]))
                   for t in tasks])
      results.append((int(v), int(m), f))
    states.append(strategy.update(states[-1], results)[0])
  np.testing.assert_allclose(rows["delay"]["final_w"][1], np.asarray(states[-1].params["w"]), atol=1e-6)
  assert np.abs(states[-1].params["w"]).max() > 1e-3


def test_stats_paired_seeds_and_slope():
  p = stats.paired([-2.0, -4.0, -3.0])
  assert p["mean"] == -3.0 and p["stderr"] == pytest.approx(1 / np.sqrt(3)) and p["resolved"]
  assert not stats.paired([1.0, -1.0])["resolved"]
  assert stats.seeds_for(None, 1.0) is None
  assert stats.seeds_for(4.0, 1.0) == 16
  fit = stats.slope([[(0, 0), (1, -2), (2, -4)], [(0, 0), (1, -1), (2, -2)]])
  assert fit["mean"] == pytest.approx(-1.5) and fit["stderr"] == pytest.approx(0.5)
