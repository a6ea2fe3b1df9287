"""Stale-result policies side by side in the discrete-event simulator (issue 34).

  python benchmarks/staleness_policies.py [--updates 80] [--seeds 0,1,2] [--update_seconds 30,240]

Heavy-tailed duration models x {sync, Async-1 under drop, wait, weight, baseline_only, pace;
throttle at K = 2 issuing one update ahead (the grid's async2_throttle); Async-1 under drop with
4-turn episodes whose later turns move to the newest weights (the in-flight version change,
async1_switch)}, W = 64 workers, N = 32, E = 2, K = 1 unless the row says, each update keeping the trainer busy ``update_seconds``
(virtual; results finishing meanwhile wait in the pool: 30 s leaves the rollouts the bottleneck,
240 s makes the trainer one, which is where PACE's pool budget has something to reject). Per cell, the mean over seeds of:
updates/hour, useful utilisation, mean staleness, its generation and waiting parts, the mean
effective staleness the ES steps see (staleness weighted by the policy's weights), members
dropped/rejected per update, and the synthetic objective (through jaxes.es) after the run.
Everything runs on a virtual clock: the table is exact and machine-independent.
"""
from __future__ import annotations

import argparse

from jaxes.controller import Controller, ControllerConfig, durations, policies
from jaxes.controller.objective import SyntheticObjective
from jaxes.controller.simulate import Simulator

MODELS = ("lognormal:1.0", "pareto:1.5", "bimodal", "per-task")
W, N, E, K = 64, 32, 2, 1
KEYS = ("updates_per_hour", "useful_utilization", "mean_staleness", "mean_generation_staleness",
        "mean_waiting_staleness", "mean_effective_staleness", "dropped", "rejected",
        "switched_results", "objective_final")


# Row label -> (controller settings, simulator settings) beyond the defaults above.
ROWS = {"sync": ({"mode": "sync", "max_staleness": 0}, {}),
        **{name: ({"overage": name}, {}) for name in policies.POLICIES if name != "throttle"},
        "throttle K=2 D=1": ({"overage": "throttle", "max_staleness": 2, "issue_depth": 1}, {}),
        "drop, 4 turns, switch": ({"overage": "drop"}, {"turns": 4, "switch_versions": True})}


def run(model: str, row: str, updates: int, seed: int, update_seconds: float) -> dict:
  controller, simulator = ROWS[row]
  cfg = ControllerConfig(**{"mode": "async", "population": N, "episodes_per_member": E,
                            "max_staleness": K, "seed": seed, **controller})
  fitness = SyntheticObjective(cfg, num_tasks=1000, seed=seed)
  sim = Simulator(Controller(cfg, num_tasks=1000), W, durations.parse(model, seed=seed), seed=seed,
                  fitness=fitness, update_seconds=update_seconds, **simulator)
  return sim.run(updates)


def table(updates: int, seeds: list[int], update_seconds: float) -> str:
  lines = [f"update_seconds = {update_seconds:g}", "", "| durations | policy | updates/h | useful | staleness (gen + wait) | effective | "
           "dropped / upd | rejected / upd | moved / upd | objective |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for model in MODELS:
    for policy in ROWS:
      runs = [run(model, policy, updates, s, update_seconds) for s in seeds]
      m = {k: sum(r[k] for r in runs) / len(runs) for k in KEYS}
      lines.append(
          f"| {model} | {policy} | {m['updates_per_hour']:.1f} | {m['useful_utilization']:.3f} | "
          f"{m['mean_staleness']:.3f} ({m['mean_generation_staleness']:.3f} + "
          f"{m['mean_waiting_staleness']:.3f}) | {m['mean_effective_staleness']:.3f} | "
          f"{m['dropped'] / updates:.2f} | {m['rejected'] / updates:.2f} | "
          f"{m['switched_results'] / updates:.2f} | {m['objective_final']:.4f} |")
      print(lines[-1], flush=True)
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--updates", type=int, default=80)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--update_seconds", default="30,240")
  args = p.parse_args()
  print(f"W={W} N={N} E={E} K={K} update_seconds={args.update_seconds} updates={args.updates} "
        f"seeds={args.seeds}")
  for u in args.update_seconds.split(","):
    print(table(args.updates, [int(s) for s in args.seeds.split(",")], float(u)), "\n")


if __name__ == "__main__":
  main()
