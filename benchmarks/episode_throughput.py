"""End-to-end rollout throughput of the trainer: held-out episodes and ES updates with real local
sandboxes, timing every engine call by kind.

  python benchmarks/episode_throughput.py --init_from runs/demo [--config configs/demo.py]
      [--updates 3 --eval_tasks 32 --sandbox_steps K --mode sync|async]

Uses the demo's policy (``--init_from``: a workdir whose version-0 parameters and tokenizer to
load) and reports wall time, engine calls (prefill-carrying / decode-only) with the seconds of the
engine steps of each kind (``EpisodeRunner.stats``), episodes/s and tokens. Compare two code versions by running this file against each with
``PYTHONPATH`` side by side, so both see the same machine load; or the cost of the deterministic
schedule by running ``--sandbox_steps 0`` and ``--sandbox_steps 3`` side by side; or async vs
sync updates/hour by running ``--mode async`` and ``--mode sync`` side by side (``--eval_tasks 0``:
no evaluation, the training loop only). Updates/hour is reported over the whole loop and over the
updates after the first (whose window holds most of the compiles), from the metrics lines.
The counters include the engine's ``prefill_hold`` and ``prefill_held`` (row-steps a new prefill
waited to share a call) where the engine has them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="configs/demo.py")
  ap.add_argument("--init_from", required=True)
  ap.add_argument("--updates", type=int, default=3)
  ap.add_argument("--eval_tasks", type=int, default=32)
  ap.add_argument("--sandbox_steps", type=int, default=None, help="default: the config's")
  ap.add_argument("--mode", choices=("sync", "async"), default=None,
                  help="the controller's mode (default: the config's)")
  a = ap.parse_args()

  from jaxes.train.config import load_config_file
  c = load_config_file(a.config)
  c.warmstart.init_from = a.init_from
  c.train.num_updates, c.train.eval_every = a.updates, 0
  c.train.progress_bar, c.train.plot = False, False
  c.eval.num_tasks = a.eval_tasks
  if a.sandbox_steps is not None:
    c.rollout.sandbox_steps = a.sandbox_steps
  if a.mode is not None:
    c.controller.mode = a.mode
    if a.mode == "sync":   # a staleness bound is async's
      c.controller.max_staleness = 0

  from jaxes.train import metrics
  from jaxes.train.trainer import Trainer
  workdir = tempfile.mkdtemp(prefix="jaxes-episode-throughput-")
  try:
    t = time.perf_counter()
    trainer = Trainer(c, workdir, log=lambda s: None)
    summary = trainer.run()
    wall = time.perf_counter() - t
    stats = trainer.runner.stats()
    lines = [r for r in metrics.read_metrics(os.path.join(workdir, "metrics.jsonl")) if "time" in r]
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  episodes = 2 * a.eval_tasks + a.updates * c.es.population * c.controller.episodes_per_member
  steps = {"prefill": (stats["prefill_calls"], stats["prefill_step_s"]),
           "decode": (stats["decode_calls"], stats["decode_s"] - stats["prefill_step_s"])}
  result = {"sandbox_steps": c.rollout.sandbox_steps, "wall_s": wall, "episodes": episodes,
            "episodes_per_s": episodes / wall,
            "tokens_decoded": stats["tokens_decoded"], "tokens_prefilled": stats["tokens_prefilled"],
            "engine_steps": stats["steps"], "prefill_held": stats.get("prefill_held"),
            "prefill_hold": getattr(trainer.runner.engine, "prefill_hold", None),
            "multi_version_calls": stats["multi_version_calls"],
            "calls": {k: {"count": n, "total_s": s} for k, (n, s) in steps.items()},
            "mode": c.controller.mode, "updates": summary["updates_this_run"],
            "updates_per_hour": summary["updates_per_hour"],
            "update_wall_s": [r["time"]["wall_s"] for r in lines],
            "updates_per_hour_after_first": (3600.0 * (len(lines) - 1)
                                             / sum(r["time"]["wall_s"] for r in lines[1:])
                                             if len(lines) > 1 else None),
            "generate_s": sum(r["time"]["generate_s"] for r in lines),
            "update_s": sum(r["time"]["update_s"] for r in lines),
            "slot_utilisation": [r["slot_utilisation"] for r in lines],
            "staleness_mean": [r["staleness_mean"] for r in lines],
            "dropped": sum(r["dropped"] for r in lines),
            "heldout_before": summary["before"] and summary["before"]["success"],
            "heldout_after": summary["after"] and summary["after"]["success"]}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
