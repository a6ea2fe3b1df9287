"""Fitness shaping: raw fitness -> weights ``z`` of the update (pure NumPy, host side, float64).

Both shapings map all-equal fitness to all-zero weights, so such a cohort gives a zero step.
"""
from __future__ import annotations

import numpy as np

SHAPINGS = ("zscore", "centered_rank")


def zscore(fitness: np.ndarray) -> np.ndarray:
  """``(f - mean) / (std + 1e-8)`` (Qiu et al.)."""
  f = np.asarray(fitness, np.float64)
  if f.size == 0:
    return f
  return (f - f.mean()) / (f.std() + 1e-8)


def centered_rank(fitness: np.ndarray) -> np.ndarray:
  """Ranks scaled to ``[-0.5, 0.5]`` (OpenAI ES); tied values share their average rank."""
  f = np.asarray(fitness, np.float64)
  n = f.size
  if n <= 1:
    return np.zeros_like(f)
  _, inverse, counts = np.unique(f, return_inverse=True, return_counts=True)
  first = np.cumsum(counts) - counts
  rank = (first + (counts - 1) / 2.0)[inverse]
  return rank / (n - 1) - 0.5


def shape(fitness: np.ndarray, method: str) -> np.ndarray:
  if method == "zscore":
    return zscore(fitness)
  if method == "centered_rank":
    return centered_rank(fitness)
  raise ValueError(f"shaping must be one of {SHAPINGS}, got {method!r}")
