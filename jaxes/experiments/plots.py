"""The grid's plots: the held-out measure (success, or WebShop's mean reward) against updates per
variant (mean over seeds, band ± s.e. over seeds), and each variant's staleness histogram (share
of consumed results)."""
from __future__ import annotations

import os

import numpy as np

from jaxes.train.metrics import mean_stderr


def _pyplot():
  import matplotlib   # heavy: only when plotting
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def measure_curves(result: dict) -> dict[str, dict]:
  """variant -> {versions, mean, stderr, seeds}: the held-out measure at every version that each
  of the variant's finished runs evaluated."""
  curves = {}
  for v in result["variants"]:
    runs = [r for r in result["runs"] if r["variant"] == v["variant"] and r["status"] == "finished"]
    if not runs:
      continue
    by_run = [{e["version"]: e["value"] for e in r["evals"]} for r in runs]
    versions = sorted(set.intersection(*(set(b) for b in by_run)))
    stats = [mean_stderr([b[x] for b in by_run]) for x in versions]
    curves[v["variant"]] = {"versions": versions, "mean": [m for m, _ in stats],
                            "stderr": [s for _, s in stats], "seeds": len(runs)}
  return curves


def plot_measure(result: dict, path: str, title: str = "") -> None:
  plt = _pyplot()
  measure = result["measure"]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, c in measure_curves(result).items():
    x, m, s = np.array(c["versions"]), np.array(c["mean"]), np.array(c["stderr"])
    line, = ax.plot(x, m, "o-", label=f"{name} ({c['seeds']} seeds)")
    ax.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.2)
  ax.set_xlabel("policy version (updates applied)")
  ax.set_ylabel(f"held-out {measure} (mean ± s.e. over seeds)")
  ax.legend(fontsize=8, loc="best")
  ax.set_title(title or f"held-out {measure} vs updates")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_staleness(result: dict, path: str) -> None:
  plt = _pyplot()
  variants = [v for v in result["variants"] if v.get("staleness") and v["staleness"]["results"]]
  fig, ax = plt.subplots(figsize=(7, 4))
  width = 0.8 / max(len(variants), 1)
  for i, v in enumerate(variants):
    hist = np.array(v["staleness"]["hist"], dtype=float)
    ax.bar(np.arange(len(hist)) + (i - (len(variants) - 1) / 2) * width, hist / hist.sum(), width,
           label=f"{v['variant']} (mean {v['staleness']['mean']:.2f})")
  ax.set_xlabel("staleness of a consumed result (updates)")
  ax.set_ylabel("share of consumed results")
  ax.set_yscale("log")
  ax.legend(fontsize=8)
  ax.set_title("staleness histograms (pooled over seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write(result: dict, workdir: str) -> list[str]:
  paths = [os.path.join(workdir, f"{result['measure']}.png"), os.path.join(workdir, "staleness.png")]
  plot_measure(result, paths[0])
  plot_staleness(result, paths[1])
  return paths
