"""Episode-duration models for the simulator, parsed from strings like ``lognormal:1.0``.

All durations are in virtual seconds and scale with ``scale`` (the median, or the minimum for
pareto). Each draw comes from a ``random.Random`` the caller seeds with the job's identity, so a
job's duration does not depend on the order jobs are handed out.

  constant            scale
  lognormal:S         scale * exp(S z), z ~ N(0, 1)                  (median = scale)
  pareto:A            scale * Pareto(A), support [scale, inf)         (heavy tail; A <= 1: no mean)
  bimodal[:P[:R]]     R * scale with probability P, else scale        (defaults P = 0.2, R = 10)
  per-task[:S]        scale * difficulty(task) * exp(S z), difficulty in {1, 2, 3, 4} fixed per
                      task by the seed (default S = 0.25)
"""
from __future__ import annotations

import dataclasses
import math
import random


@dataclasses.dataclass(frozen=True)
class DurationModel:
  kind: str
  params: tuple[float, ...]
  scale: float = 60.0
  seed: int = 0

  def sample(self, rng: random.Random, task: int) -> float:
    kind, p = self.kind, self.params
    if kind == "constant":
      return self.scale
    if kind == "lognormal":
      return self.scale * math.exp(p[0] * rng.gauss(0.0, 1.0))
    if kind == "pareto":
      return self.scale * rng.paretovariate(p[0])
    if kind == "bimodal":
      return self.scale * (p[1] if rng.random() < p[0] else 1.0)
    if kind == "per-task":
      return self.scale * self.difficulty(task) * math.exp(p[0] * rng.gauss(0.0, 1.0))
    raise AssertionError(kind)

  def difficulty(self, task: int) -> int:
    return 1 + random.Random(f"jaxes.difficulty:{self.seed}:{task}").randrange(4)


_DEFAULTS = {"constant": (), "lognormal": None, "pareto": None, "bimodal": (0.2, 10.0),
             "per-task": (0.25,)}


def parse(spec: str, scale: float = 60.0, seed: int = 0) -> DurationModel:
  """``"lognormal:1.0"`` -> DurationModel; errors name the spec and the accepted forms."""
  kind, _, rest = spec.partition(":")
  if kind not in _DEFAULTS:
    raise ValueError(f"--durations={spec!r}: unknown model {kind!r}; one of {sorted(_DEFAULTS)}")
  try:
    given = tuple(float(x) for x in rest.split(":")) if rest else ()
  except ValueError:
    raise ValueError(f"--durations={spec!r}: parameters must be numbers") from None
  default = _DEFAULTS[kind]
  if default is None and len(given) != 1:
    raise ValueError(f"--durations={spec!r}: {kind} needs one parameter, e.g. {kind}:1.0")
  if default is not None and len(given) > len(default):
    raise ValueError(f"--durations={spec!r}: {kind} takes at most {len(default)} parameter(s)")
  params = given + (default or ())[len(given):]
  if kind in ("lognormal", "per-task") and params[0] < 0:
    raise ValueError(f"--durations={spec!r}: sigma must be >= 0")
  if kind == "pareto" and params[0] <= 0:
    raise ValueError(f"--durations={spec!r}: alpha must be > 0")
  if kind == "bimodal" and not (0 <= params[0] <= 1 and params[1] > 0):
    raise ValueError(f"--durations={spec!r}: need 0 <= P <= 1 and R > 0")
  if scale <= 0:
    raise ValueError(f"duration scale must be > 0, got {scale}")
  return DurationModel(kind, params, scale, seed)
