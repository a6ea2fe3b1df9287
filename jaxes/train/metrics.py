"""Per-update metrics: one JSON line per update in ``metrics.jsonl``, the scalars to TensorBoard,
and a PNG plot of success and staleness over updates."""
from __future__ import annotations

import json
import math
import os

import numpy as np


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
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_version + 1)

  def write(self, record: dict) -> None:
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      step = int(record.get("version", 0))
      for k, v in _scalars(record):
        if k != "version":
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def plot(records: list[dict], path: str, title: str = "") -> None:
  """Top: training success (per update) and held-out success ± s.e. Bottom: staleness."""
  import matplotlib
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


def mean_stderr(values) -> tuple[float, float]:
  v = np.asarray(values, dtype=np.float64)
  if v.size == 0:
    return float("nan"), float("nan")
  se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
  return float(v.mean()), se
