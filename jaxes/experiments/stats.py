"""Paired statistics of a staleness surface: each cell against sync on the same seeds, whether
the difference is resolved, how many seeds would resolve it, the fitted points lost per unit of
mean staleness, and the heat map (PNG and HTML) with the paper's two points on it.

A *row* is one variant or cell: ``{"seeds": [...], "diff": [per-seed score minus sync's, in
points], "mean_staleness": [per seed]}`` (None where a seed is missing). Shared by the LLM grid
(``jaxes.experiments.grid``, per-seed paired differences on the same held-out tasks) and the
fast lane (``jaxes.experiments.fastlane``).
"""
from __future__ import annotations

import math

import numpy as np

from jaxes.experiments import surface

RESOLVED_SE = 2.0   # resolved: |mean difference| > 2 standard errors
TARGET_SE = 1.0     # points: the default s.e. the seed recommendation aims at
# The paper's two points (arXiv 2610.04196, abstract): 10% of each cohort delayed 4 / 8 updates
# costs 1.6 / 3.1 points of held-out success.
PAPER_POINTS = {(0.1, 4): -1.6, (0.1, 8): -3.1}


def paired(diffs) -> dict | None:
  """Mean ± s.e. of per-seed paired differences, their s.d. (None from one seed: table.json stays
  free of NaN), and whether resolved."""
  d = np.asarray([x for x in diffs if x is not None and math.isfinite(x)], float)
  if d.size == 0:
    return None
  sd = float(d.std(ddof=1)) if d.size > 1 else None
  se = sd / math.sqrt(d.size) if d.size > 1 else None
  return {"mean": float(d.mean()), "stderr": se, "sd": sd, "n": int(d.size),
          "resolved": bool(d.size > 1 and abs(d.mean()) > RESOLVED_SE * se)}


def seeds_for(sd: float, target_se: float) -> int | None:
  """Seeds whose mean has standard error ``target_se`` given a pilot's per-seed s.d."""
  if sd is None or not (sd > 0 and target_se > 0 and math.isfinite(sd)):
    return None
  return max(2, math.ceil((sd / target_se) ** 2))


def seeds_to_resolve(sd: float, effect: float) -> int | None:
  """Seeds for |effect| > 2 s.e. (in expectation) given a per-seed s.d."""
  return seeds_for(sd, abs(effect) / RESOLVED_SE) if effect else None


def slope(points_by_seed: list[list[tuple[float, float]]]) -> dict | None:
  """Least-squares slope of difference on mean staleness, fitted per seed (intercept free), then
  mean ± s.e. over seeds: points per unit of mean staleness (negative: staleness costs)."""
  slopes = []
  for pts in points_by_seed:
    x = np.array([p[0] for p in pts], float)
    y = np.array([p[1] for p in pts], float)
    if len(x) >= 2 and np.ptp(x) > 0:
      xc = x - x.mean()
      slopes.append(float((xc * (y - y.mean())).sum() / (xc * xc).sum()))
  return paired(slopes)


def _group_axis(labels: list[str]) -> str | None:
  if "delay_fraction" in labels:
    return "delay_fraction"
  return labels[0] if labels else None


def surface_summary(rows: dict[str, dict], seeds=None, target_se: float = TARGET_SE) -> dict:
  """The table, the slopes and the heat map's matrix of a surface from its rows (sync and
  async1 are references; cells are named by ``jaxes.experiments.surface``)."""
  table, labels = [], []
  for name, r in rows.items():
    values = surface.cell_values(name)
    for label in values:
      if label not in labels:
        labels.append(label)
    p = r.get("vs_sync") or (paired(r["diff"]) if name != "sync" and "diff" in r else None)
    stale = [s for s in r.get("mean_staleness", []) if s is not None]
    table.append({"name": name, "values": values, "vs_sync": p,
                  "mean_staleness": float(np.mean(stale)) if stale else None,
                  "seeds_for_target": seeds_for(p["sd"], target_se) if p else None,
                  "seeds_to_resolve": seeds_to_resolve(p["sd"], p["mean"]) if p else None,
                  "score": paired(r["score"]) if "score" in r else None})
  group = _group_axis(labels)
  per_seed = lambda name: {s: (x, d) for s, x, d in zip(rows[name]["seeds"], rows[name]["mean_staleness"],
                                                         _diffs(rows, name)) if x is not None and d is not None}
  groups = sorted({t["values"].get(group) for t in table if t["values"]}, key=_num) if group else []

  def fits(refs):
    out = {}
    for g in groups + ["all"]:
      names = refs + [t["name"] for t in table if t["values"] and (g == "all" or t["values"].get(group) == g)]
      seed_ids = sorted(set.union(*(set(per_seed(n)) for n in names))) if names else []
      fit = slope([[per_seed(n)[s] for n in names if s in per_seed(n)] for s in seed_ids])
      if fit:
        out[g] = {**fit, "cells": names}
    return out

  # Through sync and async1 (and the cells), and -- where async1 ran -- above async1 alone: the
  # cells' delays sit on top of Async-1, so the second is the delays' own cost per unit.
  slopes = fits([n for n in ("sync", "async1") if n in rows])
  above = fits(["async1"]) if "async1" in rows else {}
  heat = None
  if len(labels) == 2:
    rows_v = sorted({t["values"][labels[0]] for t in table if t["values"]}, key=_num)
    cols_v = sorted({t["values"][labels[1]] for t in table if t["values"]}, key=_num)
    by = {(t["values"][labels[0]], t["values"][labels[1]]): t for t in table if t["values"]}
    heat = {"row_label": labels[0], "col_label": labels[1], "rows": rows_v, "cols": cols_v,
            "cells": [[(by.get((a, b)) or {}).get("vs_sync") for b in cols_v] for a in rows_v],
            "paper": _paper_positions(labels, rows_v, cols_v)}
  return {"table": table, "axes": labels, "slope_by": group, "slopes": slopes,
          "slopes_above_async1": above, "heat": heat,
          "target_se": target_se, "seeds": seeds}


def _diffs(rows, name):
  r = rows[name]
  if name == "sync":
    return [0.0 if s is not None else None for s in r["mean_staleness"]]
  return r["diff"] if "diff" in r else None


def _num(v):
  try:
    return (0, float(v))
  except (TypeError, ValueError):
    return (1, str(v))


def _paper_positions(labels, rows_v, cols_v) -> list[dict]:
  """Where the paper's points fall on the heat map (axes delay_fraction x delay_updates)."""
  if set(labels) != {"delay_fraction", "delay_updates"}:
    return []
  out = []
  for (fraction, delay), value in PAPER_POINTS.items():
    coords = {"delay_fraction": fraction, "delay_updates": delay}
    r = [i for i, v in enumerate(rows_v) if _num(v)[1] == coords[labels[0]]]
    c = [i for i, v in enumerate(cols_v) if _num(v)[1] == coords[labels[1]]]
    out.append({"fraction": fraction, "delay": delay, "points": value,
                "row": r[0] if r else None, "col": c[0] if c else None})
  return out


# -- text ---------------------------------------------------------------------------------------------
def format_paired(p, digits=1) -> str:
  """``+d ± s.e.`` (— when absent)."""
  if not p:
    return "—"
  se = "—" if p["stderr"] is None else f"{p['stderr']:.{digits}f}"
  return f"{p['mean']:+.{digits}f} ± {se}"


def surface_markdown(summary: dict, unit: str = "points") -> str:
  t = summary["target_se"]
  lines = [f"Paired difference vs sync on the same seeds ({unit}), mean ± s.e. over seeds; "
           f"resolved: |d| > {RESOLVED_SE:g} s.e.; seeds for s.e. {t:g}: from the per-seed s.d.; "
           "seeds to resolve: for |d| > 2 s.e. at the measured d and s.d.", "",
           "| cell | mean staleness | score | vs sync | resolved | s.d. per seed | seeds for s.e. "
           f"{t:g} | seeds to resolve |", "| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: |"]
  for r in summary["table"]:
    p = r["vs_sync"]
    score = (f"{r['score']['mean']:.1f} ± " + (f"{r['score']['stderr']:.1f}" if r["score"]["n"] > 1 else "—")
             if r.get("score") else "—")
    lines.append(f"| {r['name']} | {'—' if r['mean_staleness'] is None else format(r['mean_staleness'], '.2f')} | "
                 f"{score} | {'(reference)' if r['name'] == 'sync' else format_paired(p)} | "
                 f"{'yes' if p and p['resolved'] else ('no' if p else '—')} | "
                 f"{'—' if not p or p['sd'] is None else format(p['sd'], '.1f')} | "
                 f"{r['seeds_for_target'] or '—'} | {r['seeds_to_resolve'] or '—'} |")
  if summary["slopes"]:
    lines += ["", f"Points per unit of mean staleness (least squares per seed over sync, async1 and "
              f"the cells, by {summary['slope_by']}; mean ± s.e. over seeds):", "",
              f"| {summary['slope_by']} | slope | seeds | resolved |", "| --- | ---: | ---: | :---: |"]
    for g, s in summary["slopes"].items():
      lines.append(f"| {g} | {format_paired(s, 2)} | {s['n']} | {'yes' if s['resolved'] else 'no'} |")
  if summary.get("slopes_above_async1"):
    lines += ["", "The same without sync (async1 and the cells: the delays' own cost per unit):", "",
              f"| {summary['slope_by']} | slope | seeds | resolved |", "| --- | ---: | ---: | :---: |"]
    for g, s in summary["slopes_above_async1"].items():
      lines.append(f"| {g} | {format_paired(s, 2)} | {s['n']} | {'yes' if s['resolved'] else 'no'} |")
  return "\n".join(lines) + "\n"


# -- the heat map ---------------------------------------------------------------------------------------
def _limits(heat) -> float:
  vals = [abs(p["mean"]) for row in heat["cells"] for p in row if p]
  vals += [abs(p["points"]) for p in heat["paper"]]
  return max(vals + [1e-9])


def plot_heatmap(summary: dict, path: str, title: str = "") -> str | None:
  """surface.png: the paired difference per cell (diverging colours, 0 white), ``d ± s.e.``
  written in each cell (* resolved), the paper's points as circles in their cells coloured on
  the same scale. None when the surface is not two axes."""
  heat = summary["heat"]
  if heat is None:
    return None
  import matplotlib   # heavy: only when plotting
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  lim = _limits(heat)
  mean = np.array([[p["mean"] if p else np.nan for p in row] for row in heat["cells"]])
  fig, ax = plt.subplots(figsize=(1.3 * len(heat["cols"]) + 2.5, 0.9 * len(heat["rows"]) + 1.8))
  im = ax.imshow(mean, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
  for i, row in enumerate(heat["cells"]):
    for j, p in enumerate(row):
      if p:
        se = f"{p['stderr']:.1f}" if p["n"] > 1 else "— (1 seed)"
        ax.text(j, i, f"{p['mean']:+.1f}{'*' if p['resolved'] else ''}\n± {se}",
                ha="center", va="center", fontsize=8, color="w" if abs(p["mean"]) > 0.6 * lim else "k")
  for pp in heat["paper"]:
    if pp["row"] is not None and pp["col"] is not None:
      ax.scatter([pp["col"] + 0.32], [pp["row"] - 0.28], s=160, c=[pp["points"]], cmap="RdBu",
                 vmin=-lim, vmax=lim, edgecolors="k", linewidths=1.2, zorder=3)
      ax.text(pp["col"] + 0.32, pp["row"] - 0.28, "P", ha="center", va="center", fontsize=6, zorder=4)
  ax.set_xticks(range(len(heat["cols"])), heat["cols"])
  ax.set_yticks(range(len(heat["rows"])), heat["rows"])
  ax.set_xlabel(heat["col_label"])
  ax.set_ylabel(heat["row_label"])
  paper = ", ".join(f"{p['fraction']:g} x {p['delay']}: {p['points']:+.1f}" for p in heat["paper"])
  ax.set_title((title + "\n" if title else "") + "vs sync, points (* |d| > 2 s.e.)"
               + (f"; P = paper ({paper})" if paper else ""), fontsize=8)
  fig.colorbar(im, ax=ax, shrink=0.8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def heatmap_html(summary: dict, esc=str) -> str:
  """The heat map as an HTML table (inline colours; the report page stays one file)."""
  heat = summary["heat"]
  if heat is None:
    return ""
  lim = _limits(heat)

  def colour(v):
    a = min(abs(v) / lim, 1.0)
    r, g, b = (255, int(255 * (1 - a)), int(255 * (1 - a))) if v < 0 else (int(255 * (1 - a)), int(255 * (1 - a)), 255)
    return f"rgb({r},{g},{b})"

  paper = {(p["row"], p["col"]): p for p in heat["paper"]}
  head = "".join(f"<th>{esc(str(c))}</th>" for c in heat["cols"])
  body = []
  for i, (label, row) in enumerate(zip(heat["rows"], heat["cells"])):
    tds = []
    for j, p in enumerate(row):
      pp = paper.get((i, j))
      mark = f"<br><small>paper {pp['points']:+.1f}</small>" if pp else ""
      if p:
        se = f"{p['stderr']:.1f}" if p["n"] > 1 else "— (1 seed)"
        text = f"{'<b>' if p['resolved'] else ''}{p['mean']:+.1f} ± {se}{'</b>' if p['resolved'] else ''}"
        tds.append(f'<td style="background:{colour(p["mean"])}">{text}{mark}</td>')
      else:
        tds.append(f"<td>—{mark}</td>")
    body.append(f"<tr><th>{esc(str(label))}</th>{''.join(tds)}</tr>")
  return (f"<table><tr><th>{esc(heat['row_label'])} \\ {esc(heat['col_label'])}</th>{head}</tr>"
          f"{''.join(body)}</table><p>Paired difference vs sync in points, mean ± s.e. over seeds; "
          "bold: resolved (|d| &gt; 2 s.e.); red: worse than sync.</p>")


def grid_rows(result: dict) -> dict[str, dict]:
  """A grid table's variants as rows (points = 100 x the held-out measure): each finished run's
  paired difference vs sync of its seed (same held-out tasks) and its mean staleness."""
  measure, rows = result["measure"], {}
  for v in result["variants"]:
    if v["status"] == "not available":
      continue
    runs = [r for r in result["runs"] if r["variant"] == v["variant"]]
    done = [r["status"] == "finished" for r in runs]
    rows[v["variant"]] = {
        "seeds": [r["seed"] for r in runs],
        "diff": [100 * r["vs_sync"][measure] if ok and r["vs_sync"] else None for r, ok in zip(runs, done)],
        "mean_staleness": [r["staleness"]["mean"] if ok else None for r, ok in zip(runs, done)],
        "score": [100 * r["after"] if ok and r["after"] is not None else None for r, ok in zip(runs, done)]}
  return rows
