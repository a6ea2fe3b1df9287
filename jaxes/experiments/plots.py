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


def measure_curves(result: dict, key: str = "value") -> dict[str, dict]:
  """variant -> {versions, mean, stderr, seeds}: the held-out measure (``key``: or an evaluation's
  ``param_drift``, ``kl_to_initial``, ``probe``, ``mc_probe``) at every version that each of the
  variant's finished runs evaluated."""
  curves = {}
  for v in result["variants"]:
    runs = [r for r in result["runs"] if r["variant"] == v["variant"] and r["status"] == "finished"]
    if not runs:
      continue
    by_run = [{e["version"]: e[key] for e in r["evals"] if e.get(key) is not None} for r in runs]
    if not all(by_run):
      continue
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
  from jaxes.experiments import stats
  paths = [os.path.join(workdir, f"{result['measure']}.png"), os.path.join(workdir, "staleness.png")]
  plot_measure(result, paths[0])
  plot_staleness(result, paths[1])
  if result.get("paired") and stats.plot_heatmap(result["paired"], os.path.join(workdir, "surface.png"),
                                                 title=f"grid {os.path.basename(os.path.abspath(workdir))}"):
    paths.append(os.path.join(workdir, "surface.png"))
  return paths


# The paper's held-out success (Qwen2.5-7B-Instruct, Endless Terminals, 3 eval seeds; delays as
# sync's 25.4% plus their reported change), shown beside a grid's own numbers.
PAPER_SUCCESS = {"sync": 0.254, "async1": 0.259, "delay4": 0.254 - 0.016, "delay8": 0.254 - 0.031,
                 "grpo": 0.290}


def grid_html(result: dict) -> str:
  """The grid's report page: each variant's curve (mean ± s.e. over seeds) side by side on one
  scale, and a table of its final measure beside the paper's. Self-contained as ``report.render``."""
  from jaxes.run_tools import report
  esc, measure = report.esc, result["measure"]
  curves = measure_curves(result)
  everything = [m + s for c in curves.values() for m, s in zip(c["mean"], c["stderr"])]
  everything += [m - s for c in curves.values() for m, s in zip(c["mean"], c["stderr"])]
  xs = [x for c in curves.values() for x in c["versions"]]
  y_range, x_range = report.value_range(everything, lo=0.0) if everything else (0, 1), report.value_range(xs, 0)
  charts = []
  for i, (name, c) in enumerate(curves.items()):
    color = report.COLORS[i % len(report.COLORS)]
    chart = report.Chart(f"{name} ({c['seeds']} seeds)", x_range, y_range, "policy version",
                         f"held-out {measure}")
    chart.errorbars(c["versions"], c["mean"], c["stderr"], color)
    chart.line(c["versions"], c["mean"], color, "mean ± s.e. over seeds")
    if measure == "success" and name in PAPER_SUCCESS:
      chart.line(x_range, [PAPER_SUCCESS[name]] * 2, "#555", "paper (7B, final)", markers=False, dash="5 3")
    charts.append(chart.svg())
  charts += _drift_charts(result)
  rows = []
  for v in result["variants"]:
    after = v.get("after")
    paper = PAPER_SUCCESS.get(v["variant"]) if measure == "success" else None
    final = "—" if not after else f"{after['mean']:.3f} ± {after['stderr']:.3f}"
    rows.append(f"<tr><td>{esc(v['variant'])}</td><td>{esc(v['status'])}</td><td>{final}</td>"
                f"<td>{'—' if paper is None else f'{paper:.3f}'}</td>"
                f"<td>{esc(v.get('description') or v.get('reason') or '')}</td></tr>")
  body = (f"<h1>jaxes grid <code>{esc(os.path.basename(os.path.abspath(result['workdir'])))}</code></h1>"
          f"<p>Held-out {esc(measure)} per variant, seeds {esc(','.join(map(str, result['seeds'])))}; "
          "the paper's numbers are Qwen2.5-7B-Instruct on Endless Terminals, a different scale: "
          "compare the ordering, not the level. All numbers: table.md / table.json.</p>"
          f"<table><tr><th>variant</th><th>runs</th><th>final {esc(measure)}</th><th>paper</th>"
          f"<th>what it is</th></tr>{''.join(rows)}</table>"
          + _paired_html(result, esc) +
          f'<h2>Curves</h2><div class="charts">{"".join(charts) or "<p>No finished run yet.</p>"}</div>')
  return report.page(f"jaxes grid: {result['workdir']}", body)


def _drift_charts(result: dict) -> list[str]:
  """Per variant on one chart each: param_drift, kl_to_initial, the probe measure and the
  multiple-choice probe's accuracy against the version (mean ± s.e. over seeds), where the runs
  measured them."""
  from jaxes.run_tools import report
  charts = []
  for key, label in (("param_drift", "‖θ_v − θ₀‖ (param_drift)"),
                     ("kl_to_initial", "KL(π_θ₀ ‖ π_θv) per token"),
                     ("probe", f"probe {result['measure']} (off-task families)"),
                     ("mc_probe", "multiple-choice probe accuracy")):
    curves = measure_curves(result, key)
    if not curves:
      continue
    ys = [y for c in curves.values() for m, s in zip(c["mean"], c["stderr"]) for y in (m - s, m + s)]
    xs = [x for c in curves.values() for x in c["versions"]]
    chart = report.Chart(label, report.value_range(xs, 0), report.value_range(ys, lo=0.0), "policy version", key)
    for i, (name, c) in enumerate(curves.items()):
      color = report.COLORS[i % len(report.COLORS)]
      chart.errorbars(c["versions"], c["mean"], c["stderr"], color)
      chart.line(c["versions"], c["mean"], color, name, dash="4 2" if name.endswith("_l2") else "")
    charts.append(chart.svg())
  return charts


def _paired_html(result: dict, esc) -> str:
  """The surface's heat map and the paired statistics (jaxes.experiments.stats) as HTML."""
  from jaxes.experiments import stats
  summary = result.get("paired")
  if not summary:
    return ""
  rows = []
  for r in summary["table"]:
    p, ref = r["vs_sync"], r["name"] == "sync"
    rows.append(f"<tr><td>{esc(r['name'])}</td>"
                f"<td>{'—' if r['mean_staleness'] is None else format(r['mean_staleness'], '.2f')}</td>"
                f"<td>{'(reference)' if ref else stats.format_paired(p)}</td>"
                f"<td>{'' if ref else stats.format_ci(p)}</td><td>{'' if ref else stats.format_p(p)}</td>"
                f"<td>{'yes' if p and p['resolved'] else ('no' if p else '—')}</td>"
                f"<td>{r['seeds_for_target'] or '—'}</td><td>{r.get('seeds_for_power') or '—'}</td></tr>")
  slopes = "".join(f"<tr><td>{esc(str(g))}</td><td>{stats.format_paired(s, 2)}</td><td>{stats.format_ci(s, 2)}</td>"
                   f"<td>{s['n']}</td><td>{esc(stats.format_fit(s.get('lack_of_fit')))}</td></tr>"
                   for g, s in summary["slopes"].items())
  heat = stats.heatmap_html(summary, esc)
  unit = "points of the held-out measure"
  return ((f"<h2>Surface</h2>{heat}" if heat else "")
          + f"<h2>Paired vs sync</h2><p>{esc(stats.rules_line(unit))}</p>"
          f"<table><tr><th>variant</th><th>mean staleness</th><th>vs sync</th><th>95% t-interval</th>"
          f"<th>p</th><th>resolved</th><th>seeds for s.e. {summary['target_se']:g}</th>"
          f"<th>seeds for {stats.POWER:.0%} power</th></tr>{''.join(rows)}</table>"
          + (f"<p>Points per unit of mean staleness, by {esc(str(summary['slope_by']))} (read only "
             f"where the line fits):</p><table><tr><th>{esc(str(summary['slope_by']))}</th><th>slope</th>"
             f"<th>95% t-interval</th><th>seeds</th><th>line</th></tr>{slopes}</table>"
             if slopes else ""))


def write_grid_report(result: dict, workdir: str) -> str:
  from jaxes.run_tools import report
  return report.write_page(os.path.join(workdir, "report.html"), grid_html(result))
