"""Per-update metrics: one JSON line per update in ``metrics.jsonl``, the scalars to TensorBoard,
and a PNG plot of success and staleness over updates."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections import Counter

import numpy as np
from tqdm import tqdm

from jaxes.es import keys


def read_json(path: str):
  """A run's JSON file (summary.json, config.json), or None where it is missing or unreadable:
  the readers of run directories report such a run, they do not stop at it."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def read_metrics(path: str) -> list[dict]:
  """The records of a metrics file; a torn last line (the run was killed mid-write) is skipped."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().split("\n")
  records = [json.loads(line) for line in lines[:-1] if line.strip()]
  if lines[-1].strip():  # no newline yet: complete only if it parses
    try:
      records.append(json.loads(lines[-1]))
    except json.JSONDecodeError:
      pass
  return records


def _scalars(record: dict, prefix=""):
  for k, v in record.items():
    if isinstance(v, dict):
      yield from _scalars(v, f"{prefix}{k}/")
    elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
      yield prefix + k, v


class MetricsWriter:
  """Appends records; on resume, lines from beyond the restored version (written by a run that
  was killed before its checkpoint committed) are dropped so every version appears once."""

  def __init__(self, workdir: str, resume_version: int = 0, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = [r for r in read_metrics(self.path) if r.get("version", 0) <= resume_version]
    with open(self.path + ".tmp", "w") as f:  # replaced atomically: a kill here loses nothing
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(self.path + ".tmp", self.path)
    self._versions = {r.get("version") for r in kept if "train" in r}
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      self._tb = _summary_writer_class()(os.path.join(workdir, "tensorboard"), purge_step=resume_version + 1)

  def write(self, record: dict) -> None:
    if "train" in record:
      self._versions.add(record.get("version"))
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      step = int(record.get("version", 0))
      for k, v in _scalars(record):
        if k != "version":
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def backfill(self, records: list[dict]) -> None:
    """Writes the update lines among ``records`` that the file lacks (a run killed between
    logging an update and writing its line; the update-log replay supplies them)."""
    for r in records:
      if r.get("version") not in self._versions:
        self.write(r)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def _summary_writer_class():
  """tensorboardX's ``SummaryWriter`` (heavy, protobuf: imported only when writing), imported
  without torch: its writer module imports torch where installed only to accept torch tensors as
  values (these are floats), costing every training process ~1.1 s of start-up. The block is
  lifted at once, so torch still imports later for whoever asks."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None   # ``import torch`` raises ImportError, which tensorboardX handles
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def plot(records: list[dict], path: str, title: str = "") -> None:
  """Top: training success (per update) and held-out success ± s.e. Bottom: staleness."""
  import matplotlib   # heavy: only when plotting
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train = [r for r in records if "train" in r]
  evals = [r for r in records if "eval" in r]
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  if train:
    ax1.plot([r["version"] for r in train], [r["train"]["success"] for r in train], ".-", alpha=0.5,
             label="training episodes (perturbed members)")
  if evals:
    ax1.errorbar([r["version"] for r in evals], [r["eval"]["success"] for r in evals],
                 yerr=[r["eval"]["stderr"] for r in evals], fmt="o-", capsize=3,
                 label="held-out, unperturbed policy (± s.e.)")
  ax1.set_ylabel("success rate")
  ax1.set_ylim(-0.02, 1.02)
  if train or evals:
    ax1.legend(loc="lower right", fontsize=8)
  if train:
    versions = [r["version"] for r in train]
    ax2.plot(versions, [r["staleness_mean"] for r in train], ".-", label="mean staleness")
    ax2.plot(versions, [r["staleness_max"] for r in train], "x", label="max staleness")
    ax2.plot(versions, [r["dropped"] for r in train], "+", label="dropped results")
    ax2.legend(loc="upper right", fontsize=8)
  ax2.set_xlabel("policy version (updates applied)")
  ax2.set_ylabel("staleness (updates)")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def peak_rss_gib() -> float:
  """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def mean_stderr(values) -> tuple[float, float]:
  v = np.asarray(values, dtype=np.float64)
  if v.size == 0:
    return float("nan"), float("nan")
  se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
  return float(v.mean()), se


def _finite(x):
  return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def pair_ties(results) -> dict:
  """Antithetic pairs of a cohort with both members' fitness, and how many of them tie: a tied
  pair adds nothing to the update (with greedy decoding, most do when σ is small)."""
  by_pair: dict[tuple[int, int], list[float]] = {}
  for version, member, fitness in results:
    by_pair.setdefault((version, keys.pair_id(member, True)), []).append(fitness)
  complete = [f for f in by_pair.values() if len(f) == 2]
  return {"complete": len(complete), "tied": sum(a == b for a, b in complete)}


class UpdateWindow:
  """The training episodes and runner work between two updates, summed as they arrive; the
  runner's counters are read as differences of two snapshots (``EpisodeRunner.stats``)."""

  def __init__(self, runner_stats: dict[str, float]):
    self.start_stats, self.t = dict(runner_stats), time.perf_counter()
    self.episodes = self.passed = self.turns = self.truncated = 0
    self.reward = self.env_worker_s = self.update_s = 0.0
    self.failures: Counter = Counter()

  def add(self, result) -> None:
    """A finished training episode (``EpisodeResult``); infrastructure failures count only as
    failures."""
    self.failures[result.failure or "none"] += 1
    if result.reward is None:
      return
    self.episodes += 1
    self.passed += int(result.passed)
    self.reward += result.reward
    self.turns += result.turns
    self.truncated += int(result.truncated)
    self.env_worker_s += result.env_s

  def record(self, update, results, es_metrics: dict, runner_stats: dict[str, float],
             antithetic: bool) -> dict:
    """An ES update's metrics line."""
    return {
        **self.common(es_metrics["version"], update, results, runner_stats),
        "fitness": {k: _finite(es_metrics[f"fitness_{k}"]) for k in ("mean", "std", "min", "max")},
        "pairs": pair_ties(results) if antithetic else None,
        "sigma": es_metrics["sigma"], "update_norm": es_metrics["update_norm"],
        "zero_step": es_metrics["zero_step"],
    }

  def common(self, version: int, update, results, runner_stats: dict[str, float]) -> dict:
    """The part of a metrics line every algorithm shares: staleness of the consumed results
    ``(version, member, ...)``, the controller's counts, the training episodes, engine and time
    use."""
    wall = time.perf_counter() - self.t
    d = {k: runner_stats[k] - self.start_stats.get(k, 0) for k in runner_stats}
    n = max(self.episodes, 1)
    staleness = np.array([version - 1 - r[0] for r in results], np.int64)
    return {
        "version": version,
        "staleness_hist": [int(c) for c in np.bincount(staleness, minlength=1)],
        "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
        "staleness_max": int(staleness.max()) if len(staleness) else 0,
        "dropped": update.dropped, "excluded": update.excluded, "delayed": int(sum(update.delayed)),
        **update.staleness_metrics(),   # generation/waiting histograms, policy weights, rejected
        "num_results": len(results),
        "train": {"success": self.passed / n, "reward": self.reward / n, "episodes": self.episodes,
                  "turns_per_episode": self.turns / n, "truncated": self.truncated,
                  "failures": dict(self.failures)},
        "episodes_per_s": self.episodes / wall if wall > 0 else 0.0,
        "slot_utilisation": d["rows_busy"] / d["rows_total"] if d.get("rows_total") else 0.0,
        "tokens_per_s": d["tokens_decoded"] / wall if wall > 0 else 0.0,
        "time": {"generate_s": d["decode_s"], "prefill_s": d.get("prefill_step_s", 0.0),
                 "env_wait_s": d["wait_s"],
                 "env_worker_s": self.env_worker_s, "update_s": self.update_s, "wall_s": wall},
    }


class ProgressBar:
  """A tqdm bar over updates showing training success, staleness and episodes/s (a no-op when
  disabled). A process's first update includes its XLA compiles (a minute for the demo), so the
  bar says "compiling…" without an estimate until it ends, and then starts timing afresh."""

  def __init__(self, total: int, initial: int, enabled: bool = True, desc: str = "ES updates",
               file=None):
    self._total, self._desc, self._file, self._timed = total, desc, file, False
    self._bar = None
    if enabled:
      self._bar = tqdm(total=total, initial=initial, desc=desc, unit="upd", file=file, leave=False,
                       bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [compiling…]")

  def update(self, record: dict) -> None:
    if self._bar is None:
      return
    if not self._timed:   # a new bar from here on: its rate and estimate leave the compiles out
      done = self._bar.n + 1
      self._bar.close()
      self._bar = tqdm(total=self._total, initial=done, desc=self._desc, unit="upd", file=self._file)
      self._timed = True
    else:
      self._bar.update(1)
    self._bar.set_postfix(success=f"{record['train']['success']:.2f}",
                          stale=f"{record['staleness_mean']:.2f}", eps=f"{record['episodes_per_s']:.1f}/s")

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
