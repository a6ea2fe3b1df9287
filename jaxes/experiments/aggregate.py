"""Every run of a grid into one table: ``table.json`` (all numbers) and ``table.md``.

Per variant, over the seeds whose run finished: the held-out measure (success; the mean reward,
WebShop's score, when the runs are WebShop runs) before and after (mean ± s.e. over seeds), the
run's own paired change (after − before on the same tasks), the paired change against sync of the
same seed (the per-task difference of the two final evaluations — same seed, so the same held-out
tasks — its mean ± s.e. over tasks per seed, then mean ± s.e. over seeds), updates/hour of the
training loop (evaluations excluded), the staleness histogram of every consumed result pooled over
seeds (mean, share with staleness >= 1, max), dropped and delayed results per run. A run that is
missing, failed or unfinished is a row saying so, never left out; a variant that is not available
is a row with the reason.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from jaxes.experiments import rundirs
from jaxes.experiments.variants import DESCRIPTIONS, Variant
from jaxes.train.evaluation import REWARD, SUCCESS, Measure
from jaxes.train.metrics import mean_stderr

REFERENCE = "sync"


def _ms(values) -> dict | None:
  values = [v for v in values if v is not None and math.isfinite(v)]
  if not values:
    return None
  mean, se = mean_stderr(values)
  return {"mean": mean, "stderr": se, "n": len(values)}


def _same_tasks(a: rundirs.RunRecord, b: rundirs.RunRecord) -> bool:
  """Two runs evaluated the same held-out tasks: same seed, same env and eval settings."""
  if a.config is None or b.config is None:
    return False
  keys = ("seed",)
  return (all(a.config.get(k) == b.config.get(k) for k in keys)
          and a.config.get("env") == b.config.get("env")
          and (a.config.get("eval") or {}).get("num_tasks") == (b.config.get("eval") or {}).get("num_tasks"))


def measure_of(runs) -> Measure:
  """WebShop's score (mean reward) when any run is a WebShop run, else success."""
  webshop = any(((r.config or {}).get("env") or {}).get("kind") == "webshop" for r in runs)
  return REWARD if webshop else SUCCESS


def paired_vs(run: rundirs.RunRecord, ref: rundirs.RunRecord, measure: Measure = SUCCESS) -> dict | None:
  """Final held-out ``measure`` of ``run`` minus ``ref``'s on the same tasks, ± s.e. over tasks."""
  if run.status != rundirs.FINISHED or ref.status != rundirs.FINISHED or not _same_tasks(run, ref):
    return None
  a = (run.summary.get("after") or {}).get(measure.per_task)
  b = (ref.summary.get("after") or {}).get(measure.per_task)
  if not a or not b or len(a) != len(b):
    return None
  diff, se = mean_stderr(np.subtract(a, b))
  return {measure.name: diff, "stderr": se, "tasks": len(a)}


def staleness_summary(hist: list[int]) -> dict:
  total = sum(hist)
  if not total:
    return {"mean": None, "share_stale": None, "max": None, "results": 0, "hist": list(hist)}
  return {"mean": sum(s * n for s, n in enumerate(hist)) / total,
          "share_stale": sum(hist[1:]) / total,
          "max": max(s for s, n in enumerate(hist) if n),
          "results": total, "hist": list(hist)}


def pool_histograms(hists) -> list[int]:
  """Staleness histograms added bin by bin (the longest sets the length)."""
  out: list[int] = []
  for h in hists:
    out.extend([0] * (len(h) - len(out)))
    for s, n in enumerate(h):
      out[s] += n
  return out


def run_row(run: rundirs.RunRecord, ref: rundirs.RunRecord | None, measure: Measure = SUCCESS) -> dict:
  s, m = run.summary or {}, measure
  before, after, change = s.get("before") or {}, s.get("after") or {}, s.get(m.change) or {}
  return {"variant": run.variant, "seed": run.seed, "workdir": run.workdir, "status": run.status,
          "reason": run.reason, "version": run.version, "num_updates": run.num_updates,
          "before": before.get(m.name), "before_stderr": before.get(m.stderr),
          "after": after.get(m.name), "after_stderr": after.get(m.stderr),
          "change": change.get(m.name), "change_stderr": change.get("stderr"),
          "vs_sync": paired_vs(run, ref, m) if ref is not None and run is not ref else None,
          "updates_per_hour": run.updates_per_hour, "train_wall_s": run.train_wall_s,
          "staleness": staleness_summary(run.staleness_hist),
          "dropped": run.dropped, "delayed": run.delayed, "excluded": run.excluded,
          "cpu_s": run.cpu_s, "wall_s": run.wall_s,
          "evals": [{"version": e["version"], "value": e[m.name], **drift_of(e, m)}
                    for e in run.evals if m.name in e]}


# What an evaluation says of drift and off-task probes (jaxes.train.drift, eval.probe_families,
# eval.mc_probe_file).
DRIFT = ("param_drift", "kl_to_initial", "probe", "mc_probe")


def drift_of(evaluation: dict, measure: Measure = SUCCESS) -> dict:
  """The evaluation's ``param_drift``, ``kl_to_initial``, probe ``measure`` and multiple-choice
  probe accuracy (None where absent)."""
  return {"param_drift": evaluation.get("param_drift"), "kl_to_initial": evaluation.get("kl_to_initial"),
          "probe": (evaluation.get("probe") or {}).get(measure.name),
          "mc_probe": (evaluation.get("mc_probe") or {}).get("accuracy")}


def _final(row: dict, key: str):
  return row["evals"][-1].get(key) if row["evals"] else None


def aggregate(variants: list[Variant], seeds: list[int], workdir: str,
              num_updates: dict[tuple[str, int], int] | None = None) -> dict:
  """The grid's table from its run directories (``workdir/<variant>-s<seed>``); ``num_updates``
  gives each run's final version (else its own config.json's)."""
  num_updates = num_updates or {}
  runs = {(v.name, s): rundirs.read_run(os.path.join(workdir, rundirs.run_name(v.name, s)), v.name, s,
                                        num_updates.get((v.name, s)))
          for v in variants if v.available for s in seeds}
  measure = measure_of(runs.values())
  rows, table = [], []
  for v in variants:
    if not v.available:
      table.append({"variant": v.name, "description": DESCRIPTIONS.get(v.name, ""),
                    "status": "not available", "reason": v.unavailable})
      continue
    per_run = [run_row(runs[v.name, s], runs.get((REFERENCE, s)), measure) for s in seeds]
    rows += per_run
    done = [r for r in per_run if r["status"] == rundirs.FINISHED]
    problems = [f"s{r['seed']} {r['status']} ({r['reason']})" for r in per_run if r["status"] != rundirs.FINISHED]
    vs = [r["vs_sync"][measure.name] for r in done if r["vs_sync"]]
    stale = staleness_summary(pool_histograms(runs[v.name, s].staleness_hist for s in seeds
                                    if runs[v.name, s].status == rundirs.FINISHED))
    table.append({
        "variant": v.name, "description": DESCRIPTIONS.get(v.name, ""),
        "status": "finished" if len(done) == len(seeds) else f"{len(done)}/{len(seeds)} finished",
        "seeds": [r["seed"] for r in done], "problems": problems,
        "before": _ms(r["before"] for r in done), "after": _ms(r["after"] for r in done),
        "change": _ms(r["change"] for r in done),
        "vs_sync": _ms(vs) if v.name != REFERENCE else None,
        "vs_sync_seeds": len(vs),
        "updates_per_hour": _ms(r["updates_per_hour"] for r in done),
        "staleness": stale,
        "dropped": _ms(r["dropped"] for r in done), "delayed": _ms(r["delayed"] for r in done),
        **{f"final_{k}": _ms(x for r in done if (x := _final(r, k)) is not None) for k in DRIFT},
    })
  return {"workdir": workdir, "seeds": list(seeds), "measure": measure.name, "variants": table, "runs": rows}


# -- markdown -------------------------------------------------------------------------------------
def _pm(x: dict | None, digits=3, signed=False) -> str:
  if not x:
    return "—"
  sign = "+" if signed else ""
  return f"{x['mean']:{sign}.{digits}f} ± {x['stderr']:.{digits}f}"


def _num(x, fmt=".3f") -> str:
  return "—" if x is None else format(x, fmt)


MEASURE_NAMES = {"success": "success", "reward": "mean reward (WebShop's score)"}


def to_markdown(result: dict) -> str:
  seeds = ",".join(map(str, result["seeds"]))
  name = MEASURE_NAMES[result["measure"]]
  lines = [f"Held-out {name} of the unperturbed policy: mean ± s.e. over seeds ({seeds}). "
           f"\"vs sync\": final {name} minus sync's on the same tasks (same seed), mean ± s.e. "
           "over seeds; each seed draws its own held-out tasks (the 95% t-intervals and verdicts: "
           "the paired statistics below). Updates/hour: the training loop without evaluations. Staleness: every "
           "consumed result, pooled over seeds. Dropped, delayed: results per run (mean ± s.e.).",
           "",
           "| variant | runs | before | after | change (paired) | vs sync | updates/hour | "
           "mean staleness | share stale ≥ 1 | max staleness | dropped | delayed |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  notes = []
  for v in result["variants"]:
    if v["status"] == "not available":
      lines.append(f"| {v['variant']} | not available | — | — | — | — | — | — | — | — | — | — |")
      notes.append(f"- {v['variant']}: not available — {v['reason']}")
      continue
    st = v["staleness"]
    vs = "(reference)" if v["variant"] == REFERENCE else _pm(v["vs_sync"], signed=True)
    lines.append(
        f"| {v['variant']} | {v['status']} | {_pm(v['before'])} | {_pm(v['after'])} | "
        f"{_pm(v['change'], signed=True)} | {vs} | {_pm(v['updates_per_hour'], 0)} | "
        f"{_num(st['mean'], '.2f')} | {_num(st['share_stale'], '.2f')} | {_num(st['max'], 'd')} | "
        f"{_pm(v['dropped'], 1)} | {_pm(v['delayed'], 1)} |")
    notes += [f"- {v['variant']}: {p}" for p in v["problems"]]
  lines += ["", "Runs:", "",
            "| run | status | version | before | after | change (paired s.e.) | vs sync (paired s.e.) | "
            "updates/hour | mean staleness | dropped | delayed | CPU s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in result["runs"]:
    status = r["status"] + (f": {r['reason']}" if r["status"] != rundirs.FINISHED and r["reason"] else "")
    change = f"{r['change']:+.3f} ± {r['change_stderr']:.3f}" if r["change"] is not None else "—"
    vs = f"{r['vs_sync'][result['measure']]:+.3f} ± {r['vs_sync']['stderr']:.3f}" if r["vs_sync"] else "—"
    lines.append(f"| {r['variant']}-s{r['seed']} | {status} | {r['version']}/{r['num_updates']} | "
                 f"{_num(r['before'])} | {_num(r['after'])} | {change} | {vs} | "
                 f"{_num(r['updates_per_hour'], '.0f')} | {_num(r['staleness']['mean'], '.2f')} | "
                 f"{r['dropped']} | {r['delayed']} | {r['cpu_s']:.0f} |")
  if any(v.get("final_param_drift") for v in result["variants"]):
    lines += ["", "Drift at the last version (jaxes.train.drift; mean ± s.e. over seeds): "
              "param_drift = ‖θ − θ₀‖, kl_to_initial = KL(π_θ₀ ‖ π_θ) per token on version 0's "
              f"held-out transcripts, probe = held-out {name} on eval.probe_families, mc probe = "
              "multiple-choice accuracy on eval.mc_probe_file (or scored afterwards: "
              "python -m jaxes.run_tools.probe).", "",
              "| variant | param_drift | kl_to_initial | probe | mc probe |",
              "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {v['variant']} | {_pm(v.get('final_param_drift'), 3)} | "
              f"{_pm(v.get('final_kl_to_initial'), 4)} | {_pm(v.get('final_probe'))} | "
              f"{_pm(v.get('final_mc_probe'))} |"
              for v in result["variants"] if v.get("status") != "not available"]
  if notes:
    lines += ["", "Not in the means:", "", *notes]
  if result.get("paired"):
    from jaxes.experiments import stats
    lines += ["", "Paired statistics:", "", stats.surface_markdown(
        result["paired"], unit=f"points of held-out {MEASURE_NAMES[result['measure']]}").rstrip("\n")]
  return "\n".join(lines) + "\n"


def write(result: dict, workdir: str) -> tuple[str, str]:
  md, js = os.path.join(workdir, "table.md"), os.path.join(workdir, "table.json")
  with open(js + ".tmp", "w") as f:
    json.dump(result, f, indent=2)
  os.replace(js + ".tmp", js)
  with open(md + ".tmp", "w") as f:
    f.write(to_markdown(result))
  os.replace(md + ".tmp", md)
  return md, js
