"""Async vs sync ES scheduling in the discrete-event simulator, plus controller bookkeeping speed.

  python benchmarks/async_vs_sync.py [--updates 300] [--out controller_tables.md]
                                     [--plot benchmarks/async_vs_sync.png] [--quick]

1. Sweep: duration models x K in {0, 1, 2, 4, 8} x overage {drop, wait}, W = 64 workers,
   N = 32, E = 2; updates/hour (virtual), busy and useful utilisation, drops, mean staleness.
   K = 0 is synchronous ES.
2. Target check (docs/design.md, "Performance targets"): lognormal(1.0), W = 64, N = 32, E = 2, several seeds: async K = 1
   busy >= 95% and >= 2.5x the updates/hour of sync.
3. Learning curves of the synthetic objective (through jaxes.es) under sync, Async-1, 10% of
   each cohort delayed 4 or 8 updates, and every result stale by 4.
4. Bookkeeping: results/s of the controller alone (no simulator), target >= 10k/s.
Everything but (4) runs on a virtual clock, so (1)-(3) are exact and machine-independent.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import time

from jaxes.controller import Controller, ControllerConfig
from jaxes.controller import durations
from jaxes.controller.simulate import Simulator

MODELS = ("constant", "lognormal:0.5", "lognormal:1.0", "pareto:1.5", "bimodal", "per-task")
KS = (0, 1, 2, 4, 8)
W, N, E = 64, 32, 2


def run(model, k, overage, updates, seed=0, abort=True, fitness=None, **extra):
  cfg = ControllerConfig(mode="sync" if k == 0 and not extra else "async", population=N,
                         episodes_per_member=E, max_staleness=k, overage=overage, seed=seed,
                         **extra)
  sim = Simulator(Controller(cfg, num_tasks=1000), W, durations.parse(model, seed=seed),
                  seed=seed, fitness=fitness, abort_doomed=abort)
  summary = sim.run(updates)
  summary["curve"] = [(u["time"] / 3600.0, u.get("objective")) for u in sim.updates]
  return summary


def sweep(updates):
  rows = []
  for model in MODELS:
    for overage in ("drop", "wait"):
      for k in KS:
        if k == 0 and overage == "wait":
          continue   # K = 0 is sync under either overage
        s = run(model, k, overage, updates)
        rows.append(dict(model=model, k=k, overage="sync" if k == 0 else overage, **s))
  return rows


def target_check(updates, seeds):
  out = []
  for seed in seeds:
    sync = run("lognormal:1.0", 0, "drop", updates, seed)
    a1 = run("lognormal:1.0", 1, "drop", updates, seed)
    a1_keep = run("lognormal:1.0", 1, "drop", updates, seed, abort=False)
    a2 = run("lognormal:1.0", 2, "drop", updates, seed)
    out.append((seed, sync, a1, a1_keep, a2))
  return out


def learning_curves(updates):
  from jaxes.controller.objective import SyntheticObjective
  settings = [("sync", 0, {}), ("Async-1", 1, {}),
              ("Async-1 + 10% delayed 4", 1, dict(delay_fraction=0.1, delay_updates=4)),
              ("Async-1 + 10% delayed 8", 1, dict(delay_fraction=0.1, delay_updates=8)),
              ("Async-1, all stale by 4", 1, dict(stress_all_stale=4))]
  curves = {}
  for name, k, extra in settings:
    cfg = ControllerConfig(mode="sync" if k == 0 else "async", population=N,
                           episodes_per_member=E, max_staleness=k, **extra)
    fitness = SyntheticObjective(cfg, num_tasks=1000, dim=64, sigma=0.1, learning_rate=0.05)
    s = run("lognormal:1.0", k, "drop", updates, fitness=fitness, **extra)
    curves[name] = s
  return curves


def bookkeeping(results_target=200_000, seed=0):
  """Results/s through next_jobs/report/pop_update alone, with a seeded completion order."""
  out = {}
  for name, cfg in [
      ("sync", ControllerConfig(mode="sync", population=N, episodes_per_member=E)),
      ("async K=1 drop", ControllerConfig(mode="async", population=N, episodes_per_member=E,
                                          max_staleness=1)),
      ("async K=4 wait, 10% delayed 4", ControllerConfig(
          mode="async", population=N, episodes_per_member=E, max_staleness=4, overage="wait",
          delay_fraction=0.1, delay_updates=4)),
  ]:
    for logged in (False, True):
      ctl = Controller(cfg, num_tasks=10_000, log=[] if logged else None)
      rnd = random.Random(seed)
      in_flight, done = [], 0
      start = time.perf_counter()
      while done < results_target:
        in_flight += ctl.next_jobs(W - len(in_flight))
        # Complete a random eighth of what is running (several results per tick).
        rnd.shuffle(in_flight)
        k = max(1, len(in_flight) // 8)
        for job in in_flight[:k]:
          ctl.report(job.job_id, 1.0)
        in_flight = in_flight[k:]
        done += k
        while ctl.pop_update() is not None:
          pass
      elapsed = time.perf_counter() - start
      out[(name, logged)] = (done / elapsed, ctl.version)
  return out


def _fmt_sweep(rows):
  lines = ["| durations | overage | K | updates/h | busy | useful | dropped | mean staleness | "
           "x sync updates/h |", "|---|---|---|---|---|---|---|---|---|"]
  sync = {r["model"]: r["updates_per_hour"] for r in rows if r["overage"] == "sync"}
  for r in rows:
    lines.append(f"| {r['model']} | {r['overage']} | {r['k']} | {r['updates_per_hour']:.2f} | "
                 f"{r['utilization']:.3f} | {r['useful_utilization']:.3f} | {r['dropped']} | "
                 f"{r['mean_staleness']:.2f} | {r['updates_per_hour'] / sync[r['model']]:.2f} |")
  return "\n".join(lines)


def _fmt_target(checks):
  lines = ["| seed | sync updates/h | sync busy | Async-1 updates/h (x sync) | Async-1 busy | "
           "Async-1 useful | Async-1 keep-doomed busy / useful (x sync) | Async-2 busy (x sync) |",
           "|---|---|---|---|---|---|---|---|"]
  for seed, sync, a1, keep, a2 in checks:
    base = sync["updates_per_hour"]
    lines.append(
        f"| {seed} | {base:.2f} | {sync['utilization']:.3f} | {a1['updates_per_hour']:.2f} "
        f"({a1['updates_per_hour'] / base:.2f}x) | {a1['utilization']:.3f} | "
        f"{a1['useful_utilization']:.3f} | {keep['utilization']:.3f} / "
        f"{keep['useful_utilization']:.3f} ({keep['updates_per_hour'] / base:.2f}x) | "
        f"{a2['utilization']:.3f} ({a2['updates_per_hour'] / base:.2f}x) |")
  return "\n".join(lines)


def _fmt_curves(curves):
  lines = ["| setting | objective: initial | after 25% | 50% | 100% of updates | virtual hours | "
           "staleness histogram |", "|---|---|---|---|---|---|---|"]
  for name, s in curves.items():
    c = s["curve"]
    at = lambda f: c[max(0, int(len(c) * f) - 1)][1]
    lines.append(f"| {name} | {s['objective_initial']:.3f} | {at(0.25):.3f} | {at(0.5):.3f} | "
                 f"{at(1.0):.3f} | {s['virtual_hours']:.2f} | {s['staleness_histogram']} |")
  return "\n".join(lines)


def _fmt_bookkeeping(book):
  lines = ["| controller | event log | results/s | updates made |", "|---|---|---|---|"]
  for (name, logged), (rate, version) in book.items():
    lines.append(f"| {name} | {'on' if logged else 'off'} | {rate:,.0f} | {version} |")
  return "\n".join(lines)


def plot(rows, curves, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
  (ax_rate, ax_useful), (ax_time, ax_step) = axes
  colors = plt.get_cmap("tab10").colors
  for model, color in zip(MODELS, colors):
    for overage, style in (("drop", "-"), ("wait", "--")):
      pts = [r for r in rows if r["model"] == model and (r["overage"] in (overage, "sync"))]
      ks = [r["k"] for r in pts]
      label = f"{model} ({overage})"
      ax_rate.plot(ks, [r["updates_per_hour"] for r in pts], style, marker="o", color=color,
                   label=label)
      ax_useful.plot(ks, [r["useful_utilization"] for r in pts], style, marker="o", color=color,
                     label=label)
  ax_rate.set(xlabel="max_staleness K (0 = sync)", ylabel="updates / virtual hour",
              title=f"Updates per hour (W={W}, N={N}, E={E})")
  ax_useful.set(xlabel="max_staleness K (0 = sync)", ylabel="useful utilisation",
                title="Worker time whose results were consumed", ylim=(0, 1.02))
  ax_rate.legend(fontsize=7, ncol=2)
  for name, s in curves.items():
    obj = [s["objective_initial"]] + [o for _, o in s["curve"]]
    ax_time.plot([0.0] + [t for t, _ in s["curve"]], obj, label=name)
    ax_step.plot(range(len(obj)), obj, label=name)
  ax_time.set(xlabel="virtual hours (lognormal(1.0) durations)", ylabel="objective",
              title="Synthetic objective through jaxes.es vs time")
  ax_step.set(xlabel="updates", ylabel="objective", title="... vs updates (effect of staleness)")
  ax_time.legend(fontsize=8)
  ax_step.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--updates", type=int, default=300)
  p.add_argument("--curve_updates", type=int, default=150)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--out", default="")
  p.add_argument("--plot", default="")
  p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
  args = p.parse_args()
  if args.quick:
    args.updates, args.curve_updates, args.seeds = 40, 20, 1

  rows = sweep(args.updates)
  checks = target_check(args.updates, range(args.seeds))
  curves = learning_curves(args.curve_updates)
  book = bookkeeping(20_000 if args.quick else 200_000)

  ok_busy = all(a1["utilization"] >= 0.95 for _, _, a1, _, _ in checks)
  ok_speed = all(a1["updates_per_hour"] >= 2.5 * s["updates_per_hour"] for _, s, a1, _, _ in checks)
  ok_book = min(rate for rate, _ in book.values()) >= 10_000
  cpu = subprocess.run(["sh", "-c", "nproc; uname -m"], capture_output=True, text=True)
  cores, arch = cpu.stdout.split()
  when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
  report = "\n\n".join([
      f"Run: `python benchmarks/async_vs_sync.py --updates {args.updates} --curve_updates "
      f"{args.curve_updates} --seeds {args.seeds}`; {when}; bookkeeping measured on a "
      f"{cores}-core {arch} host.",
      "### Sweep (virtual clock; exact)\n\n" + _fmt_sweep(rows),
      "### Target check: lognormal(1.0), W=64, N=32, E=2\n\n" + _fmt_target(checks) +
      f"\n\nAsync-1 busy >= 95%: {'PASS' if ok_busy else 'FAIL'}; "
      f"Async-1 >= 2.5x sync updates/h: {'PASS' if ok_speed else 'FAIL'}",
      "### Learning curves (synthetic objective via jaxes.es, lognormal(1.0))\n\n" +
      _fmt_curves(curves),
      "### Controller bookkeeping alone (wall clock)\n\n" + _fmt_bookkeeping(book) +
      f"\n\n>= 10k results/s: {'PASS' if ok_book else 'FAIL'}",
  ])
  print(report)
  if args.out:
    with open(args.out, "w") as f:
      f.write(report + "\n")
  if args.plot:
    plot(rows, curves, args.plot)


if __name__ == "__main__":
  main()
