"""An optional experiment tracker beside TensorBoard: ``train.tracker = "wandb"`` logs each metrics
line's scalars, the staleness histogram and the sampled transcripts (a table) to Weights & Biases.
Off by default; W&B's own settings (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ...) apply. When
the package is missing, one line says so and the run goes on without it."""
from __future__ import annotations

import math
import os

import numpy as np

TRACKERS = ("", "wandb")
TABLE_COLUMNS = ("update", "task", "member", "version", "reward", "failure", "transcript")


def flat_scalars(record: dict, prefix: str = ""):
  """``(name, value)`` of every finite number in a metrics line, nested keys joined by ``/``."""
  for k, v in record.items():
    if isinstance(v, dict):
      yield from flat_scalars(v, f"{prefix}{k}/")
    elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
      yield prefix + k, v


def transcript_text(episode: dict) -> str:
  return "\n\n".join(f"[{t['role']}]\n{t['text']}" for t in episode.get("transcript", []))


class WandbTracker:
  def __init__(self, wandb, workdir: str, config: dict, name: str):
    self._wandb = wandb
    # The run id is the workdir's name, so a resumed run continues the same W&B run.
    self.run = wandb.init(dir=workdir, config=config, name=name, id=name, resume="allow")

  def log(self, record: dict, episodes: list[dict]) -> None:
    wandb = self._wandb
    data = {k: v for k, v in flat_scalars(record) if k != "version"}
    hist = record.get("staleness_hist")
    if hist:
      data["staleness"] = wandb.Histogram(np_histogram=(np.asarray(hist), np.arange(len(hist) + 1)))
    if episodes:
      data["episodes"] = wandb.Table(columns=list(TABLE_COLUMNS), data=[
          [e.get("update"), e.get("task"), e.get("member"), e.get("version"), e.get("reward"),
           e.get("failure") or ("passed" if e.get("passed") else "wrong"), transcript_text(e)]
          for e in episodes])
    self.run.log(data, step=int(record.get("version", 0)))

  def close(self) -> None:
    self.run.finish()


def build(kind: str, workdir: str, config: dict, log=print) -> WandbTracker | None:
  """The configured tracker, or None (off, or its package is not installed)."""
  if not kind:
    return None
  try:
    import wandb
  except ImportError:
    log("train.tracker = 'wandb': the wandb package is not installed (pip install wandb); not tracking")
    return None
  return WandbTracker(wandb, workdir, config, os.path.basename(os.path.abspath(workdir)))
