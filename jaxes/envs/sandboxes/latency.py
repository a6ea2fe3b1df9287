"""Heavy-tailed sandbox latency for any backend: terminal tasks' episodes take from seconds to
many minutes (slow builds, downloads, test suites), which is where asynchronous ES pays. This
wraps a real sandbox and sleeps a log-normal time -- once per episode (``per="episode"``, at
start: the episode's duration then follows the simulator's ``lognormal:SIGMA`` with median
``median_s``) or before every command and the final tests (``per="command"``) -- then does the
real work. A draw is seeded by (seed, task, how many times that task has drawn), so a run's
latencies do not depend on thread timing.
"""
from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter

from jaxes.envs.sandboxes.sandbox import Sandbox, SandboxHandle

PER = ("episode", "command")


class LatencyModel:
  """Log-normal seconds: ``median_s * exp(sigma * z)``."""

  def __init__(self, median_s: float, sigma: float, seed: int = 0):
    if not median_s > 0 or not sigma >= 0:
      raise ValueError(f"latency: need median_s > 0 and sigma >= 0, got {median_s}, {sigma}")
    self.median_s, self.sigma, self.seed = median_s, sigma, seed
    self._counts: Counter = Counter()
    self._lock = threading.Lock()
    self.total_s, self.draws = 0.0, 0

  def draw(self, key: str) -> float:
    with self._lock:
      n = self._counts[key]
      self._counts[key] += 1
    seconds = self.median_s * math.exp(self.sigma * random.Random(f"jaxes.latency:{self.seed}:{key}:{n}").gauss(0, 1))
    with self._lock:
      self.total_s += seconds
      self.draws += 1
    return seconds


class _Handle(SandboxHandle):
  def __init__(self, inner: SandboxHandle, model: LatencyModel, key: str, per: str):
    self.inner, self.model, self.key, self.per = inner, model, key, per

  def exec(self, command, timeout_s):
    if self.per == "command":
      time.sleep(self.model.draw(self.key))
    return self.inner.exec(command, timeout_s)

  def run_tests(self):
    if self.per == "command":
      time.sleep(self.model.draw(self.key))
    return self.inner.run_tests()

  def close(self):
    self.inner.close()


class LatencySandbox(Sandbox):
  """``LatencySandbox(make_sandbox("local"), median_s=2.0, sigma=1.0)``."""

  def __init__(self, inner: Sandbox, median_s: float, sigma: float, per: str = "episode", seed: int = 0):
    if per not in PER:
      raise ValueError(f"latency: per must be one of {PER}, got {per!r}")
    self.inner, self.per = inner, per
    self.model = LatencyModel(median_s, sigma, seed)

  def start(self, task):
    key = getattr(task, "name", "") or repr(task)[:80]
    if self.per == "episode":
      time.sleep(self.model.draw(key))
    return _Handle(self.inner.start(task), self.model, key, self.per)

  def shutdown(self):
    self.inner.shutdown()

  def check_verifier(self, tasks):
    self.inner.check_verifier(tasks)

  def leftovers(self):
    return self.inner.leftovers()
