r"""Updates/hour of sync and Async-1 ES in the real trainer on heavy-tailed episode durations,
beside the simulator's prediction for the same duration distribution.

  python -m jaxes.experiments.heavy_tail --config=configs/demo_grid.py --workdir=runs/heavy \
      --init_from=runs/grid/init-s0 --median_s=4 --sigma=1 --updates=10 [--per=episode]

Each variant trains ``--updates`` updates of configs/demo_grid.py (evaluation off, sandbox
results taken as they come, one sandbox thread per slot) with every episode's sandbox delayed a
log-normal time (``jaxes.envs.sandboxes.latency``). The prediction runs the same controller in
``jaxes.controller.simulate`` with workers = slots and ``lognormal:SIGMA`` durations of median
``median_s``: it models the latency alone, so where the policy's own compute is not small beside
it the measured ratio falls short of the predicted one. Writes WORKDIR/heavy_tail.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxes.controller import durations
from jaxes.controller.config import ControllerConfig
from jaxes.controller.controller import Controller
from jaxes.controller.simulate import Simulator
from jaxes.envs.sandboxes.latency import PER, LatencySandbox
from jaxes.experiments import rundirs
from jaxes.experiments.variants import ES_OVERRIDES


def predict(mode: str, max_staleness: int, workers: int, population: int, episodes: int,
            sigma: float, median_s: float, updates: int, num_tasks: int, seed: int) -> dict:
  config = ControllerConfig(mode=mode, population=population, episodes_per_member=episodes,
                            max_staleness=max_staleness, seed=seed)
  sim = Simulator(Controller(config, num_tasks), workers, durations.parse(f"lognormal:{sigma}", median_s, seed),
                  seed=seed)
  return sim.run(updates)


def measure(config, workdir: str, median_s: float, sigma: float, per: str) -> dict:
  from jaxes.envs import make_sandbox
  from jaxes.run_tools import report
  from jaxes.train.trainer import Trainer
  sandbox = LatencySandbox(make_sandbox(config.env.sandbox), median_s, sigma, per, seed=config.seed)
  t = time.perf_counter()
  Trainer(config, workdir, sandbox=sandbox, log=lambda s: print(s, file=sys.stderr),
          write_report=report.write).run()
  run = rundirs.read_run(workdir, config.controller.mode, config.seed)
  return {"updates": run.version, "train_wall_s": run.train_wall_s, "updates_per_hour": run.updates_per_hour,
          "process_wall_s": time.perf_counter() - t, "latency_draws": sandbox.model.draws,
          "latency_mean_s": sandbox.model.total_s / max(sandbox.model.draws, 1),
          "staleness_hist": run.staleness_hist, "dropped": run.dropped}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxes.experiments.heavy_tail", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/demo_grid.py")
  p.add_argument("--workdir", required=True)
  p.add_argument("--init_from", default="", help="a run directory whose version 0 to start from")
  p.add_argument("--median_s", type=float, default=4.0)
  p.add_argument("--sigma", type=float, default=1.0)
  p.add_argument("--per", choices=PER, default="episode")
  p.add_argument("--updates", type=int, default=10)
  p.add_argument("--variants", default="sync,async1")
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--episodes_per_member", type=int, default=2)
  args = p.parse_args(argv)
  from jaxes.train.config import load_config_file
  out = {"args": vars(args), "variants": {}}
  for name in args.variants.split(","):
    c = load_config_file(args.config, name)
    for key, value in ES_OVERRIDES[name].items():
      section, field = key.split(".")
      c[section][field] = value
    c.train.num_updates, c.eval.num_tasks, c.train.plot = args.updates, 0, False
    c.rollout.sandbox_steps = 0                   # a slow command must not stall every slot
    c.rollout.num_slots = c.env.sandbox_workers = args.slots   # no episode waits for a thread
    c.controller.episodes_per_member = args.episodes_per_member
    c.warmstart.init_from = args.init_from
    workdir = os.path.join(args.workdir, name)
    measured = measure(c, workdir, args.median_s, args.sigma, args.per)
    predicted = predict(c.controller.mode, c.controller.max_staleness, args.slots, c.es.population,
                        c.controller.episodes_per_member, args.sigma, args.median_s, 200,
                        c.env.num_train_tasks, c.seed)
    out["variants"][name] = {"measured": measured, "predicted": {
        k: predicted[k] for k in ("updates_per_hour", "utilization", "mean_staleness", "dropped")}}
    print(json.dumps({name: out["variants"][name]}), flush=True)
  v = out["variants"]
  if "sync" in v and "async1" in v:
    out["ratio"] = {kind: v["async1"][kind]["updates_per_hour"] / v["sync"][kind]["updates_per_hour"]
                    for kind in ("measured", "predicted")}
    print(json.dumps({"async1/sync": out["ratio"]}))
  os.makedirs(args.workdir, exist_ok=True)
  with open(os.path.join(args.workdir, "heavy_tail.json"), "w") as f:
    json.dump(out, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
