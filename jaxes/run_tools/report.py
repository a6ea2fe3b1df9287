r"""``python -m jaxes.run_tools.report --workdir=W [--out=W/report.html]``: one self-contained HTML page
per run, from what the run directory already holds (``metrics.jsonl``, ``episodes.jsonl``,
``config.json``, ``summary.json``). The trainer rewrites it at every evaluation, so it is live.

The page needs no network and runs no script: charts are matplotlib's SVG output inlined, styles are inline, episodes
are ``<details>`` elements. Every piece of run text (task names, transcripts, config values) goes
through ``html.escape``; a Content-Security-Policy that allows no script at all guards the page
too, so a transcript holding ``<script>`` is shown as text and could not run even if unescaped.
"""
from __future__ import annotations

import argparse
import html
import math
import os
import sys

from jaxes import cli

if __name__ == "__main__":   # a command: JAX starts quietly (cli.start_jax) before an import below loads it
  cli.start_jax(init_backends=False)

from jaxes.train import metrics
from jaxes.train.transcripts import EPISODES, read_episodes

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f")
TIME_PARTS = (("decode", "#1f77b4"), ("prefill", "#aec7e8"), ("sandbox wait", "#ff7f0e"),
              ("update", "#2ca02c"), ("evaluation", "#9467bd"), ("other", "#c7c7c7"))
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{border:1px solid #eee;padding:4px}
.chart h3{font-size:.95em;margin:.2em .4em}table{border-collapse:collapse}
td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left;font-size:.9em}
details{border:1px solid #ddd;margin:4px 0;padding:4px 8px}summary{cursor:pointer}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0 8px;padding:6px;font-size:.85em}
.prompt{background:#f4f4f4}.model{background:#e8f0fe}.observation{background:#fff4e0}
.role{font-size:.8em;color:#666}.legend span{margin-right:10px;font-size:.85em}
"""


def esc(x) -> str:
  return html.escape(str(x), quote=True)


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# -- SVG charts ------------------------------------------------------------------------------------
class Chart:
  """One chart: the calls record what to draw; ``svg()`` draws it with matplotlib (its axes, rounded
  ticks and layout) and inlines matplotlib's SVG output, text kept as text, no script."""

  W, H = 340, 210   # pixels

  def __init__(self, title: str, x_range, y_range, x_label: str, y_label: str):
    self.title, self.x_label, self.y_label = title, x_label, y_label
    self.x0, self.x1 = x_range if x_range[1] > x_range[0] else (x_range[0], x_range[0] + 1)
    self.y0, self.y1 = y_range if y_range[1] > y_range[0] else (y_range[0], y_range[0] + 1)
    self.draws: list = []   # (axes method name, args, kwargs)
    self.legend: list[tuple[str, str]] = []

  def line(self, xs, ys, color, label=None, markers=True, dash=""):
    pts = [(x, y) for x, y in zip(xs, ys) if _finite(y)]
    if not pts:
      return
    self.draws.append(("plot", ([x for x, _ in pts], [y for _, y in pts]),
                       dict(color=color, linewidth=1.5, marker="o" if markers else None, markersize=3,
                            linestyle=(0, tuple(float(d) for d in dash.split())) if dash else "-",
                            gid=f"curve{len(self.draws)}")))
    if label:
      self.legend.append((label, color))

  def errorbars(self, xs, ys, errs, color):
    pts = [(x, y, e) for x, y, e in zip(xs, ys, errs) if _finite(y) and _finite(e)]
    if pts:
      self.draws.append(("vlines", ([x for x, _, _ in pts], [y - e for _, y, e in pts],
                                    [y + e for _, y, e in pts]), dict(color=color, linewidth=1)))

  def band(self, xs, lo, hi, color):
    if xs:
      self.draws.append(("fill_between", (xs, lo, hi), dict(color=color, alpha=0.18, linewidth=0)))

  def rect(self, x, y, w, h, color, tip=""):
    """A filled rectangle (``tip``: the hover text is not kept: matplotlib's SVG has no titles)."""
    self.draws.append(("bar", ([x], [h]), dict(width=w, bottom=y, align="edge", color=color, linewidth=0)))

  def svg(self) -> str:
    import io
    import matplotlib
    from matplotlib.figure import Figure   # no pyplot: no global figure state, safe off the main thread
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "jaxes", "font.size": 8}):
      fig = Figure(figsize=(self.W / 100, self.H / 100), dpi=100, layout="constrained")
      ax = fig.add_subplot()
      for method, args, kwargs in self.draws:
        getattr(ax, method)(*args, **kwargs)
      ax.set_xlim(self.x0, self.x1)
      ax.set_ylim(self.y0, self.y1)
      ax.set_xlabel(self.x_label)
      ax.set_ylabel(self.y_label)
      ax.spines[["top", "right"]].set_visible(False)
      buf = io.StringIO()
      fig.savefig(buf, format="svg", metadata={"Date": None})   # no date: the page is reproducible
    text = buf.getvalue()
    text = text[text.index("<svg"):]   # inline: without the XML declaration and doctype
    legend = "".join(f'<span style="color:{c}">■ {esc(n)}</span>' for n, c in self.legend)
    return (f'<div class="chart"><h3>{esc(self.title)}</h3><div role="img" aria-label="{esc(self.title)}">'
            f'{text}</div><div class="legend">{legend}</div></div>')


def value_range(values, pad=0.05, lo=None, hi=None):
  v = [x for x in values if _finite(x)]
  a, b = (min(v), max(v)) if v else (0.0, 1.0)
  a, b = (a if lo is None else min(a, lo)), (b if hi is None else max(b, hi))
  span = (b - a) or 1.0
  return a - pad * span, b + pad * span


def heldout_chart(evals: list[dict], key: str, stderr: str, title: str) -> str:
  xs = [e["version"] for e in evals]
  ys, es = [e.get(key) for e in evals], [e.get(stderr) for e in evals]
  lo = [y - e for y, e in zip(ys, es) if _finite(y) and _finite(e)]
  hi = [y + e for y, e in zip(ys, es) if _finite(y) and _finite(e)]
  probe = [(e.get("probe") or {}).get(key) for e in evals]   # eval.probe_families: off-task
  # eval.mc_probe_file: multiple-choice accuracy, a success rate, so on the success chart
  mc = [(e.get("mc_probe") or {}).get("accuracy") if key == "success" else None for e in evals]
  c = Chart(title, value_range(xs, 0), value_range(ys + lo + hi + probe + mc, lo=0.0), "policy version",
            f"held-out {key}")
  c.errorbars(xs, ys, es, COLORS[0])
  c.line(xs, ys, COLORS[0], f"held-out {key} ± s.e.")
  if any(_finite(p) for p in probe):
    c.errorbars(xs, probe, [(e.get("probe") or {}).get(stderr) for e in evals], COLORS[4])
    c.line(xs, probe, COLORS[4], f"probe {key} (off-task) ± s.e.", dash="4 2")
  if any(_finite(p) for p in mc):
    c.errorbars(xs, mc, [(e.get("mc_probe") or {}).get("stderr") for e in evals], COLORS[6])
    c.line(xs, mc, COLORS[6], "multiple-choice probe accuracy ± s.e.", dash="1 2")
  return c.svg()


def drift_charts(evals: list[dict], train: list[dict]) -> list[str]:
  """``param_drift`` (total and per group) and ``kl_to_initial`` per evaluated version, and
  ``update_cosine`` per update (jaxes.train.drift); none for a run without them."""
  evals = [e for e in evals if _finite(e.get("param_drift"))]
  charts = []
  if evals:
    xs = [e["version"] for e in evals]
    groups = sorted({g for e in evals for g in e.get("param_drift_groups") or {}})
    series = [("total", [e["param_drift"] for e in evals])] + [
        (g, [(e.get("param_drift_groups") or {}).get(g) for e in evals]) for g in groups]
    c = Chart("distance from version 0, ‖θ_v − θ₀‖", value_range(xs, 0),
              value_range([v for _, ys in series for v in ys], lo=0.0), "policy version", "param_drift")
    for i, (name, ys) in enumerate(series):
      c.line(xs, ys, COLORS[i % len(COLORS)], name, dash="" if name == "total" else "4 2")
    charts.append(c.svg())
    kl = [e.get("kl_to_initial") for e in evals]
    if any(_finite(k) for k in kl):
      c = Chart("KL(π_θ₀ ‖ π_θv) per token, held-out transcripts", value_range(xs, 0),
                value_range(kl, lo=0.0), "policy version", "nats / token")
      c.line(xs, kl, COLORS[1], "kl_to_initial")
      charts.append(c.svg())
  cos = [(r["version"], r.get("update_cosine")) for r in train if _finite(r.get("update_cosine"))]
  if cos:
    c = Chart("cosine between consecutive updates", value_range([x for x, _ in cos], 0),
              value_range([y for _, y in cos], lo=-0.1, hi=0.1), "update", "cosine")
    c.line([x for x, _ in cos], [y for _, y in cos], COLORS[2], "update_cosine")
    charts.append(c.svg())
  return charts


def training_chart(train: list[dict]) -> str:
  xs = [r["version"] for r in train]
  f = [r.get("fitness") or {} for r in train]
  mean, std = [x.get("mean") for x in f], [x.get("std") for x in f]
  lo, hi = [x.get("min") for x in f], [x.get("max") for x in f]
  c = Chart("fitness per update (band: min-max)", value_range(xs, 0), value_range(lo + hi + mean), "update", "fitness")
  ok = [i for i in range(len(xs)) if _finite(lo[i]) and _finite(hi[i])]
  c.band([xs[i] for i in ok], [lo[i] for i in ok], [hi[i] for i in ok], COLORS[1])
  c.errorbars(xs, mean, std, COLORS[1])
  c.line(xs, mean, COLORS[1], "mean ± std")
  c.line(xs, [r["train"]["success"] for r in train], COLORS[2], "training success", markers=False, dash="4 2")
  return c.svg()


def staleness_chart(train: list[dict]) -> str:
  """A heat map: column = update, row = staleness, shade = share of the cohort."""
  xs = [r["version"] for r in train]
  depth = max([len(r.get("staleness_hist") or [1]) for r in train] + [1])
  c = Chart("staleness of consumed results per update (shade: share)", (min(xs) - 0.5, max(xs) + 0.5),
            (-0.5, depth - 0.5), "update", "staleness")
  for r in train:
    hist = r.get("staleness_hist") or []
    total = sum(hist) or 1
    for s, n in enumerate(hist):
      if n:
        shade = int(230 - 200 * n / total)
        c.rect(r["version"] - 0.5, s - 0.5, 1, 1, f"#{shade:02x}{shade:02x}ff",
               f"update {r['version']}: {n} results with staleness {s}")
  c.line(xs, [r.get("staleness_mean") for r in train], COLORS[1], "mean staleness", markers=False)
  return c.svg()


def time_parts(record: dict, eval_s: float) -> list[float]:
  """Seconds of one update window by ``TIME_PARTS`` (prefill: engine steps that carried prefill)."""
  t = record.get("time") or {}
  prefill = t.get("prefill_s", 0.0)
  decode = max(t.get("generate_s", 0.0) - prefill, 0.0)
  wait, update = t.get("env_wait_s", 0.0), t.get("update_s", 0.0)
  other = max(t.get("wall_s", 0.0) - decode - prefill - wait - update, 0.0)
  return [decode, prefill, wait, update, eval_s, other]


def time_chart(train: list[dict]) -> str:
  xs = [r["version"] for r in train]
  stacks = [time_parts(r, (r.get("eval") or {}).get("seconds", 0.0)) for r in train]
  c = Chart("where the time goes, per update", (min(xs) - 0.5, max(xs) + 0.5),
            (0, max([sum(s) for s in stacks] + [1e-9]) * 1.05), "update", "seconds")
  for x, parts in zip(xs, stacks):
    y = 0.0
    for (name, color), v in zip(TIME_PARTS, parts):
      if v > 0:
        c.rect(x - 0.4, y, 0.8, v, color, f"update {x}: {name} {v:.2f}s")
        y += v
  c.legend = [(name, color) for name, color in TIME_PARTS]
  return c.svg()


def throughput_chart(train: list[dict]) -> str:
  xs = [r["version"] for r in train]
  hours, elapsed = [], 0.0
  for r in train:
    elapsed += (r.get("time") or {}).get("wall_s", 0.0) + (r.get("eval") or {}).get("seconds", 0.0)
    hours.append(elapsed / 3600)
  rate = [(i + 1) / h if h > 0 else None for i, h in enumerate(hours)]
  util = [r.get("slot_utilisation") for r in train]
  c = Chart("updates/hour (cumulative) and slot utilisation", value_range(xs, 0), value_range(rate, lo=0.0),
            "update", "updates / hour")
  c.line(xs, rate, COLORS[0], "updates/hour")
  top = max([x for x in rate if _finite(x)] + [1.0])
  c.line(xs, [u * top if _finite(u) else None for u in util], COLORS[4], "slot utilisation (× top)",
         markers=False, dash="4 2")
  return c.svg()


def failure_kinds(train: list[dict]) -> list[str]:
  kinds = sorted({k for r in train for k in r["train"].get("failures", {}) if k != "none"})
  return kinds + ["truncated", "dropped", "excluded"]


def failures_chart(train: list[dict]) -> str:
  xs = [r["version"] for r in train]
  kinds = failure_kinds(train)
  series = {k: [r["train"].get("failures", {}).get(k, r["train"].get(k, r.get(k, 0))) or 0 for r in train]
            for k in kinds}
  c = Chart("failure kinds per update (episodes / results)", value_range(xs, 0),
            value_range([v for s in series.values() for v in s], lo=0.0), "update", "count")
  for i, k in enumerate(kinds):
    c.line(xs, series[k], COLORS[i % len(COLORS)], k)
  return c.svg()


# -- the page --------------------------------------------------------------------------------------
def episode_html(e: dict) -> str:
  outcome = "passed" if e.get("passed") else (e.get("failure") or "wrong")
  reward = e.get("reward")
  head = (f"update {e.get('update')} · {e.get('task')} · member {e.get('member')} · version "
          f"{e.get('version')} · reward {'—' if reward is None else f'{reward:.3g}'} · {outcome} · "
          f"{e.get('turns')} turns" + (" · truncated" if e.get("truncated") else ""))
  turns = "".join(f'<div class="role">{esc(t.get("role"))}</div><pre class="{esc(t.get("role"))}">'
                  f'{esc(t.get("text", ""))}</pre>' for t in e.get("transcript", []))
  return f'<details class="episode"><summary>{esc(head)}</summary>{turns}</details>'


def summary_rows(summary: dict | None, config: dict | None, train: list[dict]) -> str:
  rows = []
  c = config or {}
  for label, path in (("algorithm", ("train", "algorithm")), ("controller", ("controller", "mode")),
                      ("max staleness", ("controller", "max_staleness")), ("ES mode", ("es", "mode")),
                      ("population", ("es", "population")), ("sigma", ("es", "sigma")),
                      ("updates planned", ("train", "num_updates"))):
    v = c.get(path[0], {}).get(path[1]) if isinstance(c.get(path[0]), dict) else None
    if v is not None:
      rows.append((label, v))
  rows.append(("updates done", train[-1]["version"] if train else 0))
  if summary:
    for key in ("change", "reward_change"):
      ch = summary.get(key)
      if ch:
        name = "success" if key == "change" else "reward"
        rows.append((f"held-out {name} change (paired)", f"{ch[name]:+.3f} ± {ch['stderr']:.3f}"))
    if summary.get("updates_per_hour"):
      rows.append(("updates/hour (training loop)", f"{summary['updates_per_hour']:.1f}"))
  return "<table>" + "".join(f"<tr><th>{esc(a)}</th><td>{esc(b)}</td></tr>" for a, b in rows) + "</table>"


def render(workdir: str) -> str:
  records = metrics.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  episodes = read_episodes(os.path.join(workdir, EPISODES))
  config = metrics.read_json(os.path.join(workdir, "config.json"))
  summary = metrics.read_json(os.path.join(workdir, "summary.json"))
  train = [r for r in records if "train" in r]
  evals = [r["eval"] for r in records if "eval" in r]
  charts = []
  if evals:
    charts += [heldout_chart(evals, "success", "stderr", "held-out success per version"),
               heldout_chart(evals, "reward", "reward_stderr", "held-out mean reward per version")]
  charts += drift_charts(evals, train)
  if train:
    charts += [training_chart(train), staleness_chart(train), time_chart(train),
               throughput_chart(train), failures_chart(train)]
  name = os.path.basename(os.path.abspath(workdir))
  return page(f"jaxes report: {name}", "\n".join([f"<h1>jaxes run <code>{esc(name)}</code></h1>", summary_rows(summary, config, train),
          "<h2>Curves</h2>", '<div class="charts">' + "".join(charts) + "</div>"
          if charts else "<p>No update or evaluation yet.</p>",
          f"<h2>Episodes ({len(episodes)} sampled)</h2>",
          "<p>A bounded sample of training episodes per update (train.transcripts_per_update), "
          "each text cut to train.transcript_chars. Newest first.</p>",
          "".join(episode_html(e) for e in reversed(episodes)) or "<p>No episodes sampled.</p>"]))


def page(title: str, body: str) -> str:
  """A whole HTML document around ``body`` (already escaped), under the no-script policy."""
  return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
          f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
          f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>{body}</body></html>\n")


def write_page(out: str, text: str) -> str:
  """Writes a page atomically (a reader never sees half of it); returns its path. Text that is
  not Unicode (a task folder's name in bytes that are not UTF-8, read as lone surrogates) is
  written as its ``\\udcXX`` escapes: readable, and nothing lost."""
  with open(out + ".tmp", "w", encoding="utf-8", errors="backslashreplace") as f:
    f.write(text)
  os.replace(out + ".tmp", out)
  return out


def write(workdir: str, out: str | None = None) -> str:
  """Writes the run's report; returns its path."""
  return write_page(out or os.path.join(workdir, "report.html"), render(workdir))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxes.run_tools.report", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="a run directory (python -m jaxes.train --workdir)")
  p.add_argument("--out", default=None, help="where to write the page (default WORKDIR/report.html)")
  args = p.parse_args(argv)
  if not os.path.isfile(os.path.join(args.workdir, "metrics.jsonl")):
    print(f"error: --workdir={args.workdir}: no metrics.jsonl (not a run directory?)", file=sys.stderr)
    return 2
  print(write(args.workdir, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
