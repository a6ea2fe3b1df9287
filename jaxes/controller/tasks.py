"""Seeded task sampler: within one version, tasks are drawn without repeats.

The slots of version ``v`` follow a seeded lazy Fisher-Yates shuffle of ``range(T)``: slot ``i``
is the ``i``-th element of a random permutation, so no task repeats until all T were used
(then a fresh permutation starts; repeats only when a version needs more than T slots). Drawing
a slot costs O(1) whatever T is. A pure function of (seed, version, slot): nothing to
checkpoint, identical on every host.
"""
from __future__ import annotations

import random
from collections import OrderedDict


class _VersionDraw:
  """The permutation stream of one version, drawn as far as asked."""

  def __init__(self, seed: int, version: int):
    # A str seed is hashed with SHA-512: stable across processes and Python runs.
    self.rng = random.Random(f"jaxes.tasks:{seed}:{version}")
    self.swaps: dict[int, int] = {}
    self.drawn: list[int] = []


class TaskSampler:
  def __init__(self, num_tasks: int, seed: int, cache_size: int = 16):
    if num_tasks < 1:
      raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    self.num_tasks = num_tasks
    self.seed = seed
    self._versions: OrderedDict[int, _VersionDraw] = OrderedDict()
    self._cache_size = cache_size

  def task(self, version: int, slot: int) -> int:
    draw = self._versions.get(version)
    if draw is None:
      draw = self._versions[version] = _VersionDraw(self.seed, version)
      if len(self._versions) > self._cache_size:
        self._versions.popitem(last=False)
    else:
      self._versions.move_to_end(version)
    t = self.num_tasks
    while len(draw.drawn) <= slot:
      i = len(draw.drawn) % t
      if i == 0:
        draw.swaps.clear()
      j = draw.rng.randrange(i, t)
      at_i, at_j = draw.swaps.get(i, i), draw.swaps.get(j, j)
      draw.swaps[j] = at_i
      draw.drawn.append(at_j)
    return draw.drawn[slot]
