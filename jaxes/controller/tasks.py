"""Seeded task sampler: within one version, tasks are drawn without repeats.

Slot ``i`` of version ``v`` is element ``i mod T`` of the ``i // T``-th seeded permutation of
``range(T)`` for that version, so slots never repeat a task until all T were used (repeats only
when a version needs more than T slots). Pure function of (seed, version, slot): nothing to
checkpoint, identical on every host.
"""
from __future__ import annotations

import random
from collections import OrderedDict


class TaskSampler:
  def __init__(self, num_tasks: int, seed: int, cache_size: int = 8):
    if num_tasks < 1:
      raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    self.num_tasks = num_tasks
    self.seed = seed
    self._cache: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
    self._cache_size = cache_size

  def _permutation(self, version: int, round_: int) -> list[int]:
    key = (version, round_)
    perm = self._cache.get(key)
    if perm is None:
      perm = list(range(self.num_tasks))
      # A str seed is hashed with SHA-512: stable across processes and Python runs.
      random.Random(f"jaxes.tasks:{self.seed}:{version}:{round_}").shuffle(perm)
      self._cache[key] = perm
      if len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)
    else:
      self._cache.move_to_end(key)
    return perm

  def task(self, version: int, slot: int) -> int:
    round_, index = divmod(slot, self.num_tasks)
    return self._permutation(version, round_)[index]
