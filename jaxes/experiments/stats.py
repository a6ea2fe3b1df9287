"""Paired statistics of a staleness surface: each cell against sync on the same seeds, its
95% t-interval, whether it is resolved, how many seeds an 80%-power test would take, the points
lost per unit of mean staleness where a line fits, and the heat map (PNG and HTML) with the
paper's two points on it.

A *row* is one variant or cell: ``{"seeds": [...], "diff": [per-seed score minus sync's, in
points], "mean_staleness": [per seed]}`` (None where a seed is missing). Shared by the LLM grid
(``jaxes.experiments.grid``, per-seed paired differences on the same held-out tasks) and the
fast lane (``jaxes.experiments.fastlane``). Each seed draws its own held-out tasks, so the s.e.
over seeds holds task sampling as well as training noise.

The rules (docs/experiments.md, "Statistics"): a difference over n seeds is a one-sample t on
n - 1 degrees of freedom; *resolved* means its 95% t-interval excludes 0 (at 2 or 3 seeds the
2-s.e. rule fires on no effect 29% / 18% of the time, the t-interval 5%). Seeds for 80% power:
the smallest n at which a two-sided 5% paired t-test detects the measured mean with 80%
probability if the measured mean and s.d. were the truth (noncentral t) -- a plug-in from a few
seeds, not a guarantee. A staleness slope is reported only where a straight line fits the
cells (a lack-of-fit F test with seeds as blocks); otherwise read the per-cell differences.
scipy (already a requirement of jax) gives the t, noncentral t and F distributions.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats as dist

from jaxes.experiments import surface

CONFIDENCE = 0.95   # resolved: the two-sided t-interval at this level excludes 0
POWER = 0.80        # seeds_for_power's target
LINE_P = 0.05       # a lack-of-fit p below this: no line, no slope
TARGET_SE = 1.0     # points: the default s.e. the seed recommendation aims at
MAX_SEEDS = 100_000
# The paper's two points (arXiv 2610.04196, abstract): 10% of each cohort delayed 4 / 8 updates
# costs 1.6 / 3.1 points of held-out success.
PAPER_POINTS = {(0.1, 4): -1.6, (0.1, 8): -3.1}


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
  """The two-sided critical value of Student's t on ``df`` degrees of freedom."""
  return float(dist.t.ppf(0.5 + confidence / 2, df))


def paired(diffs) -> dict | None:
  """Mean, s.e. and s.d. over seeds of per-seed paired differences, the t statistic on n - 1
  degrees of freedom, its two-sided p, the 95% t-interval and whether it excludes 0 (resolved).
  From one seed: only the mean (table.json stays free of NaN). A zero s.d. gives the interval
  [mean, mean], t None and p 0 (1 when the mean is 0 too)."""
  d = np.asarray([x for x in diffs if x is not None and math.isfinite(x)], float)
  if d.size == 0:
    return None
  mean, n = float(d.mean()), int(d.size)
  out = {"mean": mean, "stderr": None, "sd": None, "n": n, "df": None, "t": None, "p": None,
         "ci": None, "resolved": False}
  if n < 2:
    return out
  sd = float(d.std(ddof=1))
  se = sd / math.sqrt(n)
  half = t_quantile(n - 1) * se
  t = mean / se if se > 0 else None
  p = float(2 * dist.t.sf(abs(t), n - 1)) if t is not None else (0.0 if mean else 1.0)
  ci = [mean - half, mean + half]
  return {**out, "stderr": se, "sd": sd, "df": n - 1, "t": t, "p": p, "ci": ci,
          "resolved": bool(ci[0] > 0 or ci[1] < 0)}


def seeds_for(sd: float, target_se: float) -> int | None:
  """Seeds whose mean has standard error ``target_se`` given a pilot's per-seed s.d."""
  if sd is None or not (sd > 0 and target_se > 0 and math.isfinite(sd)):
    return None
  return max(2, math.ceil((sd / target_se) ** 2))


def t_power(effect: float, sd: float, n: int, confidence: float = CONFIDENCE) -> float:
  """Power of the two-sided paired t-test at ``n`` seeds when the true mean difference is
  ``effect`` and the per-seed s.d. ``sd`` (noncentral t on n - 1 degrees of freedom)."""
  q, nc = t_quantile(n - 1, confidence), effect * math.sqrt(n) / sd
  return float(dist.nct.sf(q, n - 1, nc) + dist.nct.cdf(-q, n - 1, nc))


def seeds_for_power(sd: float, effect: float, power: float = POWER) -> int | None:
  """The fewest seeds (>= 2) at which the paired t-test resolves ``effect`` with probability
  ``power``, assuming the measured ``effect`` and ``sd`` are the true ones (a plug-in: both come
  from a few seeds). None without an effect or an s.d."""
  if not effect or sd is None or not math.isfinite(sd) or sd < 0:
    return None
  if sd == 0:
    return 2
  # From the normal approximation's n (never above the t-test's), up one at a time.
  z = dist.norm.ppf(0.5 + CONFIDENCE / 2) + dist.norm.ppf(power)
  n = max(2, math.floor((z * sd / effect) ** 2))
  while n < MAX_SEEDS and t_power(abs(effect), sd, n) < power:
    n += 1
  return n


def slope(points_by_seed: list[list[tuple[float, float]]]) -> dict | None:
  """Least-squares slope of difference on mean staleness, fitted per seed (intercept free), then
  ``paired`` over seeds: points per unit of mean staleness (negative: staleness costs)."""
  slopes = []
  for pts in points_by_seed:
    x = np.array([p[0] for p in pts], float)
    y = np.array([p[1] for p in pts], float)
    if len(x) >= 2 and np.ptp(x) > 0:
      xc = x - x.mean()
      slopes.append(float((xc * (y - y.mean())).sum() / (xc * xc).sum()))
  return paired(slopes)


def lack_of_fit(y: np.ndarray, x: np.ndarray) -> dict | None:
  """Whether a straight line in ``x`` (each cell's mean staleness) fits the seeds x cells
  matrix ``y`` (every seed in every cell). Seeds are blocks: the full model gives every cell its
  own mean (y = seed + cell), the line y = seed + b x; F = ((SSE_line - SSE_full) / (k - 2)) /
  (SSE_full / ((S - 1)(k - 1))) on (k - 2, (S - 1)(k - 1)) degrees of freedom. None below 3
  cells or 2 seeds (nothing to check). ``fits``: p >= LINE_P -- with few seeds a weak check,
  which a curve can pass."""
  y, x = np.asarray(y, float), np.asarray(x, float)
  seeds, k = y.shape
  if k < 3 or seeds < 2 or np.ptp(x) == 0:
    return None
  rows = y - y.mean(axis=1, keepdims=True)
  full = rows - rows.mean(axis=0, keepdims=True)
  xc = x - x.mean()
  b = float((rows * xc).sum() / (seeds * (xc * xc).sum()))
  sse_full, sse_line = float((full ** 2).sum()), float(((rows - b * xc) ** 2).sum())
  df = (k - 2, (seeds - 1) * (k - 1))
  if sse_full <= 1e-12 * max(sse_line, 1.0):
    f, p = (None, 0.0) if sse_line > 1e-12 else (None, 1.0)
  else:
    f = ((sse_line - sse_full) / df[0]) / (sse_full / df[1])
    p = float(dist.f.sf(f, *df))
  return {"F": f, "df": list(df), "p": p, "seeds": seeds, "fits": bool(p >= LINE_P)}


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
    alone = [s for s in r.get("unpaired_share", []) if s is not None]
    orphaned = [s for s in r.get("orphaned_share", []) if s is not None]
    table.append({"name": name, "values": values, "vs_sync": p,
                  "mean_staleness": float(np.mean(stale)) if stale else None,
                  "unpaired_share": float(np.mean(alone)) if alone else None,
                  "orphaned_share": float(np.mean(orphaned)) if orphaned else None,
                  "seeds_for_target": seeds_for(p["sd"], target_se) if p else None,
                  "seeds_for_power": seeds_for_power(p["sd"], p["mean"]) if p else None,
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
        every = [s for s in seed_ids if all(s in per_seed(n) for n in names)]
        check = lack_of_fit(np.array([[per_seed(n)[s][1] for n in names] for s in every]).reshape(len(every), len(names)),
                            np.array([np.mean([per_seed(n)[s][0] for s in every]) for n in names])) if every else None
        out[g] = {**fit, "cells": names, "lack_of_fit": check}
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


def format_ci(p, digits=1) -> str:
  """``[lo, hi]``, the 95% t-interval (— from one seed)."""
  if not p or not p.get("ci"):
    return "—"
  return f"[{p['ci'][0]:+.{digits}f}, {p['ci'][1]:+.{digits}f}]"


def format_p(p) -> str:
  if not p or p.get("p") is None:
    return "—"
  return f"{p['p']:.2g}" if p["p"] >= 0.001 else "<0.001"


def format_fit(check) -> str:
  """The lack-of-fit verdict of a slope: whether the line may be read."""
  if check is None:
    return "2 cells: no line to check (read their difference)"
  f = "∞" if check["F"] is None else f"{check['F']:.2f}"
  return (f"{'line fits' if check['fits'] else 'no line'} (F = {f} on {check['df'][0]}, "
          f"{check['df'][1]} df, p = {format_p(check)})")


def rules_line(unit: str, confidence: float = CONFIDENCE) -> str:
  """What every paired table's numbers mean (said above each one)."""
  return (f"Paired difference vs sync on the same seeds ({unit}): mean ± s.e. over seeds (the "
          f"held-out tasks differ per seed, so the s.e. holds task sampling too); {confidence:.0%} "
          f"interval and p from Student's t on seeds − 1 df; resolved: the interval excludes 0; "
          f"seeds for {POWER:.0%} power: a two-sided 5% paired t-test, taking the measured mean "
          "and s.d. as the truth (a plug-in from these seeds).")


def surface_markdown(summary: dict, unit: str = "points") -> str:
  t = summary["target_se"]
  # The share of results consumed without their antithetic partner, where the rows measured it.
  alone = any(r.get("unpaired_share") is not None for r in summary["table"])
  lines = [rules_line(unit) + f" Seeds for s.e. {t:g}: from the per-seed s.d."
           + (" Unpaired: the share of consumed results whose antithetic partner is not in their "
              "update; orphaned: whose partner no update consumes." if alone else ""), "",
           "| cell | mean staleness | " + ("unpaired | orphaned | " if alone else "") + "score | vs sync | "
           f"95% t-interval | p | resolved | s.d. per seed | seeds for s.e. {t:g} | seeds for {POWER:.0%} power |",
           "| --- | ---: | " + ("---: | ---: | " if alone else "") + "---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: |"]
  for r in summary["table"]:
    p = r["vs_sync"]
    score = (f"{r['score']['mean']:.1f} ± " + (f"{r['score']['stderr']:.1f}" if r["score"]["n"] > 1 else "—")
             if r.get("score") else "—")
    ref = r["name"] == "sync"
    shares = "".join(("—" if r.get(k) is None else f"{r[k]:.0%}") + " | " for k in ("unpaired_share", "orphaned_share"))
    lines.append(f"| {r['name']} | {'—' if r['mean_staleness'] is None else format(r['mean_staleness'], '.2f')} | "
                 + (shares if alone else "")
                 + f"{score} | {'(reference)' if ref else format_paired(p)} | {'' if ref else format_ci(p)} | "
                 f"{'' if ref else format_p(p)} | "
                 f"{'yes' if p and p['resolved'] else ('no' if p else '—')} | "
                 f"{'—' if not p or p['sd'] is None else format(p['sd'], '.1f')} | "
                 f"{r['seeds_for_target'] or '—'} | {r.get('seeds_for_power') or '—'} |")
  for key, what in (("slopes", "least squares per seed over sync, async1 and the cells"),
                    ("slopes_above_async1", "async1 and the cells, without sync: the delays' own cost")):
    if not summary.get(key):
      continue
    lines += ["", f"Points per unit of mean staleness ({what}, by {summary['slope_by']}; mean ± s.e. "
              "over seeds, t-interval on seeds − 1 df), read only where a line fits (lack-of-fit F "
              "test, seeds as blocks; otherwise read the cells' differences above):", "",
              f"| {summary['slope_by']} | slope | 95% t-interval | seeds | line |",
              "| --- | ---: | ---: | ---: | --- |"]
    for g, s in summary[key].items():
      check = s.get("lack_of_fit")
      line = check is not None and check["fits"]
      shown = format_paired(s, 2) if line else "(no line)"
      ci = format_ci(s, 2) if line else "—"
      lines.append(f"| {g} | {shown} | {ci} | {s['n']} | {format_fit(check)} |")
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
  ax.set_title((title + "\n" if title else "") + "vs sync, points ± s.e. over seeds (* 95% t-interval excludes 0)"
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
          f"{''.join(body)}</table><p>Paired difference vs sync in points, mean ± s.e. over seeds "
          "(held-out tasks differ per seed); bold: resolved (the 95% t-interval excludes 0); red: "
          "worse than sync.</p>")


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
