"""What one grid run's directory says about it: finished, unfinished, failed or missing.

A run directory is what ``python -m jaxes.train`` writes (config.json, metrics.jsonl,
summary.json, checkpoints/) plus the grid's own ``grid_run.json`` (the command, its exit status,
wall and CPU seconds of every attempt) and ``grid.log`` (the run's output). A run is *finished*
when summary.json is at the final version its config asks for.
"""
from __future__ import annotations

import dataclasses
import json
import os

from jaxes.run_tools import probe
from jaxes.train import config_history, metrics

GRID_RUN = "grid_run.json"
GRID_LOG = "grid.log"

FINISHED, UNFINISHED, FAILED, MISSING = "finished", "unfinished", "failed", "missing"


def run_name(variant: str, seed: int) -> str:
  return f"{variant}-s{seed}"


def final_version(workdir: str) -> int | None:
  """The number of updates the run's config in force asks for: config.json's, or the latest a
  rerun recorded in config_history.json (a run extended past it). None before it started."""
  try:
    return int(config_history.in_force(workdir)["config.train.num_updates"])
  except (OSError, TypeError, KeyError, ValueError):   # no or unreadable config: not started
    return None


def is_finished(workdir: str, num_updates: int | None = None) -> bool:
  """summary.json at the final version (``num_updates``, else the run's config.json's)."""
  summary = metrics.read_json(os.path.join(workdir, "summary.json"))
  want = num_updates if num_updates is not None else final_version(workdir)
  return summary is not None and want is not None and summary.get("version") == want


def last_error(workdir: str, lines: int = 40) -> str:
  """The last line of the run's log that looks like an error (else its last non-empty line)."""
  try:
    with open(os.path.join(workdir, GRID_LOG), errors="replace") as f:
      tail = [l.strip() for l in f.read()[-20000:].splitlines() if l.strip()][-lines:]
  except OSError:
    return ""
  for line in reversed(tail):
    if line.startswith("error:") or "Error" in line.split(":")[0]:
      return line[:300]
  return tail[-1][:300] if tail else ""


def attempts(workdir: str) -> list[dict]:
  return (metrics.read_json(os.path.join(workdir, GRID_RUN)) or {}).get("attempts", [])


def _write_attempts(workdir: str, tries: list[dict]) -> None:
  path = os.path.join(workdir, GRID_RUN)
  with open(path + ".tmp", "w") as f:   # replaced atomically: a kill here loses nothing
    json.dump({"attempts": tries}, f, indent=2)
  os.replace(path + ".tmp", path)


def start_attempt(workdir: str, command: list[str], started: float) -> None:
  """Records an attempt before it runs (exit status None until ``finish_attempt``), so a grid
  killed meanwhile leaves the attempt visible as such."""
  _write_attempts(workdir, attempts(workdir) + [{"command": command, "started": started,
                                                  "returncode": None}])


def finish_attempt(workdir: str, returncode: int, wall_s: float, cpu_s: float) -> None:
  tries = attempts(workdir)
  tries[-1].update(returncode=returncode, wall_s=wall_s, cpu_s=cpu_s)
  _write_attempts(workdir, tries)


@dataclasses.dataclass
class RunRecord:
  """Everything the table needs from one run."""
  variant: str
  seed: int
  workdir: str
  status: str
  reason: str = ""
  version: int = 0                 # updates in metrics.jsonl
  num_updates: int | None = None   # what the config asks for
  summary: dict | None = None
  config: dict | None = None
  evals: list = dataclasses.field(default_factory=list)        # [{version, success, reward, ...}]
  staleness_hist: list = dataclasses.field(default_factory=list)  # consumed results per staleness
  dropped: int = 0
  delayed: int = 0
  excluded: int = 0
  train_wall_s: float = 0.0        # sum of the update windows (training loop, no evaluations)
  cpu_s: float = 0.0               # every attempt's CPU seconds (the grid's measurement)
  wall_s: float = 0.0              # every attempt's wall seconds

  @property
  def updates_per_hour(self) -> float | None:
    return 3600.0 * self.version / self.train_wall_s if self.train_wall_s > 0 and self.version else None


def read_run(workdir: str, variant: str, seed: int, num_updates: int | None = None) -> RunRecord:
  """The run in ``workdir``; ``num_updates`` is what the grid asks for (else the run's config)."""
  rec = RunRecord(variant, seed, workdir, MISSING)
  if not os.path.isdir(workdir):
    rec.reason = "no run directory"
    return rec
  tries = attempts(workdir)
  rec.cpu_s = sum(a.get("cpu_s") or 0.0 for a in tries)
  rec.wall_s = sum(a.get("wall_s") or 0.0 for a in tries)
  rec.config = metrics.read_json(os.path.join(workdir, "config.json"))
  rec.num_updates = num_updates if num_updates is not None else final_version(workdir)
  records = metrics.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  train = [r for r in records if "train" in r]
  rec.version = max((r["version"] for r in train), default=0)
  keys = ("version", "success", "stderr", "per_task", "reward", "reward_stderr", "per_task_reward",
          # then jaxes.train.drift's, eval.probe_families' and eval.mc_probe_file's
          "param_drift", "kl_to_initial", "probe", "mc_probe")
  rec.evals = [{k: r["eval"][k] for k in keys if k in r["eval"]} for r in records if "eval" in r]
  # Versions the run did not probe itself, scored afterwards (python -m jaxes.run_tools.probe).
  scored = (metrics.read_json(os.path.join(workdir, probe.OUTPUT)) or {}).get("versions", {})
  for e in rec.evals:
    if "mc_probe" not in e and str(e["version"]) in scored:
      e["mc_probe"] = scored[str(e["version"])]
  hist: list[int] = []
  for r in train:
    for s, n in enumerate(r.get("staleness_hist") or []):
      hist.extend([0] * (s + 1 - len(hist)))
      hist[s] += int(n)
    rec.dropped += int(r.get("dropped") or 0)
    rec.delayed += int(r.get("delayed") or 0)
    rec.excluded += int(r.get("excluded") or 0)
    rec.train_wall_s += float((r.get("time") or {}).get("wall_s") or 0.0)
  rec.staleness_hist = hist
  if is_finished(workdir, rec.num_updates):
    rec.status, rec.summary = FINISHED, metrics.read_json(os.path.join(workdir, "summary.json"))
    return rec
  last = tries[-1] if tries else None
  if last is not None and last.get("returncode") not in (0, None):
    rec.status = FAILED
    rec.reason = f"exit status {last['returncode']}" + (f": {e}" if (e := last_error(workdir)) else "")
  elif last is not None and last.get("returncode") is None:
    rec.status = UNFINISHED
    rec.reason = f"no exit recorded at version {rec.version} of {rec.num_updates} (killed, or still running)"
  elif rec.config is None and not records:
    rec.reason = "run directory holds no run"
  else:
    rec.status = UNFINISHED
    rec.reason = f"at version {rec.version} of {rec.num_updates}"
  return rec
