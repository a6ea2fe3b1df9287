"""Sigma schedules as functions of the policy version (works on Python ints and traced values).

* ``constant``: ``sigma_t = sigma_0``;
* ``cosine``: ``sigma_t = sigma_T + (sigma_0 - sigma_T) (1 + cos(pi t / T)) / 2`` for ``t <= T``,
  then ``sigma_T`` (Agentic ESOpt's decay).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jaxes.errors import OptionError

SCHEDULES = ("constant", "cosine")


def validate(schedule: str, sigma: float, sigma_final: float | None, steps: int | None) -> None:
  if schedule not in SCHEDULES:
    raise OptionError("sigma_schedule", f"must be one of {SCHEDULES}, got {schedule!r}")
  if not sigma > 0:
    raise OptionError("sigma", f"must be > 0, got {sigma!r}")
  if schedule == "cosine":
    if sigma_final is None or not sigma_final >= 0:
      raise OptionError("sigma_final", f"must be >= 0 with sigma_schedule='cosine', got {sigma_final!r}",
                        f"sigma_schedule='cosine' needs sigma_final >= 0, got {sigma_final!r}")
    if steps is None or int(steps) <= 0:
      raise OptionError("sigma_schedule", f"'cosine' needs schedule_steps > 0, got {steps!r}",
                        f"sigma_schedule='cosine' needs schedule_steps > 0, got {steps!r}")


def sigma_at(version, schedule: str, sigma: float, sigma_final: float | None = None,
             steps: int | None = None):
  """Sigma used by members of ``version``: a Python float for a Python int, else a jnp float32."""
  if isinstance(version, int):
    if schedule == "constant":
      return float(sigma)
    t = min(version, steps) / steps
    return sigma_final + (sigma - sigma_final) * (1.0 + math.cos(math.pi * t)) / 2.0
  version = jnp.asarray(version)
  if schedule == "constant":
    return jnp.full(version.shape, sigma, jnp.float32)
  t = jnp.minimum(version, steps).astype(jnp.float32) / steps
  return (sigma_final + (sigma - sigma_final) * (1.0 + jnp.cos(jnp.pi * t)) / 2.0).astype(jnp.float32)
